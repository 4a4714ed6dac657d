"""MNLI data: loading (hub, local files, synthetic), prompts, tokenisation and batching.

Prompt formats of the original apps. T5: encoder ``mnli hypothesis: {hypothesis}
premise: {premise}``, target ``{class_label}``; the decoder input is the target
shifted right behind a ``<pad>`` start token, and padded label positions are -100.
GPT-J (a causal LM): ``mnli hypothesis: {hypothesis} premise: {premise} target:``
continued by `` {class_label}<|endoftext|>`` (the tokenizer's end-of-text token).
"""

from __future__ import annotations

import glob
import logging
import os

import numpy as np

from data import synthetic
from data.packing import Examples, Packer, causal_packer, causal_rows, concat_rows, pack_rows, pad_rows
from utils.errors import FlanT5Error
from utils.hub import fetch

logger = logging.getLogger("flan_t5")

CLASS_LABELS = ["entailment", "neutral", "contradiction"]
COLUMNS = ("premise", "hypothesis", "label")
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class DataError(FlanT5Error, ValueError):
    """A missing, unreadable or malformed dataset; the message names the file, row and column."""


def prompt(hypothesis: str, premise: str) -> str:
    return f"mnli hypothesis: {hypothesis} premise: {premise}"


# --------------------------------------------------------------------------- loading


def _read_table(path: str) -> list:
    """Rows of a local json/jsonl/parquet/csv file as dicts."""
    import pandas as pd

    try:
        if path.endswith(".jsonl"):
            return _read_jsonl(path)
        elif path.endswith(".json"):
            try:
                df = pd.read_json(path, dtype=False)
            except ValueError:
                return _read_jsonl(path)
        elif path.endswith(".parquet"):
            df = pd.read_parquet(path)
        elif path.endswith(".csv"):
            import csv

            with open(path, newline="") as f:
                header = next(csv.reader(f), [])
            dup = sorted({c for c in header if header.count(c) > 1})
            if dup:
                raise DataError(f"{path}: line 1: column(s) {', '.join(dup)} appear more than once in the header: "
                                "keep one of each")
            df = pd.read_csv(path, keep_default_na=False)
        else:
            raise DataError(f"{path}: unknown file type: use one of {', '.join(SUFFIXES)}")
    except DataError:
        raise
    except Exception as e:  # pandas/pyarrow raise many types for unreadable files
        raise DataError(f"{path}: cannot be read as {os.path.splitext(path)[1]} ({type(e).__name__}: {e})") from None
    if len(df) == 0:
        raise DataError(f"{path}: the file has no rows: give a file with premise, hypothesis and label columns")
    return df.to_dict("records")


def _read_jsonl(path: str) -> list:
    """Rows of a JSON-lines file; a malformed line or a key given twice in a row is a DataError naming its line."""
    import json

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"key(s) {', '.join(dup)} appear more than once")
        return dict(pairs)

    rows = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=no_duplicates)
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise DataError(f"{path}: line {n}: not a valid JSON object ({e}): fix or remove the line") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {n}: a JSON object with premise, hypothesis and label is expected, got "
                                f"{type(row).__name__}")
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: the file has no rows: give a file with premise, hypothesis and label columns")
    return rows


def _missing(value) -> bool:
    return value is None or (isinstance(value, (float, np.floating)) and np.isnan(value))


def parse_label(value):
    """A label cell -> 0/1/2 (or -1: unlabelled); a class name (entailment, neutral, contradiction) is accepted
    beside the number. None for an empty cell; ValueError for anything else."""
    if _missing(value) or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, (bool, np.bool_)):
        raise ValueError
    if isinstance(value, str):
        text = value.strip().lower()
        if text in CLASS_LABELS:
            return CLASS_LABELS.index(text)
        value = float(text)  # "1", "1.0"; ValueError otherwise
    if isinstance(value, (float, np.floating)):
        if not float(value).is_integer():
            raise ValueError
        value = int(value)
    if not isinstance(value, (int, np.integer)) or not -1 <= value <= 2:
        raise ValueError
    return int(value)


