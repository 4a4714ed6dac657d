"""The data caches' contracts (data/cache.py): what each cache key is made of, and that a cache written in several
batches reads back every row exactly.

- texts: keyed by the source and the task's definition (what decides the texts of a row); two tasks over one file
  each read their own texts.
- tokens: keyed by the texts, the tokenizer and the family's text format; nothing is cut, so every sequence length
  reads one cache.
- learnt tokenizers: keyed by the texts, the vocabulary size, the family, the label words and each part's held-out
  rows (count and seed); one that fills a small vocabulary says so, with the size that holds the data.
- the flat files: offsets run on across the batches they are written in (``WRITE_ROWS`` rows at a time).
- a large source is read and tokenized by a process of its own, into the same arrays."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from data import cache, sources, synthetic
from data.packing import FileRagged, Ragged
from data.sources import DataError
from data.tasks import Task
from data.tokenizer import TRAINED, load_tokenizer
from modelling import registry
from tests.helpers import write_jsonl

CHEAP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _task(**kw):
    base = dict(name="t", input_template="{text}", input_column=None, target_column="summary", labels=None,
                metrics=["exact_match"])
    return {**base, **kw}


def _part(path, task, held=0, seed=0):
    return cache.Part(source=vars(sources.locate(str(path), "train")).copy(), task=task, held=held, seed=seed)


# --------------------------------------------------------------------------- keys
_TEMPLATES = ["{text}", "summarize: {text}", "{text} {summary}", "{title}: {text}", "{text}\n"]


_definitions = st.fixed_dictionaries({
    "input_template": st.sampled_from(_TEMPLATES),
    "input_column": st.sampled_from([None, "text", "title"]),
    "target_column": st.sampled_from(["summary", "label", "title"]),
    "labels": st.sampled_from([None, ("yes", "no"), ("no", "yes"), ("yes", "no", "maybe")]),
})


@pytest.fixture(scope="module")
def one_file(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("src") / "rows.jsonl", [{"text": "a", "summary": "b", "title": "c"}])


@CHEAP
@given(a=_definitions, b=_definitions, names=st.tuples(st.sampled_from(["t", "u"]), st.sampled_from(["t", "u"])))
def test_two_task_definitions_share_a_texts_key_exactly_when_they_decide_the_same_texts(one_file, a, b, names):
    """Guards the task definition in the texts key (a second task over the same file once read the first's
    texts): keys differ whenever the definitions do; a task's name and metrics, which change no text, share one."""
    ta = _task(name=names[0], metrics=["exact_match"], **a)
    tb = _task(name=names[1], metrics=["rouge"], **b)
    same = Task(SimpleNamespace(**ta)).definition() == Task(SimpleNamespace(**tb)).definition()
    assert (cache.texts_key(_part(one_file, ta)) == cache.texts_key(_part(one_file, tb))) == same


def test_two_files_get_two_texts_keys(tmp_path):
    a = _write(tmp_path / "a.jsonl", [{"text": "x", "summary": "y"}])
    b = _write(tmp_path / "b.jsonl", [{"text": "x", "summary": "y"}])
    assert cache.texts_key(_part(a, _task())) != cache.texts_key(_part(b, _task()))


def _word_tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


_vocabularies = st.lists(st.sampled_from(["cat", "dog", "runs", "sleeps", "the", "a"]), min_size=1, max_size=6,
                         unique=True)


@settings(max_examples=25, deadline=None)
@given(a=_vocabularies, b=_vocabularies, fa=st.sampled_from(["t5", "gptj"]), fb=st.sampled_from(["t5", "gptj"]),
       ta=st.sampled_from(["k1", "k2"]), tb=st.sampled_from(["k1", "k2"]))
def test_tokens_keys_differ_when_the_tokenizer_the_family_or_the_texts_do(a, b, fa, fb, ta, tb):
    """Guards the tokens key: another vocabulary (the same words in another order are other ids), another family's
    text format or other texts never read one cache."""
    key = lambda words, fam, texts: cache.tokens_key(f"/c/texts/{texts}", _word_tokenizer(words),  # noqa: E731
                                                     registry.get(fam))
    assert (key(a, fa, ta) == key(b, fb, tb)) == (a == b and fa == fb and ta == tb)


_learnt = st.fixed_dictionaries({"texts": st.sampled_from([("k1",), ("k2",), ("k1", "k2")]),
                                 "vocab_size": st.sampled_from([64, 128]), "family": st.sampled_from(["t5", "gptj"]),
                                 "labels": st.sampled_from([(), ("yes", "no")]), "held": st.sampled_from([0, 150]),
                                 "seed": st.sampled_from([0, 1])})


@CHEAP
@given(a=_learnt, b=_learnt)
def test_a_learnt_tokenizer_s_key_holds_everything_it_is_learnt_from(a, b):
    """Guards (held, seed) in the learnt tokenizer's key, and the rest of it: ``--holdout 0`` then ``--holdout 150``
    (or another seed, which holds out other rows) must not reuse a tokenizer learnt on rows now held out."""

    def key(d):
        req = cache.Request([], d["family"], TRAINED, "/c", vocab_size=d["vocab_size"], labels=d["labels"])
        parts = [cache.Part({}, {}, held=d["held"], seed=d["seed"]) for _ in d["texts"]]
        return cache.tokenizer_key(req, parts, [f"/c/texts/{t}" for t in d["texts"]], d["family"])

    assert (key(a) == key(b)) == (a == b)


