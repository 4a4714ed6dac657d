"""Decoding's searches (modelling/decoding.py) against Hugging Face ``generate`` in float32, on random fixtures.

Greedy: HF's tokens at tp 1 and 2, cached equal to uncached, the end-of-text token stopping a sequence and padding
after it (also as the first token), the output length cutting generation; the KV cache's logits equal to the whole
model's at every position, for every T5 layout and GPT-J.

Beyond greedy, both families: beam search (2 and 4 beams, with and without a length penalty, each early-stopping
rule) gives HF's tokens, token for token, at tp 1 and tp 2. Sampling cannot draw HF's tokens (torch's generator is
not JAX's), so it is checked as the same distribution: our warpers (temperature, top-k, top-p) turn the same logits
into HF's processed scores, our draws follow that distribution, a fixed seed gives the same outputs at any dp x tp,
and top_k 1 is greedy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from modelling import decoding, registry
from modelling.decoding import Options
from modelling.hf_mapping import params_from_hf_state_dict
from tests.hf_utils import hf_greedy as hf_generate
from tests.hf_utils import N, hf_tokens, make_hf, options, ours, random_batch, search_models
from tests.hf_utils import sharded_greedy as sharded_generate


@pytest.fixture(scope="module")
def model():
    hf, m, _ = make_hf("1.1", seed=1)
    with torch.no_grad():
        # transformers >= 5 ties the head to the embedding; a smaller embedding keeps the
        # random model from echoing its start token, so the tokens vary across steps
        hf.shared.weight.mul_(0.05)
    params = jax.tree.map(jnp.asarray, params_from_hf_state_dict(hf.state_dict(), m))
    batch = random_batch(m.embedding.vocab_size, 4, 11, 5, seed=2)  # rows padded differently
    return hf, m, params, batch


def generate(params, ids, mask, opts, n, eos_id=1):
    """Greedy decoding of the T5 family on one device."""
    return decoding.greedy(registry.get(opts.family), params, ids, mask, opts, n, eos_id=eos_id)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_same_tokens_as_hf_generate(model, tp):
    hf, m, params, batch = model
    ref = hf_generate(hf, batch, 6)
    assert len(set(ref.ravel().tolist())) > 3  # a non-trivial sequence
    np.testing.assert_array_equal(sharded_generate(m, params, batch, 6, tp), ref)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_cached_equals_uncached(model, tp):
    _, m, params, batch = model
    np.testing.assert_array_equal(sharded_generate(m, params, batch, 6, tp),
                                  sharded_generate(m, params, batch, 6, tp, cached=False))


@pytest.mark.slow
def test_eos_stops_a_sequence_and_pads_after_it(model):
    hf, m, params, batch = model
    free = np.asarray(generate(params, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]),
                               options(m), 6))
    eos = int(free[0, 1])  # make row 0's second token the end-of-sequence token
    ours = sharded_generate(m, params, batch, 6, 1, eos=eos)
    np.testing.assert_array_equal(ours, hf_generate(hf, batch, 6, eos=eos))
    first = int(np.argmax(ours[0] == eos))
    assert first <= 1 and np.all(ours[0, first + 1:] == 0)


@pytest.mark.slow
def test_eos_as_first_token_leaves_only_padding(model):
    _, m, params, batch = model
    opts = options(m)
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    first = np.asarray(generate(params, ids, mask, opts, 1))[:, 0]
    # row 0 alone, with its first token declared EOS: the loop's stop condition holds after one step
    one = np.asarray(generate(params, ids[:1], mask[:1], opts, 8, eos_id=int(first[0])))
    np.testing.assert_array_equal(one[0], [first[0]] + [0] * 7)


@pytest.mark.slow
def test_output_length_cuts_generation(model):
    _, m, params, batch = model
    opts = options(m)
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
    long = np.asarray(generate(params, ids, mask, opts, 6))
    short = np.asarray(generate(params, ids, mask, opts, 3))
    assert short.shape == (4, 3)
    np.testing.assert_array_equal(short, long[:, :3])


# ----------------------------------------------------------------------------- the KV cache against the whole model
def _fixture(kind: str, seed: int):
    """(family, options, our params, vocab) of a random HF model of one layout: each T5-family kind, and GPT-J."""
    from transformers import GPTJConfig, GPTJForCausalLM

    from modelling import gptj

    if kind != "gptj":
        hf, m, params = make_hf(kind, seed=seed, **({"num_decoder_layers": 3} if kind == "mt5" else {}))
        return registry.get(m.family), options(m), params, m.embedding.vocab_size
    torch.manual_seed(seed)
    hf = GPTJForCausalLM(GPTJConfig(vocab_size=96, n_positions=64, n_embd=48, n_layer=2, n_head=4, rotary_dim=8,
                                    n_inner=96, bos_token_id=1, eos_token_id=1, tie_word_embeddings=False))
    m = gptj.config_from_hf(hf.config.to_dict())
    from config.schema import Config

    opts = registry.get("gptj").options_of(Config(model=m))
    return registry.get("gptj"), opts, jax.tree.map(jnp.asarray, gptj.params_from_hf(hf.state_dict(), m)), 96


def _cached_logits(family, opts, n, per_layer: bool = False):
    """logits [n, b, V] of n positions decoded with the cache, the tokens forced (not chosen); ``per_layer``: the
    last stack's weights one tree per layer, as decoding's layout holds a shallow decoder on a CPU."""

    @jax.jit
    def run(params, ids, mask, tokens):
        dp = family.decoding_params(params, opts)
        if per_layer:
            last = family.stacks[-1].name
            layers, depth = dp[last]["layers"], jax.tree.leaves(dp[last]["layers"])[0].shape[0]
            dp = {**dp, last: {**dp[last], "layers": [jax.tree.map(lambda w: w[i], layers) for i in range(depth)]}}
        first, cache = family.decode_start(dp, ids, mask, opts, n)

        def body(cache, inputs):
            i, token = inputs
            logits, cache = family.decode_step(dp, token, i, cache, opts)
            return cache, logits

        _, rest = jax.lax.scan(body, cache, (jnp.arange(n - 1), tokens[:, :-1].T))
        return jnp.concatenate([first[None], rest])

    return run


def _whole_model_logits(family, opts, params, ids, mask, tokens):
    """The same n positions' logits [n, b, V] from one forward pass over the whole sequence."""
    if family.causal:  # the (left-aligned) prompt, then the tokens
        seq = jnp.concatenate([ids, tokens[:, :-1]], 1)
        seg = jnp.concatenate([mask, jnp.ones_like(tokens[:, :-1])], 1)
        batch = {"input_ids": seq, "attention_mask": seg, "positions": jnp.maximum(jnp.cumsum(seg, 1) - 1, 0)}
        logits = family.forward(params, batch, opts)[:, ids.shape[1] - 1:]
    else:  # the encoder on the prompt, the decoder on the start token and the tokens
        dec = jnp.concatenate([jnp.zeros_like(tokens[:, :1]), tokens[:, :-1]], 1)
        logits = family.forward(params, {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}, opts)
    return jnp.transpose(logits, (1, 0, 2))


