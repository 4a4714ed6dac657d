"""What decoder/slot_programs.py's programs carry from call to call, and return, in few arrays: each array a call returns is a
release and a retaking of Python's interpreter lock by JAX's dispatch, a wait of the server's decoding thread
behind its HTTP thread. ``Carry`` packs every leaf of the cache but its floating-point ones (the keys and values),
and every leaf of the rows' state, into one int32 vector a device and back, bit for bit; ``pack_scored`` does the
same for a call's log-probabilities; the advance program returns the tokens, the scores, the keys and values, and
the vector, nothing more. An insert's inputs travel in one array; each advance gets its call's keep flags, copied to
the device only when they change, and runs in the span program that holds its rows and costs least. An insert (its
programs stubbed) reads several packed rows, both dp shards and a prompt as long as its width, its rows back in the
joiners' order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decoder.slot_programs import Carry, pack_scored, unpack_scored
from modelling import continuous
from modelling import continuous as S

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
    scored = continuous.Scored(jnp.asarray(_values(rng, lead, jnp.float32)),
                             jnp.asarray(rng.integers(0, 1000, lead + (top,)), jnp.int32),
                             jnp.asarray(_values(rng, lead + (top,), jnp.float32)))
    packed = np.asarray(jax.jit(pack_scored)(scored))
    assert packed.dtype == np.int32 and packed.shape == lead + (1 + 2 * top,)
    from decoder.slot_programs import PackedScored, SlotPrograms

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
    the cache's floating leaves, the rows' processors' two lists (each row's table and history: modelling/
    processors.py's RowControls) and one int32 vector a device, whatever the cache and state hold; the vector is
    every other leaf, 17 of them the state's (slots / dp rows each: where a row is, how it samples, its processors,
    its adapter)."""
    from config import load_config
    from decoder.decoder import Decoder
    from decoder.slot_programs import SlotPrograms, joiner_words

    g = Decoder.of_config(load_config("inference", preset, dict(eval=True, tensor_parallel=1, data_parallel=1)))
    sp = SlotPrograms(g, 4, 8, (1,), 6, 3)
    sp.params = g.abstract_decode_params()
    cache = jax.eval_shape(sp._empty_cache)
    kv = [x for x in jax.tree.leaves(cache) if jnp.issubdtype(x.dtype, jnp.floating)]
    state = sp._empty_state()
    sp.carry = Carry(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), cache),
                     jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
    small = sum(int(np.prod(x.shape[2:])) for x in jax.tree.leaves(cache) if not jnp.issubdtype(x.dtype, jnp.floating))
    assert sp.carry.words == small + 17 * 4
    lists = [state[2].table, state[2].history]
    assert [x.shape for x in lists] == [(4, 320, 3), (4, sp.prompt_part + 6)]
    kv = [x for x in jax.tree.leaves(cache) if jnp.issubdtype(x.dtype, jnp.floating)]
    kv += [jax.ShapeDtypeStruct((1, 1) + x.shape, x.dtype) for x in lists]
    apart = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sp.pieces) for x in kv)
    words = jax.ShapeDtypeStruct((1, 1, sp.carry.words), jnp.int32, sharding=sp.pieces)
    advance = jax.eval_shape(sp._advance_program(), sp._weights(), apart, words,
                             jax.ShapeDtypeStruct((4,), jnp.bool_, sharding=sp.rows),
                             jax.ShapeDtypeStruct((), jnp.int32, sharding=sp.replicated))
    insert = jax.eval_shape(sp._insert_program(2), sp._weights(), apart, words,
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
    log-probabilities (-1) and read no adapter (-1), the state of that device's dp shard."""
    from config import load_config
    from decoder.decoder import Decoder
    from decoder.slot_programs import SlotPrograms

    g = Decoder.of_config(load_config("inference", "gptj_tiny", dict(eval=True, tensor_parallel=2, data_parallel=2)))
    sp = SlotPrograms(g, 4, 8, (1,), 6, 3)
    sp.params = g.abstract_decode_params()
    sp.reset()
    assert sp.words.shape == (2, 2, sp.carry.words) and all(x.shape[:2] == (2, 2) for x in sp.apart)
    words, apart = np.asarray(sp.words), [np.asarray(x) for x in sp.apart]
    for d in range(2):
        for t in range(2):
            cache, (rows, sampling, c, adapter) = jax.jit(sp.carry.unpack)(tuple(x[d, t] for x in apart), words[d, t])
            assert all(not np.asarray(x).any() for x in jax.tree.leaves(cache))
            assert np.asarray(rows.alive).tolist() == [False, False] and np.asarray(rows.limit).tolist() == [0, 0]
            assert np.asarray(sampling.logprobs).tolist() == [-1, -1] and np.asarray(adapter).tolist() == [-1, -1]
            # no processor: repetition 1, no key, an empty table and history
            assert np.asarray(c.repetition).tolist() == [1, 1] and not np.asarray(c.grammar).any()
            assert (np.asarray(c.table) == -1).all() and (np.asarray(c.history) == -1).all()
            assert not any(np.asarray(x).any() for x in (c.presence, c.frequency, c.min_p, c.ignore_eos))
            assert not any(np.asarray(x).any() for x in (rows.token, rows.index, sampling.temperature, sampling.seed))


def test_a_narrow_span_s_program_steps_a_narrow_copy_of_the_cache():
    """Lowered, not compiled: the advance program of a span narrower than the cache (GPT-J: 8 prompt columns and 40
    new, spans 16, 24, 40, 48) steps keys and values 24 columns wide; the whole cache's program never makes them."""
    from config import load_config
    from decoder.decoder import Decoder
    from decoder.slot_programs import SlotPrograms, attention_spans

    g = Decoder.of_config(load_config("inference", "gptj_tiny", dict(eval=True, tensor_parallel=1, data_parallel=1)))
    sp = SlotPrograms(g, 4, 8, (1,), 40, 3, spans=4)
    sp.params = g.abstract_decode_params()
    cache = jax.eval_shape(sp._empty_cache)
    local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), cache)
    assert attention_spans(g.family, local, 4) == (16, 24, 40, 48)
    state = sp._empty_state()
    sp.carry = Carry(local, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
    kv = [x for x in jax.tree.leaves(cache) if jnp.issubdtype(x.dtype, jnp.floating)]
    kv += [jax.ShapeDtypeStruct((1, 1) + x.shape, x.dtype) for x in (state[2].table, state[2].history)]
    apart = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sp.pieces) for x in kv)
    words = jax.ShapeDtypeStruct((1, 1, sp.carry.words), jnp.int32, sharding=sp.pieces)
    args = (sp._weights(), apart, words, jax.ShapeDtypeStruct((4,), jnp.bool_, sharding=sp.rows),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=sp.replicated))
    d_kv = kv[0].shape[-1]
    texts = {span: sp._advance_program(span).lower(*args).as_text() for span in (24, 48)}
    assert f"x24x{d_kv}xf32>" in texts[24] and f"x48x{d_kv}xf32>" in texts[24]  # (the cache, whole, around it)
    assert f"x24x{d_kv}xf32>" not in texts[48]


