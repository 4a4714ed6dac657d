"""Export (app/export.py, through run_export.py): a LoRA checkpoint's adapters in PEFT's format name their base by
its absolute path, so PEFT loads them from any directory (and, moved, with the base named); a GPT-J export's
tokenizer reads prompts as GPT-J does here, so transformers' generate on the export answers as this project
decodes."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import SMALL


# ------------------------------------------------------------------ 15. PEFT's base path, 16. hf/ in .gitignore
@pytest.mark.slow
def test_a_peft_export_names_its_base_by_its_absolute_path_and_loads_from_any_directory(tmp_path, monkeypatch):
    """Exported with a relative --output, the adapters name the base written beside them by its absolute path:
    ``AutoPeftModel...from_pretrained`` loads both from another directory (PEFT reads the path from the current
    directory: a relative one loaded only where it was exported); a moved folder loads with its base named."""
    import run_export
    import run_finetuning

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    run_finetuning.main(SMALL + ["--lora_rank", "2", "--lora_random_base", "--steps", "1", "--save", "ck"])
    run_export.main(["--load", "ck", "--output", "hf/lora", "--peft"])
    config = json.load(open(project / "hf" / "lora" / "adapter_config.json"))
    assert config["base_model_name_or_path"] == str(project / "hf" / "lora" / "base")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    peft = pytest.importorskip("peft")
    model = peft.AutoPeftModelForSeq2SeqLM.from_pretrained(str(project / "hf" / "lora"))  # base and adapters
    assert model.peft_config["default"].r == 2
    moved = tmp_path / "moved"
    os.rename(project / "hf" / "lora", moved)
    from transformers import T5ForConditionalGeneration

    base = T5ForConditionalGeneration.from_pretrained(str(moved / "base"))
    assert peft.PeftModel.from_pretrained(base, str(moved)).peft_config["default"].r == 2


def test_a_gptj_export_generates_in_transformers_as_it_decodes_here(tmp_path, monkeypatch):
    """The exported tokenizer reads a prompt as GPT-J does here (no end-of-text appended: the synthetic tokenizer
    appends one, made for T5), so ``GPTJForCausalLM.generate`` on the export, prompted through that tokenizer as a
    transformers user prompts it, gives run_inference.py's greedy tokens; a T5 export keeps its end-of-text."""
    import numpy as np
    import torch
    import transformers

    import run_export
    import run_inference
    from decoder.decoder import Decoder
    from tests.helpers import save_random_checkpoint

    ck, out = str(tmp_path / "gptj"), str(tmp_path / "hf")
    save_random_checkpoint("gptj_tiny", ck)
    run_export.main(["--load", ck, "--output", out])
    seen, original = [], Decoder.predict_tokens
    monkeypatch.setattr(Decoder, "predict_tokens", lambda self, *a: seen.append(original(self, *a)) or seen[-1])
    texts = ["the cat sleeps in the park", "a dog"]
    run_inference.main(["--load", ck, "--prompt", *texts, "--output_length", "6", "--micro_batch_size", "2"])
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.GPTJForCausalLM.from_pretrained(out).eval()
    for text, ours in zip(texts, np.asarray(seen[0]).tolist()):
        ids = tok(text + " target:", return_tensors="pt")["input_ids"]
        assert tok.eos_token_id not in ids[0].tolist()
        with torch.no_grad():
            # (the embedding's rows past the tokenizer's ids are never chosen here: HF told the same)
            theirs = model.generate(ids, max_new_tokens=6, do_sample=False,
                                    suppress_tokens=list(range(len(tok), model.config.vocab_size)))[0, ids.shape[1]:]
            theirs = theirs.tolist()
        stop = ours.index(tok.eos_token_id) + 1 if tok.eos_token_id in ours else 6
        assert theirs[:stop] == ours[:stop], (text, theirs, ours)
    t5 = str(tmp_path / "t5")
    save_random_checkpoint("tiny", t5)
    run_export.main(["--load", t5, "--output", str(tmp_path / "hf_t5")])
    t5_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf_t5"))
    assert t5_tok("the cat")["input_ids"][-1] == t5_tok.eos_token_id  # (T5 reads its input so)
