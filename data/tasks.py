"""Tasks: how a row becomes an example (an input text and a target text, and for a label set the label), and what
is the same for every task: the row checks that name the row, the column and the columns present; examples and
prompts as tokens in a model family's format (the tokenizer itself: data/tokenizer.py).

A task is data (the config's ``task`` section, or one task of a ``mixture``; MNLI's are the defaults): an input
template over the row's columns (or one input column), a target column, a label set when the target is a label, and
the metrics that score it (data/metrics.py). ``Task.render`` turns a batch of rows (columns of values, as
``Dataset.map(batched=True)`` gives them) into input and target texts and labels, applying data/sources.py's typing
rule: a number where text is expected is its text, in every format. The family (modelling/family.py) says how an
input and a target become tokens: T5 reads the input with its encoder and writes the target with its decoder; GPT-J
continues ``INPUT target:`` with `` TARGET<|endoftext|>``.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import string
from dataclasses import dataclass
from typing import Optional

import numpy as np

from config.schema import template_fields
from data.packing import Examples
from data.tokenizer import pad_id
from utils.errors import DataError

logger = logging.getLogger("flan_t5")

@dataclass(frozen=True)
class Example:
    """One example: the input text (the template filled in), the target text (the label's word, or the target
    column) and the label's index in the task's label set (-1: free text)."""

    input: str
    target: str
    label: int = -1


def _positional(template: str, fields: list) -> str:
    """``template`` with its {column} fields numbered in ``fields``' order (str.format of a row's values)."""
    out = []
    for literal, name, spec, conversion in string.Formatter().parse(template):
        out.append(literal.replace("{", "{{").replace("}", "}}"))
        if name is not None:
            out.append("{" + str(fields.index(name)) + (f"!{conversion}" if conversion else "")
                       + (f":{spec}" if spec else "") + "}")
    return "".join(out)


class Task:
    """A config's ``task`` section (or a mixture's task), resolved: the columns it reads, its label set, its metrics
    (see the module docstring)."""

    def __init__(self, section):
        self.name, self.template, self.input_column = section.name, section.input_template, section.input_column
        self.target_column = section.target_column
        self.labels = tuple(section.labels) if section.labels is not None else None
        self.fields = ([self.input_column] if self.input_column
                       else list(dict.fromkeys(template_fields(self.template))))
        self.metrics = tuple(section.metrics) or (("accuracy",) if self.labels else ("exact_match", "rouge"))
        self._format = "{0}" if self.input_column else _positional(self.template, self.fields)

    @property
    def columns(self) -> list:
        """The columns a row must have: the input's, then the target's."""
        return list(dict.fromkeys(self.fields + [self.target_column]))

    def definition(self) -> dict:
        """What decides the examples of a row (the caches are keyed by it)."""
        return {"template": None if self.input_column else self.template, "input_column": self.input_column,
                "target_column": self.target_column, "labels": list(self.labels) if self.labels else None}

    def input_text(self, row: dict) -> str:
        return self._format.format(*(row[f] for f in self.fields))

    # ------------------------------------------------------------------ rows -> examples

    def render(self, batch: dict, start: int, where: str, first_line: Optional[int] = None,
               targets: bool = True, kept: Optional[list] = None) -> dict:
        """{input: [str], target: [str], label: [int]} of a batch of rows ({column: [values]}, the first being row
        ``start`` of ``where``), each checked (DataError naming the row, its line, the column and the row's columns);
        rows labelled -1 (unlabelled) are left out (``kept``: a list given gets the indices of the rows kept).
        ``targets=False``: inputs only (rows to predict), the target where there is one."""
        out = self._render(batch, start, where, first_line, targets)
        rows = out.pop("_kept", None)
        if kept is not None:
            kept += list(range(start, start + len(out["input"]))) if rows is None else rows
        return out

    def _render(self, batch: dict, start: int, where: str, first_line: Optional[int], targets: bool) -> dict:
        n = len(next(iter(batch.values()))) if batch else 0
        at = _Where(batch, start, where, first_line, self, targets)
        need = self.columns if targets else self.fields
        for col in need:
            if col not in batch:
                at.missing(0, col)
        cols = [_texts(batch[c], c, at) for c in self.fields]
        inputs = cols[0] if self.input_column else [self._format.format(*vals) for vals in zip(*cols)]
        values = batch.get(self.target_column, [None] * n)
        given = list(range(n)) if targets else [k for k, v in enumerate(values) if not _missing(v) and v != ""]
        tgt, labels = [""] * n, [-1] * n  # rows to predict without a target: none
        if self.labels is None:
            texts = _texts([values[k] for k in given], self.target_column, at, given)
            for k, text in zip(given, texts):
                tgt[k] = text
            return {"input": inputs, "target": tgt, "label": labels}
        dropped = []
        ints = [values[k] for k in given]
        if targets and ints and all(type(v) is int for v in ints) and -1 < min(ints) and max(ints) < len(self.labels):
            return {"input": inputs, "target": [self.labels[v] for v in ints], "label": ints}  # the usual column
        for k in given:
            labels[k] = self._label(values[k], at, k)
            tgt[k] = self.labels[labels[k]] if labels[k] != -1 else dropped.append(k) or ""
        if not dropped:
            return {"input": inputs, "target": tgt, "label": labels}
        keep = sorted(set(range(n)) - set(dropped))
        return {"input": [inputs[k] for k in keep], "target": [tgt[k] for k in keep],
                "label": [labels[k] for k in keep], "_kept": [start + k for k in keep]}

    def examples(self, rows, targets: bool = True, kept: Optional[list] = None) -> list:
        """The examples of rows (data/sources.py's ``Rows``; small sets: evaluation, prediction), each checked as
        ``render`` checks it; rows whose label is -1 (unlabelled) are dropped with a count in the log (``kept``: a
        list given gets each example's row index)."""
        out = []
        for start, batch in rows.batches():
            r = self.render(batch, start, rows.where, rows.first_line, targets, kept)
            out += [Example(*e) for e in zip(r["input"], r["target"], r["label"])]
        dropped = len(rows) - len(out)
        if dropped:
            logger.info("%s: dropped %d rows with label -1", rows.where, dropped)
        if not out:
            raise DataError(f"{rows.where}: " + ("every row has label -1: nothing to train or score" if dropped
                                                 else "no rows"))
        return out

    def _label(self, value, at: "_Where", k: int) -> int:
        col, n = self.target_column, len(self.labels)
        try:
            label = parse_label(value, self.labels)
        except (ValueError, TypeError):
            raise DataError(f"{at(k)}: column '{col}' must be {', '.join(map(str, range(n)))} (or -1 for "
                            f"unlabelled), or {', '.join(self.labels)}; got {value!r}: fix the row, or, if the "
                            f"'{col}' column is free text rather than a label, pass --labels none") from None
        if label is None:
            if value is None:
                at.missing(k, col)
            raise DataError(f"{at(k)}: column '{col}' is empty: give {', '.join(map(str, range(n)))} or a class "
                            f"name ({', '.join(self.labels)}), or -1 for an unlabelled row")
        return label


class _Where:
    """Where row k of a batch is, for messages: ``FILE: row I (line L)``."""

    def __init__(self, batch: dict, start: int, where: str, first_line, task: Task, targets: bool = True):
        self.batch, self.start, self.where, self.first_line, self.task = batch, start, where, first_line, task
        self.targets = targets  # whether the rows need their target (training, scoring) or not (rows to predict)

    def __call__(self, k: int) -> str:
        i = self.start + k
        return f"{self.where}: row {i}" + (f" (line {self.first_line + i})" if self.first_line is not None else "")

    def missing(self, k: int, col: str):
        has = [str(c) for c, v in self.batch.items() if v[k] is not None] if self.batch else []
        if self.batch and col in self.batch and self.null_in_file(k, col) is not False:  # a null: the row has it
            raise DataError(f"{self(k)}: column '{col}' is null" + ("" if self.null_in_file(k, col) else
                                                                    " (or absent from this row)")
                            + f": give the {col}, or remove the row")
        reads = (f"the task reads {', '.join(self.task.columns)}" if self.targets else
                 f"the task's input reads {', '.join(self.task.fields)} (its target column, "
                 f"{self.task.target_column}, is not needed to predict)")
        raise DataError(f"{self(k)}: column '{col}' is missing: {reads}; the row has {', '.join(has) or 'no columns'}")

    def null_in_file(self, k: int, col: str) -> Optional[bool]:
        """Whether row k of a JSON-lines file names ``col`` with a null (Arrow reads a null and an absent key alike);
        None where the file cannot tell (another format)."""
        if self.first_line is None or not str(self.where).endswith(".jsonl") or not os.path.isfile(self.where):
            return None
        with open(self.where) as f:
            line = next(itertools.islice(f, self.first_line + self.start + k - 1, None), "")
        try:
            return col in json.loads(line)
        except ValueError:
            return None


def _as_text(value, col: str, at: _Where, k: int) -> str:
    """The typing rule (data/sources.py): text as it is, a number as its text, anything else refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise DataError(f"{at(k)}: column '{col}' must be text, got {value!r} ({type(value).__name__}): write it as "
                        "text (a string), or fix the column the task reads")
    if isinstance(value, (float, np.floating)):
        if math.isnan(value):
            return ""
        return str(int(value)) if float(value).is_integer() and abs(value) < 1e16 else repr(float(value))
    return str(int(value))


def _texts(values: list, col: str, at: _Where, rows: Optional[list] = None) -> list:
    """A text column of a batch under the typing rule, every value non-empty (``rows``: the batch rows the values
    are of, when not all)."""
    rows = rows if rows is not None else range(len(values))
    out = values if all(type(v) is str for v in values) else [
        at.missing(k, col) if v is None else _as_text(v, col, at, k) for k, v in zip(rows, values)]
    for k, v in zip(rows, out):
        if not v or v.isspace():
            raise DataError(f"{at(k)}: column '{col}' is empty: write its text, or remove the row")
    return out


def _missing(value) -> bool:
    return value is None or (isinstance(value, (float, np.floating)) and np.isnan(value))


def parse_label(value, labels: tuple):
    """A label cell -> its index in ``labels`` (or -1: unlabelled); a label word is accepted beside the number. None
    for an empty cell; ValueError for anything else."""
    if _missing(value) or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, (bool, np.bool_)):
        raise ValueError
    if isinstance(value, str):
        text = value.strip()
        for i, word in enumerate(labels):
            if text.lower() == word.lower():
                return i
        value = float(text)  # "1", "1.0"; ValueError otherwise
    if isinstance(value, (float, np.floating)):
        if not float(value).is_integer():
            raise ValueError
        value = int(value)
    if not isinstance(value, (int, np.integer)) or not -1 <= value < len(labels):
        raise ValueError
    return int(value)


# --------------------------------------------------------------------------- tokens


def tokenize_examples(examples: list, tokenizer, family) -> Examples:
    """Input and target ids of every example (nothing truncated yet): the input of padding or packing
    (data/packing.py), in the family's format (``Family.prompt``, ``encode_inputs``, ``encode_targets``)."""
    inputs = family.encode_inputs(tokenizer, [family.prompt(e.input) for e in examples])
    targets = family.encode_targets(tokenizer, [e.target for e in examples])
    return Examples([np.asarray(x, np.int32) for x in inputs], [np.asarray(t, np.int32) for t in targets])


def tokenize_prompts(examples: list, tokenizer, family, length: Optional[int] = None, given: bool = False) -> dict:
    """Input ids and attention mask [n, length] as the family reads its input (right-padded with ``pad_id``;
    ``length`` None: padded to the longest, none cut). ``given``: each input is the whole prompt as written (a raw
    continuation, as the server's /v1/completions reads one), not put in the family's prompt format."""
    enc = family.encode_inputs(tokenizer, [e.input if given else family.prompt(e.input) for e in examples])
    length = length or max(len(x) for x in enc)
    ids = np.full((len(enc), length), pad_id(tokenizer), np.int32)
    mask = np.zeros((len(enc), length), np.int32)
    for i, x in enumerate(enc):
        x = x[:length]
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    return {"input_ids": ids, "attention_mask": mask}
