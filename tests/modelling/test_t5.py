"""The T5 family on one engine: T5 v1.1 (Flan-T5's layout), T5 v1.0, UL2 (gated-SiLU), mT5 (a larger, padded
vocabulary and a decoder deeper than its encoder) and UMT5 (a relative-position table in every layer).

For each, at tp 1 and 2 and float32: the fused executor's loss and every weight's gradient equal HF's (each
compared on its own: the untied fixtures' ``lm_head`` differs from ``shared``), within 1e-5 of the largest value;
greedy decoding with the KV cache equals HF ``generate``; the export loads back into transformers with the same
logits. The phased executor is checked against the fused one for the variants whose layout it had not seen
(per-layer tables, stacks of different depths).
"""

import copy
import functools

import jax
import numpy as np
import pytest
import torch
from transformers import T5ForConditionalGeneration, UMT5ForConditionalGeneration

from config.schema import T5Config
from decoder.decoder import Decoder
from graphs.executor import make_executor
from graphs.graphs import Graphs
from modelling.hf_mapping import hf_state_dict_from_params, params_from_hf_state_dict, save_hf_model
from tests.hf_utils import T5_DEC, T5_ENC, from_pretrained, random_batch, rel_err, t5_with_norms_off_one
from tests.hf_utils import t5_batch as batch_of_rows, t5_training_config as training_config

TOL = 1e-5
ENC, DEC = T5_ENC, T5_DEC  # encoder and decoder lengths of the test batches
# variant -> make_hf overrides: mT5 gets an odd vocabulary (padded at tp 2) and 3 decoder layers over 2 encoder
VARIANTS = {
    "v1.1": ("1.1", {}),
    "v1.0": ("1.0", {}),
    "ul2": ("ul2", {}),
    "mt5": ("mt5", dict(vocab_size=251, num_decoder_layers=3)),
    "umt5": ("umt5", {}),
}
# the class the export loads into: an mT5 exports as T5 (the same layout), a UMT5 as UMT5
MODEL_CLASSES = {"1.1": T5ForConditionalGeneration, "1.0": T5ForConditionalGeneration,
                 "ul2": T5ForConditionalGeneration, "mt5": T5ForConditionalGeneration,
                 "umt5": UMT5ForConditionalGeneration}


@functools.lru_cache(maxsize=None)
def build(name):
    version, overrides = VARIANTS[name]
    return (name, *t5_with_norms_off_one(version, **overrides))


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return build(request.param)


def hf_loss_and_grads(hf, batch):
    hf.zero_grad()
    out = hf(**{k: torch.tensor(v) for k, v in batch.items()})
    out.loss.backward()
    return float(out.loss.detach()), {k: p.grad.numpy().copy() for k, p in hf.named_parameters()}


def executor_loss_and_grads(cfg, hf, batch):
    ex = make_executor(Graphs(cfg))
    host = params_from_hf_state_dict(hf.state_dict(), cfg.model, cfg.execution.tensor_parallel)
    grouped = ex.g.shard_batch({k: v.reshape(2, 2, -1) for k, v in batch.items()})
    rng = jax.random.key_data(jax.random.key(0))
    loss, grads = ex.loss_and_grads(ex.init_state(host), grouped, rng)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_loss_and_every_gradient_equal_hf(variant, tp):
    name, hf, m = variant
    batch = batch_of_rows(m.embedding.vocab_size)
    ref_loss, ref = hf_loss_and_grads(hf, batch)
    loss, grads = executor_loss_and_grads(training_config(m, tensor_parallel=tp), hf, batch)
    assert abs(loss - ref_loss) <= TOL * ref_loss
    ours = hf_state_dict_from_params(grads, m)
    assert ("lm_head.weight" in ref) == (not m.tie_word_embeddings)  # an untied fixture has a head of its own
    # our gradients name every weight HF has, and nothing else (the embedding's aliases aside: a tied head is one)
    aliases = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"} | (
        {"lm_head.weight"} if m.tie_word_embeddings else set())
    assert set(ours) - aliases == set(ref)
    for key, r in ref.items():
        assert np.any(r != 0) and rel_err(ours[key], r) < TOL, (name, key)
    layers = m.layers + m.decoder_depth
    if name == "umt5":  # a table per layer, each its own gradient
        tables = [ours[k] for k in ours if "relative_attention_bias" in k]
        assert len(tables) == layers and all(not np.array_equal(tables[0], t) for t in tables[1:])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ul2", "mt5", "umt5"])  # T5 v1.1 and v1.0: tests/graphs/test_phased.py
