"""End-to-end runs of run_validation.py: the report after training (both families), and the model's shape taken
from the checkpoint or the HF config."""

import json
import re
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


@pytest.mark.slow
def test_scored_labels_are_hfs_log_likelihoods_and_constrained_answers_are_labels(two_models, tmp_path, capsys):
    """--score labels: each example's labels ranked by their log-likelihood, equal to HF's float32 forward pass of
    the same weights (each label's target tokens, its end-of-text token's included, given the prompt) within 1e-4,
    their scores reported beside the decoded answers' (here --constrain labels: every answer a label); the report's
    name says both. --regex: every answer matches it; a --json_schema the vocabulary cannot write: one line."""
    import torch

    from app.hf_generate import hf_model_of
    from config.presets import config_from_mapping
    from data.tokenizer import load_tokenizer
    from modelling import registry
    from tests.helpers import params_at

    out = str(tmp_path / "r.json")
    run_validation.main(["--load", two_models[0], "--limit", "6", "--constrain", "labels", "--score", "labels",
                         "--output", out])
    r = json.load(open(out))
    labels = ("entailment", "neutral", "contradiction")
    assert r["decoding_name"] == "greedy_labels_ranked" and set(r["generated"]) <= set(labels)
    ranked = r["ranked"]
    assert ranked["generated"] == [labels[int(np.argmax(x))] for x in ranked["log_likelihoods"]]
    assert set(ranked["scores"]) == {"accuracy"} and "ranked: accuracy" in capsys.readouterr().out
    meta, params = params_at(two_models[0], 1)
    cfg = config_from_mapping(meta["config"])
    cfg.model.eval = True
    family, tok = registry.of_config(cfg), load_tokenizer("synthetic")
    model = hf_model_of(cfg, family, params).float()
    targets = family.encode_targets(tok, list(labels))
    for i, text in enumerate(r["inputs"][:3]):
        prompt = family.encode_inputs(tok, [text])[0]
        for j, t in enumerate(targets):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([[0] + t[:-1]])).logits
            ll = torch.log_softmax(logits[0].double(), -1)[torch.arange(len(t)), torch.tensor(t)].sum().item()
            assert ranked["log_likelihoods"][i][j] == pytest.approx(ll, abs=1e-4), (i, j)
    out = str(tmp_path / "g.json")
    run_validation.main(["--load", two_models[0], "--limit", "6", "--regex", "(entailment|neutral) (the|a)",
                         "--output", out, "--output_length", "4"])
    assert all(re.fullmatch("(entailment|neutral) (the|a)", g) for g in json.load(open(out))["generated"])
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object"}))
    fails(capsys, run_validation.main, ["--load", two_models[0], "--limit", "2", "--json_schema", str(schema)],
          "--json_schema cannot be followed: no token of this model's vocabulary can start it")
