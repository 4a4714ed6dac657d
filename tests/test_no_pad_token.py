"""Tokenizers without a pad token (GPT-J's and GPT-2's have none; their config.json sets no pad_token_id): both
families train, validate and decode with one, padding with the end-of-text token as Hugging Face ``generate`` does
(``data.tasks.pad_id``), and our greedy outputs equal HF ``generate``'s. The benchmarks use generated token ids, no
tokenizer, so no pad token enters them."""

import json
import os

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import GPTJConfig, GPTJForCausalLM, PreTrainedTokenizerFast
from transformers import T5Config as HFT5Config
from transformers import T5ForConditionalGeneration

import run_finetuning
import run_inference
import run_validation
from data import synthetic
from utils import checkpoint as ckpt


def tokenizer_without_pad(path, eos: str, t5: bool):
    """A word-level tokenizer over the synthetic task's words with an end-of-text token and no pad token; T5's
    appends it to every text (as T5's tokenizers do), GPT-J's adds nothing (as GPT-2's). Id 0 is a word, not a
    pad."""
    words = [w for w in synthetic.vocabulary() if w not in synthetic.SPECIALS]
    vocab = {w: i for i, w in enumerate(["the", eos] + [w for w in words if w != "the"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=eos))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if t5:
        tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos)
    assert fast.pad_token is None and fast.pad_token_id is None
    fast.save_pretrained(path)
    return fast


def hf_model(family: str, vocab: int):
    torch.manual_seed(0)
    if family == "gptj":
        config = GPTJConfig(vocab_size=vocab, n_positions=128, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                            n_inner=128, bos_token_id=1, eos_token_id=1, pad_token_id=None, tie_word_embeddings=False)
        model = GPTJForCausalLM(config)
    else:
        config = HFT5Config(vocab_size=vocab, d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2,
                            feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
                            eos_token_id=1, pad_token_id=0, initializer_factor=5.0)
        model = T5ForConditionalGeneration(config)
        with torch.no_grad():  # its own head, unlike the embedding (transformers >= 5 ties them on construction)
            model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight) * 0.5)
        model.config.tie_word_embeddings = False
    assert model.config.pad_token_id is None or family == "t5"
    return model


@pytest.mark.slow
@pytest.mark.parametrize("family,preset,eos", [("gptj", "gptj_tiny", "<|endoftext|>"), ("t5", "tiny", "</s>")])
def test_a_tokenizer_without_a_pad_token_trains_validates_and_decodes_as_hf(tmp_path, capsys, family, preset, eos):
    tok = tokenizer_without_pad(tmp_path / "tok", eos, t5=family == "t5")
    model = hf_model(family, len(tok))
    model.save_pretrained(tmp_path / "hf")
    common = ["--config", preset, "--hf_model", str(tmp_path / "hf"), "--tokenizer", str(tmp_path / "tok")]

    out = run_inference.main(common + ["--compare_hf", "--limit", "4", "--output_length", "6"])
    assert len(out) == 4 and all(r["same_tokens"] for r in out), out
    assert len({r["ours"] for r in out}) > 1 or any(r["ours"] for r in out)  # the model says something

    report = tmp_path / "val.json"
    run_validation.main(common + ["--limit", "6", "--output", str(report)])
    assert json.load(open(report))["samples"] == 6

    save = str(tmp_path / "ck")
    run_finetuning.main(common + ["--steps", "2", "--save", save, "--sequence_length", "48",
                                  "--global_batch_size", "8", "--micro_batch_size", "2"])
    assert ckpt.saved_steps(save)[-1] == 2
    first = json.loads(open(os.path.join(save, "metrics.jsonl")).readline())
    assert first["loss"] > 0 and first["unknown_token_share"] == 0.0
    capsys.readouterr()


@pytest.mark.parametrize("family,preset,eos", [("gptj", "gptj_tiny", "<|endoftext|>"), ("t5", "tiny", "</s>")])
def test_without_a_pad_token_prompts_and_finished_outputs_are_padded_with_end_of_text(tmp_path, monkeypatch, family,
                                                                                     preset, eos):
    """Id 0 is a word of these tokenizers: a prompt padded with it, or an output continued with it after its end,
    would read or write "the". The decoding program our Decoder builds stops at end-of-text and pads with it
    (as HF ``generate`` does when the model sets no pad token), and prompts are padded with it."""
    from config import load_config
    from data.tasks import Example, pad_id, tokenize_prompts
    from decoder.engine import Decoder
    from modelling import registry

    tok = tokenizer_without_pad(tmp_path / "tok", eos, t5=family == "t5")
    assert tok.convert_ids_to_tokens(0) == "the" and pad_id(tok) == tok.eos_token_id == 1
    decoder = Decoder.of_config(load_config("inference", preset, {"rts": False}), tok)
    assert (decoder.eos_id, decoder.pad_id) == (1, 1)
    feats = tokenize_prompts([Example("the cat runs .", "", 0), Example("the dog", "", 0)], tok, registry.get(family))
    ids, mask = np.asarray(feats["input_ids"]), np.asarray(feats["attention_mask"])
    assert (mask[1] == 0).any() and (ids[mask == 0] == 1).all()
