"""Decoding's weights in int8 (decoder/weights.py, modelling/quant.py) against decoding the same weights in float32,
for both families at tp 1 and 2 (random models of the tiny presets' shapes, float32 compute):

- decoding with int8 weights, its activations in the compute dtype (a GPU's products), equals decoding in float32
  with the weights ``q * scale`` (the dequantized ones) to float32 rounding (logits within 1e-4 relative to their
  spread): the scale is applied to the accumulator, exactly as to the weight;
- against the original float32 weights, the first token's logits move by at most 3% of their spread in RMS and 10%
  at the worst logit (measured: 1.5% and 5.5%); with a CPU's integer products (each matmul's input rounded to its
  row's int8 grid too, as CTranslate2's int8: tests/modelling/test_quant.py) by at most 4% and 15% (measured: T5
  2.8% and 11.4%, GPT-J 1.0% and 2.7%); the tiny presets' trained checkpoints score within 1 point
  (tests/modelling/test_lora.py for T5 with LoRA merged then quantized, tests/data/test_tasks.py for GPT-J);
- an int8 model holds about half the bytes of bfloat16; a LoRA checkpoint is merged, then quantized, a layer at a
  time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from config import load_config
from data.generated import generated_batch
from decoder.decoder import Decoder
from modelling import quant
from modelling.params import is_spec
from partitioning import sharding as S
from partitioning.placement import Placement


# --------------------------------------------------------------------------- decoding with int8 weights
def _graphs(preset: str, tp: int, quantize: str) -> Decoder:
    cfg = load_config("inference", preset, dict(eval=True, data_parallel=1, tensor_parallel=tp, micro_batch_size=4,
                                                quantize=quantize, sequence_length=32))
    return Decoder.of_config(cfg)


def _host_params(g: Decoder, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (s.std or 0.0) * rng.standard_normal(s.shape).astype(np.float32)
                        + (0.0 if s.std else 1.0) + (0.1 * rng.standard_normal(s.shape).astype(np.float32)
                                                     if s.std is None else 0.0), g.specs, is_leaf=is_spec)


def _first_logits(g: Decoder, params, ids, mask) -> np.ndarray:
    family, opts = g.family, g.opts
    start = g.phase(lambda p, i, m: family.decode_start(family.decoding_params(p, opts), i, m, opts, 4, S.TP)[0],
                    (g.decode_specs(), P(S.DP, None), P(S.DP, None)), P(S.DP, S.TP))
    return np.asarray(start(params, ids, mask))[:, : g.vocab_size]


def _prompts(g: Decoder):
    data = generated_batch(g.cfg, seed=0, packing=False)
    L = g.cfg.model.sequence_length
    ids, mask = data["input_ids"].reshape(-1, L)[:4], data["attention_mask"].reshape(-1, L)[:4]
    ids, mask = g.family.layout_prompts(ids, mask)
    return S.put_global(ids, g.row_sharding), S.put_global(mask, g.row_sharding)


def _dequantized(g8: Decoder, host: dict) -> dict:
    """The float32 weights int8 decoding stands for: q * scale of each quantized weight, the rest as they are."""
    flat = jax.tree_util.tree_flatten_with_path(host)[0]
    out = {}
    for path, x in flat:
        key = tuple(str(getattr(k, "key", k)) for k in path)
        spec = g8.specs
        for k in key:
            spec = spec[k]
        if quant.quantizes(g8.family, key):
            lead = int(spec.axes[0] == "layers")
            x = np.asarray(quant.dequantize(quant.quantize(x, quant.input_dims(spec.axes), lead, jnp.float32)))
        out[key] = x
    return jax.tree_util.tree_unflatten(jax.tree.structure(host), [out[tuple(str(getattr(k, "key", k)) for k in p)]
                                                                  for p, _ in flat])


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "gptj_tiny"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("integer", [False, True], ids=["gpu_products", "integer_products"])
def test_int8_decoding_is_float32_decoding_of_the_dequantized_weights(preset, tp, integer, monkeypatch):
    monkeypatch.setattr(quant, "integer_dots", lambda: integer)
    g32, g8 = _graphs(preset, tp, "none"), _graphs(preset, tp, "int8")
    host = _host_params(g32)
    ids, mask = _prompts(g32)
    int8 = g8.weights.place(host)
    # which weights: the family's matmul weights of every layer and the LM head, nothing else
    kinds = {tuple(str(getattr(k, "key", k)) for k in p): quant.is_int8(x)
             for p, x in jax.tree_util.tree_flatten_with_path(int8, is_leaf=quant.is_int8)[0]}
    assert kinds[("lm_head",)] and not kinds[("shared",)]
    stacks = [s.name for s in g8.family.stacks]
    for key, is8 in kinds.items():
        if key[0] in stacks and key[1] == "layers":
            assert is8 == g8.family.is_dense(key[-1]), key
        elif key != ("lm_head",):
            assert not is8, key
    assert sum(kinds.values()) >= 2 * len(stacks)
    got = _first_logits(g8, int8, ids, mask)
    ref = _first_logits(g32, g32.to_decoding(g32.place.shard_params(_dequantized(g8, host))), ids, mask)
    orig = _first_logits(g32, g32.weights.place(host), ids, mask)  # (decoding's layout, in float32)
    spread = orig.std()
    rms, worst = np.sqrt(np.mean((got - orig) ** 2)) / spread, np.abs(got - orig).max() / spread
    if integer:  # the activations on their int8 grids too: further from float32 (measured: tiny 2.8%, 11.4%)
        assert np.abs(got - ref).max() > 1e-3 * spread  # (the integer products did run)
        assert 0 < rms <= 0.04 and worst <= 0.15, (rms, worst)
        return
    assert np.abs(got - ref).max() <= 1e-4 * spread, np.abs(got - ref).max() / spread
    # int8 is not float32, and not far from it: measured (tiny, tp 1) 1.5% RMS, 5.5% at the worst logit
    assert 0 < rms <= 0.03 and worst <= 0.1, (rms, worst)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "gptj_tiny"])
def test_int8_greedy_tokens_are_the_same_at_tp_1_and_2(preset):
    outs = []
    for tp in (1, 2):
        g = _graphs(preset, tp, "int8")
        params = g.weights.place(_host_params(g))
        ids, mask = _prompts(g)
        from modelling.decoding import Options

        outs.append(np.asarray(g.search(Options(6))(params, ids, mask)))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_an_int8_model_holds_about_half_the_bytes_of_bfloat16():
    """The device bytes of decoding's weights: int8 (values + scales) against bfloat16, the embedding kept."""
    cfg = load_config("inference", "xxl", dict(eval=True, quantize="int8", data_parallel=1, tensor_parallel=1))
    g8 = Decoder.of_config(cfg, mesh=S.make_mesh(1, 1))
    g16 = Decoder.of_config(load_config("inference", "xxl", dict(eval=True, data_parallel=1, tensor_parallel=1)),
                 mesh=S.make_mesh(1, 1))
    b8 = sum(quant.nbytes(x) for x in jax.tree.leaves(g8.abstract_decode_params(), is_leaf=quant.is_int8))
    b16 = sum(quant.nbytes(x) for x in jax.tree.leaves(g16.abstract_decode_params()))
    assert 0.5 < b8 / b16 < 0.53, b8 / b16  # the bfloat16 embedding and float32 scales and norms: a little over half


