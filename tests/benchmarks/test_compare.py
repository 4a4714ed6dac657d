"""benchmarks/compare.py reports a failed run and keeps the other."""

import json

import pytest


@pytest.mark.slow
def test_compare_reports_a_failed_run_and_keeps_the_other(tmp_path, capsys):
    from benchmarks import compare

    path = tmp_path / "cmp.json"
    r = compare.main(["--config", "tiny", "--only", "train", "--batch", "4", "--micro_batch", "2", "--steps", "3",
                      "--sequence_length", "16", "--hf", "eager", "--ours_flags", "--no_such_flag 1",
                      "--json", str(path)])
    out = capsys.readouterr().out
    assert "FAILED (exit 2): finetuning.py" in out
    assert r["training"]["ours"]["examples_per_s"] is None and r["ratios"]["ours / HF eager"] is None
    hf = r["training"]["HF eager"]
    assert hf["examples_per_s"] > 0 and hf["model_tflops_per_s"] > 0
    saved = json.loads(path.read_text())
    assert saved["training"] == r["training"]
    assert saved["runs"]["ours"] == [None] and saved["runs"]["HF eager"][0]["global_batch_size"] == 4
    assert saved["runs"]["HF eager"][0]["padding"] == "max_length"  # equal work: full rows on both sides
