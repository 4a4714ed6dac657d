"""Decoding beyond greedy, against Hugging Face generate in float32 on random fixtures of both families.

Beam search (2 and 4 beams, with and without a length penalty, each early-stopping rule) gives HF's tokens, token
for token, at tp 1 and tp 2. Sampling cannot draw HF's tokens (torch's generator is not JAX's), so it is checked
as the same distribution: our warpers (temperature, top-k, top-p) turn the same logits into HF's processed scores,
our draws follow that distribution, a fixed seed gives the same outputs at any dp x tp, and top_k 1 is greedy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import GPTJConfig, GPTJForCausalLM

from config.schema import Config
from decoder.engine import Decoder
from modelling import decoding, gptj, registry
from modelling.decoding import Options
from tests.hf_utils import make_hf, random_batch

N = 7  # new tokens


@pytest.fixture(scope="module", params=["t5", "gptj"])
def fixture(request):
    """(family name, HF model, our ModelConfig, our params, prompts ids/mask as the family decodes them)."""
    if request.param == "t5":
        hf, m, params = make_hf("1.1", seed=3)
        with torch.no_grad():
            hf.shared.weight.mul_(0.05)  # a smaller embedding: the random model does not echo its start token
        from modelling.hf_mapping import params_from_hf_state_dict

        params = params_from_hf_state_dict(hf.state_dict(), m)
    else:
        torch.manual_seed(3)
        hf = GPTJForCausalLM(GPTJConfig(vocab_size=96, n_positions=64, n_embd=48, n_layer=2, n_head=4, rotary_dim=8,
                                        n_inner=96, bos_token_id=1, eos_token_id=1, tie_word_embeddings=False)).eval()
        m = gptj.config_from_hf(hf.config.to_dict())
        params = gptj.params_from_hf(hf.state_dict(), m)
    batch = random_batch(m.embedding.vocab_size, 4, 9, 2, seed=4)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ids, mask = registry.get(request.param).layout_prompts(ids, mask)
    return request.param, hf, m, jax.tree.map(np.asarray, params), ids, mask


def ours(m, params, ids, mask, options: Options, tp: int = 1, dp: int = 1, eos: int = 1, seed: int = 0):
    cfg = Config(model=m)
    cfg.model.eval = True
    cfg.execution.tensor_parallel, cfg.execution.data_parallel, cfg.execution.rts = tp, dp, False
    g = Decoder.of_config(cfg.validate(), eos=eos, pad=0)
    run = g.search(options, seed)
    return np.asarray(run(g.place.shard_params(params), jnp.asarray(ids), jnp.asarray(mask)))


def hf_tokens(name, hf, ids, mask, eos: int = 1, **kw):
    extra = {"decoder_start_token_id": 0} if name == "t5" else {}
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=N,
                          eos_token_id=eos, pad_token_id=0, **kw, **extra).numpy()
    out = out[:, ids.shape[1]:] if name == "gptj" else out[:, 1:]
    out = np.pad(out, ((0, 0), (0, N - out.shape[1])))
    ended = np.cumsum(out == eos, axis=1) - (out == eos) > 0  # after the first EOS: padding (HF may fill with EOS)
    return np.where(ended, 0, out)


def ending_eos(name, hf, ids, mask, **kw) -> tuple:
    """(eos, HF's tokens with it): a token the search writes early, so that as EOS some beams end before others and
    the finished-hypotheses rules (length penalty, early stopping) decide the outputs."""
    free = hf_tokens(name, hf, ids, mask, eos=-1, **kw)
    tried = []
    for eos in dict.fromkeys(free[:, 1:4].ravel().tolist()):
        ref = hf_tokens(name, hf, ids, mask, eos=eos, **kw)
        ended = (ref == eos).any(axis=1)
        if ended.any() and not ended.all():
            return eos, ref
        tried.append((ended.any(), eos, ref))
    ends = [(eos, ref) for any_, eos, ref in tried if any_]
    return ends[0] if ends else tried[0][1:]  # (a length penalty of 2 can prefer the unfinished beams throughout)


@pytest.mark.slow
@pytest.mark.parametrize("beams,length_penalty,early_stopping", [
    (2, 1.0, "false"), (4, 1.0, "false"), (4, 0.5, "true"), (4, 2.0, "never")])
@pytest.mark.parametrize("tp", [1, 2])
def test_beam_search_gives_hf_generates_tokens(fixture, beams, length_penalty, early_stopping, tp):
    name, hf, m, params, ids, mask = fixture
    es = {"true": True, "false": False, "never": "never"}[early_stopping]
    eos, ref = ending_eos(name, hf, ids, mask, num_beams=beams, length_penalty=length_penalty, early_stopping=es,
                          do_sample=False)
    assert len({tuple(r) for r in ref}) > 1  # outputs that differ from row to row
    got = ours(m, params, ids, mask, Options(N, beams, length_penalty, early_stopping), tp=tp, eos=eos)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_one_beam_is_greedy(fixture, tp):
    name, hf, m, params, ids, mask = fixture
    np.testing.assert_array_equal(ours(m, params, ids, mask, Options(N, num_beams=1), tp=tp),
                                  hf_tokens(name, hf, ids, mask, do_sample=False, num_beams=1))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.6)])
def test_our_warpers_give_hfs_processed_scores(temperature, top_k, top_p):
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    logits = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32) * 3
    procs = LogitsProcessorList(([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])
                                + ([TopKLogitsWarper(top_k)] if top_k else [])
                                + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))
    theirs = procs(None, torch.tensor(logits)).numpy()
    got = np.asarray(decoding.warp(jnp.asarray(logits), Options(N, do_sample=True, temperature=temperature,
                                                                top_k=top_k, top_p=top_p)))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(theirs))  # the same tokens removed
    finite = np.isfinite(theirs)
    np.testing.assert_allclose(got[finite], theirs[finite], rtol=1e-6)
    assert np.isinf(theirs).any() == (top_k > 0 or top_p < 1.0)


def test_our_draws_follow_the_warped_distribution():
    """20,000 draws of one row's token: the frequencies are the warped softmax's (each within 5 sigma)."""
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(1, 12)).astype(np.float32) * 2)
    options = Options(N, do_sample=True, temperature=0.8, top_k=8, top_p=0.9)
    scores = decoding.warp(logits, options)
    p = np.asarray(jax.nn.softmax(scores, axis=-1))[0]
    n = 20000
    rows = jnp.arange(n)
    draws = np.asarray(decoding.sample_token(jnp.broadcast_to(scores, (n, 12)), jax.random.key(0), rows))
    freq = np.bincount(draws, minlength=12) / n
    sigma = np.sqrt(p * (1 - p) / n) + 1e-12
    assert np.all(np.abs(freq - p) <= 5 * sigma + 1e-9), (freq, p)
    assert freq[p == 0].sum() == 0  # never a token the warpers removed


@pytest.mark.slow
def test_sampling_is_the_same_at_any_layout_and_top_k_one_is_greedy(fixture):
    name, hf, m, params, ids, mask = fixture
    options = Options(N, do_sample=True, temperature=1.5, top_k=0, top_p=0.95)
    one = ours(m, params, ids, mask, options, seed=11)
    assert not np.array_equal(one, ours(m, params, ids, mask, options, seed=12))  # the seed matters
    np.testing.assert_array_equal(one, ours(m, params, ids, mask, options, tp=2, dp=2, seed=11))
    greedy = ours(m, params, ids, mask, Options(N))
    np.testing.assert_array_equal(ours(m, params, ids, mask, Options(N, do_sample=True, top_k=1), seed=3), greedy)