def test_an_inserts_inputs_travel_in_one_array_and_come_back_whole():
    """decoder/slot_programs.py packs what a shard's insert reads into one int32 vector (one host-to-device copy): the
    prompts packed into rows (first-fit decreasing: the longest first, each into the first row with room), their
    segments and positions, every joiner's field as it went, with its type, seeds' 32 bits and the floats' bits
    included, its processors (none asked: repetition 1, no key) and its table's entries, each at its joiner's index
    and its place in the row's table, its LoRA adapter's slot (-1 where it names none); the slots past the joiners'
    are fillers (a slot past the shard's, length 0, no adapter), and so are the entries past theirs (a joiner past
    the shard's: dropped)."""
    from decoder.slot_programs import ENTRY, JOINER_COLUMNS, joiner_words, pack_joiners, unpack_joiners
    from modelling.processors import TABLE
    from modelling.rows import first_fit

    prompts = [[5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15]]
    placed = first_fit([len(p) for p in prompts], 8)
    assert placed == [(0, 6), (0, 0), (1, 0)]  # 6 first (row 0), 3 (no room in row 0: row 1), 2 (row 0 after 6)
    assert first_fit([8, 1, 8], 8) == [(0, 0), (2, 0), (1, 0)] and first_fit([], 8) == []
    sampling = [(0.5, 3, 0.1, 2 ** 32 - 1, 2 ** 31, -1), (float("nan"), 0, -0.0, 7, 0, 4), (1.0, 1, 0.0, 0, 1, 0)]
    controls = [(0.5, -1.25, 1.5, 0.05, True, 7, ((3, -100.0, 2 ** 31 - 1), (1, float("-inf"), 4))), None,
                (0.0, 2.0, 0.5, 1.0, False, 0, ((9, 2.5, 2 ** 31 - 1),))]
    shard = [(k, slot, p, smp, limit, c) for k, (slot, p, smp, limit, c) in
             enumerate(zip([3, 0, 1], prompts, sampling, [9, 2, 5], controls))]
    shard = [shard[0] + (2,), shard[1] + (0,), shard[2]]  # adapters 2, 0 and none
    local = 4
    packed = pack_joiners(shard, placed, 2, 8, local)
    assert packed.dtype == np.int32 and packed.shape == (joiner_words(2, 8, local),) == (
        3 * 2 * 8 + 4 * JOINER_COLUMNS + TABLE * ENTRY,)
    (ids, segments, positions), at, lengths, slots, s, limit, c, entries, adapters = (
        jax.tree.map(np.asarray, x) for x in unpack_joiners(jnp.asarray(packed), 2, 8, local))
    assert ids.tolist() == [[7, 8, 9, 10, 11, 12, 5, 6], [13, 14, 15, 0, 0, 0, 0, 0]]
    assert segments.tolist() == [[2, 2, 2, 2, 2, 2, 1, 1], [1, 1, 1, 0, 0, 0, 0, 0]]  # (numbered as the joiners come)
    assert positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 0, 0, 0, 0, 0]]
    assert at.tolist() == [6, 0, 8, 0] and lengths.tolist() == [2, 6, 3, 0]
    assert slots.tolist() == [3, 0, 1, local] and limit.tolist() == [9, 2, 5, 0]
    assert adapters.tolist() == [2, 0, -1, -1]
    dtypes = (np.float32, np.int32, np.float32, np.uint32, np.uint32, np.int32)
    for i, (field, dt) in enumerate(zip(S.Sampling.__dataclass_fields__, dtypes)):
        value = getattr(s, field)
        assert value.dtype == dt and value[:3].tobytes() == np.asarray([x[i] for x in sampling], dt).tobytes(), field
    asked = [controls[0], (0.0, 0.0, 1.0, 0.0, False, 0, ()), controls[2]]
    for i, field in enumerate(("presence", "frequency", "repetition", "min_p", "ignore_eos", "grammar")):
        dt = np.asarray(getattr(c, field)).dtype
        assert np.asarray(getattr(c, field))[:3].tolist() == np.asarray([x[i] for x in asked], dt).tolist(), field
    f32 = lambda x: np.asarray(x, np.float32).view(np.int32)  # noqa: E731
    assert entries[:3].tolist() == [[0, 0, 3, f32(-100.0), 2 ** 31 - 1], [0, 1, 1, f32(-np.inf), 4],
                                    [2, 0, 9, f32(2.5), 2 ** 31 - 1]]
    assert (entries[3:, 0] == local).all()  # fillers: dropped


