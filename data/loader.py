"""Batches of the training data and of decoding: the resumable shuffled stream of training examples, padded or
packed into rows (data/packing.py), and length buckets for decoding."""

from __future__ import annotations

import numpy as np

from data.packing import Examples, Packer, causal_packer, causal_rows, concat_rows, pack_rows, pad_rows


class TrainLoader:
    """Deterministic shuffled global batches of ``rows`` rows, padded or packed; resumable.

    The examples are visited in a stream: epoch e in permutation(seed, e). Padded, batch k holds
    stream examples [k * rows, (k + 1) * rows), one per row. Packed, each batch takes as many
    examples as fit its rows (data/packing.py), the ones that did not fit held over to the next
    batch. ``state()`` (the stream position and the held-over examples) is saved in checkpoints;
    ``restore(state)`` continues with exactly the next batch.

    Batches are {key: int32 [gradient_accumulation, rows / gradient_accumulation, length]}; dp
    replica r takes rows [r * mb, (r + 1) * mb) of each micro-batch (the device_put split).

    ``causal`` (GPT-J): rows of prompt + target (data/packing.py's causal rows), packed by segment, or with
    ``causal_packing="concat"`` the original's concatenated stream cut into rows (``pending`` then holds the
    example the last row cut, and the offset to continue from).
    """

    def __init__(self, examples: Examples, rows: int, gradient_accumulation: int, seed: int = 0, *,
                 sequence_length: int, target_length: int, packing: bool = False, decoder_length: int | None = None,
                 causal: bool = False, causal_packing: str = "segments", loss_tokens: str = "all", pad_id: int = 0):
        self.examples, self.rows, self.ga, self.seed = examples, rows, gradient_accumulation, seed
        self.L, self.T = sequence_length, target_length
        self.packing = packing
        self.D = decoder_length or target_length
        self.causal, self.concat = causal, causal and packing and causal_packing == "concat"
        self.loss_tokens, self.pad_id = loss_tokens, pad_id
        self.position = 0  # stream examples consumed so far
        self.pending: list = []  # examples held over for the next packed batch
        if packing and causal:
            self.packer = causal_packer(examples, self.L)
        elif packing:
            self.packer = Packer.for_examples(examples, self.L, self.T, self.D)

    @property
    def size(self) -> int:
        return len(self.examples)

    def _stream(self, start: int):
        epoch, offset = divmod(start, self.size)
        while True:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            for i in perm[offset:]:
                yield int(i)
            epoch, offset = epoch + 1, 0

    def next_batch(self) -> dict:
        stream = self._stream(self.position)
        if self.concat:
            batch, pending, started = concat_rows(self.examples, stream, tuple(self.pending), self.rows, self.L,
                                                  self.loss_tokens)
            self.pending, self.position = list(pending), self.position + started
        elif self.packing:
            taken = [0]

            def counted():
                for i in stream:
                    taken[0] += 1
                    yield i

            rows, self.pending = self.packer.fill(self.rows, self.pending, counted())
            self.position += taken[0]
            if self.causal:
                batch = causal_rows(self.examples, rows, self.L, self.loss_tokens, self.pad_id)
            else:
                batch = pack_rows(self.examples, rows, self.L, self.T, self.D)
        else:
            idx = [next(stream) for _ in range(self.rows)]
            self.position += self.rows
            if self.causal:
                batch = causal_rows(self.examples, [[i] for i in idx], self.L, self.loss_tokens, self.pad_id)
            else:
                batch = pad_rows(self.examples, idx, self.L, self.T)
        return {k: v.reshape(self.ga, self.rows // self.ga, -1) for k, v in batch.items()}

    def state(self) -> dict:
        """What a checkpoint saves to resume the data exactly."""
        return {"data_position": self.position, "data_pending": list(self.pending)}

    def restore(self, meta: dict) -> None:
        self.position = int(meta["data_position"])
        self.pending = [int(i) for i in meta.get("data_pending", [])]


def length_buckets(lengths: np.ndarray, batch_size: int) -> list:
    """Index batches (sorted by length, so padding is small); the last may be short."""
    order = np.argsort(lengths, kind="stable")
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
