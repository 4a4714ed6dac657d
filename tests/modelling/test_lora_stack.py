"""The adapter stack (modelling/lora_stack.py, layers.MultiAdapted): many LoRA adapters unmerged beside one base, each
token reading its own, in float32.

- Every token's output is its own adapter merged into the weight (W + alpha / r A B, modelling/lora.merged's
  arithmetic) times the token, whatever the other tokens read: slots of different ranks and alphas, tokens of no
  adapter (the base alone), an empty slot, a weight whose input is several dims (a row-parallel one); with an int8
  base, the int8 product plus the same adapter; at tp 2 (a column-parallel weight's B split like its output, a
  row-parallel one's A split like its input, the partial products summed by the layer's own sum) as at tp 1.
- A slot's values are the adapter's A and B padded to the stack's rank with zeros and its alpha / r; a rank above
  the stack's, a weight the stack holds none of, an adapter of another shape are each one line.
- Packed prompts: each token reads its prompt's adapter, a position of no prompt none.
- The stack's specs: A keeps its weight's input axes and B its output axes (so partitioning/sharding.py splits them
  as training's adapters), the slot and rank axes never split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, PartitionSpec as P

from config import load_config
from modelling import layers as L
from modelling import lora, lora_stack, quant, registry
from partitioning import sharding as S
from utils.errors import ConfigError

TOL = 1e-5


def tiny_specs(family="t5"):
    preset = {"t5": "tiny", "gptj": "gptj_tiny"}[family]
    cfg = load_config("inference", preset, dict(eval=True, tensor_parallel=1, data_parallel=1))
    fam = registry.get(cfg.model.family)
    return fam, fam.param_specs(cfg.model, 1)


def merged_weight(w, a, b, alpha, r):
    """lora.merged's arithmetic for one layer's weight: W + alpha / r (A B), float32."""
    n = 1
    tree = {"s": {"layers": {"w": w[None]}}}
    ad = {"s": {"layers": {"w" + lora.A: a[None], "w" + lora.B: b[None]}}}
    opts = type("O", (), {"lora_alpha": alpha, "lora_rank": r})()
    return np.asarray(lora.merged(tree, ad, opts)["s"]["layers"]["w"][:n][0])


def random_stack(rng, ins, outs, ranks, alphas, rank):
    """A stack of one layer's weight [ins..., outs...] with an adapter of rank ranks[s] and alpha alphas[s] in slot s
    (rank 0: the slot empty) -> (w, stack a [ins..., S, rank], b [S, rank, outs...], scales [S], adapters [(a, b)])."""
    w = rng.standard_normal(ins + outs).astype(np.float32)
    slots = len(ranks)
    a_all = np.zeros(ins + (slots, rank), np.float32)
    b_all = np.zeros((slots, rank) + outs, np.float32)
    scales = np.zeros(slots, np.float32)
    adapters = []
    for s, (r, alpha) in enumerate(zip(ranks, alphas)):
        a = rng.standard_normal(ins + (r,)).astype(np.float32)
        b = rng.standard_normal((r,) + outs).astype(np.float32)
        adapters.append((a, b))
        if r:
            a_all[..., s, :r], b_all[s, :r], scales[s] = a, b, alpha / r
    return w, a_all, b_all, scales, adapters


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.sampled_from([1.0, 8.0, 16.0])), min_size=1, max_size=4),
       st.integers(1, 9), st.booleans(), st.integers(0, 2 ** 31))
def test_each_token_gets_its_own_adapter_merged_into_the_weight(slots, n, row, seed):
    """Slots of ranks 0 (empty) to 4 padded to 4, alphas 1 to 16; tokens of a random slot or none (-1): each token's
    output equals the token times its adapter merged into W (W itself for none or an empty slot), float32."""
    rng = np.random.default_rng(seed)
    ins, outs = ((2, 3), (5,)) if row else ((5,), (2, 3))  # a row-parallel weight reads several dims
    ranks, alphas = [r for r, _ in slots], [a for _, a in slots]
    w, a_all, b_all, scales, adapters = random_stack(rng, ins, outs, ranks, alphas, 4)
    index = rng.integers(-1, len(slots), n).astype(np.int32)
    x = rng.standard_normal((n, int(np.prod(ins)))).astype(np.float32)
    scale = np.where(index >= 0, scales[np.clip(index, 0, None)], 0.0).astype(np.float32)
    got = np.asarray(L.dense(jnp.asarray(x), L.MultiAdapted(jnp.asarray(w), jnp.asarray(a_all), jnp.asarray(b_all),
                                                             jnp.asarray(index), jnp.asarray(scale))))
    for t in range(n):
        s = index[t]
        ws = w if s < 0 or ranks[s] == 0 else merged_weight(w, *adapters[s], alphas[s], ranks[s])
        want = x[t] @ ws.reshape(x.shape[1], -1)
        assert np.max(np.abs(got[t] - want)) <= TOL * max(np.max(np.abs(want)), 1.0), (t, s)


def test_bind_gives_every_adapted_weight_its_slot_and_scale_from_the_stack():
    """``bind`` over a family's decoding weights: the weights the stack holds become MultiAdapted (their layers
    axis in front of the index and scale, so a scan slices them), each token's scale its slot's alpha / r (0 for
    none), the other weights untouched; no stack: the weights as they are."""
    family, specs = tiny_specs("t5")
    stack_specs = lora_stack.specs(family, specs, ("q", "wo"), 3, 4)
    stack = jax.tree.map(lambda sp: jnp.zeros(sp.shape), stack_specs, is_leaf=lambda x: hasattr(x, "axes"))
    stack[lora_stack.SCALE] = jnp.asarray([0.5, 2.0, 4.0])
    w = jax.tree.map(lambda sp: jnp.zeros(sp.shape), specs, is_leaf=lambda x: hasattr(x, "axes"))
    index = jnp.asarray([2, -1, 0, 1], jnp.int32)
    bound = lora_stack.bind(w, stack, index)
    for s in ("encoder", "decoder"):
        for name, x in bound[s]["layers"].items():
            if name in ("q", "wo"):
                assert isinstance(x, L.MultiAdapted), (s, name)
                n_layers = specs[s]["layers"][name].shape[0]
                assert x.index.shape == (n_layers, 4) and x.scale.shape == (n_layers, 4)
                assert np.asarray(x.index[1]).tolist() == [2, -1, 0, 1]
                assert np.asarray(x.scale[0]).tolist() == [4.0, 0.0, 0.5, 2.0]
                assert x.a is stack[s]["layers"][name + lora.A] and x.b is stack[s]["layers"][name + lora.B]
                assert x.w is w[s]["layers"][name]
            else:
                assert not isinstance(x, L.MultiAdapted), (s, name)
    assert lora_stack.bind(w, {}, index) is w


def test_a_packed_token_reads_its_prompt_s_adapter():
    """Three prompts packed into 2 rows of 4 (modelling/rows.py's ``where``: each prompt's flat positions, 8 past its
    length): each token gets its prompt's slot and scale, the free positions none (-1, 0)."""
    w = {"d": {"layers": {"q": L.MultiAdapted(jnp.zeros((2, 3, 3)), jnp.zeros((2, 3, 1, 1)), jnp.zeros((2, 1, 1, 3)),
                                              jnp.asarray([[2, -1, 0]] * 2), jnp.asarray([[0.5, 0.0, 3.0]] * 2)),
                          "norm": jnp.ones((2, 3))}}}
    where = jnp.asarray([[0, 1, 2, 8], [3, 8, 8, 8], [4, 5, 8, 8]])  # prompt 0: 3 tokens, 1: 1, 2: 2 (row 1)
    got = lora_stack.per_token(w, where, 8)["d"]["layers"]
    assert np.asarray(got["q"].index).tolist() == [[2, 2, 2, -1, 0, 0, -1, -1]] * 2
    assert np.asarray(got["q"].scale).tolist() == [[0.5, 0.5, 0.5, 0.0, 3.0, 3.0, 0.0, 0.0]] * 2
    assert got["norm"] is w["d"]["layers"]["norm"]


