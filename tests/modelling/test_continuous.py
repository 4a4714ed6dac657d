"""The slots' per-device programs (modelling/continuous.py) on a small random GPT-J, one device: what the scheduler
(serving/scheduler.py) and its fake (tests/fake_backend.py) count on. Rows inserted into free slots, their prompts
read packed several to a row, decode greedy decoding's tokens; the device carries each row's position from call to
call; a row ends at its limit, at the end-of-text token, or when the host clears its ``keep`` flag, and writes
``pad_id`` after; a row left alone is not disturbed by others joining; each row's log-probabilities are the
log-softmax of the model's own logits; each row's warped scores are decoding.warp's with its own options; an advance
in the narrowest attention span that holds its rows steps as in the whole cache. The compiled programs around them
(decoder/slot_programs.py) are tests/decoder/test_slot_programs.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from modelling import continuous as S
from modelling import continuous, decoding, gptj, registry


SLOTS, WIDTH, NEW, STEPS, TOP = 4, 8, 12, 4, 3


@pytest.fixture(scope="module")
def model():
    from config.schema import Config
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(4)
    hf = GPTJForCausalLM(GPTJConfig(vocab_size=96, n_positions=64, n_embd=48, n_layer=2, n_head=4, rotary_dim=8,
                                    n_inner=96, bos_token_id=1, eos_token_id=1, tie_word_embeddings=False))
    with torch.no_grad():  # larger embeddings: the random model's greedy tokens vary (no token repeated at once)
        hf.transformer.wte.weight.mul_(4.0)
    m = gptj.config_from_hf(hf.config.to_dict())
    family = registry.get("gptj")
    opts = family.options_of(Config(model=m))
    params = jax.tree.map(jnp.asarray, gptj.params_from_hf(hf.state_dict(), m))
    w = family.decoding_params(params, opts)

    def insert(cache, state, ids, mask, rows, s, limit, eos):
        """Rows ids/mask (laid out for decoding) joining slots ``rows`` (a slot past the cache's: a filler), packed."""
        block, at, lengths = joining([r[m > 0].tolist() for r, m in zip(np.asarray(ids), np.asarray(mask))],
                                     len(rows), WIDTH)
        return insert_packed(cache, state, block, at, lengths, jnp.asarray(rows), s, jnp.asarray(limit), eos)

    def advance(cache, state, keep, eos, n):
        return S.advance(family, w, opts, cache, state, keep, STEPS, eos, 0, TOP, n=n)

    insert_packed = jax.jit(lambda cache, state, block, at, lengths, rows, s, limit, eos: S.insert(
        family, w, opts, cache, state, block, at, lengths, rows, s, limit, NEW, eos, TOP), static_argnums=8)
    advance = jax.jit(advance, static_argnums=3)  # (the step count traced: one program for every count)
    return (family, opts, params, insert,
            lambda cache, state, keep, eos, n=STEPS: advance(cache, state, keep, eos, jnp.int32(n)),
            lambda: empty(family, w, opts, WIDTH, NEW))


def joining(prompts_ids: list, rows: int, width: int) -> tuple:
    """What modelling/continuous.py's insert reads of prompts (id lists; an empty one: a filler): the packed rows (ids,
    segments, positions) [rows, width] (decoder/slot_programs.py's first-fit decreasing), each prompt's first position in
    them flattened, and its length."""
    from modelling.rows import first_fit

    placed = first_fit([len(p) for p in prompts_ids], width)
    block, segment = np.zeros((3, rows, width), np.int32), np.zeros(rows, np.int32)
    for p, (r, c) in zip(prompts_ids, placed):
        if p:
            segment[r] += 1
            block[:, r, c:c + len(p)] = [p, [segment[r]] * len(p), range(len(p))]
    at = [r * width + c for r, c in placed]
    return tuple(jnp.asarray(b) for b in block), jnp.asarray(at, jnp.int32), jnp.asarray([len(p) for p in prompts_ids],
                                                                                         jnp.int32)


def empty(family, w, opts, width: int, new: int) -> tuple:
    """The slots' cache (prompts up to ``width`` tokens, ``new`` new ones) and state, every row empty."""
    z = jnp.zeros((1, width), jnp.int32)
    _, cache = family.decode_start_packed(w, z, z, z, jnp.zeros((SLOTS, width), jnp.int32), jnp.ones(SLOTS, jnp.int32),
                                          opts, new)
    zs = jnp.zeros(SLOTS, jnp.int32)
    rows = S.Rows(zs, zs, zs, jnp.zeros(SLOTS, bool))
    return jax.tree.map(jnp.zeros_like, cache), (rows, S.Sampling(zs.astype(jnp.float32), zs, zs.astype(jnp.float32),
                                                                 zs.astype(jnp.uint32), zs.astype(jnp.uint32), zs - 1))


def prompts(family, lengths: list, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    ids, mask = np.zeros((len(lengths), WIDTH), np.int32), np.zeros((len(lengths), WIDTH), np.int32)
    for r, n in enumerate(lengths):
        ids[r, :n], mask[r, :n] = rng.integers(2, 96, n), 1
    return family.layout_prompts(ids, mask)


def sampling(n: int, logprobs: int = -1) -> S.Sampling:
    z = jnp.zeros(n, jnp.int32)
    return S.Sampling(z.astype(jnp.float32), z, z.astype(jnp.float32), z.astype(jnp.uint32), z.astype(jnp.uint32),
                      z + logprobs)


@pytest.mark.slow
def test_rows_decode_greedy_tokens_and_end_at_their_limit_eos_or_keep(model):
    family, opts, params, insert, advance, empty = model
    ids, mask = prompts(family, [5, 3, 7], seed=0)
    ref = np.asarray(decoding.greedy(family, params, jnp.asarray(ids), jnp.asarray(mask), opts, NEW, eos_id=-1))
    eos = int(ref[2, 5])  # row c's sixth greedy token, taken as the end-of-text: it ends there
    assert eos not in ref[0].tolist() and eos not in ref[1, :3].tolist() and eos not in ref[2, :5].tolist()
    cache, state = empty()
    # rows a (limit 12) and b (limit 3) join slots 1 and 3; a filler row (slot index 4: past the cache) is dropped
    first, scored, cache, state = insert(cache, state, ids[[0, 1, 0]], mask[[0, 1, 0]], [1, 3, SLOTS], sampling(3, 2),
                                         [NEW, 3, NEW], eos)
    assert first[:2].tolist() == ref[:2, 0].tolist()
    keep = jnp.asarray([False, True, False, True])
    out1, _, cache, state = advance(cache, state, keep, eos)
    assert out1[1].tolist() == ref[0, 1:5].tolist()
    assert out1[3].tolist() == ref[1, 1:3].tolist() + [0, 0]  # its limit of 3 tokens: then pads
    assert out1[0].tolist() == out1[2].tolist() == [0] * STEPS  # empty slots write nothing
    # row c joins slot 0 while a goes on, untouched (two fillers: one insert shape compiled)
    first_c, _, cache, state = insert(cache, state, ids[[2, 2, 2]], mask[[2, 2, 2]], [0, SLOTS, SLOTS], sampling(3),
                                      [NEW] * 3, eos)
    keep = jnp.asarray([True, True, False, False])
    out2, scored, cache, state = advance(cache, state, keep, eos)
    assert out2[1].tolist() == ref[0, 5:9].tolist() and int(first_c[0]) == ref[2, 0]
    assert out2[0].tolist() == ref[2, 1:5].tolist()
    # a's log-probabilities (it asked for 2): the chosen (greedy) token is the most likely
    np.testing.assert_allclose(scored.logprob[1], scored.top_logprobs[1, :, 0], rtol=1e-6)
    assert scored.top_ids[1, :, 0].tolist() == out2[1].tolist() and (scored.logprob[1] < 0).all()
    out3, _, cache, state = advance(cache, state, jnp.asarray([True, False, False, False]), eos)
    assert out3[1].tolist() == [0] * STEPS and not bool(state[0].alive[1])  # a cleared by the host: pads
    assert out3[0].tolist() == [ref[2, 5], 0, 0, 0] and not bool(state[0].alive[0])  # c ends at its end-of-text


@pytest.mark.slow
def test_an_advance_runs_the_steps_it_is_given_and_the_next_goes_on_from_there(model):
    """One program runs 1 .. STEPS steps (a traced count): its tokens and scores past them are padding, and the rows
    go on from where it stopped, as if the calls were one."""
    family, opts, params, insert, advance, empty = model
    ids, mask = prompts(family, [5, 3], seed=1)
    ref = np.asarray(decoding.greedy(family, params, jnp.asarray(ids), jnp.asarray(mask), opts, NEW, eos_id=-1))
    cache, state = empty()
    first, _, cache, state = insert(cache, state, ids, mask, [0, 2], sampling(2, 1), [NEW, 3], -1)
    keep = jnp.asarray([True] * SLOTS)
    got = [[int(first[0])], [int(first[1])]]
    for n in (1, STEPS - 1, STEPS, 2):
        out, scored, cache, state = advance(cache, state, keep, -1, n)
        out = np.asarray(out)
        assert (out[:, n:] == 0).all() and (np.asarray(scored.logprob)[:, n:] == 0).all(), n  # past n: padding
        assert (np.asarray(scored.logprob)[0, :n] < 0).all()  # (row a asked for its log-probabilities)
        got[0] += out[0, :n].tolist()
        got[1] += out[2, :n].tolist()
    assert got[0] == ref[0, :1 + 1 + STEPS - 1 + STEPS + 2].tolist()
    assert got[1] == ref[1, :3].tolist() + [0] * (len(got[1]) - 3)  # b ends at its limit of 3, whatever the calls
    assert int(state[0].index[0]) == 2 * STEPS + 2  # a's last token's index: every step counted, none twice


@pytest.mark.slow
def test_each_row_chooses_as_its_own_options_and_key_say_and_is_scored_before_warping():
    """``choose`` on logits alone (no model): a greedy row takes the most likely token; a sampled row draws from
    decoding.warp's scores with its options, keyed fold_in(fold_in(key(seed low), seed high), token index); a row
    that asks for log-probabilities gets the log-softmax of the logits as they came (before temperature, top-k and
    top-p) and the k most likely tokens."""
    vocab, top = 32, 3
    rows = [(0.0, 0, 1.0, 0, 0), (0.7, 5, 1.0, 11, 3), (1.3, 0, 0.8, 2 ** 32 - 1, 9), (0.5, 0, 1.0, 11, 4)]
    rows += [(t, k, 1.0, 100 + i, 0) for i, (t, k) in enumerate([(0.25, 0), (2.0, 2), (0.25, 3), (2.0, 0)] * 3)]
    b = len(rows)
    logits = jax.random.normal(jax.random.key(1), (b, vocab)) * 2
    s = S.Sampling(jnp.asarray([r[0] for r in rows], jnp.float32), jnp.asarray([r[1] for r in rows], jnp.int32),
                   jnp.asarray([1.0 - r[2] if r[2] < 1 else 0.0 for r in rows], jnp.float32),
                   jnp.asarray([r[3] for r in rows], jnp.uint32), jnp.asarray([r[4] for r in rows], jnp.uint32),
                   jnp.asarray([-1, 2, -1, 0] + [-1] * (b - 4), jnp.int32))
    index = jnp.asarray([0, 5, 1, 5] + list(range(b - 4)), jnp.int32)
    token, scored = jax.jit(lambda lg, s, i: S.choose(lg, s, i, None, top))(logits, s, index)
    assert int(token[0]) == int(jnp.argmax(logits[0]))
    for r in range(1, b):
        t, k, p, low, high = rows[r]
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(low), high), int(index[r]))
        warped = decoding.warp(logits[r:r + 1], decoding.Options(1, temperature=t, top_k=k, top_p=p))
        assert int(token[r]) == int(jax.random.categorical(key, warped[0])), r
    lsm = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for r in (1, 3):
        np.testing.assert_allclose(float(scored.logprob[r]), lsm[r, int(token[r])], rtol=1e-6)
        assert scored.top_ids[r].tolist() == np.argsort(-lsm[r])[:top].tolist()
        np.testing.assert_allclose(np.asarray(scored.top_logprobs[r]), np.sort(lsm[r])[::-1][:top], rtol=1e-6)


