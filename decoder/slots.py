"""The decoding slots of continuous batching, compiled on the run's mesh: their KV cache and the programs that
fill and advance it (modelling/slots.py's per-device bodies under shard_map; serving/ drives them).

Slots are rows split over dp (slot s lives on dp shard s // (slots / dp)), weights over tp, as every decoding
program here. The cache and the rows' state never leave the programs, so they are kept as each device's own piece:
every array is [dp, tp, ...] with spec P('dp', 'tp'), whatever the family's cache holds (the programs take and give
back the device's [...] part), and the programs donate them (updated in place). They travel in as few arrays as can
be (``Carry``: the keys and values, and one int32 vector a device for the rest), and a call's log-probabilities in
one (``pack_scored``): JAX's dispatch takes Python's interpreter lock back about once for every array a call
returns.

The compiled shapes are a bounded set, all compiled by ``compile`` before any request: one ``advance`` program per
attention span (``spans`` of them: a step attends over the cache's first positions only, as far as the rows still
writing have reached, which the host knows; a call picks the narrowest that holds its rows, ``span_for``), one
``insert`` program per (prompt width, joining rows per dp shard) pair, the widths and join sizes given, and for a
family that scores its prompts (a causal LM: ``Family.scores_prompts``) one ``score`` program per prompt width.

Calls only dispatch: each returns device arrays, read with ``fetch`` when the host needs them. Where each row is
and how it samples stay on the device (modelling/slots.py's ``Rows`` and ``Sampling``), so ``advance`` needs from the
host only which rows it still holds, and the host dispatches call N + 1 before it reads call N's tokens.
"""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from graphs import sharding as S
from modelling import slots as slot_lib
from utils.errors import ConfigError

logger = logging.getLogger("flan_t5")


def _local(cache):
    return jax.tree.map(lambda x: x[0, 0], cache)


def _stacked(cache):
    return jax.tree.map(lambda x: x[None, None], cache)


def _carried(packed: tuple) -> tuple:
    """``Carry.pack``'s (apart, words) of one device -> its [1, 1, ...] pieces of the global [dp, tp, ...] arrays."""
    apart, words = packed
    return _stacked(apart), words[None, None]


