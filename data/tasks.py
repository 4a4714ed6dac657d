"""Tasks: how a row becomes an example (an input text and a target text, and for a label set the label), and what
is the same for every task: the row checks that name the row, the column and the columns present; the tokenizer
(loaded, learnt from the task's texts, its pad id); the examples in a model family's format; the held-out rows.

A task is data (the config's ``task`` section; MNLI's are its defaults): an input template over the row's columns
(or one input column), a target column, a label set when the target is a label, and the metrics that score it
(data/metrics.py). The family (modelling/family.py) says how an input and a target become tokens: T5 reads the
input with its encoder and writes the target with its decoder; GPT-J continues ``INPUT target:`` with
`` TARGET<|endoftext|>``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from config.schema import template_fields
from data.packing import Examples
from data import sources, synthetic
from data.sources import DataError, Rows
from utils.hub import fetch

logger = logging.getLogger("flan_t5")

TRAINED = "train"  # --tokenizer train: learn one from the training data (train_tokenizer)


@dataclass(frozen=True)
class Example:
    """One example: the input text (the template filled in), the target text (the label's word, or the target
    column) and the label's index in the task's label set (-1: free text)."""

    input: str
    target: str
    label: int = -1


class Task:
    """A config's ``task`` section, resolved: the columns it reads, its label set, its metrics (see the module
    docstring)."""

    def __init__(self, section):
        self.name, self.template, self.input_column = section.name, section.input_template, section.input_column
        self.target_column = section.target_column
        self.labels = tuple(section.labels) if section.labels is not None else None
        self.fields = [self.input_column] if self.input_column else template_fields(self.template)
        self.metrics = tuple(section.metrics) or (("accuracy",) if self.labels else ("exact_match", "rouge"))

    @classmethod
    def of_config(cls, cfg) -> "Task":
        return cls(cfg.task)

    @property
    def columns(self) -> list:
        """The columns a row must have: the input's, then the target's."""
        return list(dict.fromkeys(self.fields + [self.target_column]))

    def input_text(self, row: dict) -> str:
        return row[self.input_column] if self.input_column else self.template.format_map(row)

    # ------------------------------------------------------------------ rows -> examples

    def examples(self, rows: Rows, targets: bool = True) -> list:
        """The examples of rows, each checked; rows whose label is -1 (unlabelled) are dropped with a count in the
        log. ``targets=False``: inputs only (rows to predict), a target where there is one."""
        out, dropped = [], 0
        for i, row in enumerate(rows.rows):
            where = f"{rows.where}: row {i}" + (f" (line {rows.first_line + i})" if rows.first_line is not None
                                                 else "")
            ex = self._example(row, where, targets)
            if ex is None:
                dropped += 1
            else:
                out.append(ex)
        if dropped:
            logger.info("%s: dropped %d rows with label -1", rows.where, dropped)
        if not out:
            raise DataError(f"{rows.where}: " + ("every row has label -1: nothing to train or score" if dropped
                                                 else "no rows"))
        return out

    def _example(self, row: dict, where: str, targets: bool) -> Optional[Example]:
        for col in self.columns if targets else self.fields:
            if col not in row:
                raise DataError(f"{where}: column '{col}' is missing: the task reads {', '.join(self.columns)}; the "
                                f"row has {', '.join(map(str, row)) or 'no columns'}")
        for col in self.fields:
            _text(row[col], col, where)
        if self.target_column not in row or (not targets and _missing(row[self.target_column])):
            return Example(self.input_text(row), "")
        if self.labels is None:
            return Example(self.input_text(row), _text(row[self.target_column], self.target_column, where))
        label = self._label(row[self.target_column], where)
        return None if label == -1 else Example(self.input_text(row), self.labels[label], label)

    def _label(self, value, where: str) -> int:
        col, n = self.target_column, len(self.labels)
        try:
            label = parse_label(value, self.labels)
        except (ValueError, TypeError):
            raise DataError(f"{where}: column '{col}' must be {', '.join(map(str, range(n)))} (or -1 for unlabelled), "
                            f"or {', '.join(self.labels)}; got {value!r}") from None
        if label is None:
            raise DataError(f"{where}: column '{col}' is empty: give {', '.join(map(str, range(n)))} or a class name "
                            f"({', '.join(self.labels)}), or -1 for an unlabelled row")
        return label


def _missing(value) -> bool:
    return value is None or (isinstance(value, (float, np.floating)) and np.isnan(value))


def _text(value, col: str, where: str) -> str:
    if _missing(value) or (isinstance(value, str) and not value.strip()):
        raise DataError(f"{where}: column '{col}' is empty: give the {col} text, or remove the row")
    if not isinstance(value, str):
        raise DataError(f"{where}: column '{col}' must be text, got {value!r} ({type(value).__name__})")
    return value


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


def holdout(examples: list, n: int, seed: int) -> tuple:
    """(training examples, held-out examples): the last ``n`` of a fixed shuffle of ``seed`` are held out (the same
    split whenever the same data and seed are read: a resumed run, validation of its checkpoints)."""
    if n <= 0:
        return examples, []
    if n >= len(examples):
        raise DataError(f"--holdout {n} holds out every one of the {len(examples)} training examples: pass a "
                        f"smaller --holdout")
    order = np.random.default_rng([seed, 0x0d]).permutation(len(examples))
    keep, held = sorted(order[:-n]), sorted(order[-n:])
    return [examples[i] for i in keep], [examples[i] for i in held]


# --------------------------------------------------------------------------- tokens


def tokenize_examples(examples: list, tokenizer, family) -> Examples:
    """Input and target ids of every example (nothing truncated yet): the input of padding or packing
    (data/packing.py), in the family's format (``Family.prompt``, ``encode_inputs``, ``encode_targets``)."""
    inputs = family.encode_inputs(tokenizer, [family.prompt(e.input) for e in examples])
    targets = family.encode_targets(tokenizer, [e.target for e in examples])
    return Examples([np.asarray(x, np.int32) for x in inputs], [np.asarray(t, np.int32) for t in targets])


