"""benchmarks/compare.py: a failed engine reported and the others kept; where the engines' workers stay alive and
which peers run (by platform); every decoding engine on the same shape and search; ratios over 1 where ours is
faster, per round; the share of a peer's tokens HF generated too."""

import json

import pytest


@pytest.mark.slow
def test_compare_reports_a_failed_run_and_keeps_the_other(tmp_path, capsys):
    from benchmarks import compare

    path = tmp_path / "cmp.json"
    r = compare.main(["--config", "tiny", "--only", "train", "--batch", "4", "--micro_batch", "2", "--steps", "3",
                      "--sequence_length", "16", "--hf", "eager", "--ours_flags", "--no_such_flag 1",
                      "--repeats", "2", "--json", str(path)])
    out = capsys.readouterr().out
    assert "FAILED (exit 2): ours: finetuning.py" in out and out.count("FAILED") == 1  # (once: it stays failed)
    assert r["training"]["ours"]["examples_per_s"] is None and r["ratios"]["ours / HF eager"] is None
    hf = r["training"]["HF eager"]
    assert hf["examples_per_s"] > 0 and hf["model_tflops_per_s"] > 0
    saved = json.loads(path.read_text())
    assert saved["training"] == r["training"]
    assert saved["runs"]["ours"] == [None, None] and saved["runs"]["HF eager"][1]["global_batch_size"] == 4
    assert r["persistent_workers"] and len(r["load_before"]) == 3
    assert saved["runs"]["HF eager"][0]["padding"] == "max_length"  # equal work: full rows on both sides


# ------------------------------------------------------------------ the choices, the commands and the figures


def test_workers_stay_alive_on_a_cpu_and_start_anew_each_round_on_an_accelerator():
    from benchmarks.compare import persistent_workers

    assert persistent_workers("auto", "cpu") is True
    assert persistent_workers("auto", "gpu") is False and persistent_workers("auto", "tpu") is False
    assert persistent_workers("auto", "unknown") is False  # (when in doubt, one engine's memory at a time)
    assert persistent_workers("no", "cpu") is False and persistent_workers("yes", "gpu") is True


def test_ctranslate2_is_a_peer_on_a_cpu_for_an_encoder_decoder_where_installed(capsys):
    from benchmarks.compare import runs_ct2

    assert runs_ct2("auto", "cpu", True, True) is True
    assert runs_ct2("auto", "gpu", True, True) is False and runs_ct2("auto", "cpu", False, True) is False
    assert runs_ct2("auto", "cpu", True, False) is False
    assert "pip install -r benchmarks/requirements.txt" in capsys.readouterr().out
    assert runs_ct2("on", "gpu", False, False) is True and runs_ct2("off", "cpu", True, True) is False


def test_every_decoding_engine_runs_the_same_shape_and_search():
    from benchmarks import compare as C

    a = C.parse(["--only", "decode", "--batch", "1", "--output_length", "16", "--decode_flags", "--num_beams 4"])
    _, gen = C.commands(a)
    assert gen[gen.index("--micro_batch_size") + 1] == "1" and gen[gen.index("--output_length") + 1] == "16"
    assert gen[-2:] == ["--num_beams", "4"]
    float_only = C.decoders(a, gen, ct2=True)
    assert set(float_only) == {C.OURS, C.HF, C.CT2}  # int8 engines only with --int8
    both = C.decoders(C.parse(["--int8"]), gen, ct2=True)
    assert set(both) == {C.OURS, C.HF, C.INT8, C.CT2, C.CT2_INT8} and list(both)[0] == C.OURS
    assert both[C.CT2_INT8][-2:] == ["--compute_type", "int8"] and both[C.INT8][-2:] == ["--quantize", "int8"]
    for cmd in both.values():  # the shape, the prompts' preset and the search: the same arguments for each
        assert cmd[-len(gen) - 2:-2] == gen or cmd[-len(gen):] == gen
    assert set(C.decoders(C.parse(["--int8"]), gen, ct2=False)) == {C.OURS, C.HF, C.INT8}


def _round(tokens_per_s, first, per_token, tokens=None):
    return {"generated_tokens_per_s": tokens_per_s, "first_token_s": first, "decode_token_latency_s": per_token,
            "tokens": tokens}


def test_decoding_ratios_are_over_one_where_ours_is_faster_in_rate_and_in_time(capsys):
    from benchmarks import compare as C

    runs = {C.OURS: [_round(200.0, 0.1, 0.01), _round(100.0, 0.2, 0.02)],
            C.CT2: [_round(100.0, 0.3, 0.04), _round(25.0, 0.4, 0.02)],
            C.HF: [_round(50.0, 0.5, 0.05, [[1, 2]]), _round(50.0, 0.5, 0.05, [[3, 4]])],
            C.INT8: [], C.CT2_INT8: []}
    f = C.decode_figures(runs)
    r = f["decode_ratios"]["ours / CTranslate2 float32"]
    assert r["generated_tokens_per_s"]["rounds"] == [2.0, 4.0] and r["generated_tokens_per_s"]["median"] == 3.0
    assert r["first_token_s"]["rounds"] == [pytest.approx(3.0), pytest.approx(2.0)]  # its time over ours
    assert r["decode_token_latency_s"]["rounds"] == [pytest.approx(4.0), pytest.approx(1.0)]
    assert f["decode_tokens_per_s"] == {"ours": 150.0, "hf": 50.0, "ratio": 3.0, "runs": [2, 2]}
    assert f["first_token_s"]["ratio"] == pytest.approx((5.0 + 2.5) / 2)
    assert f["engines"]["CTranslate2 float32"]["generated_tokens_per_s"]["median"] == 62.5
    assert "ours int8 / ours" not in f["decode_ratios"] and "int8_tokens_per_s" not in f
    assert "ours / CTranslate2 float32: tokens/s 3.00x" in capsys.readouterr().out


def test_same_tokens_is_the_share_of_the_last_rounds_tokens_hf_generated_too():
    from benchmarks.compare import same_tokens

    hf = [{"tokens": [[9, 9]]}, {"tokens": [[1, 2], [3, 4]]}]
    assert same_tokens([{"tokens": [[1, 2], [3, 5]]}, None], hf) == 0.75
    assert same_tokens([{"tokens": [[1, 2], [3, 4]]}], hf) == 1.0
    assert same_tokens([None], hf) is None and same_tokens([{"tokens": [[1, 2]]}], hf) is None  # rows differ
