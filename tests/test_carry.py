"""What decoder/slots.py's programs carry from call to call, and return, in few arrays: each array a call returns is a
release and a retaking of Python's interpreter lock by JAX's dispatch, a wait of the server's decoding thread
behind its HTTP thread. ``Carry`` packs every leaf of the cache but its floating-point ones (the keys and values),
and every leaf of the rows' state, into one int32 vector a device and back, bit for bit; ``pack_scored`` does the
same for a call's log-probabilities; the advance program returns the tokens, the scores, the keys and values, and
the vector, nothing more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from decoder.slots import Carry, pack_scored, unpack_scored
from modelling import slots as slot_lib

DTYPES = {"bool": jnp.bool_, "int32": jnp.int32, "uint32": jnp.uint32, "float32": jnp.float32}


def _values(rng, shape, dtype):
    """Every bit pattern a leaf may hold: the full uint32 range, negative zero, infinities and NaN's bits."""
    if dtype == jnp.bool_:
        return rng.random(shape) < 0.5
    bits = rng.integers(0, 2 ** 32, size=shape, dtype=np.uint64).astype(np.uint32)
    flat = bits.reshape(-1)
    special = np.array([0, 2 ** 31, 2 ** 32 - 1, 0x7F800000, 0xFF800000, 0x7FC00001], np.uint32)  # -0.0, inf, NaN
    flat[:min(len(flat), len(special))] = special[:len(flat)]
    return bits.view(np.dtype(dtype))


leaf = st.tuples(st.lists(st.integers(1, 3), min_size=0, max_size=3), st.sampled_from(sorted(DTYPES)))


@settings(max_examples=60, deadline=None)
@given(st.lists(leaf, min_size=1, max_size=5), st.lists(leaf, min_size=1, max_size=4), st.integers(0, 2 ** 31))
def test_carry_packs_and_unpacks_any_leaves_bit_for_bit(cache_leaves, state_leaves, seed):
    rng = np.random.default_rng(seed)
    cache = {f"c{i}": jnp.asarray(_values(rng, tuple(s), DTYPES[d])) for i, (s, d) in enumerate(cache_leaves)}
    state = tuple(jnp.asarray(_values(rng, tuple(s), DTYPES[d])) for s, d in state_leaves)
    carry = Carry(jax.eval_shape(lambda: cache), jax.eval_shape(lambda: state))
    apart, words = jax.jit(carry.pack)(cache, state)
    assert words.dtype == jnp.int32 and words.shape == (carry.words,)
    got_cache, got_state = jax.jit(carry.unpack)(apart, words)
    assert jax.tree.structure((got_cache, got_state)) == jax.tree.structure((cache, state))
    for want, got in zip(jax.tree.leaves((cache, state)), jax.tree.leaves((got_cache, got_state))):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()  # the bits, NaN's and -0.0's included


def test_only_the_cache_s_floating_leaves_and_leaves_of_another_size_stay_apart():
    """The keys and values (floating, any precision) stay one array each, in their order; the cache's masks and
    positions and every state leaf, floats included, go in the vector; a leaf that is not 4 bytes (or a bool)
    cannot, and stays apart, in its place."""
    a = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    cache = {"kv": [(a((2, 3), jnp.float32), a((2, 3), jnp.bfloat16))], "key_ok": a((2, 5), jnp.bool_),
             "start": a((2,), jnp.int32)}
    state = (a((2,), jnp.float32), a((2,), jnp.uint32), a((2,), jnp.int8))
    carry = Carry(cache, state)
    # jax.tree order: the cache's key_ok, kv, start, then the state's leaves
    assert carry.packed == [True, False, False, True, True, True, False]
    assert carry.words == 2 * 5 + 2 + 2 + 2
    apart, words = carry.pack(*jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), (cache, state)))
    assert [(x.shape, x.dtype) for x in apart] == [((2, 3), jnp.float32), ((2, 3), jnp.bfloat16), ((2,), jnp.int8)]
    assert words.shape == (carry.words,)
    # a program whose cache or state comes back of another make is refused where it is traced, not misread
    ones = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), (cache, state))
    for bad in ({**ones[0], "start": jnp.ones((2,), jnp.float32)}, {**ones[0], "extra": jnp.ones(2, jnp.int32)}):
        with pytest.raises(ValueError, match="changed their make"):
            carry.pack(bad, ones[1])


