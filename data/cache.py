"""Data on disk: each source read once, each task's rows checked and tokenized once, and memory-mapped by every run,
resume, validation and process that needs them.

Under the cache root (data/sources.py's ``cache_root``: --cache_dir, $FLAN_T5_CACHE or ~/.cache/flan_t5):

- ``arrow/``: datasets' Arrow copies of local files (its JSON, CSV and Parquet builders);
- ``texts/KEY``: a task's rows of one split as texts, checked by the task (``Task.render``): the inputs and targets
  (UTF-8 bytes and offsets, read by offset for evaluation; and the reading map's own Arrow files, which the tokenizing
  map reads) and the labels; KEY: the source's fingerprint and the task's definition;
- ``tokens/KEY``: their token ids in a family's format (int32 ids and offsets of the inputs and the targets, nothing
  cut: any lengths read them), length histograms and the share of unknown input tokens; KEY: the texts' key, the
  tokenizer (its serialised vocabulary and rules) and the family's text format;
- ``tokenizers/KEY``: tokenizers learnt from the texts (--tokenizer train).

Both stages are ``Dataset.map(batched=True)`` (a progress bar; ``num_proc`` worker processes where the cores allow
and the build runs in a process of its own), written to a temporary folder that is renamed into place when whole:
two runs building the same cache at once each end with a whole one. A large source (more than ``APART_BYTES``) is
built by a separate process (``python3 -m data.cache``), so that the training process never maps the source's pages
and its memory stays the same whatever the row count.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Optional

import datasets
import numpy as np
import pyarrow as pa

from data.loader import holdout_indices
from data.packing import Examples, FileRagged, Ragged
from data.sources import DataError, Source
from data.tasks import Example, Task
from data.tokenizer import TRAINED, encoder_of, load_tokenizer, train_tokenizer, vocabulary_fit
from modelling import registry
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")

TEXTS_VERSION, TOKENS_VERSION = 2, 1  # bumped when what a cache holds changes: older caches are then rebuilt
APART_BYTES = 32 << 20  # a source larger than this is read and tokenized by a process of its own
BATCH = 4096  # rows a map call reads at once
WRITE_ROWS = 65536  # rows read from a map's output (or a texts cache) and written to the flat files at once
BUILDS = {"texts": 0, "tokens": 0, "tokenizers": 0}  # caches built by this process (tests count them)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _whole(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "meta.json"))


def _publish(tmp: str, final: str) -> str:
    """The temporary folder renamed into place (another run's whole copy, if it came first, is kept)."""
    try:
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _whole(final):
            raise
    return final


def _scratch(root: str, kind: str, key: str) -> str:
    os.makedirs(os.path.join(root, kind), exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{key}.tmp", dir=os.path.join(root, kind))


def _map(ds, fn, scratch: str, what: str, key: str, num_proc: Optional[int], **kw):
    """``Dataset.map(batched=True)`` into the scratch folder, with a progress bar."""
    return ds.map(fn, batched=True, batch_size=BATCH, remove_columns=ds.column_names, num_proc=num_proc,
                  cache_file_name=os.path.join(scratch, "map.arrow"), new_fingerprint=key, desc=what,
                  load_from_cache_file=False, **kw)


def _drop_maps(scratch: str, keep: tuple = ()) -> None:
    """The map's own Arrow files (one per worker process), once their contents are in the flat files."""
    for f in glob.glob(os.path.join(scratch, "map*.arrow")) + glob.glob(os.path.join(scratch, "tmp*")):
        if os.path.basename(f) not in keep:
            os.remove(f)


def _mapped(path: str, dtype, n: int) -> np.ndarray:
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)


class _Writer:
    """Appends ragged columns (Arrow string or list arrays, batch by batch) to flat files and their offsets, each
    batch written as it comes (nothing per row is kept)."""

    def __init__(self, path: str, names: tuple):
        self.files = {n: open(os.path.join(path, f"{n}.bin"), "wb") for n in names}
        self.offsets = {n: open(os.path.join(path, f"{n}.off"), "wb") for n in names}
        for f in self.offsets.values():
            np.zeros(1, np.int64).tofile(f)
        self.total = dict.fromkeys(names, 0)

    def add(self, name: str, arr: pa.Array) -> np.ndarray:
        """Appends one column's batch -> its lengths."""
        arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
        if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
            off = np.asarray(arr.offsets, np.int64)
            values = arr.values.to_numpy(zero_copy_only=False).astype(np.int32)[off[0]: off[-1]]
            data = values.tobytes()
        else:
            wide = pa.types.is_large_string(arr.type)
            off = np.frombuffer(arr.buffers()[1], np.int64 if wide else np.int32, len(arr) + 1,
                                arr.offset * (8 if wide else 4)).astype(np.int64)
            data = arr.buffers()[2].to_pybytes()[off[0]: off[-1]]
        self.files[name].write(data)
        lengths = np.diff(off)
        (self.total[name] + np.cumsum(lengths)).astype(np.int64).tofile(self.offsets[name])
        self.total[name] += int(lengths.sum())
        return lengths

    def close(self) -> None:
        for f in list(self.files.values()) + list(self.offsets.values()):
            f.close()


# --------------------------------------------------------------------------- texts


@dataclass
class Part:
    """One task's rows of one split: its source and its task's section (as the config gives it), and the rows held
    out of training (their count and the seed that draws them)."""

    source: dict
    task: dict
    held: int = 0
    seed: int = 0

    def located(self) -> Source:
        return Source(**self.source)

    def the_task(self) -> Task:
        return Task(SimpleNamespace(**self.task))


def texts_key(part: Part) -> str:
    return _key("texts", TEXTS_VERSION, part.located().fingerprint(), part.the_task().definition())


def build_texts(part: Part, root: str, num_proc: Optional[int] = None) -> str:
    """The texts cache of a part (built unless whole) -> its folder."""
    key = texts_key(part)
    final = os.path.join(root, "texts", key)
    if _whole(final):
        return final
    src, task, t0 = part.located(), part.the_task(), time.perf_counter()
    rows = src.load()
    scratch, loaded = _scratch(root, "texts", key), time.perf_counter() - t0

    def render(batch, indices):
        return task.render(batch, indices[0], src.where, src.first_line)

    features = datasets.Features({"input": datasets.Value("large_string"), "target": datasets.Value("large_string"),
                                  "label": datasets.Value("int32")})
    try:
        out = _map(rows, render, scratch, f"reading {src.where}", key, num_proc, with_indices=True,
                   features=features)
    except FlanT5Error:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    writer, n = _Writer(scratch, ("input", "target")), 0
    with open(os.path.join(scratch, "label.bin"), "wb") as labels:
        for table in out.with_format("arrow").iter(batch_size=WRITE_ROWS):
            writer.add("input", table.column("input"))
            writer.add("target", table.column("target"))
            table.column("label").to_numpy().astype(np.int32).tofile(labels)
            n += table.num_rows
    writer.close()
    arrow = [os.path.basename(c["filename"]) for c in out.cache_files]  # kept: what the tokens map reads
    del out
    _drop_maps(scratch, keep=arrow)
    meta = {"n": n, "rows": len(rows), "where": src.where, "single": src.single,
            "task": task.name, "arrow": arrow, "load_seconds": loaded, "seconds": time.perf_counter() - t0}
    if meta["n"] == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise DataError(f"{src.where}: " + ("every row has label -1: nothing to train or score" if len(rows)
                                            else "no rows"))
    if meta["rows"] > meta["n"]:
        logger.info("%s: dropped %d rows with label -1", src.where, meta["rows"] - meta["n"])
    _write_meta(scratch, meta)
    BUILDS["texts"] += 1
    return _publish(scratch, final)


def _write_meta(path: str, meta: dict) -> None:
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def _read_meta(path: str) -> dict:
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


class TextSet:
    """A texts cache, memory-mapped: ``len``, ``example(i)``, ``examples(idx)``, ``batches()`` (lists of input and
    target texts) and its ``meta`` (where the rows came from)."""

    def __init__(self, path: str):
        self.path, self.meta = path, _read_meta(path)
        n = self.meta["n"]
        self.inputs, self.targets = (self._ragged(name, n) for name in ("input", "target"))
        self.labels = _mapped(os.path.join(path, "label.bin"), np.int32, n)

    def _ragged(self, name: str, n: int) -> Ragged:
        off = _mapped(os.path.join(self.path, f"{name}.off"), np.int64, n + 1)
        return Ragged(_mapped(os.path.join(self.path, f"{name}.bin"), np.uint8, int(off[-1])), off)

    def __len__(self) -> int:
        return self.meta["n"]

    def examples(self, idx=None) -> list:
        """Examples ``idx`` (all by default), read from the files by offset (nothing mapped)."""
        n, path = len(self), self.path
        inputs, targets = (FileRagged(os.path.join(path, f"{name}.bin"), os.path.join(path, f"{name}.off"), np.uint8,
                                      n) for name in ("input", "target"))
        fd = os.open(os.path.join(path, "label.bin"), os.O_RDONLY)
        try:
            return [Example(inputs[i].tobytes().decode(), targets[i].tobytes().decode(),
                            int(np.frombuffer(os.pread(fd, 4, 4 * int(i)), np.int32)[0]))
                    for i in (range(n) if idx is None else idx)]
        finally:
            os.close(fd)

    def dataset(self) -> datasets.Dataset:
        """The texts as the Dataset the reading map wrote (memory-mapped Arrow files: worker processes of a map over
        it open the files, nothing is pickled to them)."""
        parts = [datasets.Dataset.from_file(os.path.join(self.path, f)) for f in self.meta["arrow"]]
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)

    def arrow(self) -> pa.Table:
        """The texts as an Arrow table over the mapped files (nothing copied)."""
        cols = {}
        for name, r in (("input", self.inputs), ("target", self.targets)):
            cols[name] = pa.Array.from_buffers(pa.large_string(), len(self), [None, pa.py_buffer(r.offsets),
                                                                             pa.py_buffer(r.flat)])
        return pa.table(cols)


