"""Whether decoding with int8 weights forms a dequantized copy of a weight per call: the compiled greedy decoding
program's optimized HLO, read.

    python3 benchmarks/int8_hlo.py --config xl --json runs/int8_hlo.json          # a GPU: XLA:GPU's program
    python3 benchmarks/int8_hlo.py --config tiny                                    # XLA:CPU's

A weight is materialised when an instruction outside every fusion body (the entry computation, the decoding
loop's body, ...) produces a floating-point array of a quantized weight's size: the int8 values converted into a
buffer of their own before the GEMM reads them. Converted inside a fusion that also does the matmul (XLA:GPU's
Triton GEMM fusions), nothing of the weight's size is written. The report lists each materialised array and the
program's temporary bytes (XLA's memory analysis) against the same program with bfloat16 weights: a weight
converted per call shows there too, as at least one layer's largest weight in the compute dtype.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(bf16|f16|f32)\[([\d,]*)\]\S*\s+([\w\-]+)\(")
HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(|\{)")
CALLS = re.compile(r"calls=%?([\w.\-]+)")
NO_BUFFER = ("parameter", "get-tuple-element", "tuple", "bitcast")  # (the program's inputs, views of them)


def fusion_bodies(text: str) -> set:
    """Names of the computations that fusion instructions call (their instructions are never materialised)."""
    return {m for line in text.splitlines() if " fusion(" in line for m in CALLS.findall(line)}


def materialised(text: str, sizes: set) -> list:
    """[(computation, instruction, dtype, shape, op)] of the arrays of a weight's element count (``sizes``) that an
    instruction outside the fusion bodies produces."""
    bodies, current, out = fusion_bodies(text), None, []
    for line in text.splitlines():
        if line and not line.startswith(" ") and ("{" in line) and "=" not in line.split("{")[0]:
            m = HEADER.match(line)
            current = m.group(1) if m else None
            continue
        if current is None or current in bodies:
            continue
        m = INSTR.match(line)
        if not m:
            continue
        dims = [int(d) for d in m.group(3).split(",") if d]
        n = 1
        for d in dims:
            n *= d
        if len(dims) >= 2 and n in sizes and m.group(4) not in NO_BUFFER:
            out.append((current, m.group(1), m.group(2), dims, m.group(4)))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help="preset of config/inference.yml")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt_length", type=int, default=128)
    p.add_argument("--output_length", type=int, default=8)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from app.bench import write_json
    from config import load_config
    from decoder.decoder import Decoder
    from modelling import decoding, quant
    from partitioning import sharding as S

    def program(q: str):
        cfg = load_config("inference", a.config, dict(eval=True, quantize=q, data_parallel=1, tensor_parallel=1,
                                                      micro_batch_size=a.batch, output_length=a.output_length))
        g = Decoder.of_config(cfg, mesh=S.make_mesh(1, 1))
        family, opts = g.family, g.opts

        def fn(params, ids, mask):
            return decoding.greedy(family, params, ids, mask, opts, a.output_length, S.TP)

        prog = g.phase(fn, (g.decode_specs(), P(S.DP, None), P(S.DP, None)), P(S.DP, None))
        rows = jax.ShapeDtypeStruct((a.batch, a.prompt_length), np.int32, sharding=g.row_sharding)
        return g, prog.lower(g.abstract_decode_params(), rows, rows).compile()

    g8, c8 = program("int8")
    _, c16 = program("none")
    weights = [w for w in jax.tree.leaves(g8.abstract_decode_params(), is_leaf=quant.is_int8) if quant.is_int8(w)]
    sizes = {int(np.prod(w.q.shape[w.lead:])) for w in weights}  # one layer's weight (the loop reads a layer)
    found = materialised(c8.as_text(), sizes)
    largest = max(int(np.prod(w.q.shape[w.lead:])) for w in weights) * np.dtype(g8.opts.compute_dtype).itemsize
    t8, t16 = c8.memory_analysis().temp_size_in_bytes, c16.memory_analysis().temp_size_in_bytes
    report = {"config": a.config, "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
              "batch": a.batch, "prompt_length": a.prompt_length, "output_length": a.output_length,
              "quantized_weights": len(weights), "materialised": [list(map(str, f[:3])) + [f[3], f[4]] for f in found],
              "weights_materialised": bool(found), "temp_bytes_int8": t8, "temp_bytes_bf16_weights": t16,
              "largest_layer_weight_bytes": largest}
    print(f"{jax.default_backend()} ({report['device_kind']}): {len(found)} array(s) of a weight's size formed "
          f"outside fusions; temporaries {t8 / 2**20:.1f} MiB with int8 weights, {t16 / 2**20:.1f} MiB with "
          f"{g8.opts.compute_dtype.__name__ if hasattr(g8.opts.compute_dtype, '__name__') else g8.opts.compute_dtype}"
          f" weights (the largest layer weight: {largest / 2**20:.1f} MiB)", flush=True)
    for f in found[:8]:
        print("  ", *f)
    write_json(a.json, report)
    return report


if __name__ == "__main__":
    main()
