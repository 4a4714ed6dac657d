"""The memory plan of decoding (``run_validation.py --plan``, ``run_server.py --plan``): the device and host bytes
a batch of prompts needs, from shapes alone, before any weight is read.

Device (per device, the busiest): decoding's weights as placed (``Decoder.abstract_decode_params``: the compute
dtype or int8; a streamed encoder's layers two at a time, the one running and the next one loading); the KV cache of
``rows`` prompts ``prompt_length`` wide and ``output_length`` new tokens (the family's own ``decode_start``, traced
for its shapes); the activations: the encoder's [rows, prompt, d] and the largest layer's temporaries, estimated
from shapes, or with ``exact`` XLA's own count of the programs' temporaries (the programs compiled from shapes,
for this backend: a CPU's count is not a GPU's). Host (per process): a streamed encoder's layers, and while the
weights are placed, a LoRA checkpoint's frozen base (merged a layer at a time, decoder/weights.py).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from decoder.streaming import PromptStream, chunk_rows
from modelling import decoding, quant
from partitioning import sharding as S
from partitioning.plan import MemoryPlan, format_items, human_bytes
from partitioning.sharding import HOST_KINDS, shard_bytes


def _on_device(x) -> bool:
    return getattr(x.sharding, "memory_kind", None) not in HOST_KINDS


def _bytes(tree, where=None) -> int:
    leaves = [x for x in jax.tree.leaves(tree) if where is None or where(x)]
    return sum(shard_bytes(x.shape, x.dtype, x.sharding) for x in leaves)


def _host_bytes(tree) -> int:
    return sum(shard_bytes(x.shape, x.dtype, x.sharding) * len(x.sharding.addressable_devices)
               for x in jax.tree.leaves(tree) if not _on_device(x))


def _local(tree):
    """A device's shapes of a tree of ShapeDtypeStructs (Int8 kept), shardings dropped."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.sharding.shard_shape(x.shape), x.dtype), tree)


def cache_bytes(g, rows: int, prompt_length: int, output_length: int) -> int:
    """A device's bytes of the KV cache for ``rows`` prompts (the whole batch, split over dp): the family's
    ``decode_start`` traced on a device's shapes."""
    params = _local(g.resident(g.abstract_decode_params()))
    b = max(rows // g.dp, 1)
    ids = jax.ShapeDtypeStruct((b, prompt_length), np.int32)
    fam, opts = g.family, g.opts
    if g.prompt_stacks:
        enc = jax.ShapeDtypeStruct((b, prompt_length, g.opts.hidden_size), np.float32)
        fn = lambda p, e, m: fam.decode_start_encoded(fam.decoding_params(p, opts), e, m, opts, output_length)[1]  # noqa
        cache = jax.eval_shape(fn, params, enc, ids)
    else:
        cache = jax.eval_shape(lambda p, i, m: fam.decode_start(fam.decoding_params(p, opts), i, m, opts,
                                                                output_length)[1], params, ids, ids)
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache))


