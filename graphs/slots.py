"""The decoding slots of continuous batching, compiled on the run's mesh: their KV cache and the programs that
fill and advance it (modelling/slots.py's per-device bodies under shard_map; serving/ drives them).

Slots are rows split over dp (slot s lives on dp shard s // (slots / dp)), weights over tp, as every decoding
program here. The cache never leaves the programs, so it is kept as each device's own piece: every leaf is
[dp, tp, ...] with spec P('dp', 'tp'), whatever the family's cache holds (the programs take and give back the
device's [...] part), and the programs donate it (updated in place).

The compiled shapes are a bounded set, all compiled by ``compile`` before any request: one ``advance`` program, one
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


class SlotPrograms:
    """``slots`` decoding rows of at most ``max_new_tokens`` new tokens after prompts of at most ``widths[-1]``
    tokens, on the mesh of ``graphs``, with the ``top`` most likely tokens' log-probabilities where a row asks (see
    the module docstring)."""

    def __init__(self, graphs, slots: int, widths: tuple, joins: tuple, max_new_tokens: int, steps: int,
                 eos_id: int, pad_id: int, top: int = 20):
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
        self.params = self.cache = self.state = None
        self._insert, self._advance, self._score = {}, None, {}
        self._keep = (None, None)  # (the host's last keep flags, their device copy)
        self._n: dict = {}  # steps an advance runs -> its device copy (a scalar)

    # ------------------------------------------------------------------ the programs

    def _state_specs(self):
        return (slot_lib.Rows(*(P(S.DP),) * 4), slot_lib.Sampling(*(P(S.DP),) * 6))

    def _scored_specs(self, lead: tuple):
        return slot_lib.Scored(P(*lead), P(*lead, None), P(*lead, None))

    def _insert_program(self):
        family, opts, width, n, eos, top = (self.family, self.opts, self.widths[-1], self.max_new_tokens,
                                            self.eos_id, self.top)

        def fn(p, cache, state, ints, floats):
            dp = family.decoding_params(p, opts)
            ids, mask, rows, s, limit = unpack_joiners(ints, floats)
            first, scored, cache, state = slot_lib.insert(family, dp, opts, _local(cache), state, ids, mask, rows, s,
                                                          limit, width, n, eos, top, S.TP)
            return first, scored, _stacked(cache), state

        mapped = jax.shard_map(fn, mesh=self.g.mesh, check_vma=False,
                               in_specs=(self.g.decode_specs(), P(S.DP, S.TP), self._state_specs(), P(S.DP, None),
                                         P(S.DP, None)),
                               out_specs=(P(S.DP), self._scored_specs((S.DP,)), P(S.DP, S.TP), self._state_specs()))
        return jax.jit(mapped, donate_argnums=(1, 2))

    def _advance_program(self):
        family, opts, steps, eos, pad, top = (self.family, self.opts, self.steps, self.eos_id, self.pad_id,
                                              self.top)

        def fn(p, cache, state, keep, n):
            dp = family.decoding_params(p, opts)
            out, scored, cache, state = slot_lib.advance(family, dp, opts, _local(cache), state, keep, steps, eos,
                                                         pad, top, S.TP, n)
            return out, scored, _stacked(cache), state

        mapped = jax.shard_map(fn, mesh=self.g.mesh, check_vma=False,
                               in_specs=(self.g.decode_specs(), P(S.DP, S.TP), self._state_specs(), P(S.DP), P()),
                               out_specs=(P(S.DP, None), self._scored_specs((S.DP, None)), P(S.DP, S.TP),
                                          self._state_specs()))
        return jax.jit(mapped, donate_argnums=(1, 2))

    def _score_program(self):
        family, opts, top = self.family, self.opts, self.top

        def fn(p, ids_mask):
            ids, mask = jnp.split(ids_mask, 2, axis=1)
            return slot_lib.score_prompts(family, family.decoding_params(p, opts), opts, ids, mask, top, S.TP)

        mapped = jax.shard_map(fn, mesh=self.g.mesh, check_vma=False,
                               in_specs=(self.g.decode_specs(), P(S.DP, None)),
                               out_specs=self._scored_specs((S.DP, None)))
        return jax.jit(mapped)

    def _empty_cache(self):
        """The slots' cache, all rows empty (zeros; their masks let nothing be read)."""
        family, opts, width, n = self.family, self.opts, self.widths[-1], self.max_new_tokens

        def fresh(p, ids, mask):
            _, cache = family.decode_start(family.decoding_params(p, opts), ids, mask, opts, n, S.TP)
            return _stacked(family.widen_cache(cache, ids.shape[1], width))

        ids = jax.ShapeDtypeStruct((self.slots, width), jnp.int32, sharding=self.rows2)
        shapes = jax.eval_shape(self.g.phase(fresh, (self.g.decode_specs(), P(S.DP, None), P(S.DP, None)),
                                             P(S.DP, S.TP)), self.params, ids, ids)
        return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                       out_shardings=self.pieces)()

    def _empty_state(self) -> tuple:
        """Every row empty: not writing, asking for no log-probabilities."""
        z = lambda dt, v=0: np.full(self.slots, v, dt)  # noqa: E731
        rows = slot_lib.Rows(z(np.int32), z(np.int32), z(np.int32), z(bool))
        sampling = slot_lib.Sampling(z(np.float32), z(np.int32), z(np.float32), z(np.uint32), z(np.uint32),
                                     z(np.int32, -1))
        return jax.tree.map(lambda x: S.put_global(x, self.rows), (rows, sampling))

    def reset(self) -> None:
        """The cache and every row's state anew, all rows empty (after a failed call, whose donated buffers are
        gone)."""
        self.cache, self.state, self._keep = self._empty_cache(), self._empty_state(), (None, None)

    def _abstract(self, shape, dtype, sharding):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def compile(self, params) -> float:
        """The weights in decoding's layout (Graphs.decode_shardings: as Predictor.load_params gives them, else
        converted once), the empty cache, and every program compiled -> seconds."""
        t0 = time.perf_counter()
        g = self.g
        self.params = params if g.is_decoding_layout(params) else g.to_decoding(params)  # (Predictor.load_params')
        self.reset()
        cache_abs, state_abs = (jax.tree.map(lambda x: self._abstract(x.shape, x.dtype, x.sharding), t)
                                for t in (self.cache, self.state))
        insert = self._insert_program()
        for width in self.widths:
            for j in self.joins:
                n = j * g.dp
                ints = self._abstract((n, 2 * width + JOINER_INTS), jnp.int32, self.rows2)
                floats = self._abstract((n, JOINER_FLOATS), jnp.float32, self.rows2)
                self._insert[(width, j)] = insert.lower(self.params, cache_abs, state_abs, ints, floats).compile()
        keep = self._abstract((self.slots,), jnp.bool_, self.rows)
        n = self._abstract((), jnp.int32, self.replicated)
        self._advance = self._advance_program().lower(self.params, cache_abs, state_abs, keep, n).compile()
        if self.family.scores_prompts:
            score = self._score_program()
            for width in self.widths:
                ids_mask = self._abstract((self.score_rows, 2 * width), jnp.int32, self.rows2)
                self._score[width] = score.lower(self.params, ids_mask).compile()
        seconds = time.perf_counter() - t0
        logger.info("compiled %d slot programs in %.1f s (%d slots, prompt widths %s, joins %s, %d new tokens)",
                    len(self._insert) + 1 + len(self._score), seconds, self.slots, list(self.widths),
                    list(self.joins), self.max_new_tokens)
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
        (their first tokens [dp * join], their Scored), on the device. Two host-to-device copies, whatever the
        joiners ask (``pack_joiners``: each copy costs the host about a millisecond on a CPU, as much as the rest of
        the call)."""
        ints, floats = pack_joiners(ids, mask, rows, sampling, limit)
        first, scored, self.cache, self.state = self._insert[(width, join)](
            self.params, self.cache, self.state, S.put_global(ints, self.rows2), S.put_global(floats, self.rows2))
        return first, scored

    def advance(self, keep, n: int = None) -> tuple:
        """``n`` tokens of every row (1 .. ``steps``; ``steps`` when None); keep bool [slots]: the rows the host still
        holds -> (int32 [slots, steps], Scored [slots, steps]: the columns past ``n`` padding), on the device. The
        keep flags are copied to the device only when they change, each ``n`` once."""
        keep = np.asarray(keep, bool)
        n = self.steps if n is None else int(n)
        if not 1 <= n <= self.steps:
            raise ValueError(f"an advance runs 1 to {self.steps} steps, not {n}")
        if self._keep[0] is None or not np.array_equal(self._keep[0], keep):
            self._keep = (keep.copy(), S.put_global(keep, self.rows))
        if n not in self._n:
            self._n[n] = S.put_global(np.int32(n), self.replicated)
        out, scored, self.cache, self.state = self._advance(self.params, self.cache, self.state, self._keep[1],
                                                            self._n[n])
        return out, scored

    def score(self, width: int, ids, mask) -> slot_lib.Scored:
        """The prompts' own log-probabilities: ids/mask [score_rows, width] laid out for the family -> Scored
        [score_rows, width - 1] (column c: token c + 1's), on the device."""
        ids_mask = np.concatenate([np.asarray(ids, np.int32), np.asarray(mask, np.int32)], axis=1)
        return self._score[width](self.params, S.put_global(ids_mask, self.rows2))

    @staticmethod
    def fetch(x):
        """A call's device arrays (any tree of them) -> numpy."""
        return jax.tree.map(S.fetch, x)


JOINER_INTS, JOINER_FLOATS = 6, 2  # columns after ids and mask: rows, top_k, seed, seed_hi, logprobs, limit; and
# temperature, drop_mass


def pack_joiners(ids, mask, rows, sampling: tuple, limit) -> tuple:
    """What an insert reads, in two arrays: int32 [n, 2 width + 6] (ids, mask, then rows, top_k, seed, seed_hi (the
    seeds' bits), logprobs, limit) and float32 [n, 2] (temperature, drop_mass)."""
    temperature, top_k, drop_mass, seed, seed_hi, logprobs = sampling
    bits = lambda x: np.asarray(x, np.uint32).view(np.int32)  # noqa: E731
    cols = [np.asarray(rows, np.int32), np.asarray(top_k, np.int32), bits(seed), bits(seed_hi),
            np.asarray(logprobs, np.int32), np.asarray(limit, np.int32)]
    ints = np.concatenate([np.asarray(ids, np.int32), np.asarray(mask, np.int32), np.stack(cols, 1)], axis=1)
    return ints, np.stack([np.asarray(temperature, np.float32), np.asarray(drop_mass, np.float32)], 1)


def unpack_joiners(ints, floats) -> tuple:
    """``pack_joiners``' arrays (on the device) -> (ids, mask, rows, Sampling, limit)."""
    width = (ints.shape[1] - JOINER_INTS) // 2
    col = lambda i: ints[:, 2 * width + i]  # noqa: E731
    u32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)  # noqa: E731
    s = slot_lib.Sampling(floats[:, 0], col(1), floats[:, 1], u32(col(2)), u32(col(3)), col(4))
    return ints[:, :width], ints[:, width:2 * width], col(0), s, col(5)