@pytest.mark.parametrize("lead", [(4,), (2, 3)])
def test_a_call_s_scores_travel_as_one_array_and_come_back_bit_for_bit(lead):
    rng = np.random.default_rng(0)
    top = 3
    scored = slot_lib.Scored(jnp.asarray(_values(rng, lead, jnp.float32)),
                             jnp.asarray(rng.integers(0, 1000, lead + (top,)), jnp.int32),
                             jnp.asarray(_values(rng, lead + (top,), jnp.float32)))
    packed = np.asarray(jax.jit(pack_scored)(scored))
    assert packed.dtype == np.int32 and packed.shape == lead + (1 + 2 * top,)
    from decoder.slots import PackedScored, SlotPrograms

    # as the host reads it: the array fetched, or SlotPrograms.fetch of the device handle (alone or in a tree)
    for got in (unpack_scored(packed), SlotPrograms.fetch(PackedScored(jnp.asarray(packed))),
                SlotPrograms.fetch((jnp.zeros(2), PackedScored(jnp.asarray(packed))))[1]):
        for field in ("logprob", "top_ids", "top_logprobs"):
            want, have = np.asarray(getattr(scored, field)), getattr(got, field)
            assert have.dtype == want.dtype and have.shape == want.shape, field
            assert have.tobytes() == want.tobytes(), field


@pytest.mark.parametrize("preset", ["tiny", "gptj_tiny"])
def test_the_programs_return_the_tokens_the_scores_the_keys_and_values_and_one_vector(preset):
    """Traced, not compiled: the advance and insert programs of both families return 2 arrays (tokens, scores),
    the cache's floating leaves, and one int32 vector a device, whatever the cache and state hold; the vector is
    every other leaf, 10 of them the state's (slots / dp rows each)."""
    from config import load_config
    from decoder.engine import Decoder
    from decoder.slots import SlotPrograms, joiner_words

    g = Decoder.of_config(load_config("inference", preset, dict(eval=True, tensor_parallel=1, data_parallel=1)))
    sp = SlotPrograms(g, 4, 8, (1,), 6, 3)
    sp.params = g.abstract_decode_params()
    cache = jax.eval_shape(sp._empty_cache)
    kv = [x for x in jax.tree.leaves(cache) if jnp.issubdtype(x.dtype, jnp.floating)]
    sp.carry = Carry(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), cache),
                     jax.tree.map(lambda x: jax.ShapeDtypeStruct((4,), x.dtype), sp._empty_state()))
    small = sum(int(np.prod(x.shape[2:])) for x in jax.tree.leaves(cache) if not jnp.issubdtype(x.dtype, jnp.floating))
    assert sp.carry.words == small + 10 * 4
    apart = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sp.pieces) for x in kv)
    words = jax.ShapeDtypeStruct((1, 1, sp.carry.words), jnp.int32, sharding=sp.pieces)
    advance = jax.eval_shape(sp._advance_program(), sp.params, apart, words,
                             jax.ShapeDtypeStruct((4,), jnp.bool_, sharding=sp.rows),
                             jax.ShapeDtypeStruct((), jnp.int32, sharding=sp.replicated))
    insert = jax.eval_shape(sp._insert_program(2), sp.params, apart, words,
                            jax.ShapeDtypeStruct((1, joiner_words(2, 8, 4)), jnp.int32, sharding=sp.rows2))
    for out, lead in ((advance, (4, 3)), (insert, (4,))):
        assert len(jax.tree.leaves(out)) == 2 + len(kv) + 1
        tokens, scored, kv_out, words_out = out
        assert tokens.shape == lead and scored.shape == lead + (1 + 2 * sp.top,)
        assert [(x.shape, x.dtype) for x in kv_out] == [(x.shape, x.dtype) for x in kv]
        assert (words_out.shape, words_out.dtype) == ((1, 1, sp.carry.words), jnp.int32)