def test_phased_equals_fused(name):
    """The phased executor's schedule for the new layouts (per-layer tables, a decoder deeper than the encoder)."""
    name, hf, m = build(name)
    batch = batch_of_rows(m.embedding.vocab_size)
    fused = executor_loss_and_grads(training_config(m, tensor_parallel=2), hf, batch)
    phased = executor_loss_and_grads(training_config(m, tensor_parallel=2, phased=True), hf, batch)
    assert abs(fused[0] - phased[0]) <= 1e-6 * fused[0]
    assert jax.tree.structure(fused[1]) == jax.tree.structure(phased[1])  # the same weights, each once
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(fused[1])[0], jax.tree.leaves(phased[1])):
        assert a.shape == b.shape and rel_err(b, a) < TOL, (name, jax.tree_util.keystr(path))


def hf_generate(hf, batch, n):
    # transformers' KV cache is sized by num_layers: a deeper decoder runs its generate without the cache
    cache = hf.config.num_decoder_layers == hf.config.num_layers
    out = hf.generate(input_ids=torch.tensor(batch["input_ids"]), attention_mask=torch.tensor(batch["attention_mask"]),
                      do_sample=False, num_beams=1, max_new_tokens=n, decoder_start_token_id=0, eos_token_id=1,
                      pad_token_id=0, use_cache=cache).numpy()[:, 1:]
    return np.pad(out, ((0, 0), (0, n - out.shape[1])))


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_decoding_equals_hf_generate(variant, tp):
    name, hf, m = variant
    hf_sharp = copy.deepcopy(hf)  # a smaller embedding keeps the random model from echoing its start token
    with torch.no_grad():
        hf_sharp.shared.weight.mul_(0.05)
    sharp = hf_sharp.state_dict()
    batch = random_batch(m.embedding.vocab_size, 4, ENC, DEC, seed=2)
    ref = hf_generate(hf_sharp, batch, 6)
    assert len(set(ref.ravel().tolist())) > 3, ref  # a non-trivial sequence
    cfg = T5Config(model=m)
    cfg.model.eval = True
    cfg.execution.tensor_parallel, cfg.execution.rts = tp, False
    g = Decoder.of_config(cfg.validate())
    host = params_from_hf_state_dict(sharp, m, tp)
    for cached in (True, False):
        run = g.greedy_program(6, cached=cached)
        ours = np.asarray(run(g.place.shard_params(host), batch["input_ids"], batch["attention_mask"]))
        np.testing.assert_array_equal(ours, ref, err_msg=f"{name} cached={cached}")


def test_export_loads_back_into_transformers_with_the_same_logits(variant, tmp_path):
    name, hf, m = variant
    version = VARIANTS[name][0]
    params = params_from_hf_state_dict(hf.state_dict(), m, tensor_parallel=2)  # padded vocabulary stripped
    save_hf_model(params, m, str(tmp_path))
    back = from_pretrained(MODEL_CLASSES[version], str(tmp_path))
    assert back.config.num_decoder_layers == m.decoder_depth
    b = {k: torch.tensor(v) for k, v in random_batch(m.embedding.vocab_size).items() if k != "labels"}
    with torch.no_grad():
        np.testing.assert_array_equal(hf(**b).logits.numpy(), back(**b).logits.numpy())