def test_a_slot_holds_the_adapter_padded_to_the_stack_s_rank_and_its_alpha_over_r():
    """``slot_values`` of a rank-2 adapter of q in a rank-4 stack of q and v: A and B in the first 2 of the rank's
    columns and zeros after, v (not adapted by it) zeros, scale alpha / 2; ``put`` writes them into the slot asked
    alone."""
    family, specs = tiny_specs("gptj")
    stack_specs = lora_stack.specs(family, specs, ("q", "v"), 3, 4)
    rng = np.random.default_rng(0)
    qa = rng.standard_normal(specs["decoder"]["layers"]["q"].shape[:2] + (2,)).astype(np.float32)
    qb = rng.standard_normal((qa.shape[0], 2) + specs["decoder"]["layers"]["q"].shape[2:]).astype(np.float32)
    adapter = {"decoder": {"layers": {"q" + lora.A: qa, "q" + lora.B: qb}}}
    v = lora_stack.slot_values(stack_specs, adapter, 8.0, 2)
    got = v["decoder"]["layers"]
    assert v[lora_stack.SCALE] == 4.0
    np.testing.assert_array_equal(got["q" + lora.A][..., :2], qa)
    np.testing.assert_array_equal(got["q" + lora.B][:, :2], qb)
    assert not got["q" + lora.A][..., 2:].any() and not got["q" + lora.B][:, 2:].any()
    assert not got["v" + lora.A].any() and not got["v" + lora.B].any()
    stack = jax.tree.map(lambda sp: jnp.zeros(sp.shape), stack_specs, is_leaf=lambda x: hasattr(x, "axes"))
    stack = lora_stack.put(stack, jnp.int32(1), v)
    a = np.asarray(stack["decoder"]["layers"]["q" + lora.A])
    b = np.asarray(stack["decoder"]["layers"]["q" + lora.B])
    np.testing.assert_array_equal(a[..., 1, :], got["q" + lora.A])
    np.testing.assert_array_equal(b[:, 1], got["q" + lora.B])
    assert not a[..., [0, 2], :].any() and not b[:, [0, 2]].any()
    assert np.asarray(stack[lora_stack.SCALE]).tolist() == [0.0, 4.0, 0.0]


