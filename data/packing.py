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
    if "decoder_input_ids" not in batch:  # causal rows: one sequence, its labels on the same tokens
        tokens = int(np.sum(mask > 0))
        return {"examples": examples, "tokens": tokens, "encoder_tokens": tokens, "decoder_tokens": 0,
                "packing_efficiency": tokens / mask.size, "encoder_fill": tokens / mask.size}
    enc_tokens, dec_tokens = int(np.sum(mask > 0)), int(np.sum(dec_mask))
    enc_slots, dec_slots = mask.size, dec_mask.size
    return {"examples": examples, "tokens": enc_tokens + dec_tokens, "encoder_tokens": enc_tokens,
            "decoder_tokens": dec_tokens, "packing_efficiency": (enc_tokens + dec_tokens) / (enc_slots + dec_slots),
            "encoder_fill": enc_tokens / enc_slots}


# --------------------------------------------------------------------------- causal-LM rows (GPT-J)
#
# A causal example is its prompt followed by its target (``mnli hypothesis: ... premise: ... target:``
# then `` LABEL<|endoftext|>``). A row holds input_ids, attention_mask (segment ids: 1, 2, ... 0 for
# padding), positions (restarting at 0 in each segment: the rotary positions) and labels: the next
# token of the same segment at each position (-100 where there is none, or, with loss_tokens
# "target", where the next token is part of the prompt).


def causal_tokens(examples: Examples, i: int, sequence_length: int) -> tuple:
    """(tokens, is_target) of example i: prompt + target, cut to the last ``sequence_length`` tokens (an
    over-long prompt loses its start, never its target)."""
    x, t = np.asarray(examples.inputs[i], np.int32), np.asarray(examples.targets[i], np.int32)
    tokens = np.concatenate([x, t])[-sequence_length:]
    is_target = np.concatenate([np.zeros(len(x), bool), np.ones(len(t), bool)])[-sequence_length:]
    return tokens, is_target


def _next_token_labels(tokens: np.ndarray, is_target: np.ndarray, loss_tokens: str) -> np.ndarray:
    labels = np.full(len(tokens), IGNORE, np.int32)
    labels[:-1] = tokens[1:]
    if loss_tokens == "target":
        labels[:-1][~is_target[1:]] = IGNORE
    return labels


def causal_rows(examples: Examples, rows: list, sequence_length: int, loss_tokens: str = "all",
                pad_id: int = 0) -> dict:
    """Causal rows: rows[r] lists the example indices of row r (one: padded; several: packed by segment).

    -> {key: int32 [len(rows), sequence_length]}: input_ids, attention_mask, positions, labels."""
    n, L = len(rows), sequence_length
    out = {"input_ids": np.full((n, L), pad_id, np.int32), "attention_mask": np.zeros((n, L), np.int32),
           "positions": np.zeros((n, L), np.int32), "labels": np.full((n, L), IGNORE, np.int32)}
    for r, idx in enumerate(rows):
        e = 0
        for seg, i in enumerate(idx, start=1):
            tokens, is_target = causal_tokens(examples, i, L)
            if e + len(tokens) > L:
                raise ValueError(f"row {r} overflows: examples {idx} do not fit {L} tokens")
            out["input_ids"][r, e: e + len(tokens)] = tokens
            out["attention_mask"][r, e: e + len(tokens)] = seg
            out["positions"][r, e: e + len(tokens)] = np.arange(len(tokens))
            out["labels"][r, e: e + len(tokens)] = _next_token_labels(tokens, is_target, loss_tokens)
            e += len(tokens)
    return out


def causal_packer(examples: Examples, sequence_length: int) -> "Packer":
    """A packer of whole causal examples (prompt + target) into rows of ``sequence_length`` tokens."""
    lengths = np.array([len(x) + len(t) for x, t in zip(examples.inputs, examples.targets)])
    return Packer(lengths, np.zeros_like(lengths), sequence_length, 1, 1)


def concat_rows(examples: Examples, stream, pending: tuple, n_rows: int, sequence_length: int,
                loss_tokens: str = "all") -> tuple:
    """The original's rows (as Hugging Face's run_clm): the examples' tokens concatenated and cut into rows of
    ``sequence_length``, attention and positions running across example boundaries (one segment a row).

    pending: (example, offset) of an example the previous batch cut, or (); stream: example indices.
    -> (rows {key: int32 [n_rows, sequence_length]}, the new pending (example, offset), examples started)."""
    L = sequence_length
    need = n_rows * L + 1  # one token more: the last position's label
    toks, targ, started, have, i, off = [], [], 0, 0, None, 0
    while have < need:
        if pending:
            (i, off), pending = pending, ()
        else:
            i, off = next(stream), 0
            started += 1
        tokens, is_target = causal_tokens(examples, i, 1 << 30)
        take = min(len(tokens) - off, need - have)
        toks.append(tokens[off: off + take])
        targ.append(is_target[off: off + take])
        have, off = have + take, off + take
    # the last token read is only a label here: the next batch starts with it
    cut = (i, off - 1)
    tokens, is_target = np.concatenate(toks), np.concatenate(targ)
    labels = _next_token_labels(tokens, is_target, loss_tokens)
    out = {"input_ids": tokens[:-1].reshape(n_rows, L).astype(np.int32),
           "attention_mask": np.ones((n_rows, L), np.int32),
           "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (n_rows, L)).copy(),
           "labels": labels[:-1].reshape(n_rows, L)}
    return out, cut, started