@pytest.mark.slow
def test_a_sampled_row_draws_its_nth_token_with_its_key_folded_with_n_and_a_one_token_row_never_writes(model):
    """Through insert and advance: each token of a sampled row is the draw, with the key of its index in the
    output (the first 0), from the model's own scores after the prompt and the tokens before it (the prompt and the
    row's tokens read again whole, no cache). A row of one token (its limit 1) is done at its insert and writes
    nothing after."""
    family, opts, params, insert, advance, empty = model
    ids, mask = prompts(family, [6, 4, 5], seed=3)
    s = S.Sampling(jnp.full(3, 1.5, jnp.float32), jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.float32),
                   jnp.asarray([5, 5, 5], jnp.uint32), jnp.asarray([0, 1, 2], jnp.uint32), jnp.full(3, -1, jnp.int32))
    cache, state = empty()
    first, _, cache, state = insert(cache, state, ids, mask, [0, 2, 1], s, [NEW, NEW, 1], -1)
    out, _, cache, state = advance(cache, state, jnp.ones(SLOTS, bool), -1)
    assert np.asarray(out)[1].tolist() == [0] * STEPS and not bool(state[0].alive[1])  # the one-token row
    got = np.concatenate([np.asarray(first)[:2, None], np.asarray(out)[[0, 2]]], axis=1)  # [2, 1 + STEPS]
    # every position's scores at once: the left-padded prompts, then the rows' tokens (the last needs none after it)
    whole = np.concatenate([ids[:2], got[:, :-1]], axis=1)
    logits = family.prompt_logits(family.decoding_params(params, opts), jnp.asarray(whole),
                                  jnp.asarray(np.concatenate([mask[:2], np.ones_like(got[:, :-1])], axis=1)), opts)
    for r in range(2):
        for n in range(1 + STEPS):
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(5), r), n)
            scores = logits[r, WIDTH - 1 + n].astype(jnp.float32) / 1.5
            assert int(got[r, n]) == int(jax.random.categorical(key, scores)), (r, n)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "gptj_tiny"])