def test_a_rank_above_the_stack_s_a_weight_it_lacks_or_another_shape_is_one_line():
    family, specs = tiny_specs("gptj")
    stack_specs = lora_stack.specs(family, specs, ("q",), 2, 4)
    q = specs["decoder"]["layers"]["q"].shape
    a = lambda r, d=q[1]: np.zeros((q[0], d, r), np.float32)  # noqa: E731
    b = lambda r: np.zeros((q[0], r) + q[2:], np.float32)  # noqa: E731
    with pytest.raises(ConfigError, match="its rank is 8, above the server's --max_lora_rank 4: restart it with "
                                          "--max_lora_rank 8"):
        lora_stack.slot_values(stack_specs, {"decoder": {"layers": {"q" + lora.A: a(8), "q" + lora.B: b(8)}}}, 16, 8)
    with pytest.raises(ConfigError, match=r"it adapts decoder v, which the server's adapter stack holds no adapters "
                                          r"of \(it holds q\): restart it with --lora_target_modules"):
        lora_stack.slot_values(stack_specs, {"decoder": {"layers": {"v" + lora.A: a(2), "v" + lora.B: b(2)}}}, 16, 2)
    with pytest.raises(ConfigError, match="trained on a model of another shape"):
        lora_stack.slot_values(stack_specs, {"decoder": {"layers": {"q" + lora.A: a(2, 7), "q" + lora.B: b(2)}}}, 16,
                               2)
    with pytest.raises(ConfigError, match="--lora_target_modules qq: no such weight in a gptj layer"):
        lora_stack.specs(family, specs, ("q", "qq"), 2, 4)


