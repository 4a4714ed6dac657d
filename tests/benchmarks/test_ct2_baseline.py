"""benchmarks/ct2_baseline.py: CTranslate2 reads the very token ids ours and HF ``generate`` read (the decoding
benchmarks' prompts), and its conversion of the HF model decodes them as HF does."""

from __future__ import annotations

import numpy as np
import pytest

from app.args import parse_config
from data.generated import generated_prompts

TINY = ["--config", "tiny", "--micro_batch_size", "3", "--output_length", "4", "--sequence_length", "32",
        "--warmup_iterations", "1", "--iterations", "1"]


def _unpadded(ids, mask) -> list:
    return [list(map(int, row[m > 0])) for row, m in zip(ids, mask)]


class Result:
    def __init__(self, n):
        self.hypotheses = [["</s>"] + ["t7"] * (n - 1)]


class RecordingTranslator:
    """CTranslate2's Translator as the benchmark calls it, recording the source tokens and lengths it is given."""

    def __init__(self):
        self.calls = []

    def translate_batch(self, source, beam_size, length_penalty, max_decoding_length, min_decoding_length):
        self.calls.append((source, beam_size, max_decoding_length, min_decoding_length))
        return [Result(max_decoding_length) for _ in source]


def test_token_strings_map_back_to_their_ids():
    from benchmarks.ct2_baseline import IdVocabulary, token, token_id

    vocab = IdVocabulary(40).get_vocab()
    assert len(vocab) == 40 and sorted(vocab.values()) == list(range(40))
    assert all(token_id(s) == i for s, i in vocab.items())
    assert (token(0), token(1), token(2), token(3)) == ("<pad>", "</s>", "<unk>", "t3")
    assert IdVocabulary(40).convert_ids_to_tokens(0) == "<pad>"  # the decoder's start token, as T5's


def test_ctranslate2_hf_and_ours_receive_the_same_token_ids(monkeypatch):
    import jax
    import torch

    import inference
    from benchmarks import ct2_baseline, hf_baseline

    cfg, args = parse_config("inference", "test", "tiny", TINY, ct2_baseline.extra_flags)
    ids, mask = generated_prompts(cfg)
    assert ids.shape == (3, 32) and (mask.sum(1) > 0).all()
    # CTranslate2: each row's tokens up to its length, exactly output_length tokens each time
    tr = RecordingTranslator()
    header, measure = ct2_baseline.generate(cfg, args, tr)
    report = measure()
    sources = {tuple(tuple(ct2_baseline.token_id(s) for s in row) for row in src) for src, *_ in tr.calls}
    assert sources == {tuple(map(tuple, _unpadded(ids, mask)))}
    assert {c[2:] for c in tr.calls} == {(1, 1), (4, 4)} and {c[1] for c in tr.calls} == {1}
    assert report["tokens"] == [[1, 7, 7, 7]] * 3 and header["prompt_tokens"] == int(mask.sum())

    # HF generate: the same rows, padded, with their mask
    seen = []

    class Model:
        def eval(self):
            return self

        def generate(self, input_ids, attention_mask, max_new_tokens, **kw):
            seen.append((input_ids.numpy(), attention_mask.numpy()))
            return torch.zeros((input_ids.shape[0], max_new_tokens + 1), dtype=torch.long)

    monkeypatch.setattr(hf_baseline, "hf_model", lambda cfg: (Model(), "cpu", torch.float32))
    hf_baseline.generate(cfg, args)[1]()
    assert all((i == ids).all() and (m == mask).all() for i, m in seen) and seen

    # ours: inference.py's programs get the same ids and mask
    calls = []

    def fake_programs(g, n):
        def fn(params, i, m, *rest):
            calls.append((np.asarray(i), np.asarray(m)))
            return jax.numpy.zeros((i.shape[0], n), np.int32)

        return fn, fn, fn

    monkeypatch.setattr(inference, "programs", fake_programs)
    inference.main(["--config", "tiny", "--micro_batch_size", "3", "--output_length", "4", "--sequence_length", "32",
                    "--iterations", "1", "--tensor_parallel", "1"])
    assert calls and all((i == ids).all() and (m == mask).all() for i, m in calls)


def test_the_conversion_decodes_the_prompts_as_hf_generate_does(tmp_path):
    """The HF model converted by CTranslate2's converter (float32), given ``source_tokens`` of the benchmark's
    prompts, generates HF's greedy tokens: the same weights, the same ids, no token added or lost. (The weights
    are drawn wider than HF's init, so that the tokens differ from row to row and step to step.)"""
    pytest.importorskip("ctranslate2")
    import ctranslate2
    import torch

    from benchmarks import ct2_baseline
    from benchmarks.hf_baseline import hf_model

    cfg, args = parse_config("inference", "test", "tiny", TINY, ct2_baseline.extra_flags)
    model, _, _ = hf_model(cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    model.eval()
    ids, mask = generated_prompts(cfg)
    with torch.no_grad():
        hf = model.generate(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                            max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1, eos_token_id=1,
                            pad_token_id=0)[:, 1:].tolist()
    tr = ctranslate2.Translator(ct2_baseline.convert(model, str(tmp_path)), device="cpu", compute_type="float32")
    out = tr.translate_batch(ct2_baseline.source_tokens(ids, mask), beam_size=1, max_decoding_length=6,
                             min_decoding_length=6)
    ours = [[ct2_baseline.token_id(s) for s in r.hypotheses[0]] for r in out]
    assert len({tuple(r) for r in hf}) > 1 and len({t for r in hf for t in r}) > 3  # tokens that tell rows apart
    assert ours == hf