@pytest.mark.slow
def test_every_advance_gets_the_keep_flags_of_its_call_copied_to_the_device_only_when_they_change():
    """decoder/slot_programs.py's ``advance`` (its program stubbed: no compile): a call gets the flags the host passed to it;
    an unchanged set of flags reuses the device copy of the last."""
    from config import load_config
    from decoder.decoder import Decoder
    from decoder.slot_programs import SlotPrograms

    g = Decoder.of_config(load_config("inference", "gptj_tiny", dict(eval=True, tensor_parallel=1, data_parallel=1)))
    sp = SlotPrograms(g, 4, 8, (1,), 4, 3)
    assert sp.insert_rows == (1, 4)  # (every slot of a shard can join in one insert, whatever was asked)
    seen, ns = [], []
    sp.spans = (20,)
    sp._advance = {20: lambda p, cache, state, keep, n: (seen.append(keep), ns.append(n),
                                                         (None, None, cache, state))[2]}
    flags = [[True] * 4, [True, False, True, True], [True, False, True, True], [True] * 4]
    for keep, n in zip(flags, (3, 1, 3, None)):
        sp.advance(np.array(keep), n)
    assert [np.asarray(k).tolist() for k in seen] == flags
    assert seen[2] is seen[1] and seen[3] is not seen[0]  # copied when they change, and only then
    assert [int(n) for n in ns] == [3, 1, 3, 3] and ns[2] is ns[0] and ns[3] is ns[0]  # each step count copied once
    for n in (0, 4):  # 1 to the steps compiled
        with pytest.raises(ValueError, match=f"1 to 3 steps, not {n}"):
            sp.advance(np.array(flags[0]), n)


