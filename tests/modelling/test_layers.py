"""Parity with Hugging Face T5ForConditionalGeneration in float32, per layer and whole model.

Tolerances: forward values 2e-5 and gradients 5e-5, both relative to the largest
magnitude of the reference tensor (rel_err). Measured errors are ~1e-6.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from modelling import layers as L
from modelling import t5
from modelling.family import resolve_attention_impl
from modelling.hf_mapping import hf_state_dict_from_params
from tests.hf_utils import hf_outputs, make_hf, options, random_batch, rel_err

FWD_TOL = 2e-5


GRAD_TOL = 5e-5


def _ext_mask(mask):
    """HF's additive 4-D mask from a [b, k] padding mask."""
    m = torch.tensor(mask, dtype=torch.float32)[:, None, None, :]
    return (1.0 - m) * torch.finfo(torch.float32).min


def _layer(params, stack, i):
    return jax.tree.map(lambda x: x[i], params[stack]["layers"])


@pytest.fixture(scope="module")
def v11():
    return make_hf("1.1")


def test_rms_norm_matches_hf(v11):
    hf, m, params = v11
    x = torch.randn(2, 7, m.hidden_size) * 3
    ref = hf.encoder.block[0].layer[0].layer_norm(x).detach().numpy()
    ours = L.rms_norm(jnp.asarray(x.numpy()), _layer(params, "encoder", 0)["attn_norm"], m.eps)
    assert rel_err(ours, ref) < FWD_TOL


@pytest.mark.parametrize("stack,bidirectional", [("encoder", True), ("decoder", False)])
def test_position_bias_matches_hf(v11, stack, bidirectional):
    """T5's relative-position bias as its stacks compute it (``self_masks``' buckets, ``bucket_bias``), the encoder's
    bidirectional and the decoder's causal, equal to HF's ``compute_bias``."""
    hf, m, params = v11
    n = 37  # longer than max_distance=20, so the log buckets and the clamp are exercised
    att = getattr(hf, stack).block[0].layer[0].SelfAttention
    ref = att.compute_bias(n, n).detach().numpy()
    buckets, _ = t5.self_masks(not bidirectional, n, options(m))
    ours = t5.bucket_bias(params[stack]["relpos"], buckets)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=0, atol=1e-7)


def test_self_attention_with_bias_matches_hf(v11):
    hf, m, params = v11
    b = random_batch(m.embedding.vocab_size)
    x = torch.randn(3, 11, m.hidden_size)
    ref, bias_ref, _ = hf.encoder.block[0].layer[0].SelfAttention(x, mask=_ext_mask(b["attention_mask"]))
    opts = options(m)
    bias = t5.encoder_self_bias(params["encoder"]["relpos"], jnp.asarray(b["attention_mask"]), opts)
    ours = L.attention(_layer(params, "encoder", 0), jnp.asarray(x.numpy()), None, bias, None)
    valid = b["attention_mask"].astype(bool)  # padded query rows are irrelevant (never read)
    assert rel_err(np.asarray(ours)[valid], ref.detach().numpy()[valid]) < FWD_TOL


def test_cross_attention_matches_hf(v11):
    hf, m, params = v11
    b = random_batch(m.embedding.vocab_size)
    x, enc = torch.randn(3, 5, m.hidden_size), torch.randn(3, 11, m.hidden_size)
    att = hf.decoder.block[1].layer[1].EncDecAttention
    ref = att(x, mask=_ext_mask(b["attention_mask"]), key_value_states=enc)[0].detach().numpy()
    ours = L.attention(_layer(params, "decoder", 1), jnp.asarray(x.numpy()), jnp.asarray(enc.numpy()),
                       L.padding_mask_bias(jnp.asarray(b["attention_mask"])), None, prefix="c")
    assert rel_err(ours, ref) < FWD_TOL


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_feed_forward_matches_hf(version):
    hf, m, params = make_hf(version)
    x = torch.randn(2, 7, m.hidden_size)
    ref = hf.encoder.block[1].layer[1](x).detach().numpy()  # T5LayerFF: x + ff(norm(x))
    p = _layer(params, "encoder", 1)
    xj = jnp.asarray(x.numpy())
    ours = xj + L.feed_forward(p, L.rms_norm(xj, p["ff_norm"], m.eps), None, proj=m.feed_forward_proj)
    assert rel_err(ours, ref) < FWD_TOL


def test_feed_forward_scale_ff_is_exact_in_float32(v11):
    _, m, params = v11
    p = _layer(params, "encoder", 0)
    x = jax.random.normal(jax.random.key(0), (2, 4, m.hidden_size))
    a = L.feed_forward(p, x, None, scale_ff=1, proj=m.feed_forward_proj)
    b = L.feed_forward(p, x, None, scale_ff=8, proj=m.feed_forward_proj)
    assert rel_err(b, a) < 1e-6