def validate_rows(rows: list, source: str, first_line: int | None = None) -> list:
    """Checks the MNLI schema row by row; drops label -1 rows (unlabelled) with a count in the log.

    Errors name the row (counted from 0 among the data rows; ``first_line``: the file line of row 0,
    shown beside it), the column and the value.
    """
    if not rows:
        raise DataError(f"{source}: no rows")
    out, dropped = [], 0
    for i, row in enumerate(rows):
        where = f"{source}: row {i}" + (f" (line {first_line + i})" if first_line is not None else "")
        for col in COLUMNS:
            if col not in row:
                raise DataError(f"{where}: column '{col}' is missing: every row needs {', '.join(COLUMNS)}")
        for col in ("premise", "hypothesis"):
            value = row[col]
            if _missing(value) or (isinstance(value, str) and not value.strip()):
                raise DataError(f"{where}: column '{col}' is empty: give the {col} text, or remove the row")
            if not isinstance(value, str):
                raise DataError(f"{where}: column '{col}' must be text, got {value!r} ({type(value).__name__})")
        try:
            label = parse_label(row["label"])
        except (ValueError, TypeError):
            raise DataError(f"{where}: column 'label' must be 0, 1, 2 (or -1 for unlabelled), or entailment, "
                            f"neutral, contradiction; got {row['label']!r}") from None
        if label is None:
            raise DataError(f"{where}: column 'label' is empty: give 0, 1, 2 or a class name (entailment, neutral, "
                            "contradiction), or -1 for an unlabelled row")
        if label == -1:
            dropped += 1
            continue
        out.append({"premise": row["premise"], "hypothesis": row["hypothesis"], "label": label})
    if dropped:
        logger.info("%s: dropped %d rows with label -1", source, dropped)
    if not out:
        raise DataError(f"{source}: every row has label -1: nothing to train or score")
    return out


def _local_file(path: str, split: str) -> str:
    if os.path.isfile(path):
        return path
    matches = sorted(f for f in glob.glob(os.path.join(path, f"{split}*")) if f.endswith(SUFFIXES))
    if not matches:
        raise DataError(f"{path} has no {split}.{{jsonl,json,parquet,csv}} file: add one or pass the file itself")
    return matches[0]


def load_rows(dataset: str, split: str, seed: int = 0) -> list:
    """Validated MNLI rows of ``split`` from 'glue/mnli', 'synthetic' or a local file/directory."""
    if dataset in ("synthetic", "synthetic-mnli"):
        if split not in synthetic.SPLIT_SIZES:
            import difflib

            close = difflib.get_close_matches(split, list(synthetic.SPLIT_SIZES), n=1)
            raise DataError(f"split {split!r} is not a split of {dataset}" + (f" (did you mean {close[0]}?)" if close
                                                                               else "")
                            + f": choose one of {', '.join(synthetic.SPLIT_SIZES)} (--split)")
        lengths = "mnli" if dataset == "synthetic-mnli" else "short"
        return validate_rows(synthetic.generate_split(split, seed=seed, lengths=lengths), f"{dataset}:{split}")
    if os.path.exists(dataset):
        path = _local_file(dataset, split)
        first_line = 2 if path.endswith(".csv") else 1 if path.endswith(".jsonl") else None  # after a csv header
        return validate_rows(_read_table(path), path, first_line)
    if dataset in ("glue/mnli", "mnli", "nyu-mll/glue"):
        try:
            import datasets

            ds = datasets.load_dataset("nyu-mll/glue", "mnli", split=split)
        except Exception as e:
            raise DataError(
                f"cannot load GLUE MNLI split '{split}' ({type(e).__name__}): with no network, save it elsewhere "
                f"(datasets.load_dataset('nyu-mll/glue', 'mnli', split='{split}').to_json('{split}.jsonl')), copy it "
                "here and pass --dataset PATH") from None
        return validate_rows(ds.to_list(), f"glue/mnli:{split}")
    raise DataError(f"dataset '{dataset}' is neither glue/mnli, synthetic, synthetic-mnli nor an existing path: "
                    "fix --dataset")


# --------------------------------------------------------------------------- tokenisation


TRAINED = "train"  # --tokenizer train: learn one from the training data (train_tokenizer)


def train_tokenizer(rows: list, vocab_size: int, out_dir: str, family):
    """A BPE tokenizer learnt from the training rows' prompts and labels in seconds, no download: at most
    ``vocab_size`` tokens (the model's), <pad> 0, </s> 1, <unk> 2 as T5's, every character of the data in its
    alphabet (so no word of the data is unknown), saved to ``out_dir`` (a directory AutoTokenizer loads, which
    checkpoints name and validation uses)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    # every row's label too: frequent, they become whole tokens (the targets are a few tokens long)
    texts = [family.prompt(prompt(r["hypothesis"], r["premise"])) for r in rows]
    texts += [CLASS_LABELS[r["label"]] for r in rows] + CLASS_LABELS
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
    """The tokenizer: 'synthetic' (offline word-level) or an HF name/directory."""
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


def check_unknown_tokens(examples: Examples, tokenizer, name: str, dataset: str, limit: float = 0.01,
                         sample: int = 5000) -> float:
    """The share of prompt tokens the tokenizer maps to <unk>; DataError above ``limit``, naming a tokenizer
    that fits (a word-level synthetic tokenizer turns English text into almost nothing but <unk>)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or not len(examples):
        return 0.0
    ids = examples.inputs[:sample]
    total = sum(len(x) for x in ids)
    share = sum(int(np.sum(np.asarray(x) == unk)) for x in ids) / max(total, 1)
    if share > limit:
        hint = ("the synthetic tokenizer knows only the synthetic task's words: pass --tokenizer train to learn one "
                "from this data (offline, seconds), or the model's tokenizer, e.g. --tokenizer google/flan-t5-small "
                "(a hub name or a local directory) with a preset of that model" if name == "synthetic" else
                "pass the tokenizer of the model this data is for (--tokenizer NAME_OR_DIR)")
        raise DataError(f"{share:.0%} of the prompt tokens of {dataset} are unknown (<unk>) to tokenizer {name!r}: "
                        f"{hint}")
    return share


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