def stubbed_inserts(dp: int, slots: int, width: int, insert_rows: tuple):
    """decoder/slot_programs.py's SlotPrograms on a dp x 1 mesh with its insert programs stubbed (no compile): each
    reads its packed joiners as the program does (``unpack_joiners``) and gives, at joiner j of shard d's output
    row (d x local + j), 1000 x its prompt's first token (read where the packing put it) + its slot, so a
    test sees which prompt and slot each output row holds -> (the SlotPrograms, the rows each insert read)."""
    from config import load_config
    from decoder.decoder import Decoder
    from decoder.slot_programs import SlotPrograms, unpack_joiners

    g = Decoder.of_config(load_config("inference", "gptj_tiny", dict(eval=True, tensor_parallel=1, data_parallel=dp)))
    sp = SlotPrograms(g, slots, width, insert_rows, 4, 3)
    called = []

    def program(rows):
        def run(params, apart, words, joiners):
            called.append(rows)
            first = []
            for d, shard in enumerate(np.asarray(joiners)):
                (ids, _, _), at, lengths, local_slots, *_ = unpack_joiners(jnp.asarray(shard), rows, width, sp.local)
                ids, at, local_slots = np.asarray(ids).ravel(), np.asarray(at), np.asarray(local_slots)
                first += [1000 * int(ids[at[j]]) + d * sp.local + int(local_slots[j]) for j in range(sp.local)]
            scored = np.zeros((dp * sp.local, 1 + 2 * sp.top), np.int32)
            return jnp.asarray(first), jnp.asarray(scored), apart, words
        return run

    sp._insert = {rows: program(rows) for rows in sp.insert_rows}
    return sp, called


def joiner(slot: int, ids: list) -> tuple:
    return slot, ids, (0.0, 0, 0.0, 0, 0, -1), 4


@pytest.mark.slow
def test_an_insert_of_several_packed_rows_reads_each_prompt_where_it_was_packed_in_the_joiners_order():
    """Four prompts that fill two rows 8 wide (6 + 2, 5 + 3): the insert of 2 rows runs (the fewest compiled that hold
    them) and its output rows come back in the joiners' order, each its own prompt's and slot's."""
    sp, called = stubbed_inserts(1, 4, 8, (1, 2, 4))
    joiners = [joiner(2, [11, 3, 4, 5, 6]), joiner(0, [12, 3, 4, 5, 6, 7]), joiner(3, [13, 3]), joiner(1, [14, 3, 4])]
    first, _ = sp.insert(joiners)
    assert called == [2] and sp.fetch(first).tolist() == [11002, 12000, 13003, 14001]
    sp.insert(joiners[:1])
    assert called[-1] == 1


@pytest.mark.slow
def test_an_insert_at_dp_2_returns_each_shard_s_rows_in_the_joiners_order():
    """Joiners to both dp shards, interleaved: shard d's j-th joiner comes back from output row d x local + j, read
    in the joiners' order (read at j alone, the second shard's rows were the first's)."""
    sp, called = stubbed_inserts(2, 4, 8, (1,))
    assert sp.local == 2 and sp.dp == 2
    joiners = [joiner(3, [21, 3]), joiner(0, [22, 3]), joiner(2, [23, 3, 4]), joiner(1, [24])]
    first, scored = sp.insert(joiners)
    assert sp.fetch(first).tolist() == [21003, 22000, 23002, 24001]
    assert sp.fetch(scored).logprob.shape == (4,)  # (the scores read in the same order)


@pytest.mark.slow
def test_an_insert_reads_a_prompt_as_long_as_its_width_and_refuses_one_longer_or_empty():
    sp, _ = stubbed_inserts(1, 4, 8, (1,))
    first, _ = sp.insert([joiner(1, list(range(30, 38)))])  # 8 tokens: the width
    assert sp.fetch(first).tolist() == [30001]
    for ids in (list(range(30, 39)), []):
        with pytest.raises(ValueError, match="an insert reads 1 to 8"):
            sp.insert([joiner(1, ids)])


