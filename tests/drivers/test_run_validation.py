"""End-to-end runs of run_validation.py: the report after training (both families), and the model's shape taken
from the checkpoint or the HF config."""

import json
import os

import jax
import numpy as np
import pytest

import run_finetuning
import run_validation
from tests.helpers import GPTJ_SMALL, SMALL, fails


@pytest.mark.slow
def test_validation_after_training_writes_report(tmp_path, capsys):
    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + ["--steps", "2", "--checkpoint_steps", "1", "--save", save])
    run_validation.main(["--config", "tiny", "--load", save + "/*", "--limit", "9", "--micro_batch_size", "4"])
    out = capsys.readouterr().out
    assert out.index("step 1:") < out.index("step 2:")  # every checkpoint, in step order
    for step in (1, 2):
        r = json.load(open(os.path.join(save, f"validation_step{step}_first9.json")))  # a --limit run's name
        assert r["samples"] == 9 and len(r["predictions"]) == 9 and r["step"] == step
        assert 0.0 <= r["accuracy"] <= 1.0
        assert sum(map(sum, r["confusion_matrix"]["counts"])) == 9
    from app.evaluate import report_name

    assert report_name("validation_mismatched", 1000) == "validation_mismatched_step1000.json"
    assert report_name("test") == "validation_test.json"
    assert report_name("validation_mismatched", 10, limit=5) == "validation_mismatched_step10_first5.json"
    assert report_name("validation", 10, decoding="beam4") == "validation_step10_beam4.json"


@pytest.mark.slow
def test_validation_of_a_trained_gptj_writes_the_report(tmp_path, capsys):
    save = str(tmp_path / "ck")
    run_finetuning.main(GPTJ_SMALL + ["--steps", "2", "--save", save, "--causal_packing", "concat"])
    run_validation.main(["--load", save, "--limit", "7", "--micro_batch_size", "4"])  # family from the checkpoint
    r = json.load(open(os.path.join(save, "validation_step2_first7.json")))
    assert r["samples"] == 7 and len(r["generated"]) == 7 and sum(map(sum, r["confusion_matrix"]["counts"])) == 7
    assert "accuracy" in capsys.readouterr().out


@pytest.mark.slow
def test_validation_takes_the_model_shape_from_the_checkpoint_and_the_hf_config(tmp_path, capsys):
    from modelling.hf_mapping import save_hf_model
    from tests.hf_utils import make_hf

    save = str(tmp_path / "ck")  # a shape the tiny inference preset does not have
    run_finetuning.main(SMALL + ["--steps", "1", "--save", save, "--hidden_size", "32", "--layers", "2", "--heads", "2"])
    run_validation.main(["--config", "tiny", "--load", save, "--limit", "4"])
    assert json.load(open(os.path.join(save, "validation_step1_first4.json")))["samples"] == 4
    fails(capsys, run_validation.main, ["--config", "tiny", "--load", save, "--layers", "4"],
          "--layers 4 contradicts the checkpoint")
    # an HF model directory of another shape: no shape flags needed
    _, m, params = make_hf("1.1", vocab_size=128, d_model=40, d_ff=96, num_heads=5, d_kv=8, num_layers=3)
    save_hf_model(jax.tree.map(np.asarray, params), m, str(tmp_path / "hf"))
    out = tmp_path / "hf.json"
    run_validation.main(["--config", "tiny", "--hf_model", str(tmp_path / "hf"), "--limit", "3", "--output", str(out),
                         "--tensor_parallel", "1", "--data_parallel", "1"])
    assert json.load(open(out))["samples"] == 3
