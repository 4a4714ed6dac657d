"""Batches of the training data and of decoding: the resumable shuffled stream of training examples (one task, or a
mixture of tasks with rates), laid out in rows by the family's row format (modelling/rows.py: padded, packed, or a
causal LM's concatenated stream), and length buckets for decoding.

Memory does not grow with the examples: they are memory-mapped token arrays (data/cache.py), an epoch's order of a
large set is computed position by position (``Shuffle``), and the held-out rows are the only per-example array.
"""

from __future__ import annotations

import numpy as np

from data.packing import Examples, Packer, lengths

SMALL = 1 << 20  # up to this many examples an epoch's order is numpy's permutation (as it always was), else Shuffle
BLOCK = 4096  # a mixture draws the tasks of this many stream positions at a time


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Shuffle:
    """A permutation of [0, n) computed position by position (no array of n): a four-round Feistel network over the
    smallest even power of two >= n keyed by ``key`` (ints), cycle-walked into [0, n)."""

    def __init__(self, n: int, key: tuple):
        self.n = n
        self.half = max(1, (int(n - 1).bit_length() + 1) // 2)
        seed = np.uint64(0)
        for k in key:
            seed = _mix(np.asarray(seed ^ np.uint64(k & 0xFFFFFFFFFFFFFFFF), np.uint64))
        with np.errstate(over="ignore"):
            self.keys = [_mix(np.asarray(seed + np.uint64(r + 1) * np.uint64(0x9E3779B97F4A7C15), np.uint64))
                         for r in range(4)]

    def _cipher(self, x: np.ndarray) -> np.ndarray:
        mask = np.uint64((1 << self.half) - 1)
        left, right = x >> np.uint64(self.half), x & mask
        with np.errstate(over="ignore"):
            for k in self.keys:
                left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(self.half)) | right

    def __call__(self, positions) -> np.ndarray:
        out = self._cipher(np.asarray(positions, np.uint64))
        walk = out >= self.n
        while walk.any():
            out[walk] = self._cipher(out[walk])
            walk = out >= self.n
        return out.astype(np.int64)


def epoch_order(n: int, key: list):
    """The order of one epoch of n examples: numpy's permutation of ``key`` up to ``SMALL`` examples, else a
    ``Shuffle`` of it; either is indexed by stream positions."""
    return np.random.default_rng(key).permutation(n) if n <= SMALL else Shuffle(n, tuple(key))


def holdout_indices(n: int, held: int, seed: int) -> np.ndarray:
    """The sorted indices of the ``held`` examples held out of n: the last ones of a fixed permutation of the seed
    (the same whenever the same data and seed are read: a resumed run, validation of its checkpoints); beyond
    ``SMALL`` examples a draw of ``held`` of them (no permutation of n)."""
    rng = np.random.default_rng([seed, 0x0d])
    if n <= SMALL:
        return np.sort(rng.permutation(n)[n - held:]) if held else np.zeros(0, np.int64)
    return np.sort(rng.choice(n, held, replace=False))


class TaskStream:
    """One task's training examples: its ``examples`` less the sorted ``held`` indices (held out of training);
    training example j is the j-th index not held."""

    def __init__(self, examples: Examples, held=None, name: str = ""):
        self.examples, self.name = examples, name
        self.held = np.asarray(held if held is not None else [], np.int64)
        self.gaps = self.held - np.arange(len(self.held))
        self.size = len(examples) - len(self.held)

    def index(self, j):
        """The example index of training example(s) j."""
        return j + np.searchsorted(self.gaps, j, side="right") if len(self.held) else j


class _Column:
    """``loader.view.inputs[g]``: the ids of global example g (a task's training example)."""

    def __init__(self, loader, which: str):
        self.loader, self.which = loader, which

    def __getitem__(self, g):
        t, i = self.loader.locate(g)
        return getattr(self.loader.tasks[t].examples, self.which)[i]


