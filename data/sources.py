"""Where rows come from: a local file (JSONL, JSON, CSV, TSV, Parquet), a directory of split files, a directory
written by ``datasets``' ``save_to_disk``, a Hugging Face hub data set (a name, a config and a split), or a set this
project generates offline (``synthetic``, ``synthetic-mnli``: the NLI task; ``synthetic-headlines``: a free-text
one). Every source is read with Hugging Face ``datasets`` into Arrow (its JSON, CSV and Parquet builders, its
``save_to_disk`` and hub loaders); ``locate`` says which source a name means without reading it, with a fingerprint
of its data (a file's size and time, a saved set's state, a generated set's name and seed) that keys the caches of
data/cache.py, and ``read`` gives its rows.

One typing rule for every format (data/tasks.py applies it to the columns a task reads): a number where text is
expected is read as its text (52 -> "52", 2.5 -> "2.5", 52.0 -> "52"; CSV and TSV cells are text as written, "NA"
and blanks included); a boolean, a list or a mapping is refused with the fix. Errors name the file, the row (and
its line, where rows are lines) and the column.
"""

from __future__ import annotations

import csv
import difflib
import glob
import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import datasets

from data import synthetic
from utils.errors import DataError
from utils.hub import fetch

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv")
# the original's data set, by the names it goes by -> (hub name, its config)
HUB_ALIASES = {"glue/mnli": ("nyu-mll/glue", "mnli"), "mnli": ("nyu-mll/glue", "mnli"),
               "nyu-mll/glue": ("nyu-mll/glue", "mnli")}
GENERATOR_VERSION = 1  # bumped when a generated set's rows change: their caches are then rebuilt


def cache_root(cache_dir: Optional[str] = None) -> str:
    """Where read and tokenized data are cached: ``--cache_dir``, else $FLAN_T5_CACHE, else ~/.cache/flan_t5."""
    return os.path.abspath(os.path.expanduser(cache_dir or os.environ.get("FLAN_T5_CACHE") or "~/.cache/flan_t5"))


@dataclass
class Rows:
    """Rows of one split of a source: ``rows`` (a ``datasets.Dataset``, or a list of dicts), ``where`` (the source,
    for messages and reports), ``first_line`` (the file line of row 0 where rows are lines, else None) and whether
    the source is one file holding one set of rows whatever the split asked (``single``)."""

    rows: object
    where: str
    first_line: Optional[int] = None
    single: bool = False

    def __len__(self) -> int:
        return len(self.rows)

    def batches(self, size: int = 4096):
        """(index of the first row, {column: [values]}) of consecutive batches of rows (a value missing from a row:
        None)."""
        if isinstance(self.rows, datasets.Dataset):
            for start, batch in zip(range(0, len(self.rows), size), self.rows.iter(batch_size=size)):
                yield start, batch
            return
        columns = list(dict.fromkeys(k for r in self.rows for k in r))
        for start in range(0, len(self.rows), size):
            part = self.rows[start: start + size]
            yield start, {c: [r.get(c) for r in part] for c in columns}


@dataclass
class Source:
    """One split of a source, located but not read: ``kind`` (generated, file, saved or hub), ``name`` (its path,
    hub name or generated name), ``split``, ``seed`` (a generated set's), ``config`` (a hub set's), and ``where``,
    ``first_line``, ``single`` as ``Rows`` has them."""

    kind: str
    name: str
    split: str
    where: str
    seed: int = 0
    config: Optional[str] = None
    first_line: Optional[int] = None
    single: bool = False
    cache_dir: Optional[str] = None

    def fingerprint(self) -> str:
        """What identifies the rows without reading them (a hub set's is the loaded set's own fingerprint)."""
        if self.kind == "generated":
            key = f"{self.name}:{self.split}:{self.seed}:{GENERATOR_VERSION}"
        elif self.kind == "file":
            st = os.stat(self.name)
            key = f"{os.path.realpath(self.name)}:{st.st_size}:{st.st_mtime_ns}"
        elif self.kind == "saved":
            with open(os.path.join(self.name, "state.json")) as f:
                key = f"{os.path.realpath(self.name)}:{f.read()}"
        else:
            key = f"{self.name}:{self.config}:{self.split}:{self.load()._fingerprint}"
        return hashlib.sha256(f"{self.kind}:{key}".encode()).hexdigest()[:20]

    def nbytes(self) -> int:
        """The bytes of its files (0 for a generated set)."""
        if self.kind == "file":
            return os.path.getsize(self.name)
        if self.kind == "saved":
            return sum(os.path.getsize(f) for f in glob.glob(os.path.join(self.name, "*.arrow")))
        return 0

    def load(self) -> datasets.Dataset:
        """The rows, read with ``datasets``."""
        if self.kind == "generated":
            return datasets.Dataset.from_list(synthetic.generate(self.name, self.split, seed=self.seed))
        if self.kind == "saved":
            try:
                return datasets.load_from_disk(self.name)
            except Exception as e:  # datasets raises several types for a directory it did not write
                raise DataError(f"{self.where}: cannot be read as a save_to_disk directory ({type(e).__name__}: "
                                f"{e})") from None
        if self.kind == "file":
            return read_file(self.name, self.cache_dir, self.where)
        return _read_hub(self.name, self.config, self.split)