def test_an_advance_attends_over_the_span_its_rows_write_in_and_no_less(preset):
    """``advance(..., span)``: rows at different positions (three joined, one of them ending by its limit of 2 in
    three steps, then a fourth joined; prompts of 5, 3, 5 and 7 tokens in a cache that holds 16) step the same in the
    cache's first ``span`` columns as in all of it, tokens and log-probabilities, with one of the furthest rows
    cancelled by the host (keep False), and the next call goes on from the written-back cache the same, as long as
    ``span`` holds the last column any row still writing writes: the scheduler's rule, ``first_token_column(its
    prompt's length)`` + dispatched + n - 2 (serving/scheduler.py's ``_span``). One column less and the row that
    writes it steps otherwise."""
    from config import load_config
    from decoder.decoder import Decoder

    g = Decoder.of_config(load_config("inference", preset, dict(eval=True, tensor_parallel=1, data_parallel=1)))
    family, opts = g.family, g.opts
    w = family.decoding_params(g.to_decoding(g.place.init_params()), opts)
    new, n, width = 12, 3, 2 * WIDTH
    base = np.arange(2, 2 + 3 * WIDTH).reshape(3, WIDTH) % 100 + 2
    prompts_ids = [base[r, :k].tolist() for r, k in enumerate((5, 3, 7))]

    def insert(cache, state, ps, rows, limit):
        block, at, lengths = joining(ps, len(rows), width)
        return S.insert(family, w, opts, cache, state, block, at, lengths, jnp.asarray(rows), sampling(len(rows), 2),
                        jnp.asarray(limit), new, -1, TOP)[2:]

    @jax.jit
    def start():
        cache, state = empty(family, w, opts, width, new)
        cache, state = insert(cache, state, [prompts_ids[0], prompts_ids[1], prompts_ids[0]], [0, 2, 3],
                              [new, new, 2])
        cache, state = S.advance(family, w, opts, cache, state, jnp.ones(SLOTS, bool), n, -1, 0, TOP)[2:]
        return insert(cache, state, [prompts_ids[2]], [1], [new])

    keep = jnp.asarray([True, True, False, True])  # slot 2 (one of the furthest) cancelled; slot 3 ended already
    step = jax.jit(lambda cache, state, span: S.advance(family, w, opts, cache, state, keep, n, -1, 0, TOP,
                                                        span=span), static_argnums=2)
    full = S.cache_span(family, start()[0])
    # the furthest row still writing: slot 0, its prompt of 5 tokens, 1 + n dispatched (slot 1: 7 tokens, 1)
    need = family.first_token_column(5) + (1 + n) + n - 2 + 1
    assert need > family.first_token_column(7) + 1 + n - 2 + 1 and need < full
    ref = step(*start(), None)
    ref_next = step(*ref[2:], None)
    for span in (need, need + 1):
        got = step(*start(), span)
        assert (np.asarray(got[0]) == np.asarray(ref[0])).all()
        np.testing.assert_allclose(got[1].logprob, ref[1].logprob, rtol=1e-6, atol=1e-6)
        got_next = step(*got[2:], None)  # from the cache written back
        assert (np.asarray(got_next[0]) == np.asarray(ref_next[0])).all()
        np.testing.assert_allclose(got_next[1].logprob, ref_next[1].logprob, rtol=1e-6, atol=1e-6)
    short = step(*start(), need - 1)
    assert (np.asarray(ref[0])[2:] == 0).all()  # (the cancelled and the ended rows write nothing)
    short_lp, ref_lp = np.asarray(short[1].logprob), np.asarray(ref[1].logprob)
    assert not np.allclose(short_lp[0], ref_lp[0], atol=1e-4)  # the furthest row still writing (slot 0)
    np.testing.assert_allclose(short_lp[1], ref_lp[1], rtol=1e-6, atol=1e-6)  # (the nearer one)


