"""The pinned host memory pool of a phased run, sized from its memory plan.

JAX's GPU client allocates pinned host memory (where the phased executor keeps weights, optimizer state and
activation rows) from a pool capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, 64 GB by default. Its size has to be
set before JAX starts a backend, and the plan that says how much a run needs is computed with JAX: the plan is
computed in a child process on JAX's CPU backend (host bytes are a matter of shapes, the same on every backend),
and the pool set to it plus a margin (app/runtime.py's ``pool_gib``). Run as ``python3 -m app.host_pool`` with a config mapping as
JSON on stdin, this module prints the plan's host bytes.
"""

from __future__ import annotations

import json
import sys

from config.presets import config_from_mapping
from graphs.executor import make_executor
from graphs.graphs import Graphs
from graphs.plan import plan


def host_plan_bytes(mapping: dict) -> int:
    """The host bytes (per process) of the memory plan of a config given as a nested mapping."""
    return plan(make_executor(Graphs(config_from_mapping(mapping).validate()))).host_peak


def main() -> None:
    print(host_plan_bytes(json.load(sys.stdin)), flush=True)


if __name__ == "__main__":
    main()
