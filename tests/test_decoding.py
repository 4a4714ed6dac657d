"""Greedy decoding: HF generate parity at tp=1/2, cached == uncached, EOS stop, length cut, ragged batches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from modelling import decoding, registry
from modelling.hf_mapping import params_from_hf_state_dict
from tests.hf_utils import hf_greedy as hf_generate, make_hf, options, random_batch
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


@pytest.mark.slow
def test_batches_that_do_not_divide_the_split_score_every_sample_once(tmp_path):
    from config import load_config
    from data.tasks import load_tokenizer
    from decoder.engine import Decoder
    from tests.mnli import load_rows, tokenize_inputs

    cfg = load_config("inference", "tiny", {"micro_batch_size": 4, "tensor_parallel": 2, "rts": False})
    tok = load_tokenizer("synthetic")
    v = Decoder.of_config(cfg, tok)
    params = v.place.init_params()
    rows = load_rows("synthetic", "validation")[:7]  # 7 = 4 + 3: the last batch is short
    feats = tokenize_inputs(rows, tok, cfg.model.sequence_length, v.family)
    texts = v.predict(params, feats)
    assert len(texts) == 7 and all(t is not None for t in texts)
    for i in range(7):  # each row alone gives the same text
        alone = {k: x[i: i + 1] for k, x in feats.items()}
        assert v.predict(params, alone) == [texts[i]]


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


def _cached_logits(family, opts, n):
    """logits [n, b, V] of n positions decoded with the cache, the tokens forced (not chosen)."""

    @jax.jit
    def run(params, ids, mask, tokens):
        dp = family.decoding_params(params, opts)
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
@pytest.mark.parametrize("kind", ["1.1", "1.0", "ul2", "mt5", "umt5", "gptj"])
def test_cached_logits_equal_the_whole_model_at_every_position(kind):
    """Decoding with the KV cache gives, at each of 16 positions, the logits of the whole model run on the whole
    sequence (float32, 1e-5), over three seeds of weights and prompts: a cache that reads another layer's
    position table, a wrong position or a stale key shows at some position even when the greedy tokens agree."""
    n = 16
    for seed in range(3):
        family, opts, params, vocab = _fixture(kind, seed)
        batch = random_batch(vocab, 3, 9, 2, seed=seed)  # prompts of 9, 5 and 3 tokens
        ids, mask = batch["input_ids"], batch["attention_mask"]
        ids, mask = family.layout_prompts(ids, mask)  # right-aligned where decoding continues each prompt
        ids, mask = jnp.asarray(ids), jnp.asarray(mask)
        tokens = jnp.asarray(np.random.default_rng(seed).integers(2, vocab, (3, n)), jnp.int32)
        cached = np.asarray(_cached_logits(family, opts, n)(params, ids, mask, tokens))
        whole = np.asarray(_whole_model_logits(family, opts, params, ids, mask, tokens))
        assert cached.shape == whole.shape == (n, 3, cached.shape[-1])
        for i in range(n):
            err = float(np.max(np.abs(cached[i] - whole[i])) / np.max(np.abs(whole[i])))
            assert err < 1e-5, (kind, seed, i, err)