@pytest.mark.slow
def test_per_row_warpers_equal_the_batch_warpers():
    """Sampling in the slots: each row's warped scores are decoding.warp's with that row's options."""
    rows = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 12, 0.6), (1.0, 200, 0.95)]
    scores = jax.random.normal(jax.random.key(0), (len(rows), 64)) * 3
    s = continuous.Sampling(jnp.asarray([r[0] for r in rows], jnp.float32), jnp.asarray([r[1] for r in rows], jnp.int32),
                       jnp.asarray([1.0 - r[2] if r[2] < 1 else 0.0 for r in rows], jnp.float32),
                       jnp.zeros(len(rows), jnp.uint32), jnp.zeros(len(rows), jnp.uint32),
                       jnp.full(len(rows), -1, jnp.int32))
    ours = np.asarray(continuous.warp_rows(scores, s))
    for i, (t, k, p) in enumerate(rows):
        theirs = np.asarray(decoding.warp(scores[i:i + 1], decoding.Options(1, temperature=t, top_k=k, top_p=p)))
        np.testing.assert_array_equal(ours[i], theirs[0])
    assert np.isinf(ours[1]).sum() == 64 - 5 and np.isinf(ours[3]).sum() >= 64 - 12


@pytest.mark.parametrize("preset", ["tiny", "gptj_tiny"])
def test_prompts_read_packed_start_as_each_read_alone_and_step_on_alike(preset):
    """``Family.decode_start_packed`` (serving's inserts): prompts of 5, 3, 7 and 2 tokens packed first-fit into rows
    8 wide (two to a row, segments and positions restarting) give each prompt's first logits as ``decode_start`` of
    that prompt alone does, and a cache from which the next step (each row at its own position) gives that prompt's
    next logits too: T5's cross-attention keys gathered out of the packed encoder's output, GPT-J's keys and values
    out of the packed prefill, each row's mask, start and position."""
    from config import load_config
    from decoder.decoder import Decoder
    from modelling.rows import first_fit

    g = Decoder.of_config(load_config("inference", preset, dict(eval=True, tensor_parallel=1, data_parallel=1)))
    family, opts = g.family, g.opts
    w = family.decoding_params(g.to_decoding(g.place.init_params()), opts)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 100, n).tolist() for n in (5, 3, 7, 2)]
    placed = first_fit([len(p) for p in prompts], WIDTH)
    rows = 1 + max(r for r, _ in placed)
    assert rows < len(prompts)  # (some share a row)
    block, segment = np.zeros((3, rows, WIDTH), np.int32), np.zeros(rows, np.int32)
    where = np.full((len(prompts), WIDTH), rows * WIDTH, np.int32)
    for j, (p, (r, c)) in enumerate(zip(prompts, placed)):
        segment[r] += 1
        block[:, r, c:c + len(p)] = [p, [segment[r]] * len(p), range(len(p))]
        where[j, :len(p)] = r * WIDTH + c + np.arange(len(p))
    lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
    logits, cache = family.decode_start_packed(w, *map(jnp.asarray, block), jnp.asarray(where), lengths, opts, NEW)
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    step, _ = family.decode_step(w, token, jnp.zeros(len(prompts), jnp.int32), cache, opts)
    for j, p in enumerate(prompts):
        ids, mask = family.layout_prompts(np.asarray([p], np.int32), np.ones((1, len(p)), np.int32))
        alone, alone_cache = family.decode_start(w, jnp.asarray(ids), jnp.asarray(mask), opts, NEW)
        np.testing.assert_allclose(logits[j], alone[0], rtol=1e-5, atol=1e-5, err_msg=f"prompt {j}")
        alone_step, _ = family.decode_step(w, token[j:j + 1], 0, alone_cache, opts)
        np.testing.assert_allclose(step[j], alone_step[0], rtol=1e-5, atol=1e-5, err_msg=f"prompt {j}, next step")


