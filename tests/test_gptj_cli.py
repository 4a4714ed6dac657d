"""GPT-J through the same drivers as T5 (offline, the gptj_tiny preset at small shapes): resume is exact with
dropout and warm-up, validation decodes after ``target:`` and writes the T5 report, and a Hugging Face GPT-J
directory initialises training and validation with the family and shape from its config.json."""

import json
import os

import jax
import numpy as np
import pytest
import torch
from transformers import GPTJConfig, GPTJForCausalLM

import run_finetuning
import run_validation
from app.resume import initial_state, resume_point
from tests.helpers import build, params_at
from utils import checkpoint as ckpt

SMALL = ["--config", "gptj_tiny", "--sequence_length", "32", "--global_batch_size", "8", "--micro_batch_size", "2",
         "--warmup_steps", "3", "--dropout_prob", "0.1"]

pytestmark = pytest.mark.slow  # every test here runs a driver end to end (tests/test_trainer.py: the loop's own contracts)


def test_resume_with_dropout_and_warmup_equals_uninterrupted(tmp_path):
    """2 + 2 steps equal 4 steps: weights, data position and held-over examples (the dropout RNG and the
    learning-rate schedule resume exactly)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_finetuning.main(SMALL + ["--steps", "4", "--save", a])
    run_finetuning.main(SMALL + ["--steps", "2", "--save", b])
    run_finetuning.main(SMALL + ["--steps", "4", "--save", b, "--load", b])
    meta_a, pa = params_at(a, 4)
    meta_b, pb = params_at(b, 4)
    assert meta_a["data_position"] == meta_b["data_position"] > 8  # packed: more examples than rows
    assert meta_a["data_pending"] == meta_b["data_pending"]
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(x, y)
    lines = [json.loads(x) for x in open(os.path.join(a, "metrics.jsonl"))]
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and lines[0]["learning_rate"] == 0.0


def test_validation_of_a_trained_gptj_writes_the_report(tmp_path, capsys):
    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + ["--steps", "2", "--save", save, "--causal_packing", "concat"])
    run_validation.main(["--load", save, "--limit", "7", "--micro_batch_size", "4"])  # family from the checkpoint
    r = json.load(open(os.path.join(save, "validation_step2_first7.json")))
    assert r["samples"] == 7 and len(r["generated"]) == 7 and sum(map(sum, r["confusion_matrix"]["counts"])) == 7
    assert "accuracy" in capsys.readouterr().out


def test_hf_gptj_directory_initialises_training_and_validation(tmp_path):
    from modelling import gptj

    torch.manual_seed(0)
    hf = GPTJForCausalLM(GPTJConfig(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                    n_inner=256, tie_word_embeddings=False))
    hf.save_pretrained(tmp_path / "hf")
    from config import load_config

    cfg = load_config("finetuning", "gptj_tiny", {"hf_model": str(tmp_path / "hf"), "sequence_length": 32,
                                                  "rotary_dim": 8})
    executor, loader = build(cfg)
    state, start = initial_state(cfg, executor, loader, resume_point(cfg))
    assert start == 0
    ours = gptj.hf_state_dict(jax.tree.map(np.asarray, state.params), cfg.model)
    for name, ref in hf.state_dict().items():
        np.testing.assert_array_equal(ours[name], ref.numpy(), err_msg=name)
    out = tmp_path / "val.json"
    # the default (T5) preset: the family and shape come from config.json
    run_validation.main(["--hf_model", str(tmp_path / "hf"), "--limit", "5", "--output", str(out)])
    r = json.load(open(out))
    assert r["samples"] == 5 and r["checkpoint"] == str(tmp_path / "hf")
    assert ckpt.saved_steps(str(tmp_path)) == []


def test_run_inference_equals_hf_generate_for_both_families(tmp_path, capsys, caplog):
    """run_inference.py --compare_hf: our greedy outputs of a T5 (untied head) and a GPT-J checkpoint, token for
    token those of HF generate on the same weights."""
    import run_inference

    t5_dir, gptj_dir = str(tmp_path / "t5"), str(tmp_path / "gptj")
    run_finetuning.main(["--config", "tiny", "--sequence_length", "32", "--global_batch_size", "8",
                         "--micro_batch_size", "2", "--steps", "3", "--save", t5_dir])
    run_finetuning.main(SMALL + ["--steps", "3", "--save", gptj_dir])
    for d in (t5_dir, gptj_dir):
        out = run_inference.main(["--load", d, "--compare_hf", "--limit", "5"])
        assert len(out) == 5 and all(r["same_tokens"] for r in out), out
        assert all(r["ours"] == r["hf"] for r in out)
        # beam search from the command line: HF generate with the same beams and length penalty, token for token
        out = run_inference.main(["--load", d, "--compare_hf", "--limit", "5", "--num_beams", "3",
                                  "--length_penalty", "0.8"])
        assert len(out) == 5 and all(r["same_tokens"] for r in out), out
    assert capsys.readouterr().out.count("5 of 5 outputs token for token equal to HF generate") == 4
    with caplog.at_level("WARNING", logger="flan_t5"):  # words the tokenizer does not know are said, as in training
        run_inference.main(["--load", t5_dir, "--prompt", "mnli hypothesis: zorblax quuxes premise: the cat sleeps"])
    assert "unknown to tokenizer" in caplog.text

    # back to Hugging Face format: transformers loads the export and gives our logits; its config stops generate at
    # the tokenizer's end-of-text (the synthetic tokenizer's 1, not GPT-2's 50256); nothing is written over
    import run_export
    import transformers

    from config.presets import config_from_mapping
    from modelling import registry

    for d in (t5_dir, gptj_dir):
        out = str(tmp_path / f"hf_{os.path.basename(d)}")
        run_export.main(["--load", d, "--output", out])
        config = json.load(open(os.path.join(out, "config.json")))
        assert config["eos_token_id"] == 1 and os.path.isfile(os.path.join(out, "tokenizer.json"))
        hf = getattr(transformers, config["architectures"][0]).from_pretrained(out).eval()
        meta, params = params_at(d, 3)
        cfg = config_from_mapping(meta["config"])
        cfg.model.eval = True
        family = registry.of_config(cfg)
        ids = np.random.default_rng(0).integers(3, 100, (2, 12))
        batch = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        if not family.causal:
            batch["decoder_input_ids"] = ids[:, :5]

        ours = np.asarray(family.forward(params, batch, family.options_of(cfg)))[..., :cfg.model.embedding.vocab_size]
        with torch.no_grad():
            theirs = hf(**{k: torch.tensor(v) for k, v in batch.items() if k != "attention_mask" or family.causal}).logits
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-4, atol=1e-5)
        with pytest.raises(SystemExit):
            run_export.main(["--load", d, "--output", out])  # the directory is not empty
        assert "is not an empty directory" in capsys.readouterr().err