# --------------------------------------------------------------------------- the flat files, batch by batch
_texts = st.lists(st.text(max_size=12), min_size=1, max_size=9)


_ids = st.lists(st.lists(st.integers(0, 2 ** 31 - 1), max_size=6), min_size=1, max_size=9)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.tuples(_texts, _ids, st.integers(0, 3)), min_size=1, max_size=5))
def test_a_column_written_in_several_batches_reads_back_every_row_exactly(tmp_path_factory, batches):
    """Guards the offsets across batches (they once restarted at each batch: every row after the first batch read
    the wrong text): strings and id lists, each batch a slice of a larger array (an Arrow offset), any lengths
    (empty ones too)."""
    path = tmp_path_factory.mktemp("w")
    w = cache._Writer(str(path), ("s", "i"))
    want_s, want_i = [], []
    for texts, ids, cut in batches:
        cut = min(cut, len(texts) - 1, len(ids) - 1)
        s = pa.array(["pad"] * cut + texts, pa.large_string()).slice(cut)  # a slice: the buffers hold more
        i = pa.array([[7]] * cut + ids, pa.list_(pa.int32())).slice(cut)
        np.testing.assert_array_equal(w.add("s", s), [len(t.encode()) for t in texts])
        np.testing.assert_array_equal(w.add("i", i), [len(x) for x in ids])
        want_s += texts
        want_i += ids
    w.close()
    n = len(want_s)
    got_s = FileRagged(str(path / "s.bin"), str(path / "s.off"), np.uint8, n)
    assert [got_s[k].tobytes().decode() for k in range(n)] == want_s
    off = np.fromfile(path / "i.off", np.int64)
    mapped = Ragged(np.fromfile(path / "i.bin", np.int32), off)
    assert len(off) == len(want_i) + 1 and [mapped[k].tolist() for k in range(len(want_i))] == want_i


def test_caches_written_in_several_batches_read_back_every_row_exactly(tmp_path, monkeypatch):
    """A source of 40 rows through both caches, written 7 rows at a time (``WRITE_ROWS``): every example's texts,
    label and token ids are the row's own (read by offset and mapped), uncut (no sequence length enters a cache)."""
    monkeypatch.setattr(cache, "WRITE_ROWS", 7)
    rows = synthetic.generate_split("train", 40, seed=5)
    rows[33]["premise"] = " ".join([rows[33]["premise"]] * 12)  # longer than any tiny preset's sequence_length
    path = _write(tmp_path / "train.jsonl", rows)
    mnli = _task(input_template="mnli hypothesis: {hypothesis} premise: {premise}", target_column="label",
                 labels=["entailment", "neutral", "contradiction"], metrics=["accuracy"])
    out = cache.prepare(cache.Request([_part(path, mnli)], "t5", "synthetic", str(tmp_path / "c")))
    task, family, tok = Task(SimpleNamespace(**mnli)), registry.get("t5"), load_tokenizer("synthetic")
    want = task.examples(sources.Rows(rows, path, 1))
    texts = cache.TextSet(out["texts"][0])
    assert texts.examples() == want and texts.examples([39, 0, 8]) == [want[39], want[0], want[8]]
    assert [bytes(texts.inputs[k]).decode() for k in range(40)] == [e.input for e in want]
    tokens = cache.TokenSet(out["tokens"][0])
    ids_in = family.encode_inputs(tok, [family.prompt(e.input) for e in want])
    ids_out = family.encode_targets(tok, [e.target for e in want])
    assert [tokens.examples.inputs[k].tolist() for k in range(40)] == ids_in
    assert [tokens.examples.targets[k].tolist() for k in range(40)] == ids_out
    assert len(ids_in[33]) > 64 and tokens.histogram("input").sum() == 40


def test_two_tasks_over_one_file_each_read_their_own_texts(tmp_path):
    """The issue's case: a task ``{text}`` and a task ``summarize: {text}`` over the same file."""
    path = _write(tmp_path / "rows.jsonl", [{"text": f"the dog runs {i}", "summary": f"r{i}"} for i in range(5)])
    root = str(tmp_path / "c")
    plain = cache.TextSet(cache.build_texts(_part(path, _task()), root))
    summarize = cache.TextSet(cache.build_texts(_part(path, _task(input_template="summarize: {text}")), root))
    assert plain.examples()[0].input == "the dog runs 0"
    assert [e.input for e in summarize.examples()] == [f"summarize: the dog runs {i}" for i in range(5)]