# --------------------------------------------------------------------------- each row's processors (RowControls)


class Asked:
    """decoder/grammar.py's HostMasks, each question recorded: [(key, index, last token)] of the rows with a key."""

    def __init__(self, masks):
        self.masks, self.asked = masks, []

    def __call__(self, keys, index, last):
        self.asked += [(int(k), int(i), int(t)) for k, i, t in zip(keys, index, last) if k > 0]
        return self.masks(keys, index, last)


def no_controls(n: int):
    from modelling.processors import RowControls

    z = jnp.zeros(n, jnp.float32)
    return RowControls(z, z, z + 1, z, jnp.zeros(n, bool), jnp.zeros(n, jnp.int32), None, None)


def with_controls(n: int, **fields):
    c = no_controls(n)
    return c.__class__(**{**{f: getattr(c, f) for f in c.__dataclass_fields__}, **{
        k: jnp.asarray(v, getattr(c, k).dtype) for k, v in fields.items()}})


def entries(tables: dict) -> jax.Array:
    """An insert's table entries: {joiner index: [(token, bias, held below)]} -> int32 [TABLE, 5]."""
    from modelling.processors import TABLE

    out = np.zeros((TABLE, 5), np.int32)
    out[:, 0] = 10 ** 6  # fillers: a joiner past any insert's
    e = 0
    for j, rows in tables.items():
        for k, (t, b, until) in enumerate(rows):
            out[e] = [j, k, t, np.asarray(b, np.float32).view(np.int32), until]
            e += 1
    return jnp.asarray(out)


