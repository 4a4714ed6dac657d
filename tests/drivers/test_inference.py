"""The decoding benchmark (inference.py) writes its JSON report."""

import json

import pytest

import inference


@pytest.mark.slow
def test_inference_benchmark_writes_report(tmp_path):
    path = tmp_path / "inf.json"
    inference.main(["--config", "tiny", "--iterations", "2", "--json", str(path)])
    r = json.loads(path.read_text())
    for key in ("encoder_s", "generate_s", "decode_token_latency_s", "generated_tokens_per_s", "samples_per_s",
                "compile_s"):
        assert r[key] > 0, key
    assert r["output_length"] == 5 and r["batch_size"] == 2
