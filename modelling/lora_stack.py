"""Many LoRA adapters over one frozen base, unmerged and served side by side in one batch (S-LoRA's and Punica's
scheme): the adapter stack, for any family.

Each adapted weight W of the base (our layout [layers, in dims..., out dims...], modelling/lora.py) has beside it
the adapters of ``slots`` fine-tuned tasks: A [layers, in dims..., slots, rank] and B [layers, slots, rank, out
dims...], each adapter's rank padded with zeros to the stack's ``rank`` (adapters of rank 4 and 16 sit side by
side: a padded column adds nothing), and one scale a slot, its adapter's alpha / rank (0 for an empty slot, whose A
and B are zeros). Which slot a token reads is data, an index (-1: the base alone): the number of adapters and their
ranks are shapes of the stack, so the decoding programs are as many as without it.

    specs(family, base_specs, targets, slots, rank)   # the stack's ParamSpecs: logical axes, as training's adapters
    slot_values(stack_specs, adapters, alpha, rank)   # one adapter (a LoRA checkpoint's tree) as a slot's values
    w = bind(w, stack, index)                          # each adapted weight a layers.MultiAdapted: index [n] a token
    w = per_token(w, where, n)                         # packed prompts: each token its prompt's index

Layouts as training's (modelling/lora.py): A keeps W's input axes, B its output axes, the slot and rank axes are
never split; under tensor parallelism a column-parallel weight has a replicated A and a B split like its output, a
row-parallel one an A split like its input and a replicated B (layers.MultiAdapted says how each is summed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from modelling import layers as L
from modelling import lora
from modelling.params import ParamSpec
from utils.errors import ConfigError

SLOTS = "lora_slots"  # the logical axis of the stack's slots (replicated: partitioning/sharding.py's RULES omit it)
SCALE = "scale"  # the stack's leaf of each slot's alpha / rank, float32 [slots]


def specs(family, base_specs: dict, targets: tuple, slots: int, rank: int) -> dict:
    """The stack's spec tree: {stack: {"layers": {name_lora_a: [layers, in..., slots, rank], name_lora_b: [layers,
    slots, rank, out...]}}, "scale": [slots]} for every weight of ``targets`` a stack's layers have (zeros: every slot
    empty). ConfigError (one line) for a target no stack has."""
    out, found = {}, set()
    for stack in family.stacks:
        layers = base_specs[stack.name]["layers"]
        ours = {}
        for name in targets:
            if name not in layers:
                continue
            found.add(name)
            spec = layers[name]
            k = lora.input_dims(spec)
            n, ins, outs = spec.shape[0], spec.shape[1:1 + k], spec.shape[1 + k:]
            ax_in, ax_out = spec.axes[1:1 + k], spec.axes[1 + k:]
            ours[name + lora.A] = ParamSpec((n, *ins, slots, rank), ("layers", *ax_in, SLOTS, lora.RANK), 0.0)
            ours[name + lora.B] = ParamSpec((n, slots, rank, *outs), ("layers", SLOTS, lora.RANK, *ax_out), 0.0)
        if ours:
            out[stack.name] = {"layers": ours}
    missing = [n for n in targets if n not in found]
    if missing:
        raise ConfigError(f"--lora_target_modules {' '.join(missing)}: no such weight in a {family.name} layer; the "
                          f"adapted weights are named as --lora_targets names them")
    out[SCALE] = ParamSpec((slots,), (SLOTS,), 0.0)
    return out


def targets_of(stack_specs: dict) -> tuple:
    """The weights a stack holds adapters of (sorted)."""
    return tuple(sorted({k[: -len(lora.A)] for s, sub in stack_specs.items() if s != SCALE
                         for k in sub["layers"] if k.endswith(lora.A)}))


def slot_values(stack_specs: dict, adapters: dict, alpha: float, r: int) -> dict:
    """One adapter (a LoRA checkpoint's tree, numpy: {stack: {"layers": {name_lora_a: [layers, in..., r],
    name_lora_b: [layers, r, out...]}}}, its rank ``r`` and ``alpha``) as one slot of the stack (numpy, float32):
    {stack: {"layers": {name_lora_a: [layers, in..., rank], name_lora_b: [layers, rank, out...]}}, "scale": alpha / r},
    its rank padded with zeros to the stack's, the stack's weights it does not adapt zeros. ConfigError (one line) for
    a rank above the stack's, a weight the stack holds no adapters of, or an adapter of another shape."""
    rank = rank_of(stack_specs)
    if r > rank:
        raise ConfigError(f"its rank is {r}, above the server's --max_lora_rank {rank}: restart it with "
                          f"--max_lora_rank {r}")
    theirs = sorted({f"{s} {k[: -len(lora.A)]}" for s, sub in adapters.items() for k in sub.get("layers", {})
                     if k.endswith(lora.A) and k not in stack_specs.get(s, {}).get("layers", {})})
    if theirs:
        raise ConfigError(f"it adapts {', '.join(theirs)}, which the server's adapter stack holds no adapters of (it "
                          f"holds {', '.join(targets_of(stack_specs))}): restart it with --lora_target_modules naming "
                          "them too")
    out = {}
    for s, sub in stack_specs.items():
        if s == SCALE:
            continue
        mine = adapters.get(s, {}).get("layers", {})
        layers = {}
        for key, spec in sub["layers"].items():
            is_a = key.endswith(lora.A)
            shape = spec.shape[:-2] + spec.shape[-1:] if is_a else spec.shape[:1] + spec.shape[2:]
            layers[key] = np.zeros(shape, np.float32)
            if key not in mine:
                continue
            x = np.asarray(mine[key], np.float32)
            want = shape[:-1] + (r,) if is_a else shape[:1] + (r,) + shape[2:]
            if x.shape != want:
                raise ConfigError(f"its {s} {key} is {list(x.shape)}, where this base's rank-{r} adapter is "
                                  f"{list(want)}: it was trained on a model of another shape")
            layers[key][tuple(slice(0, k) for k in x.shape)] = x
        out[s] = {"layers": layers}
    out[SCALE] = np.float32(alpha / r)
    return out


