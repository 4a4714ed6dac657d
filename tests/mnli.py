"""MNLI, the original apps' task, as the tests read it: its definition is the config's ``task`` defaults (the template
``mnli hypothesis: {hypothesis} premise: {premise}``, the label column mapped to entailment, neutral, contradiction,
accuracy), and these helpers give its rows and reports in the original's shape: rows {premise, hypothesis, label},
and the accuracy report with per-class counts. Everything here is the generic task code (data/tasks.py,
data/sources.py, data/metrics.py) with MNLI's definition; the library itself never needs it (it lived in data/ and
only tests used it).

Prompt formats of the original apps. T5: encoder ``mnli hypothesis: {hypothesis} premise: {premise}``, target
``{class_label}``; the decoder input is the target shifted right behind a ``<pad>`` start token, and padded label
positions are -100. GPT-J (a causal LM): ``mnli hypothesis: ... premise: ... target:`` continued by
`` {class_label}<|endoftext|>`` (the tokenizer's end-of-text token).
"""

from __future__ import annotations

from config.schema import Task as TaskSection
from data import metrics, sources
from data.packing import Examples
from data.tasks import Example, Task, parse_label, tokenize_prompts
from data.tasks import tokenize_examples as _tokenize
from data.tokenizer import train_tokenizer as _train_tokenizer
from modelling.rows import pad_rows

MNLI = Task(TaskSection())  # the config's task defaults
CLASS_LABELS = list(MNLI.labels)
COLUMNS = ("premise", "hypothesis", "label")


def prompt(hypothesis: str, premise: str) -> str:
    return MNLI.input_text({"hypothesis": hypothesis, "premise": premise})


def validate_rows(rows, source: str, first_line: int | None = None) -> list:
    """MNLI rows {premise, hypothesis, label} (a list of dicts or a datasets.Dataset) checked by the task (errors
    name the row, its line and the column; numbers are read as their text, as every task reads them); label -1 rows
    (unlabelled) dropped with a count in the log."""
    examples = MNLI.examples(sources.Rows(rows, source, first_line))
    out = []
    for _, batch in sources.Rows(rows, source, first_line).batches():
        out += [{"premise": p, "hypothesis": h} for p, h, y in zip(batch["premise"], batch["hypothesis"],
                                                                   batch["label"])
                if parse_label(y, MNLI.labels) != -1]
    return [{"premise": _text(r["premise"]), "hypothesis": _text(r["hypothesis"]), "label": e.label}
            for r, e in zip(out, examples)]


def _text(value) -> str:
    return value if isinstance(value, str) else str(value)


def load_rows(dataset: str, split: str, seed: int = 0) -> list:
    """Validated MNLI rows of ``split`` from 'glue/mnli', 'synthetic', 'synthetic-mnli' or a local file/directory."""
    rows = sources.read(dataset, split, seed)
    return validate_rows(rows.rows, rows.where, rows.first_line)


def examples(rows: list) -> list:
    """MNLI rows as the task's examples."""
    return [Example(prompt(r["hypothesis"], r["premise"]), CLASS_LABELS[r["label"]], r["label"]) for r in rows]


def train_tokenizer(rows: list, vocab_size: int, out_dir: str, family):
    """A tokenizer learnt from MNLI rows (data.tasks.train_tokenizer)."""
    ex = examples(rows)
    return _train_tokenizer(lambda: [[family.prompt(e.input) for e in ex], [e.target for e in ex]], vocab_size,
                            out_dir, MNLI.labels)


def tokenize_inputs(rows: list, tokenizer, sequence_length: int | None, family) -> dict:
    """Prompt ids and attention mask of MNLI rows as the family reads them (data.tasks.tokenize_prompts)."""
    return tokenize_prompts(examples(rows), tokenizer, family, sequence_length)


def tokenize_examples(rows: list, tokenizer, family) -> Examples:
    """Prompt and target ids of MNLI rows in the family's format (data.tasks.tokenize_examples)."""
    return _tokenize(examples(rows), tokenizer, family)


def tokenize_training(rows: list, tokenizer, sequence_length: int, decoder_length: int, family) -> dict:
    """Training features of an encoder-decoder, one example per row [n, len]: input_ids, attention_mask,
    decoder_input_ids, decoder_attention_mask, labels (-100 on padding)."""
    ex = tokenize_examples(rows, tokenizer, family)
    return pad_rows(ex, range(len(ex)), sequence_length, decoder_length)


def extract_class_label(text: str) -> str:
    """The class named by a generated text, or 'unknown' (counted as wrong)."""
    return metrics.label_of(text, MNLI.labels)


def score(labels: list, generated: list) -> dict:
    """Accuracy, per-class counts, the confusion matrix, the predictions and the generated texts (data.metrics)."""
    return metrics.accuracy(labels, generated, MNLI.labels)
