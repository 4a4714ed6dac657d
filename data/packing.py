"""Tokenized examples and the packing of a stream of them into rows.

``Examples`` are ragged token ids (an input and a target per example): lists of arrays, ``Ragged`` arrays (one flat
token array and its offsets) or ``FileRagged`` ones (the same, read from the token cache's files as examples are
asked for: data/cache.py) that hold no Python object per example. ``Packer`` fills a fixed number of rows first-fit from a stream of examples, with the slots each example
takes as its family's row format says (modelling/rows.py); the rows themselves are built by that format
(modelling/rows.py: ``pad_rows``, ``pack_rows``, ``causal_rows``, ``concat_rows``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from utils.errors import FlanT5Error


class Ragged:
    """Sequences of int32 ids as one flat array and ``offsets`` [n + 1] (sequence i is flat[offsets[i]:offsets[i +
    1]]); both may be memory-mapped, and nothing is read until a sequence is."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray):
        self.flat, self.offsets = flat, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i) -> np.ndarray:
        return self.flat[self.offsets[i]: self.offsets[i + 1]]

    def lengths(self, idx) -> np.ndarray:
        idx = np.asarray(idx)
        return (self.offsets[idx + 1] - self.offsets[idx]).astype(np.int64)


class FileRagged:
    """``Ragged`` read from its files by offset (``os.pread``) as sequences are asked for: the sequences are never
    mapped, so the process holds only those it reads, however many the files hold (a memory map's pages, once
    touched, count in the process's resident memory, and the kernel maps 16 neighbouring pages on each touch). The
    offsets of fewer than ``OFFSETS_IN_MEMORY`` sequences (at most 4 MiB a file) are read once into memory: each
    sequence then costs one read, not two, and the packer's lengths are one array operation (a pread per sequence
    was a third of the training loop's Python time); more are read by offset too."""

    OFFSETS_IN_MEMORY = 1 << 19

    def __init__(self, flat_path: str, offsets_path: str, dtype, n: int):
        self.dtype, self.n, self.size = np.dtype(dtype), n, np.dtype(dtype).itemsize
        self.flat, self.offsets = os.open(flat_path, os.O_RDONLY), os.open(offsets_path, os.O_RDONLY)
        self.offs = np.fromfile(offsets_path, np.int64, count=n + 1) if n < self.OFFSETS_IN_MEMORY else None
        if self.offs is not None and len(self.offs) != n + 1:
            raise FlanT5Error(f"{offsets_path} holds {len(self.offs) - 1} sequences' offsets, not {n}: the cache is "
                              f"cut short; delete its folder ({os.path.dirname(offsets_path)}) to rebuild it")

    def __len__(self) -> int:
        return self.n

    def _bounds(self, i: int) -> np.ndarray:
        if self.offs is not None:
            return self.offs[int(i):int(i) + 2]
        return np.frombuffer(os.pread(self.offsets, 16, 8 * int(i)), np.int64)

    def __getitem__(self, i) -> np.ndarray:
        if not 0 <= i < self.n:
            raise IndexError(f"sequence {i} of {self.n}")
        a, b = self._bounds(i)
        return np.frombuffer(os.pread(self.flat, int(b - a) * self.size, int(a) * self.size), self.dtype)

    def lengths(self, idx) -> np.ndarray:
        idx = np.asarray(idx, np.int64).reshape(-1)
        if idx.size and not 0 <= idx.min() <= idx.max() < self.n:
            raise IndexError(f"sequences {idx.min()}..{idx.max()} of {self.n}")
        if self.offs is not None:
            return self.offs[idx + 1] - self.offs[idx]
        return np.array([np.diff(self._bounds(i))[0] for i in idx], np.int64)

    def __del__(self):
        for fd in (getattr(self, "flat", None), getattr(self, "offsets", None)):
            if fd is not None:
                os.close(fd)


def lengths(seqs, idx) -> np.ndarray:
    """The lengths of sequences ``idx`` of a list of arrays or a ``Ragged``."""
    if isinstance(seqs, (Ragged, FileRagged)):
        return seqs.lengths(idx)
    return np.array([len(seqs[i]) for i in np.asarray(idx).reshape(-1)], np.int64)


@dataclass
class Examples:
    """Tokenized examples: input ids and target ids, each ending in EOS (as the tokenizer adds it); lists of arrays
    or ``Ragged``."""

    inputs: object
    targets: object

    def __len__(self) -> int:
        return len(self.inputs)


class Packer:
    """Greedy first-fit of a stream of examples into a fixed number of rows.

    Examples are taken in stream order; each goes into the first row with room for both its sizes (a packed row has
    two lengths: encoder and decoder tokens, or a causal row's tokens and none). One that fits nowhere is held over
    to open the next batch (where rows are empty, so it fits). A batch is complete once ``max_misses`` examples in a
    row have not fitted (its rows are then nearly full), or the stream ends. Deterministic: a batch depends only on
    the held-over examples and the stream position, which a checkpoint saves.

    ``Packer(lengths, target_lengths, sequence_length, target_length, decoder_length)``: an encoder-decoder's sizes
    from length arrays; ``Packer.of_sizes(size, capacity)``: any row format's, ``size(i) -> (a, b)`` read when an
    example is placed (no per-example array is built).
    """

    def __init__(self, lengths=None, target_lengths=None, sequence_length: int = 0, target_length: int = 0,
                 decoder_length: int = 0, max_misses: int = 16):
        if lengths is not None:
            enc, dec = np.minimum(lengths, sequence_length), np.minimum(target_lengths, target_length)
            self.size = lambda i: (int(enc[i]), int(dec[i]))  # noqa: E731
        self.L, self.D, self.max_misses = sequence_length, decoder_length, max_misses

    @classmethod
    def of_sizes(cls, size, capacity: tuple, max_misses: int = 16) -> "Packer":
        packer = cls(max_misses=max_misses)
        packer.size, (packer.L, packer.D) = size, capacity
        return packer

    def fill(self, n_rows: int, pending: list, stream) -> tuple:
        """(rows: [[example index]], held over: [example index]) for one batch of ``n_rows`` rows.

        pending: examples held over by the previous batch (placed first); stream: an iterator of
        example indices, read only as far as needed."""
        free_e = [self.L] * n_rows
        free_d = [self.D] * n_rows
        rows: list = [[] for _ in range(n_rows)]
        held, misses = [], 0

        def place(i) -> bool:
            ne, nd = self.size(i)
            for r in range(n_rows):
                if free_e[r] >= ne and free_d[r] >= nd:
                    rows[r].append(i)
                    free_e[r] -= ne
                    free_d[r] -= nd
                    return True
            return False

        for i in pending:
            if not place(i):
                held.append(i)
        while misses < self.max_misses:
            i = next(stream, None)
            if i is None:
                break
            if place(i):
                misses = 0
            else:
                held.append(i)
                misses += 1
        return rows, held


def causal_packer(examples: Examples, sequence_length: int) -> Packer:
    """A packer of whole causal examples (prompt + target) into rows of ``sequence_length`` tokens."""
    n = np.arange(len(examples))
    joint = lengths(examples.inputs, n) + lengths(examples.targets, n)
    return Packer(joint, np.zeros_like(joint), sequence_length, 1, 1)