def generated(name: str) -> bool:
    return name in synthetic.GENERATED


def locate(dataset: str, split: str, seed: int = 0, hub_config: Optional[str] = None,
           cache_dir: Optional[str] = None, how: str = "--split {}") -> Source:
    """The source of ``split`` of ``dataset`` (see the module docstring), checked to exist; nothing is read. ``how``:
    how the user names a split, for the messages (a flag, or a mixture task's mapping key)."""
    if generated(dataset):
        return Source("generated", dataset, _split_of(split, synthetic.SPLIT_SIZES, dataset, how),
                      f"{dataset}:{split}", seed=seed)
    if os.path.isdir(dataset) and is_saved_dataset(dataset):
        return _locate_saved(dataset, split, how)
    if os.path.exists(dataset):
        path = _local_file(dataset, split, how)
        first_line = 2 if path.endswith((".csv", ".tsv")) else 1 if path.endswith(".jsonl") else None
        return Source("file", os.path.abspath(path), split, path, first_line=first_line,
                      single=os.path.isfile(dataset), cache_dir=cache_dir)
    if dataset.startswith((".", "/")) or os.sep in dataset.strip("/").split("/", 1)[-1]:
        raise DataError(f"dataset {dataset} does not exist: pass --dataset with an existing file or directory, a hub "
                        "data set name, or synthetic")
    name, config = HUB_ALIASES.get(dataset, (dataset, hub_config))
    config = hub_config or config
    return Source("hub", name, split, f"{name}" + (f"/{config}" if config else "") + f":{split}", config=config)


def read(dataset: str, split: str, seed: int = 0, hub_config: Optional[str] = None,
         cache_dir: Optional[str] = None, how: str = "--split {}") -> Rows:
    """The rows of ``split`` of a source (see the module docstring)."""
    src = locate(dataset, split, seed, hub_config, cache_dir, how)
    return Rows(src.load(), src.where, src.first_line, src.single)


def _split_of(split: str, known, dataset: str, how: str = "--split {}") -> str:
    if split in known:
        return split
    close = difflib.get_close_matches(split, list(known), n=1)
    raise DataError(f"split {split!r} is not a split of {dataset}" + (f" (did you mean {close[0]}?)" if close else "")
                    + f": choose one of {', '.join(known)} ({how.format('NAME')})")


# --------------------------------------------------------------------------- files


@contextmanager
def _quiet():
    """datasets' own log lines (it logs a failed read before raising it) and progress bars for small files: our
    error says it in one line."""
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def read_file(path: str, cache_dir: Optional[str] = None, shown: Optional[str] = None) -> datasets.Dataset:
    """A local json/jsonl/parquet/csv/tsv file through datasets' builders (converted once into Arrow under the
    cache directory): JSON and Parquet typed, CSV and TSV cells as text. Messages name it as ``shown`` (the path as
    the user gave it)."""
    kind, shown = os.path.splitext(path)[1], shown or path
    if kind not in SUFFIXES:
        raise DataError(f"{shown}: unknown file type: use one of {', '.join(SUFFIXES)}")
    if not _has_content(path, header=kind in (".csv", ".tsv")):
        raise DataError(f"{shown}: the file has no rows"
                        + (" (a header alone)" if _has_content(path) else "") + ": give a file with the task's columns")
    kw = {}
    if kind in (".csv", ".tsv"):
        builder, kw = "csv", _delimited(path, "\t" if kind == ".tsv" else ",", shown)
    else:
        builder = "json" if kind in (".json", ".jsonl") else "parquet"
    try:
        with _quiet():
            ds = datasets.load_dataset(builder, data_files=path, split="train",
                                       cache_dir=os.path.join(cache_root(cache_dir), "arrow"), **kw)
    except Exception as e:  # datasets and pyarrow raise many types for unreadable files
        cause = e.__cause__ or e
        try:
            if isinstance(cause, UnicodeDecodeError):
                raise cause
            if builder == "json":
                _find_bad_line(path, shown)
        except UnicodeDecodeError:
            raise DataError(not_utf8(path, shown)) from None
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:200]
        raise DataError(f"{shown}: cannot be read as {kind} ({type(cause).__name__}: {first})") from None
    if len(ds) == 0:
        raise DataError(f"{shown}: the file has no rows: give a file with the task's columns")
    return ds


def _has_content(path: str, header: bool = False) -> bool:
    """Whether the file has a line that is not blank (after its first, a ``header``)."""
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                if not header:
                    return True
                header = False
    return False