@pytest.mark.slow
def test_an_advance_runs_in_the_span_program_that_holds_its_rows_and_costs_least():
    """decoder/slot_programs.py's span choice (programs stubbed: no compile): of the spans at or past the one asked, the one
    whose n steps cost least on the line through its two timed figures (1 step and ``steps``); ties: the
    narrower; untimed: the narrowest that holds it; none asked: the whole cache; past the whole cache: an error.
    The spans compiled: the cache's columns in equal parts, each rounded up to a multiple of 8, the last all."""
    from config import load_config
    from decoder.decoder import Decoder
    from decoder.slot_programs import SlotPrograms, attention_spans

    g = Decoder.of_config(load_config("inference", "gptj_tiny", dict(eval=True, tensor_parallel=1, data_parallel=1)))
    sp = SlotPrograms(g, 4, 8, (1,), 4, 5)
    ran = []
    sp.spans = (16, 32, 48)
    assert sp.first_token_column(5) == 5  # (GPT-J's: after the prompt's tokens)
    sp._advance = {s: (lambda s: lambda p, a, w, keep, n: (ran.append(s), (None, None, a, w))[1])(s) for s in sp.spans}
    keep = np.ones(4, bool)
    for span, n, want in ((1, 1, 16), (16, 5, 16), (17, 5, 32), (33, 3, 48), (None, 2, 48)):
        sp.advance(keep, n, span)
        assert ran[-1] == want, (span, n)
    with pytest.raises(ValueError, match="at most 48 positions, not 49"):
        sp.advance(keep, 1, 49)
    # timed: 16 costs 1 ms a call + 1 a step, 32 costs 4 + 0.25 a step (a copy cheaper per step), 48 the most
    sp.costs = {16: (2.0, 6.0), 32: (4.25, 5.25), 48: (9.0, 9.0)}
    assert sp.cost(32, 3) == 4.75 and sp.cost(16, 1) == 2.0 and sp.cost(16, 5) == 6.0
    for span, n, want in ((8, 1, 16), (8, 5, 32), (8, 4, 16), (17, 1, 32), (33, 5, 48)):  # (8, 4): 5 and 5
        assert sp.span_for(span, n) == want, (span, n)
    sp.costs = {16: (2.0, 6.0), 32: (2.0, 6.0), 48: (2.0, 6.0)}
    assert sp.span_for(1, 3) == 16  # a tie: the narrower
    cache = {"kv": (jnp.zeros((4, 3, 2, 100, 8)),) * 2, "key_ok": jnp.zeros((4, 100), bool),
             "next_pos": jnp.zeros(4, jnp.int32), "start": jnp.zeros(4, jnp.int32)}
    assert attention_spans(g.family, cache, 4) == (32, 56, 80, 100)
    assert attention_spans(g.family, cache, 1) == (100,)
    assert attention_spans(g.family, cache, 200) == tuple(range(8, 100, 8)) + (100,)
    # a family whose steps read all of their cache: one span, the whole cache, and no column asked of the family
    sp.spans, sp._advance = (None,), {None: sp._advance[48]}
    sp.family = type("Whole", (), {"first_token_column": lambda self, w: 1 / 0})()
    assert sp.first_token_column(8) == 0 and sp.span_for(5, 1) is None and sp.span_for(None, 1) is None


