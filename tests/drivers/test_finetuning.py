"""The training benchmark (finetuning.py) writes its JSON report."""

import json

import pytest

import finetuning


@pytest.mark.slow
def test_finetuning_benchmark_writes_report(tmp_path):
    path = tmp_path / "ft.json"
    finetuning.main(["--config", "tiny", "--steps", "3", "--warmup_iterations", "1", "--sequence_length", "16",
                     "--json", str(path), "--peak_tflops", "1.0"])
    r = json.loads(path.read_text())
    for key in ("median_step_s", "samples_per_s", "tokens_per_s", "compile_s", "model_tflops_per_s", "mfu"):
        assert r[key] > 0, key
    assert r["timed_steps"] == 2 and len(r["losses"]) == 3
    assert r["global_batch_size"] == 32 and (r["data_parallel"], r["tensor_parallel"]) == (2, 2)