def _words(x: jax.Array) -> jax.Array:
    """A leaf's values as int32 words: a bool as 0 or 1, any other 4-byte type its bits."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.int32)
    return x if x.dtype == jnp.int32 else jax.lax.bitcast_convert_type(x, jnp.int32)


def _from_words(w: jax.Array, dtype) -> jax.Array:
    if dtype == jnp.bool_:
        return w != 0
    return w if dtype == jnp.int32 else jax.lax.bitcast_convert_type(w, dtype)


class Carry:
    """What the programs carry from one call to the next (the slots' cache and every row's state), in as few device
    arrays as it can be.

    JAX's dispatch lets go of Python's interpreter lock and takes it back about once for every array a call returns
    (jaxlib 0.10.2; benchmarks/gil_waits.py), and in the server another thread (HTTP's) holds that lock in between:
    each array is a wait of the decoding thread. So the cache's floating-point leaves (its keys and values, updated
    in place: too big to copy each call; T5's cross-attention bias too) stay apart, one array each, and every other
    leaf, the cache's and the state's (a mask, positions, a few numbers a row), travels in one int32 vector a device,
    the leaves in turn (a bool as 0 or 1, a 4-byte type its bits). A leaf of another size stays apart.

    Built from one device's (abstract) cache and state; ``pack`` and ``unpack`` run inside the programs, on each
    device's pieces."""

    def __init__(self, cache, state):
        leaves, self.tree = jax.tree.flatten((cache, state))
        n_cache = len(jax.tree.leaves(cache))
        self.specs = [(tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves]
        self.packed = [(i >= n_cache or not jnp.issubdtype(dt, jnp.floating))
                       and (dt == jnp.bool_ or dt.itemsize == 4) for i, (_, dt) in enumerate(self.specs)]
        sizes = [int(np.prod(shape)) for (shape, _), p in zip(self.specs, self.packed) if p]
        self.offsets = [int(o) for o in np.cumsum([0] + sizes)]

    @property
    def words(self) -> int:
        """The int32 words of the packed leaves."""
        return self.offsets[-1]

    def pack(self, cache, state) -> tuple:
        """(cache, state) -> (the leaves apart (a tuple), int32 [words])."""
        leaves, tree = jax.tree.flatten((cache, state))
        got = [(tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves]
        if tree != self.tree or got != self.specs:  # (at trace time) a program's cache or state of another make
            raise ValueError(f"the slots' cache and state changed their make: {got} against {self.specs}")
        packed = [_words(x).reshape(-1) for x, p in zip(leaves, self.packed) if p]
        return (tuple(x for x, p in zip(leaves, self.packed) if not p),
                jnp.concatenate(packed) if packed else jnp.zeros(0, jnp.int32))

    def unpack(self, apart, words) -> tuple:
        """``pack``'s arrays -> (cache, state)."""
        apart, out, k = iter(apart), [], 0
        for (shape, dtype), p in zip(self.specs, self.packed):
            if p:
                out.append(_from_words(words[self.offsets[k]:self.offsets[k + 1]].reshape(shape), dtype))
                k += 1
            else:
                out.append(next(apart))
        return jax.tree.unflatten(self.tree, out)


class SlotPrograms:
    """``slots`` decoding rows of at most ``max_new_tokens`` new tokens after prompts of at most ``widths[-1]``
    tokens, on the mesh of ``graphs``, with the ``top`` most likely tokens' log-probabilities where a row asks (see
    the module docstring)."""

    def __init__(self, graphs, slots: int, widths: tuple, joins: tuple, max_new_tokens: int, steps: int,
                 eos_id: int, pad_id: int, top: int = 20, spans: int = 1):
        if slots < 1 or slots % graphs.dp:
            raise ConfigError(f"--slots {slots} must be a positive multiple of data_parallel={graphs.dp} (the slots "
                              f"are split over dp): pass --slots {max(graphs.dp, slots - slots % graphs.dp)}")
        self.g, self.family, self.opts = graphs, graphs.family, graphs.opts
        self.slots, self.local = slots, slots // graphs.dp
        self.widths, self.joins = tuple(sorted(widths)), tuple(sorted(j for j in joins if j <= self.local))
        self.max_new_tokens, self.steps, self.eos_id, self.pad_id = max_new_tokens, steps, eos_id, pad_id
        self.top = max(1, min(top, graphs.opts.vocab_size))  # lax.top_k's k: at least 1, at most the vocabulary
        self.rows = NamedSharding(graphs.mesh, P(S.DP))
        self.rows2 = NamedSharding(graphs.mesh, P(S.DP, None))
        self.pieces = NamedSharding(graphs.mesh, P(S.DP, S.TP))
        self.replicated = NamedSharding(graphs.mesh, P())
        self.params = self.carry = self.apart = self.words = None  # the Carry, and its arrays between calls
        self._insert, self._advance, self._score = {}, {}, {}
        if spans < 1:
            raise ConfigError(f"--attention_spans {spans} must be at least 1 (1: every step attends over the whole "
                              "cache)")
        self.n_spans, self.spans = spans, ()  # the spans compiled (``compile``), ascending; the last the whole cache
        self.costs: dict = {}  # span -> seconds of its advance of 1 and of ``steps`` steps (``compile`` times them)
        self._keep = (None, None)  # (the host's last keep flags, their device copy)
        self._n: dict = {}  # steps an advance runs -> its device copy (a scalar)
        self._local = None  # _local_cache's

    # ------------------------------------------------------------------ the programs

    def _state_specs(self):
        return (slot_lib.Rows(*(P(S.DP),) * 4), slot_lib.Sampling(*(P(S.DP),) * 6))

    def _scored_specs(self, lead: tuple):  # ``pack_scored``'s array
        return P(*lead, None)

    def _insert_program(self):
        family, opts, width, n, eos, top = (self.family, self.opts, self.widths[-1], self.max_new_tokens,
                                            self.eos_id, self.top)

        def fn(p, apart, words, joiners):
            w = family.decoding_params(p, opts)
            ids, mask, rows, s, limit = unpack_joiners(joiners)
            cache, state = self.carry.unpack(_local(apart), words[0, 0])
            first, scored, cache, state = slot_lib.insert(family, w, opts, cache, state, ids, mask, rows, s,
                                                          limit, width, n, eos, top, S.TP)
            return (first, pack_scored(scored)) + _carried(self.carry.pack(cache, state))

        mapped = jax.shard_map(fn, mesh=self.g.mesh, check_vma=False,
                               in_specs=(self.g.decode_specs(), P(S.DP, S.TP), P(S.DP, S.TP), P(S.DP, None)),
                               out_specs=(P(S.DP), self._scored_specs((S.DP,)), P(S.DP, S.TP), P(S.DP, S.TP)))
        return jax.jit(mapped, donate_argnums=(1, 2))

    def _advance_program(self, span=None):
        family, opts, steps, eos, pad, top = (self.family, self.opts, self.steps, self.eos_id, self.pad_id,
                                              self.top)

        def fn(p, apart, words, keep, n):
            w = family.decoding_params(p, opts)
            cache, state = self.carry.unpack(_local(apart), words[0, 0])
            out, scored, cache, state = slot_lib.advance(family, w, opts, cache, state, keep, steps, eos, pad, top,
                                                         S.TP, n, span)
            return (out, pack_scored(scored)) + _carried(self.carry.pack(cache, state))

        mapped = jax.shard_map(fn, mesh=self.g.mesh, check_vma=False,
                               in_specs=(self.g.decode_specs(), P(S.DP, S.TP), P(S.DP, S.TP), P(S.DP), P()),
                               out_specs=(P(S.DP, None), self._scored_specs((S.DP, None)), P(S.DP, S.TP),
                                          P(S.DP, S.TP)))
        return jax.jit(mapped, donate_argnums=(1, 2))

    def _score_program(self):
        family, opts, top = self.family, self.opts, self.top

        def fn(p, ids_mask):
            ids, mask = jnp.split(ids_mask, 2, axis=1)
            return pack_scored(slot_lib.score_prompts(family, family.decoding_params(p, opts), opts, ids, mask, top,
                                                      S.TP))

        mapped = jax.shard_map(fn, mesh=self.g.mesh, check_vma=False,
                               in_specs=(self.g.decode_specs(), P(S.DP, None)),
                               out_specs=self._scored_specs((S.DP, None)))
        return jax.jit(mapped)

    def _cache_shapes(self):
        """The slots' cache, abstract: every leaf [dp, tp, ...] (each device's piece)."""
        family, opts, width, n = self.family, self.opts, self.widths[-1], self.max_new_tokens

        def fresh(p, ids, mask):
            _, cache = family.decode_start(family.decoding_params(p, opts), ids, mask, opts, n, S.TP)
            return _stacked(family.widen_cache(cache, ids.shape[1], width))

        ids = jax.ShapeDtypeStruct((self.slots, width), jnp.int32, sharding=self.rows2)
        return jax.eval_shape(self.g.phase(fresh, (self.g.decode_specs(), P(S.DP, None), P(S.DP, None)),
                                           P(S.DP, S.TP)), self.params, ids, ids)

    def _empty_cache(self):
        """The slots' cache, all rows empty (zeros; their masks let nothing be read)."""
        shapes = self._cache_shapes()
        return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                       out_shardings=self.pieces)()

    def _empty_state(self) -> tuple:
        """Every row empty: not writing, asking for no log-probabilities."""
        z = lambda dt, v=0: np.full(self.slots, v, dt)  # noqa: E731
        rows = slot_lib.Rows(z(np.int32), z(np.int32), z(np.int32), z(bool))
        sampling = slot_lib.Sampling(z(np.float32), z(np.int32), z(np.float32), z(np.uint32), z(np.uint32),
                                     z(np.int32, -1))
        return jax.tree.map(lambda x: S.put_global(x, self.rows), (rows, sampling))

    def _local_cache(self):
        """One device's piece of the slots' cache, abstract (traced once: ``reset``, ``compile`` and every reset
        after a failed call read it)."""
        if self._local is None:
            self._local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[2:], x.dtype), self._cache_shapes())
        return self._local

    def reset(self) -> None:
        """The cache and every row's state anew, all rows empty (after a failed call, whose donated buffers are
        gone), packed as ``Carry`` says: the cache's zeros made on each device, the state's few numbers copied."""
        local = self._local_cache()
        state = self._empty_state()
        if self.carry is None:
            self.carry = Carry(local, jax.tree.map(lambda x: jax.ShapeDtypeStruct((self.local,), x.dtype), state))

        def empty(st):
            return _carried(self.carry.pack(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), local), st))

        self.apart, self.words = jax.jit(jax.shard_map(empty, mesh=self.g.mesh, check_vma=False,
                                                       in_specs=(self._state_specs(),),
                                                       out_specs=(P(S.DP, S.TP), P(S.DP, S.TP))))(state)
        self._keep = (None, None)

    def _abstract(self, shape, dtype, sharding):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def compile(self, params) -> float:
        """The weights in decoding's layout (Graphs.decode_shardings: as Predictor.load_params gives them, else
        converted once), the empty cache, and every program compiled -> seconds."""
        t0 = time.perf_counter()
        g = self.g
        self.params = params if g.is_decoding_layout(params) else g.to_decoding(params)  # (Predictor.load_params')
        self.reset()
        apart, words = (jax.tree.map(lambda x: self._abstract(x.shape, x.dtype, x.sharding), t)
                        for t in (self.apart, self.words))
        insert = self._insert_program()
        for width in self.widths:
            for j in self.joins:
                n = j * g.dp
                joiners = self._abstract((n, 2 * width + JOINER_COLUMNS), jnp.int32, self.rows2)
                self._insert[(width, j)] = insert.lower(self.params, apart, words, joiners).compile()
        keep = self._abstract((self.slots,), jnp.bool_, self.rows)
        n = self._abstract((), jnp.int32, self.replicated)
        self.spans = attention_spans(self.family, self._local_cache(), self.n_spans)
        for span in self.spans:
            self._advance[span] = self._advance_program(span).lower(self.params, apart, words, keep, n).compile()
        self.costs = self._time_spans() if len(self.spans) > 1 else {}
        if self.family.scores_prompts:
            score = self._score_program()
            for width in self.widths:
                ids_mask = self._abstract((self.score_rows, 2 * width), jnp.int32, self.rows2)
                self._score[width] = score.lower(self.params, ids_mask).compile()
        seconds = time.perf_counter() - t0
        logger.info("compiled %d slot programs in %.1f s (%d slots, prompt widths %s, joins %s, %d new tokens, "
                    "attention spans %s)", len(self._insert) + len(self._advance) + len(self._score), seconds,
                    self.slots, list(self.widths), list(self.joins), self.max_new_tokens, list(self.spans))
        return seconds

    @property
    def score_rows(self) -> int:
        """The prompts one ``score`` call reads (the widest join)."""
        return self.joins[-1] * self.g.dp

    # ------------------------------------------------------------------ calls (host arrays in, device arrays out)

    def insert(self, width: int, join: int, ids, mask, rows, sampling: tuple, limit) -> tuple:
        """Joining prompts into the slots: ids/mask [dp * join, width] laid out for the family, the rows of each dp
        shard together; rows [dp * join]: each one's slot within its shard (``self.local``: a filler, dropped);
        sampling: their (temperature, top_k, drop_mass, seed, seed_hi, logprobs); limit: their most tokens ->
        (their first tokens [dp * join], their PackedScored), on the device. One host-to-device copy, whatever the
        joiners ask (``pack_joiners``: each copy costs the host about a millisecond on a CPU, as much as the rest of
        the call)."""
        first, scored, self.apart, self.words = self._insert[(width, join)](
            self.params, self.apart, self.words,
            S.put_global(pack_joiners(ids, mask, rows, sampling, limit), self.rows2))
        return first, PackedScored(scored)

    def first_token_column(self, width: int) -> int:
        """The cache column a row's first new token is written at, its prompt laid out ``width`` wide (new token i
        at that + i): what ``advance``'s ``span`` counts in. 0 for a family whose steps read all of their cache
        (``Family.cache_positions`` None): its span is not read."""
        return 0 if self.spans[-1] is None else self.family.first_token_column(width)

    def span_for(self, span, n: int) -> int:
        """The span compiled that an advance of ``n`` steps writing below column ``span`` runs in (None: the whole
        cache): of those that hold it, the one whose ``n`` steps cost least (``costs``; a narrower span attends
        over fewer columns, but copies them out of the cache and back once a call)."""
        if span is None or self.spans[-1] is None:
            return self.spans[-1]
        if span > self.spans[-1]:
            raise ValueError(f"an advance attends over at most {self.spans[-1]} positions, not {span}")
        fits = [s for s in self.spans if s >= span]
        return min(fits, key=lambda s: self.cost(s, n)) if self.costs else fits[0]

    def cost(self, span: int, n: int) -> float:
        """Seconds of an advance of ``n`` steps in ``span``'s program: ``costs``' two figures (1 step and ``steps``)
        on their line."""
        one, most = self.costs[span]
        return one + (most - one) * (n - 1) / max(self.steps - 1, 1)

    def _time_spans(self, calls: int = 3) -> dict:
        """{span: (seconds of a 1-step advance, of a ``steps``-step one)}: each the fastest of ``calls`` on the empty
        cache (every row computes whether it writes or not, so its cost is any call's), then the cache reset."""
        keep = np.ones(self.slots, bool)
        out = {}
        for span in self.spans:
            times = []
            for n in (1, self.steps):
                best = float("inf")
                for _ in range(calls + 1):  # (the first: warm)
                    t0 = time.perf_counter()
                    jax.block_until_ready(self.advance(keep, n, span)[0])
                    best = min(best, time.perf_counter() - t0)
                times.append(best)
            out[span] = tuple(times)
        self.reset()
        logger.info("attention spans' decoding calls (1 and %d steps, ms): %s", self.steps,
                    ", ".join(f"{s}: {a * 1e3:.2f}, {b * 1e3:.2f}" for s, (a, b) in out.items()))
        return out

    def advance(self, keep, n: int = None, span: int = None) -> tuple:
        """``n`` tokens of every row (1 .. ``steps``; ``steps`` when None); keep bool [slots]: the rows the host still
        holds; ``span``: the cache positions these steps write at most (every row still writing writes below it:
        ``first_token_column``), None: all -> (int32 [slots, steps], PackedScored [slots, steps]: the columns past
        ``n`` padding), on the device. The keep flags are copied to the device only when they change, each ``n``
        once."""
        keep = np.asarray(keep, bool)
        n = self.steps if n is None else int(n)
        if not 1 <= n <= self.steps:
            raise ValueError(f"an advance runs 1 to {self.steps} steps, not {n}")
        program = self._advance[self.span_for(span, n)]
        if self._keep[0] is None or not np.array_equal(self._keep[0], keep):
            self._keep = (keep.copy(), S.put_global(keep, self.rows))
        if n not in self._n:
            self._n[n] = S.put_global(np.int32(n), self.replicated)
        out, scored, self.apart, self.words = program(self.params, self.apart, self.words, self._keep[1], self._n[n])
        return out, PackedScored(scored)

    def score(self, width: int, ids, mask) -> PackedScored:
        """The prompts' own log-probabilities: ids/mask [score_rows, width] laid out for the family -> their Scored
        [score_rows, width - 1] (column c: token c + 1's), packed, on the device."""
        ids_mask = np.concatenate([np.asarray(ids, np.int32), np.asarray(mask, np.int32)], axis=1)
        return PackedScored(self._score[width](self.params, S.put_global(ids_mask, self.rows2)))

    @staticmethod
    def fetch(x):
        """A call's device arrays (any tree of them, or a PackedScored) -> numpy (a PackedScored: a Scored of
        numpy arrays)."""
        packed = lambda v: isinstance(v, PackedScored)  # noqa: E731
        return jax.tree.map(lambda v: unpack_scored(S.fetch(v.array)) if packed(v) else S.fetch(v), x,
                            is_leaf=packed)


