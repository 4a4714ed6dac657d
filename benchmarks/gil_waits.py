"""How often a slot program's call waits for Python's interpreter lock when another thread wants it (docs/serving.md,
"Throughput against static batching": the server's decoding thread shares the lock with its HTTP thread).

    python3 benchmarks/gil_waits.py [--json benchmarks/results/cpu/gil_waits.json]

For each family's tiny preset (d 64, one device, 8 slots): the slot programs compiled (decoder/slots.py), then a
thread that only spins Python, with CPython's switch interval at 20 ms: a call that lets go of the lock waits about
20 ms to take it back. Each call's dispatch time over 20 ms is the times it let go; medians of 5 calls, each
dispatched with the device idle. Beside it, the arrays the call returns: JAX's dispatch lets go about once for each
(the waits fell about with their count), and an insert's copy of its inputs to the device a few times more.
"""

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.bench import write_json  # noqa: E402

SWITCH = 0.02  # seconds: CPython's switch interval while measuring


def measure(preset: str, slots: int = 8, width: int = 64, calls: int = 5) -> dict:
    import jax
    import numpy as np
    from app.args import make_config
    from decoder.engine import Decoder
    from decoder.slots import SlotPrograms
    from serving.scheduler import SAMPLING_DTYPES

    cfg = make_config("inference", preset, {"tokenizer": "synthetic", "hf_model": None, "output_length": 256,
                                            "tensor_parallel": 1, "micro_batch_size": slots},
                      fixed={"eval": True, "rts": False})
    p = Decoder.of_config(cfg)
    sp = SlotPrograms(p, slots, (width,), (1,), 256, 32, 1, 0, 20)
    sp.compile(p.place.init_params())
    keep = np.ones(slots, bool)
    ids, mask = p.family.layout_prompts(np.full((1, width), 3, np.int32), np.ones((1, width), np.int32))
    sampling = tuple(np.zeros(1, dt) for dt in SAMPLING_DTYPES[:-1]) + (np.full(1, -1, SAMPLING_DTYPES[-1]),)
    cases = {"insert": lambda: sp.insert(width, 1, ids, mask, np.zeros(1, np.int32), sampling, np.full(1, 100)),
             "advance (8 steps)": lambda: sp.advance(keep, 8)}
    out = {}
    for name, f in cases.items():
        jax.block_until_ready(f()[0])
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    time.sleep(0.1)
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH)
    try:
        for name, f in cases.items():
            times = []
            for _ in range(calls):
                time.sleep(0.01)  # the device idle
                t0 = time.perf_counter()
                handle = f()
                times.append(time.perf_counter() - t0)
                jax.block_until_ready(handle[0])
            # what the call hands back: its results (a PackedScored is one array) and the arrays kept for the next
            out[name] = {"lock_waits": round(float(np.median(times)) / SWITCH, 1),
                         "arrays_returned": len(jax.tree.leaves(handle)) + len(jax.tree.leaves(carried(sp)))}
    finally:
        sys.setswitchinterval(before)
        stop.set()
    return out


def carried(sp) -> tuple:
    """The arrays the slot programs keep between calls: ``Carry``'s (the keys and values, the vector), or before it
    (commit dc9f573, whose run is ``gil_waits_dc9f573.json``: this script copied into that tree) the cache and the
    state as they were."""
    return (sp.apart, sp.words) if hasattr(sp, "words") else (sp.cache, sp.state)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    result = {"switch_interval_s": SWITCH, "presets": {}}
    for preset in ("gptj_tiny", "tiny"):
        result["presets"][preset] = measure(preset)
        print(preset, json.dumps(result["presets"][preset]), flush=True)
    write_json(a.json, result)


if __name__ == "__main__":
    main()