def _delimited(path: str, sep: str, shown: str) -> dict:
    """datasets' CSV builder options reading every cell as text as written, in UTF-8 with or without a byte-order
    mark (Excel's "CSV UTF-8" writes one: its first column was named with it, and refused); a header given twice is
    refused, and so is a file that is not UTF-8 (``not_utf8``)."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            header = next(csv.reader(f, delimiter=sep), [])
    except UnicodeDecodeError:
        raise DataError(not_utf8(path, shown)) from None
    dup = sorted({c for c in header if header.count(c) > 1})
    if dup:
        raise DataError(f"{shown}: line 1: column(s) {', '.join(dup)} appear more than once in the header: keep one "
                        "of each")
    return {"sep": sep, "keep_default_na": False, "encoding": "utf-8-sig",
            "features": datasets.Features({c: datasets.Value("string") for c in header})}


def not_utf8(path: str, shown: str) -> str:
    """The one line for a text file that is not UTF-8: its first such line, and the fix."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"{shown}: line {n} is not UTF-8 (byte 0x{line[e.start]:02x}, byte {e.start + 1} of the line; "
                        "a Latin-1 or Windows-1252 file?): save it as UTF-8 (Excel: \"CSV UTF-8\"; or iconv -f "
                        f"latin1 -t utf-8 {shown}) and pass that")
    return f"{shown}: is not UTF-8: save it as UTF-8 and pass that"


def _find_bad_line(path: str, shown: str) -> None:
    """The first line of a JSON-lines file that is no JSON object (or names a key twice), as a DataError; called
    when datasets could not read the file (its own error names a row of a block, not a line)."""
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"key(s) {', '.join(dup)} appear more than once")
        return dict(pairs)

    with open(path) as f:
        head = f.read(1).strip()
        f.seek(0)
        if head == "[":  # one JSON array, not lines
            return
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line, object_pairs_hook=no_duplicates)
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise DataError(f"{shown}: line {n}: not a valid JSON object ({e}): fix or remove the line") from None
            if not isinstance(row, dict):
                raise DataError(f"{shown}: line {n}: a JSON object (the row's columns) is expected, got "
                                f"{type(row).__name__}")


def _local_file(path: str, split: str, how: str = "--split {}") -> str:
    if os.path.isfile(path):
        return path
    matches = sorted(f for f in glob.glob(os.path.join(path, f"{split}*")) if f.endswith(SUFFIXES))
    if not matches:
        names = sorted({os.path.basename(f).split(".")[0] for f in glob.glob(os.path.join(path, "*"))
                        if f.endswith(SUFFIXES)})
        close = difflib.get_close_matches(split, names, n=1)
        raise DataError(f"{path} has no {split}.{{jsonl,json,parquet,csv,tsv}} file"
                        + (f" (did you mean {how.format(close[0])}?)" if close else "")
                        + f": name one of its splits ({', '.join(names) or 'none'}) with {how.format('NAME')}, add "
                        "the file, or pass a file itself")
    return matches[0]


# --------------------------------------------------------------------------- datasets' own formats


def is_saved_dataset(path: str) -> bool:
    """Whether a directory was written by ``datasets``' ``save_to_disk`` (a DatasetDict or a Dataset)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))


def _locate_saved(path: str, split: str, how: str = "--split {}") -> Source:
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        try:
            with open(os.path.join(path, "dataset_dict.json")) as f:
                splits = json.load(f)["splits"]
        except (OSError, ValueError, KeyError) as e:
            raise DataError(f"{path}: cannot be read as a save_to_disk directory ({type(e).__name__}: {e})") from None
        split = _split_of(split, splits, path, how)
        return Source("saved", os.path.abspath(os.path.join(path, split)), split, f"{path}:{split}")
    return Source("saved", os.path.abspath(path), split, path, single=True)


def _read_hub(name: str, config: Optional[str], split: str) -> datasets.Dataset:
    """A hub data set's split: the local cache first, then the hub where it answers; offline, one line at once."""
    fix = (f"with no network, save it elsewhere (datasets.load_dataset({name!r}"
           + (f", {config!r}" if config else "") + f", split={split!r}).to_json('{split}.jsonl')), copy it here and "
           "pass --dataset PATH")
    what = f"data set {name}" + (f" ({config})" if config else "") + f" split {split}"
    try:
        return fetch(lambda local_files_only: _load_dataset(name, config, split, local_files_only), name, what, fix,
                     DataError)
    except DataError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(f"cannot load {what} ({type(e).__name__}: {first}): {fix}") from None


def _load_dataset(name: str, config: Optional[str], split: str, local_files_only: bool):
    offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = offline or local_files_only  # the cache alone, no request
    try:
        return datasets.load_dataset(name, config, split=split)
    finally:
        datasets.config.HF_HUB_OFFLINE = offline