def attention_spans(family, cache, n: int) -> tuple:
    """The spans of ``n`` advance programs over one device's ``cache``: its positions (``slot_lib.cache_span``) in
    ``n`` equal parts, each rounded up to a multiple of 8, ascending, the last all of them; one span, all of them, for
    a family whose steps read all of their cache."""
    full = slot_lib.cache_span(family, cache)
    if full is None:
        return (None,)
    return tuple(sorted({min(full, -(-full * k // n // 8) * 8) for k in range(1, n + 1)}))


class PackedScored:
    """A Scored on the device as ``pack_scored``'s one array (``SlotPrograms.fetch`` reads it back)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array


def pack_scored(s: slot_lib.Scored) -> jax.Array:
    """A Scored [...] as one int32 array [..., 1 + 2 top]: the logprob's bits, the top ids, the top logprobs' bits
    (one array a call returns, not three: ``Carry`` says why)."""
    return jnp.concatenate([_words(s.logprob)[..., None], s.top_ids, _words(s.top_logprobs)], axis=-1)


def unpack_scored(x: np.ndarray) -> slot_lib.Scored:
    """``pack_scored``'s array, fetched -> a Scored of numpy arrays."""
    top = (x.shape[-1] - 1) // 2
    return slot_lib.Scored(x[..., 0].view(np.float32), x[..., 1:1 + top], x[..., 1 + top:].view(np.float32))


JOINER_COLUMNS = 8  # after ids and mask: rows, top_k, seed, seed_hi (the seeds' bits), logprobs, limit, and the
# bits of temperature and drop_mass


def pack_joiners(ids, mask, rows, sampling: tuple, limit) -> np.ndarray:
    """What an insert reads, in one array: int32 [n, 2 width + 8] (ids, mask, then rows, top_k, seed, seed_hi,
    logprobs, limit, temperature, drop_mass; the seeds and the floats as their bits)."""
    temperature, top_k, drop_mass, seed, seed_hi, logprobs = sampling
    bits = lambda x, dt: np.asarray(x, dt).view(np.int32)  # noqa: E731
    cols = [np.asarray(rows, np.int32), np.asarray(top_k, np.int32), bits(seed, np.uint32), bits(seed_hi, np.uint32),
            np.asarray(logprobs, np.int32), np.asarray(limit, np.int32), bits(temperature, np.float32),
            bits(drop_mass, np.float32)]
    return np.concatenate([np.asarray(ids, np.int32), np.asarray(mask, np.int32), np.stack(cols, 1)], axis=1)


def unpack_joiners(joiners) -> tuple:
    """``pack_joiners``' array (on the device) -> (ids, mask, rows, Sampling, limit)."""
    width = (joiners.shape[1] - JOINER_COLUMNS) // 2
    col = lambda i: joiners[:, 2 * width + i]  # noqa: E731
    s = slot_lib.Sampling(_from_words(col(6), jnp.float32), col(1), _from_words(col(7), jnp.float32),
                          _from_words(col(2), jnp.uint32), _from_words(col(3), jnp.uint32), col(4))
    return joiners[:, :width], joiners[:, width:2 * width], col(0), s, col(5)
