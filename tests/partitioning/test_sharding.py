"""The sharding rules (partitioning/sharding.py) on a model's placement: the tiny preset's resolved shardings against
their golden snapshot, and a mesh that needs more devices than there are."""

import json
import os

import pytest

from config import load_config
from partitioning import sharding as S
from partitioning.placement import Placement
from tests.helpers import ROOT

GOLDEN = os.path.join(ROOT, "tests", "golden", "tiny_dp2_tp2_shardings.json")


def test_golden_sharding_snapshot_tiny_dp2_tp2():
    cfg = load_config("finetuning", "tiny")
    assert (cfg.execution.data_parallel, cfg.execution.tensor_parallel) == (2, 2)
    g = Placement(cfg)
    snap = S.sharding_snapshot(g.specs, g.layouts)
    with open(GOLDEN) as f:
        golden = json.load(f)
    assert snap == golden, "sharding changed: review, then regenerate with tests/golden/regenerate.py"


def test_too_few_devices_says_how_to_simulate_more():
    with pytest.raises(S.DeviceCountError, match="xla_force_host_platform_device_count=16"):
        S.make_mesh(4, 4)