def activation_bytes(g, rows: int, prompt_length: int) -> int:
    """An estimate of a device's largest activations while the prompts are read (the encoder's, or a causal LM's
    prefill): the residual stream [rows, prompt, d] float32 in and out of a layer, and one layer's temporaries for
    the rows it reads at once (all of them; a streamed encoder's ``chunk_rows``): the attention scores and
    probabilities [rows, heads, prompt, prompt] float32, q, k, v and the attention's output, and the feed-forward's
    [rows x prompt, d_ff] twice (gated) and its product, in the compute dtype."""
    m, tp = g.opts, g.tp
    b = max(rows // g.dp, 1)
    at_once = chunk_rows(b) if g.prompt_stacks else b
    tokens = at_once * prompt_length
    dt = np.dtype(g.opts.compute_dtype).itemsize
    heads = -(-m.heads // tp)
    inner = heads * m.d_kv
    scores = 2 * at_once * heads * prompt_length * prompt_length * 4
    layer = scores + 4 * tokens * inner * dt + 3 * tokens * (-(-m.d_ff // tp)) * dt
    return 2 * b * prompt_length * m.hidden_size * 4 + layer


def exact_temporaries(g, rows: int, prompt_length: int, output_length: int) -> dict:
    """XLA's count of the temporaries of decoding's programs (greedy decoding of ``rows`` prompts; with a streamed
    encoder, its layer program too), each compiled from shapes: {program: bytes}."""
    fam, opts = g.family, g.opts
    params = g.resident(g.abstract_decode_params())
    ids = jax.ShapeDtypeStruct((rows, prompt_length), np.int32, sharding=g.row_sharding)

    def fn(p, i, m, e=None):
        return decoding.greedy(fam, p, i, m, opts, output_length, S.TP, encoded=e)

    specs = [g.resident(g.decode_specs()), P(S.DP, None), P(S.DP, None)]
    args = [params, ids, ids]
    out = {}
    if g.prompt_stacks:
        stream = PromptStream(g)
        enc = jax.ShapeDtypeStruct((rows, prompt_length, g.opts.hidden_size), np.float32,
                                   sharding=jax.sharding.NamedSharding(g.mesh, P(S.DP, None, None)))
        specs.append(P(S.DP, None, None))
        args.append(enc)
        layer = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                             g.abstract_decode_params()[stream.stack.name]["layers"][0], stream.device_rows)
        sub = g.abstract_decode_params()[stream.stack.name]
        ctx = {k: sub[k] for k in stream.ctx_names if k in sub}
        out["encoder layer"] = stream.layer.lower(layer, ctx, ids, enc).compile().memory_analysis().temp_size_in_bytes
    program = g.phase(fn, tuple(specs), P(S.DP, None))
    out["decoding"] = program.lower(*args).compile().memory_analysis().temp_size_in_bytes
    return out


def decode_plan(g, rows: int, prompt_length: int, output_length: int, exact: bool = False,
                lora_base_bytes: int = 0, stack=None, loras: tuple = ()) -> MemoryPlan:
    """The plan of decoding ``rows`` prompts ``prompt_length`` wide to ``output_length`` new tokens with the weights
    of the decoder ``g`` (its quantize and stream_encoder settings). ``lora_base_bytes``: a LoRA checkpoint's
    frozen base, held in host memory while its adapters are merged. ``stack``: a server's LoRA adapters served side
    by side (decoder/adapters.py's AdapterStack, on the devices beside the weights), ``loras`` [(name, path)] those
    it starts with: the stack and each slot's bytes printed, each adapter's slot.

    A device holds decoding's weights throughout, and then the larger of two phases: reading the prompts (the
    encoder's activations, and a streamed encoder's two layers) and decoding (the KV cache, the encoder's output
    the cache is made from, and the step's logits); the first phase's buffers are freed before the cache is made."""
    weights = g.abstract_decode_params()
    b = max(rows // g.dp, 1)
    # an encoder's output, which the cross-attention's cache is made from (a stack with an output the next reads)
    enc_out = b * prompt_length * g.opts.hidden_size * 4 if any(s.output for s in g.family.stacks) else 0
    prompt = {}
    if g.prompt_stacks:
        layer = weights[g.prompt_stacks[0]]["layers"][0]
        prompt["streamed encoder layers (the running one, the next one)"] = 2 * _bytes(layer)
    logits = 2 * b * (-(-g.vocab_size // g.tp)) * 4
    notes = []
    if exact:
        temps = exact_temporaries(g, rows, prompt_length, output_length)
        if g.prompt_stacks:
            prompt["encoder layer program (XLA's count) and its rows in and out"] = temps["encoder layer"] + 2 * enc_out
            decode = {"decoding program (XLA's count: the KV cache among it) and the encoder's output":
                      temps["decoding"] + enc_out}
        else:  # one program reads the prompts and decodes: its count holds both phases
            decode = {"decoding program (XLA's count: the KV cache and the prompts' reading among it)":
                      temps["decoding"]}
        notes.append("program temporaries: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in temps.items())
                     + " (XLA's count on this backend)")
    else:
        prompt["activations (estimate)"] = activation_bytes(g, rows, prompt_length)
        decode = {"KV cache": cache_bytes(g, rows, prompt_length, output_length), "encoder output": enc_out,
                  "logits": logits}
    phase, peak = max((("reading the prompts", prompt), ("decoding", decode)), key=lambda kv: sum(kv[1].values()))
    other, rest = ("decoding", decode) if phase == "reading the prompts" else ("reading the prompts", prompt)
    if sum(rest.values()):
        notes.insert(0, f"{other} (beside the weights): {format_items(rest)}")
    items = {"weights": _bytes(weights, _on_device), **peak}
    if stack is not None:
        items = {"weights": items.pop("weights"), "LoRA adapter stack": stack.nbytes, **items}
        notes += stack_notes(stack, loras, items["weights"])
    host = {"streamed encoder layers": _host_bytes(weights)} if g.prompt_stacks else {}
    loading = dict(host)
    if lora_base_bytes:
        loading["LoRA base (while merging)"] = lora_base_bytes
    host_peak, host_items, host_phase = (sum(loading.values()), loading, "placing the weights") \
        if sum(loading.values()) > sum(host.values()) else (sum(host.values()), host, "decoding")
    kind = ("int8 weights" if g.quantize == "int8" else f"{np.dtype(g.opts.compute_dtype).name} weights") + \
        (", the encoder streamed from host memory" if g.prompt_stacks else "")
    return MemoryPlan(f"decoding: {kind}; {rows} rows, prompts of {prompt_length} tokens, {output_length} new",
                      sum(items.values()), phase, items, host_peak, host_phase, host_items, exact, notes=notes)


def stack_notes(stack, loras: tuple, weights: int) -> list:
    """The plan's lines of a stack of LoRA adapters: its slots, their rank and weights, its share of the weights'
    bytes; then a line per adapter (its slot) and the free slots."""
    lines = [f"LoRA adapter stack: {stack.slots} slots of rank {stack.rank} for {', '.join(stack.targets)}: "
             f"{human_bytes(stack.nbytes)} ({human_bytes(stack.slot_bytes)} an adapter), "
             f"{100 * stack.nbytes / max(weights, 1):.1f}% of the weights' bytes"]
    for slot, (name, path) in enumerate(loras):
        lines.append(f"  slot {slot}: adapter {name} ({path}): {human_bytes(stack.slot_bytes)}")
    if stack.slots > len(loras):
        lines.append(f"  slots {len(loras)}..{stack.slots - 1}: free (POST /v1/load_lora_adapter): "
                     f"{human_bytes(stack.slot_bytes)} each")
    return lines


def weight_bytes(g) -> dict:
    """{"device": a device's bytes of decoding's weights, "host": a process's bytes of the streamed ones}."""
    w = g.abstract_decode_params()
    return {"device": _bytes(w, _on_device), "host": _host_bytes(w), "int8_weights": sum(
        1 for x in jax.tree.leaves(w, is_leaf=quant.is_int8) if quant.is_int8(x))}


def format_plan(plan: MemoryPlan) -> str:
    """The plan as --plan prints it."""
    how = "XLA's count of program temporaries" if plan.exact else "activations estimated from shapes: --plan_exact " \
                                                                  "counts XLA's temporaries"
    lines = [f"memory plan ({plan.executor}; {how}):",
             f"  device: {human_bytes(plan.device_peak)} per device at its peak ({plan.device_phase}): "
             f"{format_items(plan.device_items)}",
             f"  host:   {human_bytes(plan.host_peak)} per process at its peak ({plan.host_phase}): "
             f"{format_items(plan.host_items) or 'nothing'}"]
    return "\n".join(lines + [f"  {n}" for n in plan.notes])