@pytest.fixture(scope="module")
def controlled(model):
    """model's GPT-J, its slots carrying RowControls: (insert(state, ids, mask, rows, s, limit, eos, c, entries),
    advance(state, keep, eos), empty state, the host recorder, params, family, opts)."""
    from decoder.grammar import HostMasks
    from modelling.processors import TABLE, RowControls

    family, opts, params, _, _, empty_plain = model
    w = family.decoding_params(params, opts)
    host = Asked(HostMasks(96, 1))
    p = RowControls.prompt_part(family, WIDTH)

    def empty():
        cache, (rows, s) = empty_plain()
        z = lambda v, dt: jnp.full(SLOTS, v, dt)  # noqa: E731
        c = RowControls(z(0, jnp.float32), z(0, jnp.float32), z(1, jnp.float32), z(0, jnp.float32), z(0, bool),
                        z(0, jnp.int32), jnp.full((SLOTS, TABLE, 3), -1, jnp.int32),
                        jnp.full((SLOTS, p + NEW), -1, jnp.int32))
        return cache, (rows, s, c)

    def insert_packed(cache, state, block, at, lengths, rows, s, limit, eos, c, table):
        return S.insert(family, w, opts, cache, state, block, at, lengths, rows, s, limit, NEW, eos, TOP, None, c,
                        table, host)

    def insert(cache, state, ids, mask, rows, s, limit, eos, c, table):
        block, at, lengths = joining([r[m > 0].tolist() for r, m in zip(np.asarray(ids), np.asarray(mask))],
                                     len(rows), WIDTH)
        return insert_packed(cache, state, block, at, lengths, jnp.asarray(rows), s, jnp.asarray(limit),
                             int(eos), c, table)

    insert_packed = jax.jit(insert_packed, static_argnums=8)
    advance = jax.jit(lambda cache, state, keep, eos: S.advance(family, w, opts, cache, state, keep, STEPS, eos, 0,
                                                                TOP, None, None, None, host, 0, p),
                      static_argnums=3)
    return insert, advance, empty, host, params, family, opts


