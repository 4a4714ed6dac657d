"""Training rows of a model family, numpy only: how tokenized examples (an input's ids and a target's ids, each
ending where the model stops) become the batch the family reads. Each family owns one row format (``Family.rows``);
the data path (data/loader.py, data/generated.py, app/train_data.py) calls it and never asks which family it serves.

- ``Seq2SeqRows`` (T5): encoder rows of the inputs and decoder rows of the targets, padded (one example per row, the
  original's layout) or packed (several per row, as T5X packs seq2seq data).
- ``CausalRows`` (GPT-J): one sequence of prompt + target per example, padded or packed by segment, or the original's
  concatenated stream cut into rows (``concat``, as Hugging Face's run_clm).

Packed rows: every token carries a segment id (1, 2, ... the examples of its row; 0 padding) in ``attention_mask`` /
``decoder_attention_mask`` and a position that restarts at 0 in each segment (``positions`` /
``decoder_positions``). Each segment's decoder input is its target shifted right behind the start token (``<pad>``,
0), so a packed row trains on exactly what the same examples in padded rows would. Each example is first cut as the
padded layout cuts it: its prompt to ``sequence_length`` tokens, its target to ``target_length``.

``examples`` below is anything with ``inputs[i]`` and ``targets[i]`` (int arrays): data/packing.py's ``Examples``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

PAD = 0
IGNORE = -100


@dataclass(frozen=True)
class RowShape:
    """The lengths and options of training rows: ``sequence_length`` (encoder or causal row tokens),
    ``target_length`` (each target cut to it: decoder_sequence_length), ``decoder_length`` (a packed decoder row),
    ``packing``, ``concat`` (a causal LM's concatenated stream), ``loss_tokens`` (a causal LM's: all or target)
    and the ``pad_id`` of causal rows."""

    sequence_length: int
    target_length: int
    decoder_length: int
    packing: bool = False
    concat: bool = False
    loss_tokens: str = "all"
    pad_id: int = 0

    @classmethod
    def of_config(cls, cfg, pad_id: int = 0) -> "RowShape":
        return cls(cfg.model.sequence_length, cfg.model.decoder_sequence_length, cfg.decoder_row_length,
                   cfg.data.packing, cfg.data.packing and cfg.data.causal_packing == "concat", cfg.data.loss_tokens,
                   pad_id)


class RowFormat(abc.ABC):
    """How a family lays out its training rows (see the module docstring)."""

    @abc.abstractmethod
    def sizes(self, input_lengths: np.ndarray, target_lengths: np.ndarray, shape: RowShape) -> tuple:
        """(a, b) int arrays: the slots each example takes in a packed row (the two lengths a row has)."""

    @abc.abstractmethod
    def capacity(self, shape: RowShape) -> tuple:
        """(A, B): the slots of one packed row."""

    @abc.abstractmethod
    def padded(self, examples, idx, shape: RowShape) -> dict:
        """One example a row: {key: int32 [len(idx), length]}."""

    @abc.abstractmethod
    def packed(self, examples, rows: list, shape: RowShape) -> dict:
        """Packed rows (rows[r]: the example indices of row r, in order): {key: int32 [len(rows), length]}."""

    def streams(self, shape: RowShape) -> bool:
        """Whether rows are cut from one concatenated stream of examples (``stream_rows``) rather than filled."""
        return False

    def stream_rows(self, examples, stream, pending: tuple, n_rows: int, shape: RowShape) -> tuple:
        raise NotImplementedError("only a causal LM's rows are cut from a stream")

    @abc.abstractmethod
    def input_room(self, shape: RowShape) -> int:
        """The longest input a row holds beside a target of ``target_length`` (generated benchmark data)."""

    @abc.abstractmethod
    def decoder_row_length(self, shape: RowShape) -> int:
        """The decoder tokens of a row (0: one sequence)."""

    @abc.abstractmethod
    def template_room(self, template_tokens: int) -> tuple:
        """(the least sequence_length a row of this template needs, what else it must hold: '' or ' and the
        target')."""

    @abc.abstractmethod
    def truncation(self, inputs: np.ndarray, targets: np.ndarray, joint: np.ndarray, shape: RowShape) -> dict:
        """What the rows cut, from length histograms (``np.bincount`` of the input, target and input + target
        lengths): cut examples and targets, the longest of each, the limit and the flag that keeps them."""

    @abc.abstractmethod
    def describe(self, shape: RowShape) -> str:
        """The rows in words, for the log."""

    def stats(self, batch: dict) -> dict:
        """Examples and non-padding tokens of a batch (``batch_stats``)."""
        return batch_stats(batch)


def _longest(hist: np.ndarray) -> int:
    nz = np.flatnonzero(hist)
    return int(nz[-1]) if len(nz) else 0


def _over(hist: np.ndarray, limit: int) -> int:
    return int(hist[limit + 1:].sum())


class Seq2SeqRows(RowFormat):
    """An encoder-decoder's rows: encoder ids of the input, decoder ids of the target (T5)."""

    def sizes(self, input_lengths, target_lengths, shape):
        return np.minimum(input_lengths, shape.sequence_length), np.minimum(target_lengths, shape.target_length)

    def capacity(self, shape):
        return shape.sequence_length, shape.decoder_length

    def padded(self, examples, idx, shape):
        return pad_rows(examples, idx, shape.sequence_length, shape.target_length)

    def packed(self, examples, rows, shape):
        return pack_rows(examples, rows, shape.sequence_length, shape.target_length, shape.decoder_length)

    def input_room(self, shape):
        return shape.sequence_length

    def decoder_row_length(self, shape):
        return shape.decoder_length if shape.packing else shape.target_length

    def template_room(self, template_tokens):
        return template_tokens, ""

    def truncation(self, inputs, targets, joint, shape):
        L, T = shape.sequence_length, shape.target_length
        return {"cut_examples": _over(inputs, L), "longest_example": _longest(inputs), "cut_where": "their end",
                "cut_targets": _over(targets, T), "longest_target": _longest(targets), "target_limit": T,
                "target_flag": "decoder_sequence_length"}

    def describe(self, shape):
        return (f"{'packed' if shape.packing else 'padded'} rows of {shape.sequence_length}/"
                f"{self.decoder_row_length(shape)} tokens")


class CausalRows(RowFormat):
    """A causal LM's rows: prompt + target in one sequence, the loss on the next token (GPT-J)."""

    def sizes(self, input_lengths, target_lengths, shape):
        joint = np.minimum(np.asarray(input_lengths) + np.asarray(target_lengths), shape.sequence_length)
        return joint, np.zeros_like(joint)

    def capacity(self, shape):
        return shape.sequence_length, 0

    def padded(self, examples, idx, shape):
        return causal_rows(examples, [[i] for i in idx], shape.sequence_length, shape.loss_tokens, shape.pad_id)

    def packed(self, examples, rows, shape):
        return causal_rows(examples, rows, shape.sequence_length, shape.loss_tokens, shape.pad_id)

    def streams(self, shape):
        return shape.concat

    def stream_rows(self, examples, stream, pending, n_rows, shape):
        return concat_rows(examples, stream, pending, n_rows, shape.sequence_length, shape.loss_tokens)

    def input_room(self, shape):
        return max(shape.sequence_length - shape.target_length, 2)

    def decoder_row_length(self, shape):
        return 0

    def template_room(self, template_tokens):
        return template_tokens + 4, " and the target"

    def truncation(self, inputs, targets, joint, shape):
        L = shape.sequence_length
        return {"cut_examples": _over(joint, L), "longest_example": _longest(joint),
                "cut_where": "their start: the target is kept", "cut_targets": _over(targets, L),
                "longest_target": _longest(targets), "target_limit": L, "target_flag": "sequence_length"}

    def describe(self, shape):
        how = ("concat" if shape.concat else "segments") + "-packed" if shape.packing else "padded"
        return f"a causal LM, {how} rows of {shape.sequence_length} tokens, loss on {shape.loss_tokens} tokens"


# --------------------------------------------------------------------------- encoder-decoder rows


def _trim(examples, idx, sequence_length: int, target_length: int) -> tuple:
    return ([np.asarray(examples.inputs[i][:sequence_length], np.int32) for i in idx],
            [np.asarray(examples.targets[i][:target_length], np.int32) for i in idx])


def pad_rows(examples, idx, sequence_length: int, target_length: int) -> dict:
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


def pack_rows(examples, rows: list, sequence_length: int, target_length: int, decoder_length: int) -> dict:
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


def batch_stats(batch: dict) -> dict:
    """Examples and non-padding tokens of a batch {key: [..., length]} (packed or padded rows of either format)."""
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


def causal_tokens(examples, i: int, sequence_length: int) -> tuple:
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


def causal_rows(examples, rows: list, sequence_length: int, loss_tokens: str = "all", pad_id: int = 0) -> dict:
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


def concat_rows(examples, stream, pending: tuple, n_rows: int, sequence_length: int, loss_tokens: str = "all") -> tuple:
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


# --------------------------------------------------------------------------- prompts packed for decoding


def first_fit(lengths: list, width: int) -> list:
    """Prompts of ``lengths`` tokens (each at most ``width``) packed into rows ``width`` wide, first-fit decreasing (the
    longest first, each into the first row with room) -> [(row, column)] of each prompt, in the order given (its
    tokens from that column on)."""
    free, out = [], [None] * len(lengths)
    for k in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        row = next((r for r, f in enumerate(free) if f >= lengths[k]), None)
        if row is None:
            free.append(width)
            row = len(free) - 1
        out[k] = (row, width - free[row])
        free[row] -= lengths[k]
    return out


def pack_prompts(ids: np.ndarray, mask: np.ndarray, groups: int = 1, width: int | None = None, multiple: int = 1):
    """Right-padded prompt rows ids/mask [B, k] packed into fewer rows ``width`` wide (default k), for an encoder to read
    without its padding (decoding's first and largest cost: a batch of mixed lengths spends a third of the encoder
    on padding at MultiNLI-like lengths). The B rows come in ``groups`` equal groups (a device's share of the
    batch under data parallelism), each packed on its own by first-fit decreasing. -> None when packing saves no
    row, else (ids, segments, positions) [groups * P, width] (segment ids from 1, positions restarting at 0 in each
    prompt; zeros where nothing is packed) and ``where`` int32 [B, k]: for each prompt position, its index in its
    group's packed rows flattened (P * W), or P * W for padding (a row of zeros the reader appends). ``multiple``: P
    rounded up to a multiple of it (rows of nothing after the packed ones), so that batches of any lengths take few
    shapes: each is a program compiled."""
    b, k = ids.shape
    w = width or k  # the packed rows' width (a prompt's positions beyond k are never written)
    per = b // groups
    lengths = (mask > 0).sum(1)
    bins_of, counts = [], []
    for g in range(groups):
        rows = range(g * per, (g + 1) * per)
        placed = first_fit([int(lengths[r]) for r in rows], w)
        bins_of.append(dict(zip(rows, placed)))
        counts.append(1 + max(j for j, _ in placed))
    p = -(-max(counts) // multiple) * multiple
    if p >= per:
        return None
    out = {k: np.zeros((groups * p, w), np.int32) for k in ("ids", "segments", "positions")}
    where = np.full((b, k), p * w, np.int32)
    for g, place in enumerate(bins_of):
        seg = np.zeros(p, np.int32)
        for r, (j, start) in sorted(place.items()):
            n = int(lengths[r])
            row = g * p + j
            seg[j] += 1
            out["ids"][row, start: start + n] = ids[r, :n]
            out["segments"][row, start: start + n] = seg[j]
            out["positions"][row, start: start + n] = np.arange(n)
            where[r, :n] = j * w + start + np.arange(n)
    return out["ids"], out["segments"], out["positions"], where
