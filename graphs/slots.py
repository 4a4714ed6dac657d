"""The decoding slots of continuous batching, compiled on the run's mesh: their KV cache and the programs that
fill and advance it (modelling/slots.py's per-device bodies under shard_map; serving/ drives them).

Slots are rows split over dp (slot s lives on dp shard s // (slots / dp)), weights over tp, as every decoding
program here. The cache never leaves the programs, so it is kept as each device's own piece: every leaf is
[dp, tp, ...] with spec P('dp', 'tp'), whatever the family's cache holds (the programs take and give back the
device's [...] part), and the programs donate it (updated in place).

The compiled shapes are a bounded set, all compiled by ``compile`` before any request: one ``advance`` program and
one ``insert`` program per (prompt width, joining rows per dp shard) pair, the widths and join sizes given.
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
    tokens, on the mesh of ``graphs`` (see the module docstring)."""

    def __init__(self, graphs, slots: int, widths: tuple, joins: tuple, max_new_tokens: int, steps: int,
                 eos_id: int, pad_id: int):
        if slots < 1 or slots % graphs.dp:
            raise ConfigError(f"--slots {slots} must be a positive multiple of data_parallel={graphs.dp} (the slots "
                              f"are split over dp): pass --slots {max(graphs.dp, slots - slots % graphs.dp)}")
        self.g, self.family, self.opts = graphs, graphs.family, graphs.opts
        self.slots, self.local = slots, slots // graphs.dp
        self.widths, self.joins = tuple(sorted(widths)), tuple(sorted(j for j in joins if j <= self.local))
        self.max_new_tokens, self.steps, self.eos_id, self.pad_id = max_new_tokens, steps, eos_id, pad_id
        self.rows = NamedSharding(graphs.mesh, P(S.DP))
        self.rows2 = NamedSharding(graphs.mesh, P(S.DP, None))
        self.pieces = NamedSharding(graphs.mesh, P(S.DP, S.TP))
        self.params = self.cache = self.sampling = None
        self._insert, self._advance = {}, None

    # ------------------------------------------------------------------ the programs

    def _insert_program(self):
        family, opts, width, n = self.family, self.opts, self.widths[-1], self.max_new_tokens

        def fn(p, cache, ids, mask, rows, s):
            dp = family.decoding_params(p, opts)
            first, cache = slot_lib.insert(family, dp, opts, _local(cache), ids, mask, rows, s, width, n, S.TP)
            return first, _stacked(cache)

        mapped = jax.shard_map(fn, mesh=self.g.mesh, check_vma=False,
                               in_specs=(self.g.decode_specs(), P(S.DP, S.TP), P(S.DP, None), P(S.DP, None),
                                         P(S.DP), P(S.DP)),
                               out_specs=(P(S.DP), P(S.DP, S.TP)))
        return jax.jit(mapped, donate_argnums=1)

    def _advance_program(self):
        family, opts, steps, eos, pad = self.family, self.opts, self.steps, self.eos_id, self.pad_id

        def fn(p, cache, token, index, limit, s):
            dp = family.decoding_params(p, opts)
            out, cache = slot_lib.advance(family, dp, opts, _local(cache), token, index, limit, s, steps, eos, pad,
                                          S.TP)
            return out, _stacked(cache)

        mapped = jax.shard_map(fn, mesh=self.g.mesh, check_vma=False,
                               in_specs=(self.g.decode_specs(), P(S.DP, S.TP), P(S.DP), P(S.DP), P(S.DP), P(S.DP)),
                               out_specs=(P(S.DP, None), P(S.DP, S.TP)))
        return jax.jit(mapped, donate_argnums=1)

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

    def _abstract(self, shape, dtype, sharding):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def _sampling_abstract(self, n: int) -> slot_lib.Sampling:
        a = lambda dt: self._abstract((n,), dt, self.rows)  # noqa: E731
        return slot_lib.Sampling(a(jnp.float32), a(jnp.int32), a(jnp.float32), a(jnp.uint32))

    def compile(self, params) -> float:
        """The weights in decoding's layout (Graphs.decode_shardings: as Predictor.load_params gives them, else
        converted once), the empty cache, and every program compiled -> seconds."""
        t0 = time.perf_counter()
        g = self.g
        self.params = params if g.is_decoding_layout(params) else g.to_decoding(params)  # (Predictor.load_params')
        self.cache = self._empty_cache()
        cache_abs = jax.tree.map(lambda x: self._abstract(x.shape, x.dtype, self.pieces), self.cache)
        insert = self._insert_program()
        for width in self.widths:
            for j in self.joins:
                n = j * g.dp
                ids = self._abstract((n, width), jnp.int32, self.rows2)
                self._insert[(width, j)] = insert.lower(self.params, cache_abs, ids, ids,
                                                        self._abstract((n,), jnp.int32, self.rows),
                                                        self._sampling_abstract(n)).compile()
        vec = self._abstract((self.slots,), jnp.int32, self.rows)
        self._advance = self._advance_program().lower(self.params, cache_abs, vec, vec, vec,
                                                      self._sampling_abstract(self.slots)).compile()
        self.set_sampling(np.zeros(self.slots, np.float32), np.zeros(self.slots, np.int32),
                          np.zeros(self.slots, np.float32), np.zeros(self.slots, np.uint32))
        seconds = time.perf_counter() - t0
        logger.info("compiled %d slot programs in %.1f s (%d slots, prompt widths %s, joins %s, %d new tokens)",
                    len(self._insert) + 1, seconds, self.slots, list(self.widths), list(self.joins),
                    self.max_new_tokens)
        return seconds

    # ------------------------------------------------------------------ calls (host arrays in, host arrays out)

    def _sampling(self, temperature, top_k, drop_mass, seed) -> slot_lib.Sampling:
        put = lambda x, dt: S.put_global(np.asarray(x, dt), self.rows)  # noqa: E731
        return slot_lib.Sampling(put(temperature, np.float32), put(top_k, np.int32), put(drop_mass, np.float32),
                                 put(seed, np.uint32))

    def set_sampling(self, temperature, top_k, drop_mass, seed) -> None:
        """Every slot's sampling parameters ([slots] each), as ``advance`` reads them from now on."""
        self.sampling = self._sampling(temperature, top_k, drop_mass, seed)

    def insert(self, width: int, join: int, ids, mask, rows, sampling: tuple) -> np.ndarray:
        """Joining prompts into the slots: ids/mask [dp * join, width] laid out for the family, the rows of each dp
        shard together; rows [dp * join]: each one's slot within its shard (``self.local``: a filler, dropped);
        sampling: their (temperature, top_k, drop_mass, seed) -> their first tokens [dp * join]."""
        first, self.cache = self._insert[(width, join)](
            self.params, self.cache, S.put_global(np.asarray(ids, np.int32), self.rows2),
            S.put_global(np.asarray(mask, np.int32), self.rows2), S.put_global(np.asarray(rows, np.int32), self.rows),
            self._sampling(*sampling))
        return S.fetch(first)

    def advance(self, token, index, limit) -> np.ndarray:
        """``steps`` tokens of every slot ([slots] each: its last token, that token's index in its output, its most
        tokens; 0 for an empty slot) -> int32 [slots, steps]."""
        put = lambda x: S.put_global(np.asarray(x, np.int32), self.rows)  # noqa: E731
        out, self.cache = self._advance(self.params, self.cache, put(token), put(index), put(limit), self.sampling)
        return S.fetch(out)