def _pad(seqs: list, length: int, value: int) -> np.ndarray:
    out = np.full((len(seqs), length), value, np.int32)
    for i, s in enumerate(seqs):
        s = s[:length]
        out[i, : len(s)] = s
    return out


def tokenize_inputs(rows: list, tokenizer, sequence_length: int | None, family) -> dict:
    """Prompt ids and attention mask [n, sequence_length] (truncated/padded on the right; None: padded to the
    longest prompt, none truncated), as the model's family reads its input (T5: the encoder prompt and EOS; GPT-J:
    the prompt up to ``target:``, no special tokens)."""
    enc = family.encode_inputs(tokenizer, [family.prompt(prompt(r["hypothesis"], r["premise"])) for r in rows])
    length = sequence_length or max(len(x) for x in enc)
    ids = _pad(enc, length, pad_id(tokenizer))
    mask = _pad([[1] * len(s) for s in enc], length, 0)
    return {"input_ids": ids, "attention_mask": mask}


def tokenize_examples(rows: list, tokenizer, family) -> Examples:
    """Prompt and target ids of every row (nothing truncated yet): the input of padding or packing
    (data/packing.py), in the family's format. T5: each ends in EOS (the tokenizer's special tokens). GPT-J: the
    prompt up to ``target:`` and the target `` LABEL`` followed by the end-of-text token, as the original's
    ``... target: {label} <|endoftext|>``."""
    inputs = family.encode_inputs(tokenizer, [family.prompt(prompt(r["hypothesis"], r["premise"])) for r in rows])
    targets = family.encode_targets(tokenizer, [CLASS_LABELS[r["label"]] for r in rows])
    return Examples([np.asarray(x, np.int32) for x in inputs], [np.asarray(t, np.int32) for t in targets])


def tokenize_training(rows: list, tokenizer, sequence_length: int, decoder_length: int, family) -> dict:
    """Training features of an encoder-decoder, one example per row [n, len]: input_ids, attention_mask,
    decoder_input_ids, decoder_attention_mask, labels (-100 on padding)."""
    ex = tokenize_examples(rows, tokenizer, family)
    return pad_rows(ex, range(len(ex)), sequence_length, decoder_length)


# --------------------------------------------------------------------------- batching


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


# --------------------------------------------------------------------------- scoring


def extract_class_label(text: str) -> str:
    """The class named by a generated text, or 'unknown' (counted as wrong)."""
    s = text.replace("</s>", "").replace("<pad>", "").strip()
    return s if s in CLASS_LABELS else "unknown"


def score(labels: list, generated: list) -> dict:
    """Accuracy, per-class counts, confusion matrix (rows: true class; columns: predicted
    class, then 'unknown'), the predictions and the generated texts, from true label ids and
    generated texts."""
    names = CLASS_LABELS + ["unknown"]
    confusion = [[0] * 4 for _ in CLASS_LABELS]
    predictions = []
    for y, text in zip(labels, generated):
        pred = extract_class_label(text)
        confusion[y][names.index(pred)] += 1
        predictions.append(pred)
    n = len(labels)
    correct = sum(confusion[i][i] for i in range(3))
    per_class = {c: {"support": sum(confusion[i]), "correct": confusion[i][i],
                     "accuracy": confusion[i][i] / sum(confusion[i]) if sum(confusion[i]) else None}
                 for i, c in enumerate(CLASS_LABELS)}
    return {"accuracy": correct / n if n else 0.0, "samples": n, "correct": correct,
            "unknown": sum(r[3] for r in confusion), "per_class": per_class,
            "confusion_matrix": {"rows": CLASS_LABELS, "columns": names, "counts": confusion},
            "predictions": predictions, "generated": list(generated)}


def length_buckets(lengths: np.ndarray, batch_size: int) -> list:
    """Index batches (sorted by length, so padding is small); the last may be short."""
    order = np.argsort(lengths, kind="stable")
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