class TrainLoader:
    """Deterministic shuffled global batches of ``rows`` rows, in the row format ``fmt`` of a family
    (modelling/rows.py) with ``shape`` (its lengths and options); resumable.

    Each task's training examples are visited in a stream: epoch e in ``epoch_order`` of (seed, e) (a second task of
    a mixture: (seed, e, t)). One task: stream position p is its p-th example. A mixture (``rates``: a weight per
    task): position p takes its next example from a task drawn with probability rate / sum(rates), the draws a fixed
    function of (seed, p) (SeqIO's sampling). Padded, batch k holds positions [k * rows, (k + 1) * rows), one per
    row; packed, a batch takes as many as fit its rows (data/packing.py's Packer), those that did not fit held over
    to the next batch; a causal LM's concatenated stream keeps the example the last row cut. ``state()`` (the stream
    position, each task's position and the held-over examples) is saved in checkpoints; ``restore(state)`` continues
    with exactly the next batch.

    Examples are named by global ids: task t's training example j is ``starts[t] + j``.
    Batches are {key: int32 [gradient_accumulation, rows / gradient_accumulation, length]}; dp
    replica r takes rows [r * mb, (r + 1) * mb) of each micro-batch (the device_put split).
    """

    def __init__(self, tasks, rows: int, gradient_accumulation: int, seed: int = 0, *, fmt, shape, rates=None):
        tasks = tasks if isinstance(tasks, (list, tuple)) else [tasks]
        self.tasks = [t if isinstance(t, TaskStream) else TaskStream(t) for t in tasks]
        self.rows, self.ga, self.seed, self.fmt, self.shape = rows, gradient_accumulation, seed, fmt, shape
        self.starts = np.cumsum([0] + [t.size for t in self.tasks])
        if rates is not None and len(self.tasks) > 1:
            self.p = np.asarray(rates, np.float64) / float(np.sum(rates))
        else:
            self.p = None
        self.position = 0  # stream positions consumed so far
        self.task_positions = [0] * len(self.tasks)
        self.batch_tasks = None  # a mixture's: each task's examples in the last batch
        self.pending: list = []  # examples held over for the next batch (or the cut example and its offset)
        self.view = Examples(_Column(self, "inputs"), _Column(self, "targets"))
        self._orders, self._choices = {}, (None, None)
        self.packer = Packer.of_sizes(self._size, fmt.capacity(shape)) if shape.packing else None

    @property
    def size(self) -> int:
        return int(self.starts[-1])

    def locate(self, g: int) -> tuple:
        """(task, example index) of global id g."""
        t = int(np.searchsorted(self.starts, g, side="right")) - 1
        return t, int(self.tasks[t].index(g - int(self.starts[t])))

    def _size(self, g: int) -> tuple:
        t, i = self.locate(g)
        ex = self.tasks[t].examples
        a, b = self.fmt.sizes(lengths(ex.inputs, [i]), lengths(ex.targets, [i]), self.shape)
        return int(a[0]), int(b[0])

    def _task_at(self, p: int) -> int:
        if self.p is None:
            return 0
        block = p // BLOCK
        if self._choices[0] != block:
            rng = np.random.default_rng([self.seed, 0x6D6978, block])
            self._choices = (block, rng.choice(len(self.tasks), BLOCK, p=self.p))
        return int(self._choices[1][p % BLOCK])

    def _example(self, t: int, q: int) -> int:
        """The global id at position q of task t's stream."""
        size = self.tasks[t].size
        epoch, offset = divmod(q, size)
        if self._orders.get(t, (None,))[0] != epoch:
            self._orders[t] = (epoch, epoch_order(size, [self.seed, epoch] + ([t] if t else [])))
        order = self._orders[t][1]
        return int(self.starts[t]) + int(order([offset])[0] if isinstance(order, Shuffle) else order[offset])

    def _stream(self):
        """Global ids from the current position on; each read advances the position (and its task's)."""
        while True:
            t = self._task_at(self.position)
            g = self._example(t, self.task_positions[t])
            self.position += 1
            self.task_positions[t] += 1
            yield g

    def next_batch(self) -> dict:
        fmt, shape, stream = self.fmt, self.shape, self._stream()
        before = list(self.task_positions)
        if fmt.streams(shape):
            batch, pending, _ = fmt.stream_rows(self.view, stream, tuple(self.pending), self.rows, shape)
            self.pending = list(pending)
            ids = None
        elif shape.packing:
            rows, self.pending = self.packer.fill(self.rows, self.pending, stream)
            batch, ids = fmt.packed(self.view, rows, shape), [g for r in rows for g in r]
        else:
            ids = [next(stream) for _ in range(self.rows)]
            batch = fmt.padded(self.view, ids, shape)
        if len(self.tasks) > 1:  # each task's examples in the batch (a concatenated stream: those it started)
            self.batch_tasks = (np.diff([before, self.task_positions], axis=0)[0] if ids is None else
                                np.bincount(np.searchsorted(self.starts, ids, side="right") - 1,
                                            minlength=len(self.tasks)))
        return {k: v.reshape(self.ga, self.rows // self.ga, -1) for k, v in batch.items()}

    def stats(self, batch: dict) -> dict:
        """Examples and tokens of a batch (the row format's count); a mixture's last batch also each task's examples
        (``by_task``: examples_TASK)."""
        out = self.fmt.stats(batch)
        if self.batch_tasks is not None:
            out["by_task"] = {f"examples_{t.name}": int(k) for t, k in zip(self.tasks, self.batch_tasks)}
        return out

    def state(self) -> dict:
        """What a checkpoint saves to resume the data exactly."""
        out = {"data_position": self.position, "data_pending": [int(i) for i in self.pending]}
        if len(self.tasks) > 1:
            out["data_task_positions"] = list(self.task_positions)
        return out

    def restore(self, meta: dict) -> None:
        self.position = int(meta["data_position"])
        self.pending = [int(i) for i in meta.get("data_pending", [])]
        self.task_positions = [int(q) for q in meta.get("data_task_positions", [self.position])]


def length_buckets(lengths: np.ndarray, batch_size: int) -> list:
    """Index batches (sorted by length, so padding is small); the last may be short."""
    order = np.argsort(lengths, kind="stable")
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