# --------------------------------------------------------------------------- tokens


def tokenizer_fingerprint(tokenizer) -> str:
    """What identifies a tokenizer's ids: a fast tokenizer's serialised vocabulary and rules, else its vocabulary."""
    if getattr(tokenizer, "is_fast", False):
        return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:24]
    return _key(type(tokenizer).__name__, sorted(tokenizer.get_vocab().items()))


def tokens_key(texts_dir: str, tokenizer, family) -> str:
    return _key("tokens", TOKENS_VERSION, os.path.basename(texts_dir), tokenizer_fingerprint(tokenizer), family.name)


def _histogram(parts: list) -> list:
    size = max((len(p) for p in parts), default=0)
    return [int(x) for x in sum((np.pad(p, (0, size - len(p))) for p in parts), np.zeros(size, np.int64))]


def build_tokens(texts_dir: str, tokenizer, family, root: str, num_proc: Optional[int] = None) -> str:
    """The tokens cache of a texts cache in a family's format (built unless whole) -> its folder."""
    key = tokens_key(texts_dir, tokenizer, family)
    final = os.path.join(root, "tokens", key)
    if _whole(final):
        return final
    texts = TextSet(texts_dir)
    scratch, t0 = _scratch(root, "tokens", key), time.perf_counter()
    encoder = encoder_of(tokenizer)

    def encode(table):
        x = family.encode_inputs(encoder, [family.prompt(t) for t in table.column("input").to_pylist()])
        return pa.table({"input_ids": _ragged_array(x),
                         "target_ids": _ragged_array(_encode_targets(family, encoder, table.column("target")))})

    ds = texts.dataset().with_format("arrow")
    out = _map(ds, encode, scratch, f"tokenizing {texts.meta['where']}", key, num_proc)
    writer, hists = _Writer(scratch, ("input", "target")), {"input": [], "target": [], "joint": []}
    for table in out.with_format("arrow").iter(batch_size=WRITE_ROWS):
        a, b = writer.add("input", table.column("input_ids")), writer.add("target", table.column("target_ids"))
        for name, lens in (("input", a), ("target", b), ("joint", a + b)):
            hists[name].append(np.bincount(lens))
    writer.close()
    seconds = time.perf_counter() - t0
    del out
    _drop_maps(scratch)
    meta = {"n": len(texts), "where": texts.meta["where"], "seconds": seconds,
            "rows_per_s": len(texts) / max(seconds, 1e-9), **{f"hist_{k}": _histogram(v) for k, v in hists.items()}}
    meta["unknown"] = _unknown(scratch, len(texts), getattr(tokenizer, "unk_token_id", None))
    _write_meta(scratch, meta)
    logger.info("tokenized %d examples of %s in %.1f s (%.0f rows/s) -> %s", len(texts), texts.meta["where"],
                seconds, meta["rows_per_s"], final)
    BUILDS["tokens"] += 1
    return _publish(scratch, final)