@pytest.mark.slow
@pytest.mark.parametrize("kind,per_layer", [("1.1", False), ("1.0", False), ("ul2", False), ("mt5", False),
                                            ("umt5", False), ("gptj", False), ("1.1", True), ("umt5", True),
                                            ("mt5", True)])
def test_cached_logits_equal_the_whole_model_at_every_position(kind, per_layer):
    """Decoding with the KV cache gives, at each of 16 positions, the logits of the whole model run on the whole
    sequence (float32, 1e-5), over three seeds of weights and prompts: a cache that reads another layer's
    position table, a wrong position or a stale key shows at some position even when the greedy tokens agree. The
    decoder's layers scanned, and (``per_layer``, T5's) run one after the other over a tree and a cache per layer."""
    n = 16
    for seed in range(3):
        family, opts, params, vocab = _fixture(kind, seed)
        assert family.unrolls_decoding or not per_layer
        batch = random_batch(vocab, 3, 9, 2, seed=seed)  # prompts of 9, 5 and 3 tokens
        ids, mask = batch["input_ids"], batch["attention_mask"]
        ids, mask = family.layout_prompts(ids, mask)  # right-aligned where decoding continues each prompt
        ids, mask = jnp.asarray(ids), jnp.asarray(mask)
        tokens = jnp.asarray(np.random.default_rng(seed).integers(2, vocab, (3, n)), jnp.int32)
        cached = np.asarray(_cached_logits(family, opts, n, per_layer)(params, ids, mask, tokens))
        whole = np.asarray(_whole_model_logits(family, opts, params, ids, mask, tokens))
        assert cached.shape == whole.shape == (n, 3, cached.shape[-1])
        for i in range(n):
            err = float(np.max(np.abs(cached[i] - whole[i])) / np.max(np.abs(whole[i])))
            assert err < 1e-5, (kind, seed, i, err)


@pytest.fixture(scope="module", params=["t5", "gptj"])
def fixture(request):
    """(family name, HF model, our ModelConfig, our params, prompts ids/mask as the family decodes them)."""
    return search_models(request.param)


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
