"""Where rows come from: a local file (JSONL, JSON, CSV, TSV, Parquet), a directory of split files, a directory
written by ``datasets``' ``save_to_disk``, a Hugging Face hub data set (a name, a config and a split), or a set this
project generates offline (``synthetic``, ``synthetic-mnli``: the NLI task; ``synthetic-headlines``: a free-text
one). Every source gives the same thing: a list of rows (dicts of column -> value) and where they came from, so that
an error can name the file, the row and its line.
"""

from __future__ import annotations

import csv
import difflib
import glob
import json
import os
from dataclasses import dataclass
from typing import Optional

from data import synthetic
from utils.errors import FlanT5Error
from utils.hub import fetch

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv")
# the original's data set, by the names it goes by -> (hub name, its config)
HUB_ALIASES = {"glue/mnli": ("nyu-mll/glue", "mnli"), "mnli": ("nyu-mll/glue", "mnli"),
               "nyu-mll/glue": ("nyu-mll/glue", "mnli")}


class DataError(FlanT5Error, ValueError):
    """A missing, unreadable or malformed dataset; the message names the file, row and column."""


@dataclass
class Rows:
    """Rows of one split of a source: ``rows`` [dict], ``where`` (the source, for messages and reports),
    ``first_line`` (the file line of row 0 where rows are lines, else None) and whether the source is one file
    holding one set of rows whatever the split asked (``single``)."""

    rows: list
    where: str
    first_line: Optional[int] = None
    single: bool = False


def generated(name: str) -> bool:
    return name in synthetic.GENERATED


def read(dataset: str, split: str, seed: int = 0, hub_config: Optional[str] = None) -> Rows:
    """The rows of ``split`` of a source (see the module docstring)."""
    if generated(dataset):
        return Rows(synthetic.generate(dataset, _split_of(split, synthetic.SPLIT_SIZES, dataset), seed=seed),
                    f"{dataset}:{split}")
    if os.path.isdir(dataset) and is_saved_dataset(dataset):
        return _read_saved(dataset, split)
    if os.path.exists(dataset):
        path = _local_file(dataset, split)
        first_line = 2 if path.endswith((".csv", ".tsv")) else 1 if path.endswith(".jsonl") else None
        return Rows(read_table(path), path, first_line, single=os.path.isfile(dataset))
    if dataset.startswith((".", "/")) or os.sep in dataset.strip("/").split("/", 1)[-1]:
        raise DataError(f"dataset {dataset} does not exist: pass --dataset with an existing file or directory, a hub "
                        "data set name, or synthetic")
    name, config = HUB_ALIASES.get(dataset, (dataset, hub_config))
    return _read_hub(name, hub_config or config, split)


def _split_of(split: str, known, dataset: str) -> str:
    if split in known:
        return split
    close = difflib.get_close_matches(split, list(known), n=1)
    raise DataError(f"split {split!r} is not a split of {dataset}" + (f" (did you mean {close[0]}?)" if close else "")
                    + f": choose one of {', '.join(known)} (--split)")


# --------------------------------------------------------------------------- files


def read_table(path: str) -> list:
    """Rows of a local json/jsonl/parquet/csv/tsv file as dicts (CSV and TSV cells as text)."""
    import pandas as pd

    try:
        if path.endswith(".jsonl"):
            return _read_jsonl(path)
        if path.endswith(".json"):
            try:
                df = pd.read_json(path, dtype=False)
            except ValueError:
                return _read_jsonl(path)
        elif path.endswith(".parquet"):
            df = pd.read_parquet(path)
        elif path.endswith((".csv", ".tsv")):
            df = _read_delimited(path, "\t" if path.endswith(".tsv") else ",")
        else:
            raise DataError(f"{path}: unknown file type: use one of {', '.join(SUFFIXES)}")
    except DataError:
        raise
    except Exception as e:  # pandas/pyarrow raise many types for unreadable files
        raise DataError(f"{path}: cannot be read as {os.path.splitext(path)[1]} ({type(e).__name__}: {e})") from None
    if len(df) == 0:
        raise DataError(f"{path}: the file has no rows: give a file with the task's columns")
    return df.to_dict("records")


def _read_delimited(path: str, sep: str):

    import pandas as pd

    with open(path, newline="") as f:
        header = next(csv.reader(f, delimiter=sep), [])
    dup = sorted({c for c in header if header.count(c) > 1})
    if dup:
        raise DataError(f"{path}: line 1: column(s) {', '.join(dup)} appear more than once in the header: keep one "
                        "of each")
    return pd.read_csv(path, sep=sep, keep_default_na=False, dtype=str)


def _read_jsonl(path: str) -> list:
    """Rows of a JSON-lines file; a malformed line or a key given twice in a row is a DataError naming its line."""
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
                raise DataError(f"{path}: line {n}: a JSON object (the row's columns) is expected, got "
                                f"{type(row).__name__}")
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: the file has no rows: give a file with the task's columns")
    return rows


def _local_file(path: str, split: str) -> str:
    if os.path.isfile(path):
        return path
    matches = sorted(f for f in glob.glob(os.path.join(path, f"{split}*")) if f.endswith(SUFFIXES))
    if not matches:
        names = sorted({os.path.basename(f).split(".")[0] for f in glob.glob(os.path.join(path, "*"))
                        if f.endswith(SUFFIXES)})
        close = difflib.get_close_matches(split, names, n=1)
        raise DataError(f"{path} has no {split}.{{jsonl,json,parquet,csv,tsv}} file"
                        + (f" (did you mean --split {close[0]}?)" if close else "")
                        + ": add one, or pass the file itself")
    return matches[0]


# --------------------------------------------------------------------------- datasets' own formats


def is_saved_dataset(path: str) -> bool:
    """Whether a directory was written by ``datasets``' ``save_to_disk`` (a DatasetDict or a Dataset)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))


def _read_saved(path: str, split: str) -> Rows:
    import datasets

    try:
        saved = datasets.load_from_disk(path)
    except Exception as e:
        raise DataError(f"{path}: cannot be read as a save_to_disk directory ({type(e).__name__}: {e})") from None
    if isinstance(saved, datasets.DatasetDict):
        return Rows(saved[_split_of(split, list(saved), path)].to_list(), f"{path}:{split}")
    return Rows(saved.to_list(), path, single=True)


def _read_hub(name: str, config: Optional[str], split: str) -> Rows:
    """A hub data set's split: the local cache first, then the hub where it answers; offline, one line at once."""
    fix = (f"with no network, save it elsewhere (datasets.load_dataset({name!r}"
           + (f", {config!r}" if config else "") + f", split={split!r}).to_json('{split}.jsonl')), copy it here and "
           "pass --dataset PATH")
    what = f"data set {name}" + (f" ({config})" if config else "") + f" split {split}"
    try:
        ds = fetch(lambda local_files_only: _load_dataset(name, config, split, local_files_only), name, what, fix,
                   DataError)
    except DataError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(f"cannot load {what} ({type(e).__name__}: {first}): {fix}") from None
    return Rows(ds.to_list(), f"{name}" + (f"/{config}" if config else "") + f":{split}")


def _load_dataset(name: str, config: Optional[str], split: str, local_files_only: bool):
    import datasets

    offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = offline or local_files_only  # the cache alone, no request
    try:
        return datasets.load_dataset(name, config, split=split)
    finally:
        datasets.config.HF_HUB_OFFLINE = offline