@pytest.mark.slow
def test_a_constrained_row_runs_the_constrained_programs_until_its_slot_takes_a_free_row():
    """decoder/slot_programs.py's choice of program (programs stubbed: no compile): an insert whose joiners ask no
    grammar, and every advance while no slot holds a constrained row, run the programs compiled at start-up (no
    host callback: JAX's compilation cache holds them); a joiner with a grammar's key runs the constrained insert,
    then each advance runs the constrained one until a free row takes its slot (or a reset); a free joiner beside a
    held constrained row runs the plain insert (an insert asks the host for its joiners alone)."""
    sp, called = stubbed_inserts(1, 4, 8, (1,))
    ran = []
    sp.spans = (None,)
    sp._advance = {None: lambda p, a, w, keep, n: (ran.append("plain"), (None, None, a, w))[1]}
    sp._constrained = {("insert", 1): lambda *a: (ran.append("constrained insert"), sp._insert[1](*a))[1],
                       ("advance", None): lambda p, a, w, keep, n: (ran.append("constrained"), (None, None, a, w))[1]}
    keep = np.ones(4, bool)
    grammar = (0.0, 0.0, 1.0, 0.0, False, 7, ())  # RowControls' fields as a joiner carries them: key 7
    free = (0.0, 0.0, 1.3, 0.0, False, 0, ())  # a processor, no grammar
    sp.insert([joiner(0, [5, 3]) + (free,)])
    sp.advance(keep, 1)
    assert called == [1] and ran == ["plain"] and not sp.held_constraints.any()
    sp.insert([joiner(1, [5, 3]) + (grammar,)])
    sp.advance(keep, 1)
    assert ran[-2:] == ["constrained insert", "constrained"] and sp.held_constraints.tolist() == [0, 1, 0, 0]
    sp.insert([joiner(2, [5, 3])])  # a free joiner beside it: the plain insert, the advance still constrained
    sp.advance(keep, 1)
    assert ran[-1] == "constrained" and called[-1] == 1 and len(ran) == 4
    sp.insert([joiner(1, [5, 3]) + (None,)])  # a free row takes the constrained row's slot
    sp.advance(keep, 1)
    assert ran[-1] == "plain" and not sp.held_constraints.any()


@pytest.mark.parametrize("kind", ["insert", "advance"])
def test_only_the_constrained_programs_ask_the_host_and_none_through_a_jax_callback(kind):
    """Lowered for the CPU, not compiled: the programs compiled at start-up never ask the host; the constrained rows'
    ask it through utils/host_call.py's FFI call, not a JAX callback (on XLA:CPU a program with one runs
    synchronously and is never written to JAX's compilation cache)."""
    from utils.host_call import TARGET

    from config import load_config
    from decoder.decoder import Decoder
    from decoder.slot_programs import SlotPrograms

    g = Decoder.of_config(load_config("inference", "tiny", dict(eval=True, tensor_parallel=1, data_parallel=1)))
    sp = SlotPrograms(g, 4, 8, (1,), 6, 3)
    sp.params = g.abstract_decode_params()
    sp.reset()
    a = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)  # noqa: E731
    sp._abstracts = (jax.tree.map(a, sp._weights()), jax.tree.map(a, sp.apart), jax.tree.map(a, sp.words),
                     jax.ShapeDtypeStruct((4,), jnp.bool_, sharding=sp.rows),
                     jax.ShapeDtypeStruct((), jnp.int32, sharding=sp.replicated))
    key = 1 if kind == "insert" else None
    plain, constrained = sp._lowered(kind, key, False).as_text(), sp._lowered(kind, key, True).as_text()
    assert TARGET not in plain and "callback" not in plain
    assert TARGET in constrained and "callback" not in constrained


@pytest.mark.slow
def test_a_warm_start_reads_every_slot_program_the_constrained_rows_too_from_the_compilation_cache(tmp_path):
    """Two processes, one after the other, compile the same slot programs (the tiny preset's, the constrained rows'
    with them) with JAX's compilation cache on and no minimum compile time: the first writes an entry for each, the
    second writes none (each program found in the cache). The constrained rows' ask the host through XLA's FFI on a
    CPU (utils/host_call.py): a JAX callback would keep them out of the cache."""
    import os
    import subprocess
    import sys
    import textwrap

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cache = str(tmp_path / "xla")
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {root!r})
        import jax
        jax.config.update("jax_compilation_cache_dir", {cache!r})
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        from config import load_config
        from decoder.decoder import Decoder
        from decoder.slot_programs import SlotPrograms
        from partitioning.placement import Placement
        g = Decoder.of_config(load_config("inference", "tiny", dict(eval=True, tensor_parallel=1, data_parallel=1)))
        count = lambda: len([f for f in os.listdir({cache!r}) if f.endswith("-cache")])
        sp = SlotPrograms(g, 4, 8, (1,), 6, 3)
        sp.compile(Placement(g.cfg).init_params(0))
        plain = count()
        sp.compile_constrained().join()
        assert len(sp._constrained) == len(sp.spans) + len(sp.insert_rows), sp._constrained
        print(plain, count(), len(sp._constrained))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    counts = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        counts.append([int(x) for x in out.stdout.split()[-3:]])
    (plain, both, constrained), again = counts
    assert plain > 0 and both == plain + constrained  # (the first process: an entry for each constrained program)
    assert again == [both, both, constrained]  # (the second: none written, each program found)
