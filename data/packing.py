"""Training rows from tokenized examples: padded (one example per row) or packed (several per row).

A packed row of ``sequence_length`` encoder tokens and ``decoder_length`` decoder tokens holds
several examples, as T5X packs seq2seq data. Every token carries a segment id (1, 2, ... the
examples of its row; 0 padding) in ``attention_mask`` / ``decoder_attention_mask``, and a
position that restarts at 0 in each segment (``positions`` / ``decoder_positions``). Each
segment's decoder input is its target shifted right behind the start token (``<pad>``, 0), so
a packed row trains on exactly what the same examples in padded rows would: the model keeps
attention inside a segment and takes relative positions from the per-segment positions.

Each example is first truncated as the padded layout truncates it: its prompt to
``sequence_length`` tokens, its target to ``target_length``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PAD = 0
IGNORE = -100


@dataclass
class Examples:
    """Tokenized examples, ragged: prompt ids and target ids, each ending in EOS (as the tokenizer adds it)."""

    inputs: list
    targets: list

    def __len__(self) -> int:
        return len(self.inputs)


def _trim(examples: Examples, idx, sequence_length: int, target_length: int) -> tuple:
    return ([np.asarray(examples.inputs[i][:sequence_length], np.int32) for i in idx],
            [np.asarray(examples.targets[i][:target_length], np.int32) for i in idx])


def pad_rows(examples: Examples, idx, sequence_length: int, target_length: int) -> dict:
    """One example per row, padded: {key: int32 [len(idx), length]} (the original's layout).

    attention_mask / decoder_attention_mask are 1 on tokens, 0 on padding; labels are -100 on padding.
    """
    inputs, targets = _trim(examples, idx, sequence_length, target_length)
    n = len(inputs)
    out = {k: np.zeros((n, sequence_length), np.int32) for k in ("input_ids", "attention_mask")}
    out.update({k: np.zeros((n, target_length), np.int32) for k in ("decoder_input_ids", "decoder_attention_mask")})
    out["labels"] = np.full((n, target_length), IGNORE, np.int32)
    for r, (x, t) in enumerate(zip(inputs, targets)):
        out["input_ids"][r, : len(x)] = x
        out["attention_mask"][r, : len(x)] = 1
        out["labels"][r, : len(t)] = t
        out["decoder_attention_mask"][r, : len(t)] = 1
        out["decoder_input_ids"][r, 1: len(t)] = t[:-1]
        if len(t) < target_length:  # the padded layout's decoder input continues with the last target token
            out["decoder_input_ids"][r, len(t)] = t[-1] if len(t) else PAD
    return out


def pack_rows(examples: Examples, rows: list, sequence_length: int, target_length: int,
              decoder_length: int) -> dict:
    """Packed rows: rows[r] lists the example indices of row r, in order.

    -> {key: int32 [len(rows), length]}: input_ids, attention_mask (segment ids), positions,
    decoder_input_ids, decoder_attention_mask (segment ids), decoder_positions, labels (-100 padding).
    """
    n = len(rows)
    enc = {k: np.zeros((n, sequence_length), np.int32) for k in ("input_ids", "attention_mask", "positions")}
    dec = {k: np.zeros((n, decoder_length), np.int32)
           for k in ("decoder_input_ids", "decoder_attention_mask", "decoder_positions")}
    labels = np.full((n, decoder_length), IGNORE, np.int32)
    for r, idx in enumerate(rows):
        inputs, targets = _trim(examples, idx, sequence_length, target_length)
        e = d = 0
        for seg, (x, t) in enumerate(zip(inputs, targets), start=1):
            if e + len(x) > sequence_length or d + len(t) > decoder_length:
                raise ValueError(f"row {r} overflows: examples {idx} do not fit {sequence_length}/{decoder_length}")
            enc["input_ids"][r, e: e + len(x)] = x
            enc["attention_mask"][r, e: e + len(x)] = seg
            enc["positions"][r, e: e + len(x)] = np.arange(len(x))
            labels[r, d: d + len(t)] = t
            dec["decoder_input_ids"][r, d + 1: d + len(t)] = t[:-1]  # start token (0) first in every segment
            dec["decoder_attention_mask"][r, d: d + len(t)] = seg
            dec["decoder_positions"][r, d: d + len(t)] = np.arange(len(t))
            e, d = e + len(x), d + len(t)
    return {**enc, **dec, "labels": labels}


class Packer:
    """Greedy first-fit of a stream of examples into a fixed number of rows.

    Examples are taken in stream order; each goes into the first row with room for both its prompt
    and its target. One that fits nowhere is held over to open the next batch (where rows are
    empty, so it fits). A batch is complete once ``max_misses`` examples in a row have not fitted
    (its rows are then nearly full), or the stream ends. Deterministic: a batch depends only on
    the held-over examples and the stream position, which a checkpoint saves.
    """

    def __init__(self, lengths: np.ndarray, target_lengths: np.ndarray, sequence_length: int, target_length: int,
                 decoder_length: int, max_misses: int = 16):
        self.enc = np.minimum(lengths, sequence_length)
        self.dec = np.minimum(target_lengths, target_length)
        self.L, self.D, self.max_misses = sequence_length, decoder_length, max_misses

    @classmethod
    def for_examples(cls, examples: Examples, sequence_length: int, target_length: int, decoder_length: int):
        """A packer of these examples' prompts and targets."""
        return cls(np.array([len(x) for x in examples.inputs]), np.array([len(t) for t in examples.targets]),
                   sequence_length, target_length, decoder_length)

    def fill(self, n_rows: int, pending: list, stream) -> tuple:
        """(rows: [[example index]], held over: [example index]) for one batch of ``n_rows`` rows.

        pending: examples held over by the previous batch (placed first); stream: an iterator of
        example indices, read only as far as needed."""
        free_e = [self.L] * n_rows
        free_d = [self.D] * n_rows
        rows: list = [[] for _ in range(n_rows)]
        held, misses = [], 0

        def place(i) -> bool:
            ne, nd = self.enc[i], self.dec[i]
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


def batch_stats(batch: dict) -> dict:
    """Examples and non-padding tokens of a batch {key: [..., length]} (packed or padded rows)."""
    mask, dec_mask = np.asarray(batch["attention_mask"]), np.asarray(batch["labels"]) != IGNORE
    rows = mask.reshape(-1, mask.shape[-1])
    examples = int(np.sum(rows.max(axis=-1)))  # segment ids count 1..k in each row (1 for a padded row)
    enc_tokens, dec_tokens = int(np.sum(mask > 0)), int(np.sum(dec_mask))
    enc_slots, dec_slots = mask.size, dec_mask.size
    return {"examples": examples, "tokens": enc_tokens + dec_tokens, "encoder_tokens": enc_tokens,
            "decoder_tokens": dec_tokens, "packing_efficiency": (enc_tokens + dec_tokens) / (enc_slots + dec_slots),
            "encoder_fill": enc_tokens / enc_slots}