def _encode_targets(family, encoder, column) -> list:
    """The targets' ids, each distinct target encoded once (a label set's few words: half the encoding work)."""
    targets = column.to_pylist()
    distinct = list(dict.fromkeys(targets))
    if len(distinct) > len(targets) // 2:
        return family.encode_targets(encoder, targets)
    ids = dict(zip(distinct, family.encode_targets(encoder, distinct)))
    return [ids[t] for t in targets]


def _ragged_array(ids: list) -> pa.Array:
    lens = np.fromiter(map(len, ids), np.int32, len(ids))
    off = np.zeros(len(ids) + 1, np.int32)
    np.cumsum(lens, out=off[1:])
    flat = np.fromiter(itertools.chain.from_iterable(ids), np.int32, int(off[-1]))
    return pa.ListArray.from_arrays(pa.array(off), pa.array(flat))


def _unknown(path: str, n: int, unk: Optional[int], sample: int = 5000) -> float:
    """The share of the first ``sample`` examples' input tokens that are <unk>."""
    if unk is None or not n:
        return 0.0
    off = np.fromfile(os.path.join(path, "input.off"), np.int64, count=min(n, sample) + 1)
    ids = np.fromfile(os.path.join(path, "input.bin"), np.int32, count=int(off[-1]))
    return float(np.mean(ids == unk)) if len(ids) else 0.0