def decode_rows(controlled, ids, mask, rows, limits, eos, c, table, calls=3):
    """Rows inserted together, then ``calls`` advances: each joiner's tokens [J, 1 + calls x STEPS]."""
    insert, advance, empty, *_ = controlled
    cache, state = empty()
    first, _, cache, state = insert(cache, state, ids, mask, rows, sampling(len(rows)), limits, eos, c, table)
    out = [np.asarray(first)[:, None]]
    for _ in range(calls):
        o, _, cache, state = advance(cache, state, jnp.ones(SLOTS, bool), eos)
        out.append(np.asarray(o)[[r for r in rows if r < SLOTS]])
    return np.concatenate(out, axis=1), state


@pytest.mark.slow
def test_each_rows_penalty_and_bias_give_the_batch_searchs_tokens_beside_a_free_row_and_as_alone(controlled):
    """Four rows decoded together: a free one (greedy's tokens), one with a repetition penalty (the batch search's
    with HF's processor: the prompt's tokens and its own penalised, tests/modelling/test_processors.py holds that one
    to generate), one with a logit bias (HF's single-token sequence bias), one with both (HF's order: the bias
    first, then the penalty); each the same inserted alone."""
    from modelling.decoding import Options
    from modelling.processors import UNTIL_ALWAYS, Processors

    insert, advance, empty, host, params, family, opts = controlled
    ids, mask = prompts(family, [5, 6, 7, 6], seed=11)
    n = 1 + 3 * STEPS
    free = np.asarray(decoding.greedy(family, params, jnp.asarray(ids), jnp.asarray(mask), opts, n, eos_id=-1))
    banned = int(free[2, 1])
    up, down = int(free[3, 2]), int(free[3, 1])  # (row 3: biases that flip scores' signs, then the penalty)
    both = (((up,), 6.0), ((down,), -6.0))
    procs = [Processors(), Processors(repetition_penalty=1.8), Processors(sequence_bias=(((banned,), -7.5),)),
             Processors(sequence_bias=both, repetition_penalty=3.0)]
    refs = [np.asarray(decoding.decode(family, params, jnp.asarray(ids[r:r + 1]), jnp.asarray(mask[r:r + 1]), opts,
                                       Options(n, processors=procs[r]), eos_id=-1))[0] for r in range(4)]
    assert all(not np.array_equal(refs[r], free[r]) for r in (1, 2, 3))  # each bites
    tables = [[], [], [(banned, -7.5, UNTIL_ALWAYS)], [(t, b, UNTIL_ALWAYS) for (t,), b in both]]
    penalties = [1.0, 1.8, 1.0, 3.0]
    c = with_controls(4, repetition=penalties)
    together, _ = decode_rows(controlled, ids, mask, [0, 2, 3, 1], [n] * 4, -1, c,
                              entries({r: t for r, t in enumerate(tables)}))
    for r in range(4):
        np.testing.assert_array_equal(together[r], refs[r], err_msg=f"row {r}")
        alone, _ = decode_rows(controlled, ids[r:r + 1], mask[r:r + 1], [1], [n], -1,
                               with_controls(1, repetition=[penalties[r]]), entries({0: tables[r]}))
        np.testing.assert_array_equal(alone[0], together[r], err_msg=f"row {r} alone")