def test_reset_leaves_every_row_empty_and_the_cache_zeros_on_every_device():
    """``reset`` (at start, and after a failed call took the donated arrays): on a dp 2 x tp 2 mesh, each device's
    piece unpacks to a cache of zeros and rows that do not write (alive False, limit 0) and ask for no
    log-probabilities (-1), the state of that device's dp shard."""
    from config import load_config
    from decoder.engine import Decoder
    from decoder.slots import SlotPrograms

    g = Decoder.of_config(load_config("inference", "gptj_tiny", dict(eval=True, tensor_parallel=2, data_parallel=2)))
    sp = SlotPrograms(g, 4, 8, (1,), 6, 3)
    sp.params = g.abstract_decode_params()
    sp.reset()
    assert sp.words.shape == (2, 2, sp.carry.words) and all(x.shape[:2] == (2, 2) for x in sp.apart)
    words, apart = np.asarray(sp.words), [np.asarray(x) for x in sp.apart]
    for d in range(2):
        for t in range(2):
            cache, (rows, sampling) = jax.jit(sp.carry.unpack)(tuple(x[d, t] for x in apart), words[d, t])
            assert all(not np.asarray(x).any() for x in jax.tree.leaves(cache))
            assert np.asarray(rows.alive).tolist() == [False, False] and np.asarray(rows.limit).tolist() == [0, 0]
            assert np.asarray(sampling.logprobs).tolist() == [-1, -1]
            assert not any(np.asarray(x).any() for x in (rows.token, rows.index, sampling.temperature, sampling.seed))


def test_a_narrow_span_s_program_steps_a_narrow_copy_of_the_cache():
    """Lowered, not compiled: the advance program of a span narrower than the cache (GPT-J: 8 prompt columns and 40
    new, spans 16, 24, 40, 48) steps keys and values 24 columns wide; the whole cache's program never makes them."""
    from config import load_config
    from decoder.engine import Decoder
    from decoder.slots import SlotPrograms, attention_spans

    g = Decoder.of_config(load_config("inference", "gptj_tiny", dict(eval=True, tensor_parallel=1, data_parallel=1)))
    sp = SlotPrograms(g, 4, 8, (1,), 40, 3, spans=4)
    sp.params = g.abstract_decode_params()
    cache = jax.eval_shape(sp._empty_cache)
    local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), cache)
    assert attention_spans(g.family, local, 4) == (16, 24, 40, 48)
    sp.carry = Carry(local, jax.tree.map(lambda x: jax.ShapeDtypeStruct((4,), x.dtype), sp._empty_state()))
    kv = [x for x in jax.tree.leaves(cache) if jnp.issubdtype(x.dtype, jnp.floating)]
    apart = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sp.pieces) for x in kv)
    words = jax.ShapeDtypeStruct((1, 1, sp.carry.words), jnp.int32, sharding=sp.pieces)
    args = (sp.params, apart, words, jax.ShapeDtypeStruct((4,), jnp.bool_, sharding=sp.rows),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=sp.replicated))
    d_kv = kv[0].shape[-1]
    texts = {span: sp._advance_program(span).lower(*args).as_text() for span in (24, 48)}
    assert f"x24x{d_kv}xf32>" in texts[24] and f"x48x{d_kv}xf32>" in texts[24]  # (the cache, whole, around it)
    assert f"x24x{d_kv}xf32>" not in texts[48]