def test_a_tokenizer_learnt_with_rows_held_out_is_learnt_from_the_other_rows_alone(tmp_path, monkeypatch):
    """``--holdout 0`` then ``--holdout 3`` (then another seed): each learns its own tokenizer, from the rows it
    trains on alone (row i holds a letter no other row has: the alphabet is the trained rows' letters, whichever
    batch of ``WRITE_ROWS`` a row is read in); the same request again learns nothing."""
    from data.loader import holdout_indices

    monkeypatch.setattr(cache, "WRITE_ROWS", 4)
    letters = [chr(0x3B1 + i) for i in range(10)]  # greek: none of them in another row or in the summaries
    path = _write(tmp_path / "rows.jsonl", [{"text": f"x{c} y", "summary": "s"} for c in letters])
    root = str(tmp_path / "c")

    def learn(held, seed=0):
        out = cache.prepare(cache.Request([_part(path, _task(), held, seed)], "t5", TRAINED, root, vocab_size=64))
        vocab = load_tokenizer(out["tokenizer"]).get_vocab()
        trained = set(range(10)) - set(holdout_indices(10, held, seed).tolist())
        assert {i for i, c in enumerate(letters) if c in vocab} == trained, (held, seed)
        return out["tokenizer"], out["built"]["tokenizers"]

    every, built = learn(0)
    assert built == 1
    three, built = learn(3)
    assert built == 1 and three != every
    other, built = learn(3, seed=1)
    assert built == 1 and other not in (every, three)
    assert learn(3) == (three, 0)


@pytest.mark.slow
def test_a_large_source_is_built_by_a_process_of_its_own(tmp_path, monkeypatch):
    """Above APART_BYTES a separate process reads and tokenizes (the training process never maps the source): the
    same arrays as a build in this process, and its errors are this process's one line."""
    from data import cache, mixture
    from data.sources import cache_root

    data = write_jsonl(tmp_path / "train.jsonl", synthetic.generate_split("train", 50, seed=2))
    cfg = __import__("config").load_config("finetuning", "tiny", {"dataset": data, "cache_dir": str(tmp_path / "c")})
    part = mixture.tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed)[0].part()
    req = cache.Request([part], "t5", "synthetic", cache_root(cfg.data.cache_dir))
    monkeypatch.setattr(cache, "APART_BYTES", 0)
    apart = cache.run(req)
    here = cache.prepare(cache.Request([part], "t5", "synthetic", str(tmp_path / "here")))
    assert apart["built"] == {"texts": 1, "tokens": 1, "tokenizers": 0}
    a, b = cache.TokenSet(apart["tokens"][0]), cache.TokenSet(here["tokens"][0])
    assert len(a) == 50 and all(np.array_equal(a.examples.inputs[i], b.examples.inputs[i]) for i in range(50))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"premise": "a", "hypothesis": "b", "label": 0}, {"premise": "a"}])
    cfg.data.dataset = bad
    with pytest.raises(DataError, match=r"bad.jsonl: row 1 \(line 2\): column 'hypothesis' is missing"):
        part = mixture.tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed)[0].part()
        cache.run(cache.Request([part], "t5", "synthetic", str(tmp_path / "c")))


# ------------------------------------------------------------------------------- 2. a learnt tokenizer's size
def sort_rows(path, n=600, seed=0):
    """The task nobody here wrote: sort three numbers (of 0-999: a thousand words)."""
    import random

    rng = random.Random(seed)
    rows = [[rng.randrange(1000) for _ in range(3)] for _ in range(n)]
    path.write_text("".join(json.dumps({"numbers": " ".join(map(str, xs)), "sorted": " ".join(map(str, sorted(xs)))})
                            + "\n" for xs in rows))
    return str(path)


def test_a_learnt_tokenizer_that_fills_a_small_vocabulary_says_so_with_the_size_that_holds_the_data(tmp_path,
                                                                                                   caplog):
    """The choice: the model's vocabulary stays the config's (part of the model's shape), and a tokenizer that fills
    it while splitting the data's words finely says so in one line, at every run that uses it, with the size that
    holds them whole, which then says nothing."""
    from config import load_config
    from data import cache, mixture

    data = sort_rows(tmp_path / "sort.jsonl")

    def learn(vocab):
        cfg = load_config("finetuning", "tiny", {"dataset": data, "input_template": "sort: {numbers}",
                                                 "target_column": "sorted", "labels": "none", "tokenizer": "train"})
        part = mixture.tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed)[0].part()
        req = cache.Request([part], "t5", "train", str(tmp_path / "c"), vocab_size=vocab)
        caplog.clear()
        with caplog.at_level("INFO", logger="flan_t5"):
            folder = cache.prepare(req)["tokenizer"]
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        return folder, said

    folder, said = learn(128)
    assert len(said) == 1 and "filled --vocab_size 128" in said[0], said
    size = int(said[0].rsplit("--vocab_size ", 1)[1])
    assert size % 128 == 0 and size > 128
    assert learn(128) == (folder, said)  # the cached tokenizer: said again, nothing learnt again
    bigger, quiet = learn(size)
    from data.tokenizer import load_tokenizer

    assert quiet == [] and len(load_tokenizer(bigger)) <= size
    assert len(load_tokenizer(bigger)("sort: 5 712 48", add_special_tokens=False)["input_ids"]) == 4  # words whole
