"""The decoding slots of continuous batching, compiled on the run's mesh: their KV cache and the programs that
fill and advance it (modelling/continuous.py's per-device bodies under shard_map). ``SlotPrograms`` is the scheduler's
Backend (serving/scheduler.py) itself.

Slots are rows split over dp (slot s lives on dp shard s // (slots / dp)), weights over tp, as every decoding
program here. The cache and the rows' state never leave the programs, so they are kept as each device's own piece:
every array is [dp, tp, ...] with spec P('dp', 'tp'), whatever the family's cache holds (the programs take and give
back the device's [...] part), and the programs donate them (updated in place). They travel in as few arrays as can
be (``Carry``: the keys and values, and one int32 vector a device for the rest), and a call's log-probabilities in
one (``pack_scored``): JAX's dispatch takes Python's interpreter lock back about once for every array a call
returns.

A handful of programs, whatever the slots and the prompts' lengths, all compiled by ``compile`` before any request
(each scans the layers: its compile time does not grow with depth):
- ``insert``: joining prompts read packed several to a row (first-fit decreasing, each dp shard's apart) into rows
  ``width`` wide, the widest prompt taken; one program per number of packed rows in ``insert_rows`` (1, 4, 16 ... and
  the slots per shard by default: every free slot of a shard can join in one insert);
- ``advance``: one per attention span (``spans`` of them: a step attends over the cache's first positions only, as
  far as the rows still writing have reached, which the host knows; a call picks the cheapest that holds its rows,
  ``span_for``);
- ``score``, for a family that scores its prompts (a causal LM: ``Family.scores_prompts``): one.

Calls only dispatch: each returns device arrays, read with ``fetch`` when the host needs them. Where each row is
and how it samples stay on the device (modelling/continuous.py's ``Rows`` and ``Sampling``), so ``advance`` needs from the
host only which rows it still holds, and the host dispatches call N + 1 before it reads call N's tokens.
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from decoder.grammar import HostMasks
from modelling import continuous, lora_stack, processors
from modelling.processors import RowControls
from modelling.rows import first_fit
from partitioning import sharding as S
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
    (jaxlib 0.10.2; benchmarks/probes/README.md), and in the server another thread (HTTP's) holds that lock in between:
    each array is a wait of the decoding thread. So the cache's floating-point leaves (its keys and values, updated
    in place: too big to copy each call; T5's cross-attention bias too) stay apart, one array each, and every other
    leaf, the cache's and the state's (a mask, positions, a few numbers a row), travels in one int32 vector a device,
    the leaves in turn (a bool as 0 or 1, a 4-byte type its bits). A leaf of another size stays apart, and so does a
    state leaf of more than one axis (a row's list: its processors' table, its history): the vector is written whole
    each call, a leaf apart in place.

    Built from one device's (abstract) cache and state; ``pack`` and ``unpack`` run inside the programs, on each
    device's pieces."""

    def __init__(self, cache, state):
        leaves, self.tree = jax.tree.flatten((cache, state))
        n_cache = len(jax.tree.leaves(cache))
        self.specs = [(tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves]
        self.packed = [(len(shape) <= 1 if i >= n_cache else not jnp.issubdtype(dt, jnp.floating))
                       and (dt == jnp.bool_ or dt.itemsize == 4) for i, (shape, dt) in enumerate(self.specs)]
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
    """``slots`` decoding rows of at most ``max_new_tokens`` new tokens after prompts of at most ``width`` tokens, with
    the decoder's weights on its mesh, the ``top`` most likely tokens' log-probabilities where a row asks (see the
    module docstring): the scheduler's Backend."""

    def __init__(self, decoder, slots: int, width: int, insert_rows: tuple, max_new_tokens: int, steps: int,
                 top: int = 20, spans: int = 1, adapters=None):
        if slots < 1 or slots % decoder.dp:
            raise ConfigError(f"--slots {slots} must be a positive multiple of data_parallel={decoder.dp} (the slots "
                              f"are split over dp): pass --slots {max(decoder.dp, slots - slots % decoder.dp)}")
        if spans < 1:
            raise ConfigError(f"--attention_spans {spans} must be at least 1 (1: every step attends over the whole "
                              "cache)")
        self.g, self.family, self.opts = decoder, decoder.family, decoder.opts
        self.slots, self.local, self.dp = slots, slots // decoder.dp, decoder.dp
        self.width = width  # the widest prompt an insert reads: its packed rows' width
        self.insert_rows = tuple(sorted({min(r, self.local) for r in insert_rows} | {self.local}))
        self.max_new_tokens, self.steps = max_new_tokens, steps
        self.eos_id, self.pad_id, self.vocab_size = decoder.eos_id, decoder.pad_id, decoder.opts.vocab_size
        self.n_tokens = decoder.n_tokens  # the ids a row may choose (the tokenizer's)
        # each row's processors (modelling/processors.py's RowControls): its history's places before its output, and
        # the host's answers for constrained rows (decoder/grammar.py)
        self.prompt_part = RowControls.prompt_part(self.family, width)
        self.masks = HostMasks(self.n_tokens, self.eos_id)
        self.top = max(1, min(top, decoder.opts.vocab_size))  # lax.top_k's k: at least 1, at most the vocabulary
        self.scores_prompts = self.family.scores_prompts
        self.score_rows = self.local * decoder.dp  # the prompts one ``score`` reads
        self.platform = decoder.mesh.devices.flat[0].platform
        self.rows = NamedSharding(decoder.mesh, P(S.DP))
        self.rows2 = NamedSharding(decoder.mesh, P(S.DP, None))
        self.pieces = NamedSharding(decoder.mesh, P(S.DP, S.TP))
        self.replicated = NamedSharding(decoder.mesh, P())
        self.params = self.carry = self.apart = self.words = None  # the Carry, and its arrays between calls
        self._insert, self._advance, self._score = {}, {}, None
        # the programs a constrained row runs (the host asked inside: ``masks``) apart, compiled after the others (on
        # a GPU or TPU a program that asks the host holds a JAX callback and is never written to JAX's compilation
        # cache, so a warm start would compile them all again; a CPU's ask through XLA's FFI: utils/host_call.py):
        # {("insert", rows) | ("advance", span): program}, the slots that hold a constrained row
        self._constrained: dict = {}
        self._compiling = threading.Lock()
        self._abstracts = None  # compile's abstract arguments, to lower the constrained programs with
        self.held_constraints = np.zeros(slots, bool)
        self.n_spans, self.spans = spans, ()  # the spans compiled (``compile``), ascending; the last the whole cache
        self.costs: dict = {}  # span -> seconds of its advance of 1 and of ``steps`` steps (``compile`` times them)
        self._keep = (None, None)  # (the host's last keep flags, their device copy)
        self._n: dict = {}  # steps an advance runs -> its device copy (a scalar)
        self._local = None  # _local_cache's
        # LoRA adapters served side by side (decoder/adapters.py's AdapterStack; None: the base alone): every program
        # reads the stack's arrays beside the weights, each row its slot's adapter (its index carried with its state)
        self.adapters = adapters

    @property
    def max_prompt(self) -> int:
        """The longest prompt (tokens) an insert reads."""
        return self.width

    @property
    def programs(self) -> int:
        """The programs compiled (``compile``)."""
        return len(self._insert) + len(self._advance) + (self._score is not None)

    # ------------------------------------------------------------------ the programs

    def _state_specs(self):
        """Every row's state: where it is, how it samples, its processors, and its adapter's slot in the stack (-1:
        none)."""
        return (continuous.Rows(*(P(S.DP),) * 4), continuous.Sampling(*(P(S.DP),) * 6),
                RowControls(*(P(S.DP),) * len(RowControls.__dataclass_fields__)), P(S.DP))

    def _weights(self):
        """What every program reads first: (the weights, the adapter stack's arrays or {})."""
        return self.params, ({} if self.adapters is None else self.adapters.arrays)

    def _weight_specs(self):
        return self.g.decode_specs(), ({} if self.adapters is None else self.adapters.decode_specs)

    def _scored_specs(self, lead: tuple):  # ``pack_scored``'s array
        return P(*lead, None)

    def _insert_program(self, rows: int, constrained: bool = False):
        family, opts, n, eos, top, width = (self.family, self.opts, self.max_new_tokens, self.eos_id, self.top,
                                            self.width)
        local, host = self.local, self.masks if constrained else None

        def fn(p, apart, words, joiners):
            block, at, lengths, slot, s, limit, controls, entries, adapter = unpack_joiners(joiners[0], rows, width,
                                                                                           local)
            w = lora_stack.bind(family.decoding_params(p[0], opts), p[1], adapter)  # (each joiner its adapter)
            cache, (r, smp, ctl, adapters) = self.carry.unpack(_local(apart), words[0, 0])
            first, scored, cache, state = continuous.insert(family, w, opts, cache, (r, smp, ctl), block, at, lengths,
                                                            slot, s, limit, n, eos, top, S.TP, controls, entries,
                                                            host, self.n_tokens)
            state = (*state, adapters.at[slot].set(adapter, mode="drop"))
            return (first, pack_scored(scored)) + _carried(self.carry.pack(cache, state))

        mapped = jax.shard_map(fn, mesh=self.g.mesh, check_vma=False,
                               in_specs=(self._weight_specs(), P(S.DP, S.TP), P(S.DP, S.TP), P(S.DP, None)),
                               out_specs=(P(S.DP), self._scored_specs((S.DP,)), P(S.DP, S.TP), P(S.DP, S.TP)))
        return jax.jit(mapped, donate_argnums=(1, 2))

    def _advance_program(self, span=None, constrained: bool = False):
        family, opts, steps, eos, pad, top = (self.family, self.opts, self.steps, self.eos_id, self.pad_id,
                                              self.top)
        host = self.masks if constrained else None

        def fn(p, apart, words, keep, n):
            cache, (r, smp, ctl, adapters) = self.carry.unpack(_local(apart), words[0, 0])
            w = lora_stack.bind(family.decoding_params(p[0], opts), p[1], adapters)  # (each row its adapter)
            out, scored, cache, state = continuous.advance(family, w, opts, cache, (r, smp, ctl), keep, steps, eos,
                                                           pad, top, S.TP, n, span, host, self.n_tokens,
                                                           self.prompt_part)
            return (out, pack_scored(scored)) + _carried(self.carry.pack(cache, (*state, adapters)))

        mapped = jax.shard_map(fn, mesh=self.g.mesh, check_vma=False,
                               in_specs=(self._weight_specs(), P(S.DP, S.TP), P(S.DP, S.TP), P(S.DP), P()),
                               out_specs=(P(S.DP, None), self._scored_specs((S.DP, None)), P(S.DP, S.TP),
                                          P(S.DP, S.TP)))
        return jax.jit(mapped, donate_argnums=(1, 2))

    def _score_program(self):
        family, opts, top = self.family, self.opts, self.top

        def fn(p, ids_mask):
            ids, mask = jnp.split(ids_mask[:, :-1], 2, axis=1)
            # each prompt's adapter (the last column), for each of its tokens (the prefill reads them row by row)
            w = lora_stack.bind(family.decoding_params(p[0], opts), p[1], jnp.repeat(ids_mask[:, -1], ids.shape[1]))
            return pack_scored(continuous.score_prompts(family, w, opts, ids, mask, top, S.TP))

        mapped = jax.shard_map(fn, mesh=self.g.mesh, check_vma=False,
                               in_specs=(self._weight_specs(), P(S.DP, None)),
                               out_specs=self._scored_specs((S.DP, None)))
        return jax.jit(mapped)

    def _cache_shapes(self):
        """The slots' cache, abstract: every leaf [dp, tp, ...] (each device's piece)."""
        family, opts, width, n, local = self.family, self.opts, self.width, self.max_new_tokens, self.local

        def fresh(p):
            ids = jnp.zeros((1, width), jnp.int32)
            where = jnp.zeros((local, width), jnp.int32)
            lengths = jnp.ones((local,), jnp.int32)
            _, cache = family.decode_start_packed(family.decoding_params(p, opts), ids, ids, ids, where, lengths,
                                                  opts, n, S.TP)
            return _stacked(cache)

        return jax.eval_shape(jax.shard_map(fresh, mesh=self.g.mesh, check_vma=False,
                                            in_specs=(self.g.decode_specs(),), out_specs=P(S.DP, S.TP)), self.params)

    def _empty_cache(self):
        """The slots' cache, all rows empty (zeros; their masks let nothing be read)."""
        shapes = self._cache_shapes()
        return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
                       out_shardings=self.pieces)()

    def _empty_state(self) -> tuple:
        """Every row empty: not writing, asking for no log-probabilities."""
        z = lambda dt, v=0: np.full(self.slots, v, dt)  # noqa: E731
        rows = continuous.Rows(z(np.int32), z(np.int32), z(np.int32), z(bool))
        sampling = continuous.Sampling(z(np.float32), z(np.int32), z(np.float32), z(np.uint32), z(np.uint32),
                                     z(np.int32, -1))
        history = self.prompt_part + self.max_new_tokens
        controls = RowControls(z(np.float32), z(np.float32), z(np.float32, 1), z(np.float32), z(bool), z(np.int32),
                               np.full((self.slots, processors.TABLE, 3), -1, np.int32),
                               np.full((self.slots, history), -1, np.int32))
        return jax.tree.map(lambda x: S.put_global(x, self.rows), (rows, sampling, controls, z(np.int32, -1)))

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
            self.carry = Carry(local, jax.tree.map(lambda x: jax.ShapeDtypeStruct((self.local,) + x.shape[1:], x.dtype),
                                                   state))

        def empty(st):
            return _carried(self.carry.pack(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), local), st))

        self.apart, self.words = jax.jit(jax.shard_map(empty, mesh=self.g.mesh, check_vma=False,
                                                       in_specs=(self._state_specs(),),
                                                       out_specs=(P(S.DP, S.TP), P(S.DP, S.TP))))(state)
        self._keep = (None, None)
        self.masks.clear()
        self.held_constraints[:] = False

    def _abstract(self, shape, dtype, sharding):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def compile(self, params) -> float:
        """The weights in decoding's layout (``Decoder.decode_shardings``: as ``Decoder.load_params`` gives them, else
        converted once), the empty cache, and every program compiled -> seconds."""
        t0 = time.perf_counter()
        g = self.g
        self.params = params if g.is_decoding_layout(params) else g.to_decoding(params)
        if self.adapters is not None and self.adapters.arrays is None:
            self.adapters.place()
        self.reset()
        weights = jax.tree.map(lambda x: self._abstract(x.shape, x.dtype, x.sharding), self._weights())
        apart, words = (jax.tree.map(lambda x: self._abstract(x.shape, x.dtype, x.sharding), t)
                        for t in (self.apart, self.words))
        keep = self._abstract((self.slots,), jnp.bool_, self.rows)
        n = self._abstract((), jnp.int32, self.replicated)
        self._abstracts = (weights, apart, words, keep, n)
        self._constrained = {}
        for rows in self.insert_rows:
            self._insert[rows] = self._lowered("insert", rows, False).compile()
        self.spans = attention_spans(self.family, self._local_cache(), self.n_spans)
        for span in self.spans:
            self._advance[span] = self._lowered("advance", span, False).compile()
        self.costs = self._time_spans() if len(self.spans) > 1 else {}
        if self.scores_prompts:
            ids_mask = self._abstract((self.score_rows, 2 * self.width + 1), jnp.int32, self.rows2)
            self._score = self._score_program().lower(weights, ids_mask).compile()
        seconds = time.perf_counter() - t0
        logger.info("compiled %d slot programs in %.1f s (%d slots, prompts up to %d tokens packed into %s rows an "
                    "insert, %d new tokens, attention spans %s)", self.programs, seconds, self.slots, self.width,
                    "/".join(map(str, self.insert_rows)), self.max_new_tokens, list(self.spans))
        return seconds

    def _lowered(self, kind: str, key, constrained: bool):
        """The insert program of ``key`` packed rows or the advance program of span ``key``, lowered."""
        weights, apart, words, keep, n = self._abstracts
        if kind == "insert":
            joiners = self._abstract((self.dp, joiner_words(key, self.width, self.local)), jnp.int32, self.rows2)
            return self._insert_program(key, constrained).lower(weights, apart, words, joiners)
        return self._advance_program(key, constrained).lower(weights, apart, words, keep, n)

    def constrained_program(self, kind: str, key):
        """The program a call runs when a slot holds a constrained row, compiled at its first need (or by
        ``compile_constrained``; one compile at a time, a caller waiting for one another thread runs)."""
        with self._compiling:
            if (kind, key) not in self._constrained:
                t0 = time.perf_counter()
                self._constrained[kind, key] = self._lowered(kind, key, True).compile()
                logger.debug("compiled the constrained %s program %s in %.1f s", kind, key, time.perf_counter() - t0)
            return self._constrained[kind, key]

    def compile_constrained(self) -> threading.Thread:
        """The constrained rows' programs compiled in a thread of their own (the server's: started once the others
        are, so that a structured output's first request finds them), -> the thread."""
        def run():
            t0 = time.perf_counter()
            try:
                for span in self.spans:
                    self.constrained_program("advance", span)
                for rows in self.insert_rows:
                    self.constrained_program("insert", rows)
            except Exception as e:  # noqa: BLE001 -- (a request that needs one compiles it, and fails, itself)
                logger.error("the constrained rows' programs did not compile: %s", e)
                return
            logger.info("compiled the constrained rows' %d slot programs in %.1f s", len(self._constrained),
                        time.perf_counter() - t0)

        thread = threading.Thread(target=run, name="compile constrained", daemon=True)
        thread.start()
        return thread

    # ------------------------------------------------------------------ calls (host arrays in, device arrays out)

    def insert(self, joiners: list) -> tuple:
        """Joining prompts into the slots: joiners [(slot, ids, sampling, limit[, controls[, adapter]])], ``slot`` a
        free slot, ``ids`` a prompt of at most ``width`` tokens, ``sampling`` its (temperature, top_k, drop_mass, seed,
        seed_hi, logprobs), ``limit`` its most tokens, ``controls`` its processors (``pack_joiners``; none: none),
        ``adapter`` the stack's slot of its LoRA adapter (-1 or none given: the base alone) -> (their first tokens,
        their Scored), on the device, in ``joiners``' order. Each dp
        shard's prompts are packed into the fewest rows ``width`` wide (first-fit decreasing) and read by the program
        of the fewest ``insert_rows`` that hold them. One host-to-device copy, whatever the joiners ask (each copy
        costs the host about a millisecond on a CPU, as much as the rest of the call)."""
        shards = [[] for _ in range(self.dp)]
        for k, (slot, ids, sampling, limit, *controls) in enumerate(joiners):
            if not 0 < len(ids) <= self.width:
                raise ValueError(f"a prompt of {len(ids)} tokens: an insert reads 1 to {self.width}")
            shards[slot // self.local].append((k, slot % self.local, ids, sampling, limit, *controls))
        for shard in shards:
            entries = sum(len(j[5][6]) for j in shard if len(j) > 5 and j[5] is not None)
            if entries > processors.TABLE:
                raise ValueError(f"joiners of {entries} table entries: an insert takes {processors.TABLE} a shard")
        placed = [first_fit([len(j[2]) for j in shard], self.width) for shard in shards]
        used = max([1] + [1 + max(r for r, _ in pl) for pl in placed if pl])
        rows = next(r for r in self.insert_rows if r >= used)
        packed = np.stack([pack_joiners(shard, pl, rows, self.width, self.local) for shard, pl in zip(shards, placed)])
        joining = [bool(more and more[0] is not None and more[0][5] > 0) for _, _, _, _, *more in joiners]
        self.held_constraints[[j[0] for j in joiners]] = joining  # (a grammar's key: the controls' sixth field)
        program = self._insert[rows] if not any(joining) else self.constrained_program("insert", rows)
        first, scored, self.apart, self.words = program(self._weights(), self.apart, self.words,
                                                        S.put_global(packed, self.rows2))
        order = np.zeros(len(joiners), np.int64)  # each joiner's row of the outputs ([dp, local] flattened)
        for d, shard in enumerate(shards):
            for j, (k, *_) in enumerate(shard):
                order[k] = d * self.local + j
        return Picked(first, order), PackedScored(scored, order)

    def first_token_column(self, prompt_length: int) -> int:
        """The cache column a row's first new token is written at, its prompt ``prompt_length`` tokens long (new
        token i at that + i): what ``advance``'s ``span`` counts in. 0 for a family whose steps read all of their
        cache (``Family.cache_positions`` None): its span is not read."""
        return 0 if self.spans[-1] is None else self.family.first_token_column(prompt_length)

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
        span = self.span_for(span, n)
        program = self._advance[span] if not self.held_constraints.any() else self.constrained_program("advance", span)
        if self._keep[0] is None or not np.array_equal(self._keep[0], keep):
            self._keep = (keep.copy(), S.put_global(keep, self.rows))
        if n not in self._n:
            self._n[n] = S.put_global(np.int32(n), self.replicated)
        out, scored, self.apart, self.words = program(self._weights(), self.apart, self.words, self._keep[1],
                                                      self._n[n])
        return out, PackedScored(scored)

    def score(self, prompts: list, adapters: list | None = None) -> "PackedScored":
        """The prompts' own log-probabilities: prompts (at most ``score_rows`` of them, each of at most ``width``
        tokens), ``adapters`` each one's adapter's slot (-1 or None: the base alone) -> their Scored [score_rows,
        width - 1] (row r, column c: prompt r's token c + 1), on the device."""
        ids = np.full((self.score_rows, self.width), self.pad_id, np.int32)
        mask = np.zeros((self.score_rows, self.width), np.int32)
        chosen = np.full((self.score_rows, 1), -1, np.int32)
        for r, p in enumerate(prompts):
            ids[r, :len(p)], mask[r, :len(p)] = p, 1
            chosen[r] = -1 if adapters is None else adapters[r]
        ids_mask = np.concatenate([ids, mask, chosen], axis=1)
        return PackedScored(self._score(self._weights(), S.put_global(ids_mask, self.rows2)))

    @staticmethod
    def fetch(x):
        """A call's device arrays (any tree of them, a Picked or a PackedScored) -> numpy (a PackedScored: a Scored
        of numpy arrays; both in their ``order``)."""
        def read(v):
            if isinstance(v, PackedScored):
                return unpack_scored(v.pick(S.fetch(v.array)))
            return v.pick(S.fetch(v.array)) if isinstance(v, Picked) else S.fetch(v)

        return jax.tree.map(read, x, is_leaf=lambda v: isinstance(v, (Picked, PackedScored)))


def attention_spans(family, cache, n: int) -> tuple:
    """The spans of ``n`` advance programs over one device's ``cache``: its positions (``continuous.cache_span``) in
    ``n`` equal parts, each rounded up to a multiple of 8, ascending, the last all of them; one span, all of them, for
    a family whose steps read all of their cache."""
    full = continuous.cache_span(family, cache)
    if full is None:
        return (None,)
    return tuple(sorted({min(full, -(-full * k // n // 8) * 8) for k in range(1, n + 1)}))


class Picked:
    """A call's rows on the device (an insert's first tokens), read in ``order`` (``SlotPrograms.fetch``)."""

    __slots__ = ("array", "order")

    def __init__(self, array, order=None):
        self.array, self.order = array, order

    def pick(self, x: np.ndarray) -> np.ndarray:
        return x if self.order is None else x[self.order]


class PackedScored(Picked):
    """A Scored on the device as ``pack_scored``'s one array (``SlotPrograms.fetch`` reads it back, in ``order``)."""


def pack_scored(s: continuous.Scored) -> jax.Array:
    """A Scored [...] as one int32 array [..., 1 + 2 top]: the logprob's bits, the top ids, the top logprobs' bits
    (one array a call returns, not three: ``Carry`` says why)."""
    return jnp.concatenate([_words(s.logprob)[..., None], s.top_ids, _words(s.top_logprobs)], axis=-1)


def unpack_scored(x: np.ndarray) -> continuous.Scored:
    """``pack_scored``'s array, fetched -> a Scored of numpy arrays."""
    top = (x.shape[-1] - 1) // 2
    return continuous.Scored(x[..., 0].view(np.float32), x[..., 1:1 + top], x[..., 1 + top:].view(np.float32))


JOINER_COLUMNS = 17  # a joiner's: its slot in its shard, where its prompt starts in the packed rows flattened, its
# length, top_k, seed, seed_hi (the seeds' bits), logprobs, limit, and the bits of temperature and drop_mass; then its
# processors' (modelling/processors.py's RowControls): the bits of presence, frequency, repetition and min_p,
# ignore_eos, its grammar's key; then its LoRA adapter's slot in the stack (-1: none)
ENTRY = 5  # an insert's table entry: the joiner's index in its shard's insert, its place in the row's table, the
# token id, the bias's bits, the token index it holds below (processors.joiner_table)
NO_CONTROLS = (0.0, 0.0, 1.0, 0.0, False, 0, ())  # a joiner that asks for no processor


def joiner_words(rows: int, width: int, local: int) -> int:
    """The int32 words of a shard's insert (``pack_joiners``)."""
    return 3 * rows * width + local * JOINER_COLUMNS + processors.TABLE * ENTRY


def pack_joiners(shard: list, placed: list, rows: int, width: int, local: int) -> np.ndarray:
    """What a shard's insert reads, in one int32 vector (``joiner_words`` long): the packed rows' ids, segment ids
    (from 1 in each row) and positions (from 0 in each prompt), each [rows, width], then ``local`` joiners of
    ``JOINER_COLUMNS`` (fillers: slot ``local``, length 0, no adapter), then ``processors.TABLE`` table entries of
    ``ENTRY`` (fillers: joiner ``local``, dropped). shard: [(k, slot in the shard, ids, sampling, limit[, controls[,
    adapter]])], controls (presence, frequency, repetition, min_p, ignore_eos, grammar key, ((token, bias, until),
    ...)) or None (none: ``NO_CONTROLS``), adapter the stack's slot of its LoRA adapter (-1 or none given: none);
    placed: each one's (row, column) (modelling/rows.py's ``first_fit``)."""
    block = np.zeros((3, rows, width), np.int32)
    cols = np.zeros((local, JOINER_COLUMNS), np.int32)
    cols[:, 0] = local  # fillers: a slot past the shard's, dropped
    cols[:, 16] = -1
    entries = np.zeros((processors.TABLE, ENTRY), np.int32)
    entries[:, 0] = local
    e = 0
    segment = np.zeros(rows, np.int32)
    bits = lambda x, dt: np.asarray(x, dt).view(np.int32)  # noqa: E731
    for j, ((_, slot, ids, sampling, limit, *more), (row, col)) in enumerate(zip(shard, placed)):
        n = len(ids)
        segment[row] += 1
        block[0, row, col:col + n], block[1, row, col:col + n], block[2, row, col:col + n] = ids, segment[row], \
            np.arange(n)
        temperature, top_k, drop_mass, seed, seed_hi, logprobs = sampling
        presence, frequency, repetition, min_p, ignore_eos, key, table = (more[0] if more and more[0] is not None
                                                                          else NO_CONTROLS)
        adapter = more[1] if len(more) > 1 else -1
        cols[j] = [slot, row * width + col, n, top_k, bits(seed, np.uint32), bits(seed_hi, np.uint32), logprobs, limit,
                   bits(temperature, np.float32), bits(drop_mass, np.float32), bits(presence, np.float32),
                   bits(frequency, np.float32), bits(repetition, np.float32), bits(min_p, np.float32), ignore_eos, key,
                   adapter]
        for k, (token, bias, until) in enumerate(table):
            entries[e] = [j, k, token, bits(bias, np.float32), until]
            e += 1
    return np.concatenate([block.ravel(), cols.ravel(), entries.ravel()])


def unpack_joiners(words, rows: int, width: int, local: int) -> tuple:
    """``pack_joiners``' vector (on the device) -> ((ids, segments, positions) [rows, width], at, lengths, slots,
    Sampling, limit, the joiners' processors (a RowControls without table and history), the table entries [TABLE,
    ENTRY], the joiners' adapters)."""
    block = words[:3 * rows * width].reshape(3, rows, width)
    end = 3 * rows * width + local * JOINER_COLUMNS
    cols = words[3 * rows * width:end].reshape(local, JOINER_COLUMNS)
    col = lambda i: cols[:, i]  # noqa: E731
    f32 = lambda i: _from_words(col(i), jnp.float32)  # noqa: E731
    s = continuous.Sampling(f32(8), col(3), f32(9), _from_words(col(4), jnp.uint32), _from_words(col(5), jnp.uint32),
                            col(6))
    controls = RowControls(f32(10), f32(11), f32(12), f32(13), col(14) != 0, col(15), None, None)
    entries = words[end:].reshape(processors.TABLE, ENTRY)
    return (block[0], block[1], block[2]), col(1), col(2), col(0), s, col(7), controls, entries, col(16)