def test_encoder_block_matches_hf(v11):
    hf, m, params = v11
    b = random_batch(m.embedding.vocab_size)
    x = torch.randn(3, 11, m.hidden_size)
    ref = hf.encoder.block[0](x, attention_mask=_ext_mask(b["attention_mask"]))[0].detach().numpy()
    opts = options(m)
    bias = t5.encoder_self_bias(params["encoder"]["relpos"], jnp.asarray(b["attention_mask"]), opts)
    ours = t5.t5_block(_layer(params, "encoder", 0), jnp.asarray(x.numpy()), bias, opts, None)
    valid = b["attention_mask"].astype(bool)
    assert rel_err(np.asarray(ours)[valid], ref[valid]) < FWD_TOL


def test_decoder_block_matches_hf(v11):
    hf, m, params = v11
    b = random_batch(m.embedding.vocab_size)
    y, enc = torch.randn(3, 5, m.hidden_size), torch.randn(3, 11, m.hidden_size)
    causal = torch.triu(torch.full((5, 5), torch.finfo(torch.float32).min), 1)[None, None]
    ref = hf.decoder.block[0](y, attention_mask=causal, encoder_hidden_states=enc,
                              encoder_attention_mask=_ext_mask(b["attention_mask"]))[0].detach().numpy()
    opts = options(m)
    self_bias = t5.decoder_self_bias(params["decoder"]["relpos"], 5, opts)
    ours = t5.t5_block(_layer(params, "decoder", 0), jnp.asarray(y.numpy()), self_bias, opts, None,
                       jnp.asarray(enc.numpy()), L.padding_mask_bias(jnp.asarray(b["attention_mask"])))
    assert rel_err(ours, ref) < FWD_TOL


def _our_loss_and_grads(params, batch, opts):
    jb = jax.tree.map(jnp.asarray, batch)

    def loss(p):
        return t5.loss_sum(p, jb, opts) / t5.token_count(jb["labels"])

    return jax.value_and_grad(loss)(params)


@pytest.mark.slow
@pytest.mark.parametrize(
    "version,heads,enc_len,dec_len",
    [("1.1", 6, 11, 5), ("1.0", 6, 11, 5), ("1.1", 5, 9, 13), ("1.0", 5, 13, 4)],
    ids=["v1.1-h6", "v1.0-h6", "v1.1-h5-dec-longer", "v1.0-h5"],
)
def test_whole_model_logits_loss_and_grads_match_hf(version, heads, enc_len, dec_len):
    hf, m, params = make_hf(version, num_heads=heads)
    batch = random_batch(m.embedding.vocab_size, 3, enc_len, dec_len)
    ref_loss, ref_logits, ref_grads = hf_outputs(hf, batch)
    opts = options(m)

    logits = t5.forward(params, jax.tree.map(jnp.asarray, batch), opts)
    assert rel_err(logits, ref_logits) < FWD_TOL

    loss, grads = _our_loss_and_grads(params, batch, opts)
    assert abs(float(loss) - ref_loss) / ref_loss < FWD_TOL

    ours = hf_state_dict_from_params(grads, m)
    # v1.1's head is its own weight (tests/hf_utils.py unties it): its gradient and shared's are compared apart
    assert ("lm_head.weight" in ref_grads) == (not m.tie_word_embeddings)
    for name, ref in ref_grads.items():
        assert name in ours, name
        assert rel_err(ours[name], ref) < GRAD_TOL, name
    assert len(ref_grads) >= 4 * m.layers  # every layer's weights were compared


def test_bfloat16_mode_is_close_to_float32(v11):
    _, m, params = v11
    batch = jax.tree.map(jnp.asarray, random_batch(m.embedding.vocab_size))
    l32 = t5.loss_sum(params, batch, options(m))
    l16 = t5.loss_sum(params, batch, options(m, precision="bfloat16"))
    assert abs(float(l16) - float(l32)) / float(l32) < 2e-2
    assert float(l16) != float(l32)  # the compute really ran in bfloat16