def tokenize_prompts(examples: list, tokenizer, family, length: Optional[int] = None, given: bool = False) -> dict:
    """Input ids and attention mask [n, length] as the family reads its input (right-padded with ``pad_id``;
    ``length`` None: padded to the longest, none cut). ``given``: each input is the whole prompt as written (a user's
    --prompt), not yet in the family's prompt format."""
    enc = family.encode_inputs(tokenizer, [e.input if given else family.prompt(e.input) for e in examples])
    length = length or max(len(x) for x in enc)
    ids = np.full((len(enc), length), pad_id(tokenizer), np.int32)
    mask = np.zeros((len(enc), length), np.int32)
    for i, x in enumerate(enc):
        x = x[:length]
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    return {"input_ids": ids, "attention_mask": mask}


def pad_id(tokenizer) -> int:
    """The id that pads a row and follows a finished output: the tokenizer's pad token, else its end-of-text token
    (what Hugging Face ``generate`` pads with when the model's config sets no pad token: GPT-J's and GPT-2's
    tokenizers have none). Padding is masked everywhere, so which id it is never changes a result."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    raise DataError("the tokenizer has neither a pad token nor an end-of-text token: give it one (e.g. "
                    "tokenizer.add_special_tokens({'eos_token': '</s>'}) and save_pretrained) or pass another "
                    "--tokenizer")


def train_tokenizer(examples: list, vocab_size: int, out_dir: str, family, labels: Optional[tuple] = None):
    """A BPE tokenizer learnt in seconds, no download, from the examples' inputs (as the family reads them) and
    targets: at most ``vocab_size`` tokens (the model's), <pad> 0, </s> 1, <unk> 2 as T5's, every character of the
    data in its alphabet (so no word of the data is unknown), saved to ``out_dir`` (a directory AutoTokenizer loads,
    which checkpoints name and validation uses). A label set's words are frequent: they become whole tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [family.prompt(e.input) for e in examples] + [e.target for e in examples] + list(labels or ())
    alphabet = sorted({c for t in texts for c in t if not c.isspace()} | {"\u2581"})  # + Metaspace's word marker
    specials = ["<pad>", "</s>", "<unk>"]
    if len(alphabet) + len(specials) + 1 > vocab_size:
        raise DataError(f"the training data has {len(alphabet)} distinct characters but vocab_size is {vocab_size}: "
                        f"a tokenizer needs at least {len(alphabet) + len(specials) + 1} tokens; raise --vocab_size")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                                        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out_dir)
    return fast