def rank_of(stack_specs: dict) -> int:
    """The stack's rank (every adapter's rank padded to it)."""
    return next(sp.shape[-1] for s, sub in stack_specs.items() if s != SCALE for k, sp in sub["layers"].items()
                if k.endswith(lora.A))


def bind(w: dict, stack: dict, index: jax.Array) -> dict:
    """Decoding's weights ``w`` with each weight the stack adapts a ``layers.MultiAdapted``: index int32 [n] each
    token's slot (-1: the base alone), n the rows of what the layers read (one token a row in a decoding step).
    ``stack``: the stack's arrays (``specs``' tree); {} (no stack): ``w`` as it is. A stack whose layers decoding's
    layout holds one tree per layer (decoder/decoder.py's ``unrolled_decoder``) gets each layer's slice of the
    stack's adapters."""
    if not stack:
        return w
    scales = stack[SCALE]
    scale = jnp.where(index >= 0, scales[jnp.clip(index, 0, scales.shape[0] - 1)], 0.0)
    out = dict(w)
    for s, sub in stack.items():
        if s == SCALE:
            continue
        held = w[s]["layers"]
        if isinstance(held, (list, tuple)):  # one tree per layer: each its slice, the index as it is
            layers = [_attach(layer, {k: x[i] for k, x in sub["layers"].items()}, index.astype(jnp.int32), scale)
                      for i, layer in enumerate(held)]
        else:
            n = jax.tree.leaves(sub)[0].shape[0]
            idx, sc = (jnp.broadcast_to(x, (n,) + x.shape) for x in (index.astype(jnp.int32), scale))  # each layer's
            layers = _attach(held, sub["layers"], idx, sc)
        out[s] = {**w[s], "layers": layers}
    return out


def _attach(layers: dict, adapters: dict, idx, sc) -> dict:
    """A layer tree (or the stacked layers') with each adapted weight a ``MultiAdapted`` over ``adapters``' A and B."""
    layers = dict(layers)
    for key in adapters:
        if key.endswith(lora.A):
            name = key[: -len(lora.A)]
            layers[name] = L.MultiAdapted(layers[name], adapters[key], adapters[name + lora.B], idx, sc)
    return layers


def per_token(w: dict, where: jax.Array, n: int) -> dict:
    """``bind``'s weights of J prompts (index [J]) as the weights of the n tokens of the rows they are packed in:
    ``where`` int [J, W] each prompt's positions in the rows flattened (n past its length), a token its prompt's slot
    and scale, a position of no prompt -1 and 0. Weights without adapters come back as they are."""
    def spread(x, fill):  # [..., J] -> [..., n] ([layers, J] stacked, [J] a layer's own)
        lead = x.shape[:-1]
        each = jnp.broadcast_to(x[..., None], x.shape + (where.shape[1],)).reshape(lead + (-1,))
        return jnp.full(lead + (n + 1,), fill, x.dtype).at[..., where.reshape(-1)].set(each)[..., :n]

    def one(x):
        if not isinstance(x, L.MultiAdapted):
            return x
        return L.MultiAdapted(x.w, x.a, x.b, spread(x.index, -1), spread(x.scale, 0.0))

    return jax.tree.map(one, w, is_leaf=lambda x: isinstance(x, L.MultiAdapted))


def put(stack: dict, slot, values: dict) -> dict:
    """The stack's arrays with slot ``slot`` (a traced index: one program for every slot) holding ``values``
    (``slot_values``' tree, on the devices or numpy; zeros: the slot emptied). Runs in the stack's layouts: a
    device writes its own shard of a slot."""
    out = {SCALE: stack[SCALE].at[slot].set(jnp.asarray(values[SCALE], stack[SCALE].dtype))}
    for s, sub in stack.items():
        if s == SCALE:
            continue
        layers = {}
        for key, x in sub["layers"].items():
            v = jnp.asarray(values[s]["layers"][key], x.dtype)
            layers[key] = x.at[..., slot, :].set(v) if key.endswith(lora.A) else x.at[:, slot].set(v)
        out[s] = {"layers": layers}
    return out