def test_the_stack_is_laid_out_as_training_s_adapters():
    """A keeps its weight's input axes, B its output axes, the slots and the rank replicated: at tp 2 q's (column-
    parallel) A is whole and B split by heads; o's (row-parallel) A split by heads and B whole."""
    family, specs = tiny_specs("t5")
    st_specs = lora_stack.specs(family, specs, ("q", "o", "wi_0", "wo"), 3, 4)
    mesh = Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2), (S.DP, S.TP))
    lay = S.layouts(st_specs, mesh, rts=False)["encoder"]["layers"]
    want = {"q" + lora.A: P(None, None, None, None), "q" + lora.B: P(None, None, None, "tp", None),
            "o" + lora.A: P(None, "tp", None, None, None), "o" + lora.B: P(None, None, None, None),
            "wi_0" + lora.A: P(None, None, None, None), "wi_0" + lora.B: P(None, None, None, "tp"),
            "wo" + lora.A: P(None, "tp", None, None), "wo" + lora.B: P(None, None, None, None)}
    assert {k: lay[k].compute_spec for k in want} == want
    assert st_specs[lora_stack.SCALE].shape == (3,)


@pytest.mark.parametrize("row", [False, True])
def test_tensor_parallel_adapters_equal_one_device_s(row):
    """At tp 2 a column-parallel weight [d, h, kv] (its B split by heads: each device its share of the output) and a
    row-parallel one [h, kv, d] (its A split by heads: each device a partial product, summed with the weight's own
    partial outputs) give tp 1's outputs."""
    rng = np.random.default_rng(1)
    ins, outs = ((4, 3), (6,)) if row else ((6,), (4, 3))
    w, a_all, b_all, scales, _ = random_stack(rng, ins, outs, [2, 3, 0], [4.0, 16.0, 8.0], 3)
    index = np.asarray([1, -1, 0, 2, 1], np.int32)
    scale = np.where(index >= 0, scales[np.clip(index, 0, None)], 0.0).astype(np.float32)
    x = rng.standard_normal((5,) + ins).astype(np.float32)
    one = np.asarray(L.dense(jnp.asarray(x.reshape(5, -1)), L.MultiAdapted(*map(jnp.asarray, (w, a_all, b_all, index,
                                                                                              scale)))))
    mesh = Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2), (S.DP, S.TP))

    def local(x, w, a, b, index, scale):
        out = L.dense(x.reshape(x.shape[0], -1), L.MultiAdapted(w, a, b, index, scale))
        return jax.lax.psum(out, S.TP) if row else out

    if row:  # heads (the input's first dim) split: x, w and A by heads
        specs = (P(None, S.TP, None), P(S.TP, None, None), P(S.TP, None, None, None), P(None, None, None), P(), P())
        out_spec = P()
    else:  # heads (the output's first dim) split: w and B by heads, the output by heads
        specs = (P(), P(None, S.TP, None), P(None, None, None), P(None, None, S.TP, None), P(), P())
        out_spec = P(None, S.TP)
    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_spec, check_vma=False))
    two = np.asarray(f(*map(jnp.asarray, (x, w, a_all, b_all, index, scale))))
    np.testing.assert_allclose(two, one, rtol=0, atol=TOL * np.max(np.abs(one)))


def test_an_int8_base_reads_its_int8_product_plus_the_adapter():
    """With an int8 base weight (modelling/quant.py) each token's output is the int8 product plus its own adapter's
    product, the same adapter arithmetic as over a float base."""
    rng = np.random.default_rng(2)
    w, a_all, b_all, scales, adapters = random_stack(rng, (8,), (6,), [2, 4], [8.0, 4.0], 4)
    index = np.asarray([0, 1, -1], np.int32)
    scale = np.where(index >= 0, scales[np.clip(index, 0, None)], 0.0).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
    q = quant.quantize(jnp.asarray(w), 1, 0, jnp.float32)
    got = np.asarray(L.dense(x, L.MultiAdapted(q, *map(jnp.asarray, (a_all, b_all, index, scale)))))
    base = np.asarray(quant.matmul(x, q))
    for t, s in enumerate(index):
        delta = 0.0 if s < 0 else scales[s] * (np.asarray(x[t]) @ adapters[s][0]) @ adapters[s][1]
        np.testing.assert_allclose(got[t], base[t] + delta, rtol=0, atol=TOL * np.max(np.abs(base)))