@pytest.mark.slow
def test_presence_and_frequency_penalise_the_rows_output_alone_by_openais_rule(controlled):
    """Greedy with a bias toward one token (this model repeats no token by itself) and OpenAI's penalties: each token
    is the most likely of the model's logits (the whole sequence read again) plus the bias, less presence where the
    token was written before and frequency times the times it was; the prompt's tokens are not counted (a prompt
    token is the biased one)."""
    from modelling.processors import UNTIL_ALWAYS

    insert, advance, empty, host, params, family, opts = controlled
    ids, mask = prompts(family, [6], seed=12)
    n = 1 + 2 * STEPS
    x = int(ids[0][mask[0] > 0][2])
    table = entries({0: [(x, 6.0, UNTIL_ALWAYS)]})
    biased, _ = decode_rows(controlled, ids, mask, [0], [n], -1, no_controls(1), table, calls=2)
    assert (biased[0] == x).sum() > n // 2  # the bias alone: mostly that token
    got, _ = decode_rows(controlled, ids, mask, [0], [n], -1, with_controls(1, presence=[0.75], frequency=[1.5]),
                         table, calls=2)
    got = got[0]
    assert 1 <= (got == x).sum() < (biased[0] == x).sum()
    whole = np.concatenate([ids, got[None, :-1]], axis=1)
    logits = np.asarray(family.prompt_logits(family.decoding_params(params, opts), jnp.asarray(whole),
                                             jnp.asarray(np.concatenate([mask, np.ones((1, n - 1), np.int32)], 1)),
                                             opts), np.float32)[0, WIDTH - 1:]
    for i in range(n):
        counts = np.bincount(got[:i], minlength=logits.shape[-1])
        scores = logits[i] + 6.0 * (np.arange(logits.shape[-1]) == x) - 0.75 * (counts > 0) - 1.5 * counts
        assert int(got[i]) == int(np.argmax(scores)), i


@pytest.mark.slow
def test_min_tokens_holds_the_end_of_text_below_its_index_and_ignore_eos_goes_past_it(controlled):
    """A row whose greedy output writes the end-of-text token at index 3: held below index 3 (min_tokens 3: an
    entry of -inf held below 3) it still ends there; held below 4 it writes another token there; with ignore_eos
    it writes the end-of-text token and goes on to its limit."""
    insert, advance, empty, host, params, family, opts = controlled
    ids, mask = prompts(family, [5], seed=13)
    n = 1 + 2 * STEPS
    free = np.asarray(decoding.greedy(family, params, jnp.asarray(ids), jnp.asarray(mask), opts, n, eos_id=-1))[0]
    eos = int(free[3])
    assert eos not in free[:3].tolist()
    held = lambda k: decode_rows(controlled, ids, mask, [0], [n], eos, no_controls(1),  # noqa: E731
                                 entries({0: [(eos, -np.inf, k)]}), calls=2)
    at3, state = held(3)
    assert at3[0, :4].tolist() == free[:4].tolist() and (at3[0, 4:] == 0).all() and not bool(state[0].alive[0])
    at4, _ = held(4)
    assert at4[0, :3].tolist() == free[:3].tolist() and int(at4[0, 3]) != eos
    on, state = decode_rows(controlled, ids, mask, [0], [n], eos, with_controls(1, ignore_eos=[True]), entries({}),
                            calls=2)
    assert on[0].tolist() == free.tolist() and int(state[0].index[0]) == n - 1  # past its end-of-text, to its limit


@pytest.mark.slow
def test_a_constrained_row_writes_what_the_host_allows_and_asks_with_each_tokens_index_and_the_one_before(controlled):
    """A row with a key (the host's allowed tokens: a fixed set here) writes only those, asking at each step with
    the token's index in its output and its token before it; the free row beside it writes greedy's tokens; a row
    whose every token the host masks writes its end-of-text token."""
    from decoder.grammar import Allowed

    insert, advance, empty, host, params, family, opts = controlled
    ids, mask = prompts(family, [5, 7], seed=14)
    n = 1 + STEPS
    free = np.asarray(decoding.greedy(family, params, jnp.asarray(ids), jnp.asarray(mask), opts, n, eos_id=-1))
    allowed = sorted({int(free[1, 2]), 40, 41, 1})
    key = host.masks.open(Allowed(allowed, host.masks.words))
    host.asked.clear()
    got, _ = decode_rows(controlled, ids, mask, [0, 3], [n, n], -1, with_controls(2, grammar=[0, key]), entries({}),
                         calls=1)
    assert got[0].tolist() == free[0].tolist()
    assert set(got[1].tolist()) <= set(allowed) and len(set(got[1].tolist())) > 1
    assert [(i, t) for k, i, t in host.asked if k == key] == [(0, -1)] + [(i, int(got[1, i - 1])) for i in range(1, n)]
    host.masks.close(key)
    none = host.masks.open(Allowed([], host.masks.words))
    got, _ = decode_rows(controlled, ids[:1], mask[:1], [2], [n], 1, with_controls(1, grammar=[none]), entries({}),
                         calls=1)
    assert got[0, 0] == 1 and (got[0, 1:] == 0).all()  # nothing allowed: its end-of-text token, then it ended
