"""Hugging Face ``generate`` on our weights, with our decoding options: the reference ``run_inference.py
--compare_hf`` and the benchmarks set beside our decoding (torch is imported by whoever imports this module)."""

from __future__ import annotations

import numpy as np
import torch
import transformers


def hf_decoding(inference) -> dict:
    """The config's decoding options as HF ``generate``'s arguments."""
    es = {"true": True, "false": False, "never": "never"}[inference.early_stopping]
    return dict(do_sample=inference.do_sample, num_beams=inference.num_beams, length_penalty=inference.length_penalty,
                early_stopping=es, temperature=inference.temperature, top_k=inference.top_k, top_p=inference.top_p)


def hf_model_of(cfg, family, host_params):
    """The HF model (transformers' class of the family's export) holding our weights (numpy, stacked layout)."""
    kw = family.hf.config_dict(cfg.model)
    arch = kw.pop("architectures")[0]
    model = getattr(transformers, arch)(transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)).eval()
    sd = {k: torch.tensor(np.asarray(v)) for k, v in family.hf.state_dict(host_params, cfg.model).items()}
    if "lm_head.weight" in sd and model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        # transformers 5 ties T5's head to the embedding whatever the config says; Flan-T5's are separate, so
        # the head gets its own tensor before loading (loading into tied tensors would overwrite the embedding)
        model.get_output_embeddings().weight = torch.nn.Parameter(sd["lm_head.weight"].clone())
    if not cfg.model.tie_word_embeddings:
        model.config.tie_word_embeddings = False  # UMT5 rescales its output when it reads True (forced on construction)
    model.load_state_dict(sd, strict=False)
    return model


def hf_processors(options, family, prompt_width: int, model_vocab: int) -> dict:
    """Our search's processors (modelling/decoding.py's ``Options``) as HF ``generate``'s arguments: the vocabulary's
    cut as ``suppress_tokens``, the bias as ``bad_words_ids`` (-inf) and ``sequence_bias``, the penalties, a label
    trie as ``prefix_allowed_tokens_fn`` (its sentence's new tokens: after the prompt, or T5's start token)."""
    if options is None:
        return {}
    p, kw = options.processors, {}
    if options.vocab and options.vocab < model_vocab:
        kw["suppress_tokens"] = list(range(options.vocab, model_vocab))
    bad = [list(ids) for ids, b in p.sequence_bias if b == float("-inf")]
    bias = {tuple(ids): b for ids, b in p.sequence_bias if b != float("-inf")}
    kw.update({k: v for k, v in (("bad_words_ids", bad), ("sequence_bias", bias)) if v})
    if p.repetition_penalty != 1.0:
        kw["repetition_penalty"] = p.repetition_penalty
    if p.no_repeat_ngram_size:
        kw["no_repeat_ngram_size"] = p.no_repeat_ngram_size
    if p.trie is not None:
        start = prompt_width if family.continues_prompt else 1  # (HF's sentence: the prompt, or T5's start token)
        kw["prefix_allowed_tokens_fn"] = lambda batch_id, sent: p.trie.allowed(sent[start:].tolist())
    return kw


def hf_generate(cfg, family, host_params, ids, mask, eos: int, pad: int, options=None):
    """HF ``generate`` of the same weights with the same decoding options (``options``: our search's, whose
    processors HF's own stand beside: ``hf_processors``), on prompts laid out as the family decodes them
    (``Family.layout_prompts``): tokens [b, output_length] padded with ``pad`` after each end-of-text."""
    model = hf_model_of(cfg, family, host_params)
    n = cfg.inference.output_length
    extra = hf_processors(options, family, ids.shape[1], cfg.model.embedding.vocab_size)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=n,
                             eos_token_id=eos, pad_token_id=pad, **hf_decoding(cfg.inference),
                             **family.hf.generate_kwargs, **extra)
    out = family.hf.new_tokens(out.numpy(), ids.shape[1])
    out = np.pad(out, ((0, 0), (0, n - out.shape[1])), constant_values=pad)
    ended = np.cumsum(out == eos, axis=1) - (out == eos) > 0  # HF's beam search fills after EOS with EOS
    return np.where(ended, pad, out)