def load_tokenizer(name: str):
    """The tokenizer: 'synthetic' (the NLI task's offline word-level one) or an HF name/directory."""
    if name == "synthetic":
        return synthetic.make_tokenizer()
    if name == TRAINED:
        raise DataError("--tokenizer train learns a tokenizer from the training data: run_finetuning.py does that; "
                        "validation then uses the one saved with the checkpoint")
    from transformers import AutoTokenizer

    fix = ("pass --tokenizer train to learn one from the training data offline, or download it elsewhere "
           f"(huggingface-cli download {name} --local-dir DIR), copy DIR here and pass --tokenizer DIR")
    try:
        if os.path.isdir(name):
            return AutoTokenizer.from_pretrained(name)
        return fetch(lambda **kw: AutoTokenizer.from_pretrained(name, **kw), name, "tokenizer", fix, DataError)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"cannot load tokenizer '{name}' ({type(e).__name__}): {fix}") from None


def unknown_share(ids: list, tokenizer, sample: int = 5000) -> float:
    """The share of the token ids (a list of id sequences) that are the tokenizer's <unk> (0 without one)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    ids = ids[:sample]
    total = sum(len(x) for x in ids)
    if unk is None or not total:
        return 0.0
    return sum(int(np.sum(np.asarray(x) == unk)) for x in ids) / total


def check_unknown_tokens(examples: Examples, tokenizer, name: str, dataset: str, limit: float = 0.01) -> float:
    """The share of input tokens the tokenizer maps to <unk>; DataError above ``limit``, naming a tokenizer that
    fits (a word-level synthetic tokenizer turns other text into almost nothing but <unk>)."""
    share = unknown_share(examples.inputs, tokenizer)
    if share > limit:
        hint = ("the synthetic tokenizer knows only the synthetic NLI task's words: pass --tokenizer train to learn "
                "one from this data (offline, seconds), or the model's tokenizer, e.g. --tokenizer "
                "google/flan-t5-small (a hub name or a local directory) with a preset of that model"
                if name == "synthetic" else "pass the tokenizer of the model this data is for (--tokenizer "
                                            "NAME_OR_DIR)")
        raise DataError(f"{share:.0%} of the prompt tokens of {dataset} are unknown (<unk>) to tokenizer {name!r}: "
                        f"{hint}")
    return share


# --------------------------------------------------------------------------- what evaluation scores


@dataclass
class EvalSet:
    """The examples an evaluation scores and how to name them: ``name`` (the report's stem: a split, a file's
    stem, or heldout) and ``what`` (the result line's: which rows of which data)."""

    examples: list
    name: str
    what: str
    dataset: str
    single: bool = False


def evaluation_set(data, task: Task, seed: int) -> EvalSet:
    """The examples a run's evaluation scores (``data``: a config's data section): the rows held out of training
    (``holdout``), else the task's split (``split``); a single file is scored whole, whatever the split."""
    if data.holdout:
        rows = sources.read(data.dataset, data.train_split, seed, data.hub_config)
        _, held = holdout(task.examples(rows), data.holdout, seed)
        return EvalSet(held, "heldout", f"the {len(held)} rows of {rows.where} held out of training", data.dataset)
    rows = sources.read(data.dataset, data.split, seed, data.hub_config)
    examples = task.examples(rows)
    if rows.single:  # one file holds one set of rows, whatever --split says: name the file, not a split
        stem = os.path.splitext(os.path.basename(data.dataset))[0]
        return EvalSet(examples, stem, f"the rows of {data.dataset}", data.dataset, single=True)
    return EvalSet(examples, data.split, f"{rows.where}", data.dataset)