class TokenSet:
    """A tokens cache: ``examples`` (Examples of ids read from its files as examples are asked for: FileRagged),
    ``len`` and its ``meta`` (length histograms, the unknown share)."""

    def __init__(self, path: str):
        self.path, self.meta = path, _read_meta(path)
        n = self.meta["n"]
        self.examples = Examples(*(FileRagged(os.path.join(path, f"{name}.bin"), os.path.join(path, f"{name}.off"),
                                              np.int32, n) for name in ("input", "target")))

    def __len__(self) -> int:
        return self.meta["n"]

    def histogram(self, name: str) -> np.ndarray:
        return np.asarray(self.meta[f"hist_{name}"], np.int64)


# --------------------------------------------------------------------------- a run's data, built once


@dataclass
class Request:
    """What a run needs cached: its ``parts`` (each task's training or evaluation rows), the ``family`` name whose
    format the tokens take, the ``tokenizer`` (a name or directory, or ``train``: learnt from the parts' training
    texts with ``vocab_size`` tokens, the ``labels`` words whole), the cache ``root``, ``tokens`` (False: texts
    alone) and ``num_proc`` (the map's worker processes; 0: the cores, where the build runs apart)."""

    parts: list
    family: str
    tokenizer: str
    root: str
    vocab_size: int = 0
    labels: tuple = ()
    tokens: bool = True
    num_proc: int = 0


def prepare(req: Request, apart: bool = False) -> dict:
    """Builds what is not cached yet -> {"texts": [folder], "tokens": [folder] (with ``tokens``), "tokenizer": the
    tokenizer's name or folder, "built": the caches built}."""
    before = dict(BUILDS)
    num_proc = (req.num_proc or (os.cpu_count() or 1) if apart else req.num_proc) or None
    num_proc = num_proc if num_proc and num_proc > 1 else None
    parts = [p if isinstance(p, Part) else Part(**p) for p in req.parts]
    texts = [build_texts(p, req.root, num_proc) for p in parts]
    out = {"texts": texts, "tokens": [], "tokenizer": req.tokenizer}
    if req.tokens:
        family = registry.get(req.family)
        if req.tokenizer == TRAINED:
            out["tokenizer"] = learn_tokenizer(req, parts, texts, family)
        tokenizer = load_tokenizer(out["tokenizer"])
        out["tokens"] = [build_tokens(t, tokenizer, family, req.root, num_proc) for t in texts]
    out["built"] = {k: BUILDS[k] - before[k] for k in BUILDS}
    return out