@pytest.mark.slow
def test_bfloat16_gradient_gemms_run_in_bfloat16(v11):
    """Mixed precision: every matmul of the bf16 backward takes bf16 operands (no f32 x f32
    GEMMs from differentiating float32-output dots), and the gradient stays close to f32."""
    import re

    _, m, params = v11
    batch = jax.tree.map(jnp.asarray, random_batch(m.embedding.vocab_size))
    grad16 = jax.grad(lambda p: t5.loss_sum(p, batch, options(m, precision="bfloat16")))
    text = jax.jit(grad16).lower(params).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    operand_types = [re.search(r":\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)", line).groups() for line in dots]
    assert len(operand_types) > 6 * m.layers
    f32_gemms = [t for t in operand_types if all(x.endswith("xf32>") for x in t)]
    assert not f32_gemms, f32_gemms[:3]
    g32 = jax.grad(lambda p: t5.loss_sum(p, batch, options(m)))(params)
    g16 = grad16(params)
    for path in (("encoder", "layers", "wo"), ("decoder", "layers", "q"), ("lm_head",)):
        a, b = g16, g32
        for k in path:
            a, b = a[k], b[k]
        assert rel_err(a, np.asarray(b)) < 5e-2, path


@pytest.mark.slow
def test_fused_attention_path_equals_attend(v11, monkeypatch):
    """attention_impl=cudnn routes self-attention through jax.nn.dot_product_attention (scale 1,
    bias = relative positions + padding/causal mask). On CPU the same call runs with XLA's
    implementation: the whole model's loss and gradients must equal the einsum path's."""
    from config import ConfigError

    _, m, params = v11
    batch = jax.tree.map(jnp.asarray, random_batch(m.embedding.vocab_size))
    real = jax.nn.dot_product_attention
    calls = []

    def on_cpu(*args, **kw):
        calls.append(kw["implementation"])
        return real(*args, **{**kw, "implementation": "xla"})

    monkeypatch.setattr(jax.nn, "dot_product_attention", on_cpu)
    ref_loss, ref_g = jax.value_and_grad(lambda p: t5.loss_sum(p, batch, options(m)))(params)
    loss, g = jax.value_and_grad(lambda p: t5.loss_sum(p, batch, options(m, attention_impl="cudnn")))(params)
    assert calls and set(calls) == {"cudnn"}
    assert len(calls) == 2  # the encoder's and the decoder's self-attention (scanned stacks), not cross
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref_g)):
        assert rel_err(a, np.asarray(b)) < 1e-5
    # 'auto' picks XLA on CPU; an explicit 'cudnn' where it cannot run says how to fix it
    assert resolve_attention_impl("auto", "bfloat16", 0.0) == "xla"
    with pytest.raises(ConfigError, match="pass --attention_impl auto or xla"):
        resolve_attention_impl("cudnn", "bfloat16", 0.0)


@pytest.mark.slow
def test_dropout_only_in_training(v11):
    _, m, params = v11
    batch = jax.tree.map(jnp.asarray, random_batch(m.embedding.vocab_size))
    opts = options(m, dropout_prob=0.3)
    a = t5.loss_sum(params, batch, opts, rng=jax.random.key(1))
    b = t5.loss_sum(params, batch, opts, rng=jax.random.key(1))
    c = t5.loss_sum(params, batch, opts, rng=jax.random.key(2))
    e = t5.loss_sum(params, batch, opts, rng=None)  # eval: no dropout
    assert float(a) == float(b)
    assert float(a) != float(c)
    assert abs(float(e) - float(t5.loss_sum(params, batch, options(m)))) < 1e-6


def test_heads_major_attention_is_the_same_attention_and_a_cpu_s_alone(monkeypatch):
    """``attend`` with the heads moved in front of the positions (a CPU's products) gives the positions-major
    attention's outputs and gradients (float32, 1e-5; dropout draws the same mask: the probabilities' shape is
    the same), and only a CPU moves them."""
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((2, s, 3, 8)), jnp.float32) for s in (5, 6, 6))
    bias = jnp.asarray(rng.standard_normal((2, 3, 5, 6)), jnp.float32)
    key = jax.random.key(1)

    def run(major):
        monkeypatch.setattr(L, "heads_major_attention", lambda: major)
        f = lambda q, k, v: L.attend(q, k, v, bias, 0.2, key, scale=0.5)  # noqa: E731
        out = f(q, k, v)
        grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
        eqns = [e.params.get("dimension_numbers") for e in jax.make_jaxpr(f)(q, k, v).eqns
                if e.primitive.name == "dot_general"]
        return out, grads, eqns

    (out0, g0, dots0), (out1, g1, dots1) = run(False), run(True)
    np.testing.assert_allclose(np.asarray(out1), np.asarray(out0), rtol=1e-5, atol=1e-6)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert dots0 != dots1  # (the two paths are different products)
    monkeypatch.undo()
    assert L.heads_major_attention()  # (the tests run on a CPU)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not L.heads_major_attention()