@pytest.mark.parametrize("preset", ["tiny", "gptj_tiny"])
def test_a_lora_checkpoint_is_merged_then_quantized_layer_by_layer(preset):
    """Weights.place with adapters (a LoRA checkpoint's, its base in host memory): each layer merged with its
    adapter, then quantized; the same int8 values as quantizing the merged model (float32 merges on the device and
    in numpy may round a value across a grid point's half-way mark: at most one step, rarely)."""
    from modelling import lora

    g8 = _graphs(preset, 1, "int8")
    host = _host_params(g8)
    targets = {"tiny": ("q", "v", "wi_0", "wo"), "gptj_tiny": ("q", "v", "fc_in")}[preset]
    lcfg = load_config("inference", preset, dict(eval=True, data_parallel=1, tensor_parallel=1, micro_batch_size=4,
                                                  sequence_length=32, lora_rank=4, lora_targets=targets))
    lg = Placement(lcfg)
    rng = np.random.default_rng(1)
    adapters = jax.tree.map(lambda s: 0.05 * rng.standard_normal(s.shape).astype(np.float32), lg.specs,
                            is_leaf=is_spec)
    merged = lora.merged(host, adapters, lg.opts)  # (numpy: the reference)
    got = g8.weights.place(host, lg.shard_params(adapters), lg.opts)
    want = g8.weights.place(merged)
    pairs = [(a, b) for a, b in zip(jax.tree.leaves(got, is_leaf=quant.is_int8),
                                    jax.tree.leaves(want, is_leaf=quant.is_int8)) if quant.is_int8(a)]
    q = np.concatenate([np.asarray(a.q).ravel().astype(np.int32) - np.asarray(b.q).ravel() for a, b in pairs])
    assert np.abs(q).max() <= 1 and np.mean(q != 0) < 1e-3, (np.abs(q).max(), np.mean(q != 0))
    unmerged = g8.weights.place(host)  # (the adapters change what is placed: the test can tell)
    assert any(not np.array_equal(np.asarray(a.q), np.asarray(b.q)) for a, b in zip(
        jax.tree.leaves(got, is_leaf=quant.is_int8), jax.tree.leaves(unmerged, is_leaf=quant.is_int8))
        if quant.is_int8(a))


def test_merging_from_host_refuses_a_base_that_changed(monkeypatch):
    """The phased / int8 merge path (Weights.merged_from_host, its reads stubbed) checks the base's fingerprint as the
    device merge does: a LoRA checkpoint over a base that changed is one line, never decoded silently."""
    from types import SimpleNamespace

    from decoder import weights as W
    from utils.errors import FlanT5Error

    g8 = _graphs("tiny", 1, "int8")
    host = _host_params(g8)
    monkeypatch.setattr(W, "load_base", lambda lg, source, kind: host)
    monkeypatch.setattr(g8.weights, "lora_parts", lambda *a, **kw: (SimpleNamespace(opts=None), {}, None))
    monkeypatch.setattr(g8.weights, "place", lambda base, adapters=None, opts=None: ("placed", base))
    trained_on = W.fingerprint_rows([[x] for x in jax.tree.leaves(host)])
    saved = {"lora_base": {"source": {"hf_model": "base"}, "fingerprint": trained_on}}
    assert g8.weights.merged_from_host("ck", 3, saved) == ("placed", host)
    saved["lora_base"]["fingerprint"] = "f" * len(trained_on)
    with pytest.raises(FlanT5Error, match="ck step 3 holds adapters trained on other weights than"):
        g8.weights.merged_from_host("ck", 3, saved)