def tokenizer_key(req: Request, parts: list, texts: list, family: str) -> str:
    """What a learnt tokenizer is learnt from: the texts caches, the vocabulary size, the family's text format, the
    label words kept whole, and each part's held-out rows (their count and seed: held-out rows are scored, never
    learnt from)."""
    return _key("tokenizer", [os.path.basename(t) for t in texts], req.vocab_size, family, list(req.labels),
                [(p.held, p.seed) for p in parts])


def learn_tokenizer(req: Request, parts: list, texts: list, family) -> str:
    """The folder of a tokenizer learnt from the parts' training texts (their held-out rows left out: they are
    scored), cached by what it was learnt from."""
    key = tokenizer_key(req, parts, texts, family.name)
    final = os.path.join(req.root, "tokenizers", key)
    if _whole(final):
        if _read_meta(final).get("fit"):  # said again by every run that uses it
            logger.warning(_read_meta(final)["fit"])
        return final
    sets = [TextSet(t) for t in texts]
    kept = [np.ones(len(s), bool) for s in sets]
    for k, p, s in zip(kept, parts, sets):
        k[holdout_indices(len(s), p.held, p.seed)] = False

    def batches():
        for column, how in (("input", family.prompt), ("target", lambda t: t)):
            for s, k in zip(sets, kept):
                table = s.arrow()
                for a in range(0, len(s), WRITE_ROWS):
                    chunk = table.column(column).slice(a, WRITE_ROWS).to_pylist()
                    yield [how(t) for t, keep in zip(chunk, k[a: a + WRITE_ROWS]) if keep]

    def sample(each: int = 2000) -> list:  # the first texts of every task's inputs and targets
        return [how(t) for column, how in (("input", family.prompt), ("target", lambda t: t)) for s, k in
                zip(sets, kept) for t, keep in zip(s.arrow().column(column).slice(0, each).to_pylist(), k) if keep]

    scratch, t0 = _scratch(req.root, "tokenizers", key), time.perf_counter()
    tok = train_tokenizer(batches, req.vocab_size, scratch, tuple(req.labels))
    n, fit = int(sum(k.sum() for k in kept)), vocabulary_fit(tok, sample(), req.vocab_size)
    _write_meta(scratch, {"examples": n, "seconds": time.perf_counter() - t0, "fit": fit})
    logger.info("trained a %d-token tokenizer on %d examples of %s in %.1f s", len(tok), n,
                ", ".join(s.meta["where"] for s in sets), time.perf_counter() - t0)
    if fit:
        logger.warning(fit)
    BUILDS["tokenizers"] += 1
    return _publish(scratch, final)


def run(req: Request, apart: Optional[bool] = None) -> dict:
    """``prepare`` here, or by a process of its own (``apart``; default: when the sources hold more than
    ``APART_BYTES``): the training process then never maps a source's pages. Its errors are this process's."""
    if apart is None:
        apart = sum(Part(**p).located().nbytes() if isinstance(p, dict) else p.located().nbytes()
                    for p in req.parts) > APART_BYTES
    if not apart:
        return prepare(req)
    with tempfile.TemporaryDirectory() as d:
        ask, answer = os.path.join(d, "request.json"), os.path.join(d, "result.json")
        with open(ask, "w") as f:
            json.dump(asdict(req), f)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run([sys.executable, "-m", "data.cache", ask, answer], env=env)
        result = json.load(open(answer)) if os.path.exists(answer) else {}
    if "error" in result:
        raise DataError(result["error"])
    if proc.returncode or "texts" not in result:
        raise DataError(f"reading and tokenizing the data failed (exit {proc.returncode}): see the lines above")
    for k, v in result["built"].items():
        BUILDS[k] += v
    return result


def _main(ask: str, answer: str) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    with open(ask) as f:
        req = Request(**json.load(f))
    try:
        result = prepare(req, apart=True)
    except FlanT5Error as e:
        result = {"error": str(e)}
    with open(answer, "w") as f:
        json.dump(result, f)
    return 2 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(_main(*sys.argv[1:3]))
