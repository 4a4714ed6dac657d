"""run_inference.py: ``--compare_hf`` gives Hugging Face ``generate``'s tokens for both families."""

import json
import os

import numpy as np
import pytest
import torch

import run_finetuning
from tests.helpers import GPTJ_SMALL, params_at

pytestmark = pytest.mark.slow  # runs the drivers end to end (tests/app/test_trainer.py: the loop's own contracts)


def test_run_inference_equals_hf_generate_for_both_families(tmp_path, capsys, caplog):
    """run_inference.py --compare_hf: our greedy outputs of a T5 (untied head) and a GPT-J checkpoint, token for
    token those of HF generate on the same weights."""
    import run_inference

    t5_dir, gptj_dir = str(tmp_path / "t5"), str(tmp_path / "gptj")
    run_finetuning.main(["--config", "tiny", "--sequence_length", "32", "--global_batch_size", "8",
                         "--micro_batch_size", "2", "--steps", "3", "--save", t5_dir])
    run_finetuning.main(GPTJ_SMALL + ["--steps", "3", "--save", gptj_dir])
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


@pytest.mark.parametrize("flags", [["--constrain", "labels"], ["--constrain", "labels", "--num_beams", "3"],
                                   ["--repetition_penalty", "1.5", "--no_repeat_ngram_size", "2", "--bad_words",
                                    "entailment", "the"]])
def test_run_inference_processors_equal_hf_generates(two_models, capsys, flags):
    """--constrain labels (greedy and beam search: HF's prefix_allowed_tokens_fn over the label trie), the
    penalties and --bad_words: our tokens those of HF generate with the same processors on the same weights
    (--compare_hf), every constrained answer one of the task's labels."""
    import run_inference

    out = run_inference.main(["--load", two_models[0], "--compare_hf", "--limit", "6", "--output_length", "6",
                              *flags])
    assert len(out) == 6 and all(r["same_tokens"] for r in out), out
    if "labels" in flags:
        assert all(r["ours"] in ("entailment", "neutral", "contradiction") for r in out), out
    assert "6 of 6 outputs token for token equal to HF generate" in capsys.readouterr().out


def test_a_gptj_checkpoint_constrained_to_its_labels_equals_hf_generate(tmp_path, capsys):
    """GPT-J's answers continue its prompt: HF's prefix_allowed_tokens_fn reads the new tokens after it."""
    import run_inference
    from tests.helpers import save_random_checkpoint

    save_random_checkpoint("gptj_tiny", str(tmp_path / "g"))
    out = run_inference.main(["--load", str(tmp_path / "g"), "--compare_hf", "--limit", "4", "--constrain", "labels",
                              "--repetition_penalty", "1.3"])
    assert all(r["same_tokens"] and r["ours"] in ("entailment", "neutral", "contradiction") for r in out), out
