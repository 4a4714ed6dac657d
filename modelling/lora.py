"""Low-rank adapters (LoRA, as Hugging Face PEFT defines them), for any family.

An adapted weight W (our layout: [in dims..., out dims...], read as the matrix [in, out] by
``layers.dense``) gets two trained matrices in the same layout, A [in dims..., rank] and
B [rank, out dims...]; the layer computes x W + (alpha / rank) (dropout(x) A) B. W stays frozen.

In the parameter tree the adapters sit beside their weight in a stack's ``layers`` (stacked on the
same leading axis): ``q`` has ``q_lora_a`` and ``q_lora_b``. ``adapter_specs`` gives their specs
(logical axes: A keeps W's input axes, B its output axes, the rank axis ``lora_rank`` is never
split), so partitioning/sharding.py lays them out like any weight:

- a column-parallel weight (its output split over tp: q, k, v, wi, fc_in) has a replicated A and
  a B split like W's output;
- a row-parallel weight (its input split over tp and its output summed: o, wo, fc_out, the
  family's ``residual_outputs``) has an A split like W's input and a replicated B.

``attach`` turns one layer's tree into the one the family's block reads (each adapted weight a
``layers.Adapted``); ``merged`` folds the adapters into their weights (inference, the merged
export); ``peft_state_dict`` maps them to PEFT's names (the PEFT export).
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from modelling import layers as L
from modelling.params import ParamSpec
from utils.errors import ConfigError

A, B = "_lora_a", "_lora_b"
RANK = "lora_rank"  # the logical axis of the rank (replicated: partitioning/sharding.py's RULES do not name it)


def enabled(opts) -> bool:
    return getattr(opts, "lora_rank", 0) > 0


def is_adapter(name: str) -> bool:
    return name.endswith(A) or name.endswith(B)


def targets(family, opts) -> tuple:
    """The weight names that get adapters: the config's ``lora_targets``, else the family's default (PEFT's)."""
    return tuple(opts.lora_targets) or tuple(family.lora_targets)


def scale(opts) -> float:
    return opts.lora_alpha / opts.lora_rank


def input_dims(spec: ParamSpec) -> int:
    """How many of a stacked weight's dims (after ``layers``) are its input: all but the last when its output is
    the residual stream (``embed``, a row-parallel weight), else the first."""
    axes = spec.axes[1:]
    return len(axes) - 1 if axes[-1] == "embed" and axes[0] != "embed" else 1


def adapter_specs(family, base_specs: dict, opts) -> dict:
    """The adapters' spec tree: {stack: {"layers": {name_lora_a: ..., name_lora_b: ...}}} for every target weight of
    every stack. A is drawn with the variance of PEFT's initialiser (Kaiming-uniform, a = sqrt(5): 1 / (3 fan_in)),
    B is zero: an adapted model starts as its base. ConfigError (one line) for a target no stack has, or a rank
    larger than an adapted weight's smaller side."""
    names, r = targets(family, opts), opts.lora_rank
    out, found = {}, set()
    for stack in family.stacks:
        layers = base_specs[stack.name]["layers"]
        ours = {}
        for name in names:
            if name not in layers:
                continue
            found.add(name)
            spec = layers[name]
            k = input_dims(spec)
            n, ins, outs = spec.shape[0], spec.shape[1:1 + k], spec.shape[1 + k:]
            fan_in, fan_out = math.prod(ins), math.prod(outs)
            if r > min(fan_in, fan_out):
                raise ConfigError(f"--lora_rank {r} is larger than {stack.name} weight {name} ({fan_in} x {fan_out}):"
                                  f" choose a rank of at most {min(fan_in, fan_out)}")
            ax_in, ax_out = spec.axes[1:1 + k], spec.axes[1 + k:]
            ours[name + A] = ParamSpec((n, *ins, r), ("layers", *ax_in, RANK), (3 * fan_in) ** -0.5)
            ours[name + B] = ParamSpec((n, r, *outs), ("layers", RANK, *ax_out), 0.0)
        if ours:
            out[stack.name] = {"layers": ours}
    missing = [n for n in names if n not in found]
    if missing:
        have = sorted({k for s in family.stacks for k, v in base_specs[s.name]["layers"].items()
                       if family.is_dense(k)})
        raise ConfigError(f"--lora_targets {' '.join(missing)}: no such weight in a {family.name} layer; the layers' "
                          f"weights are {', '.join(have)}")
    return out


def attach(layer: dict, family, opts, tp_axis: Optional[str], rng=None) -> dict:
    """One layer's weights as its block reads them: each weight with adapters in ``layer`` becomes a
    ``layers.Adapted`` (its adapters' dropout drawn from ``rng``); the adapters themselves leave the dict."""
    out = {k: v for k, v in layer.items() if not is_adapter(k)}
    rows = family.residual_outputs
    for name in out:
        if name + A in layer:
            r = None if rng is None else jax.random.fold_in(rng, zlib.crc32(name.encode()) % (2 ** 31))
            out[name] = L.Adapted(out[name], layer[name + A], layer[name + B], scale(opts), name in rows, tp_axis,
                                  opts.lora_dropout, r)
    return out


def combine(base: dict, adapters: dict) -> dict:
    """The base tree with the adapters beside their weights in each stack's layers."""
    out = dict(base)
    for stack, sub in adapters.items():
        out[stack] = {**base[stack], "layers": {**base[stack]["layers"], **sub["layers"]}}
    return out


def merged(base: dict, adapters: dict, opts) -> dict:
    """The base weights with the adapters folded in: W + (alpha / rank) A B, in W's layout and dtype (float32
    arithmetic). Works on numpy or JAX arrays of the whole (unsharded) tree."""
    xp = jnp if isinstance(jax.tree.leaves(base)[0], jax.Array) else np
    out = dict(base)
    for stack, sub in adapters.items():
        layers = dict(base[stack]["layers"])
        for key in sub["layers"]:
            if not key.endswith(A):
                continue
            name = key[: -len(A)]
            w, a, b = layers[name], sub["layers"][key], sub["layers"][name + B]
            n, r = a.shape[0], a.shape[-1]
            delta = xp.matmul(xp.asarray(a, xp.float32).reshape(n, -1, r), xp.asarray(b, xp.float32).reshape(n, r, -1))
            layers[name] = (xp.asarray(w, xp.float32) + scale(opts) * delta.reshape(w.shape)).astype(w.dtype)
        out[stack] = {**base[stack], "layers": layers}
    return out


# --------------------------------------------------------------------------- PEFT's format

PEFT_PREFIX = "base_model.model."


def _modules(family, adapters: dict, m) -> list:
    """(stack, layer index, our weight name, HF module path) of every adapted weight."""
    out = []
    for stack, sub in adapters.items():
        names = [k[: -len(A)] for k in sub["layers"] if k.endswith(A)]
        n = next(iter(sub["layers"].values())).shape[0]
        for i in range(n):
            keys = family.hf.layer_keys(stack, i, m)
            out += [(stack, i, name, keys[name][: -len(".weight")]) for name in names]
    return out


def peft_state_dict(family, adapters: dict, m) -> dict:
    """{PEFT key: numpy float32}: ``base_model.model.<module>.lora_A.weight`` [rank, in] and ``.lora_B.weight``
    [out, rank] (torch Linear layouts) of every adapted weight."""
    sd = {}
    for stack, i, name, module in _modules(family, adapters, m):
        a = np.asarray(adapters[stack]["layers"][name + A][i], np.float32)
        b = np.asarray(adapters[stack]["layers"][name + B][i], np.float32)
        r = a.shape[-1]
        sd[f"{PEFT_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
        sd[f"{PEFT_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
    return sd


def peft_modules(family, base_specs: dict, m) -> dict:
    """{HF module path: (stack, layer index, our weight name)} of every weight of the base's stacks' layers (PEFT's
    module names, ``peft_state_dict``'s keys less their prefix and suffix)."""
    out = {}
    for stack in family.stacks:
        layers = base_specs.get(stack.name, {}).get("layers", {})
        n = next(iter(layers.values())).shape[0] if layers else 0
        for i in range(n):
            for name, key in family.hf.layer_keys(stack.name, i, m).items():
                if name in layers and key.endswith(".weight"):
                    out[key[: -len(".weight")]] = (stack.name, i, name)
    return out


def peft_targets(family, base_specs: dict, m, keys, modules: Optional[dict] = None) -> tuple:
    """Our names of the weights PEFT's state dict keys ``keys`` adapt (``modules``: ``peft_modules``' map, made here
    where not given); ConfigError (one line) for a key that adapts no weight of the base."""
    modules, names = modules or peft_modules(family, base_specs, m), set()
    for key in keys:
        module = _peft_module(key)
        if module not in modules:
            raise ConfigError(f"{key} adapts no weight of this model (is the adapter for another architecture?)")
        names.add(modules[module][2])
    return tuple(sorted(names))


def _peft_module(key: str) -> str:
    """A PEFT key's module path: ``base_model.model.<module>.lora_{A,B}.weight`` (an adapter's name before
    ``.weight`` dropped, as PEFT saves it)."""
    key = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
    for side in (".lora_A.", ".lora_B."):
        if side in key:
            return key[: key.index(side)]
    raise ConfigError(f"{key} is no LoRA weight (PEFT's are <module>.lora_A.weight and <module>.lora_B.weight)")


def from_peft(family, base_specs: dict, m, state: dict, rank: int) -> dict:
    """PEFT's state dict (``peft_state_dict``'s inverse: {key: numpy} of ``lora_A`` [rank, in] and ``lora_B``
    [out, rank]) -> our adapters' tree (``adapter_specs``' layouts) of the weights it adapts, zeros at a layer it
    leaves (PEFT's ``layers_to_transform``: no change there). ConfigError (one line) for a key that adapts no weight
    of the base, or a shape that is not the base's weight's at ``rank``."""
    modules = peft_modules(family, base_specs, m)
    names = peft_targets(family, base_specs, m, state, modules)
    opts = type("O", (), {"lora_rank": rank, "lora_targets": names})()
    specs = adapter_specs(family, base_specs, opts)
    out = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    for key, value in state.items():
        stack, i, name = modules[_peft_module(key)]
        side = A if ".lora_A." in key else B
        target = out[stack]["layers"][name + side]
        want = target.shape[1:]
        value = np.asarray(value, np.float32)
        flat = (rank, math.prod(want[:-1])) if side == A else (math.prod(want[1:]), rank)
        if value.shape != flat:
            raise ConfigError(f"{key} is {tuple(value.shape)}, where this model's {stack} weight {name} at rank {rank} "
                              f"takes {flat} (is the adapter for another model size?)")
        target[i] = value.T.reshape(want)
    return out


def peft_config(family, adapters: dict, m, opts, base: str) -> dict:
    """PEFT's adapter_config.json: the adapted modules named in full (ours may adapt the self-attention's q and not
    the cross-attention's), the rank, alpha and dropout, and the base model."""
    modules = sorted({module for *_, module in _modules(family, adapters, m)})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM" if family.causal else "SEQ_2_SEQ_LM",
            "base_model_name_or_path": base, "r": opts.lora_rank, "lora_alpha": opts.lora_alpha,
            "lora_dropout": opts.lora_dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "modules_to_save": None}
