"""Regenerates the golden sharding snapshot. Review the diff before committing it.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python3 tests/golden/regenerate.py
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from config import load_config  # noqa: E402
from modelling import registry  # noqa: E402
from partitioning import sharding as S  # noqa: E402

cfg = load_config("finetuning", "tiny")
mesh = S.make_mesh(cfg.execution.data_parallel, cfg.execution.tensor_parallel)
specs = registry.of_config(cfg).param_specs(cfg.model, cfg.execution.tensor_parallel)
S.write_snapshot(S.sharding_snapshot(specs, S.layouts(specs, mesh, cfg.execution.rts)),
                 os.path.join(os.path.dirname(__file__), "tiny_dp2_tp2_shardings.json"))
