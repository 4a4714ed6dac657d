"""MNLI preprocessing, local-file loading, malformed input and the resumable loader."""

import json
import logging

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from data import synthetic
from data.loader import TrainLoader
from data.sources import DataError
from tests.mnli import load_rows, score, tokenize_training
from modelling import registry
from data.packing import Examples
from modelling.rows import RowShape

VOCAB = {w: i for i, w in enumerate(synthetic.vocabulary())}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_preprocessing_of_a_hand_written_file_gives_exact_ids(tmp_path, caplog):
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"premise": "the cat runs .", "hypothesis": "the cat runs .", "label": 0},
        {"premise": "the dog sleeps .", "hypothesis": "a dog sleeps tonight .", "label": 1},
        {"premise": "the dog sleeps .", "hypothesis": "the dog runs .", "label": -1},
    ])
    with caplog.at_level(logging.INFO, logger="flan_t5"):
        rows = load_rows(path, "train")
    assert "dropped 1 rows with label -1" in caplog.text
    assert len(rows) == 2
    f = tokenize_training(rows, synthetic.make_tokenizer(), 16, 4, registry.get("t5"))
    # the vocabulary's ids, written out: mnli 8, hypothesis: 9, premise: 10, the 3, a 4, . 7,
    # cat 14, dog 15, runs 32, sleeps 33, tonight 49; entailment 11, neutral 12; </s> 1, <pad> 0
    assert [VOCAB[w] for w in ("mnli", "hypothesis:", "premise:", "cat", "runs", "tonight", "neutral")] == \
        [8, 9, 10, 14, 32, 49, 12]
    np.testing.assert_array_equal(f["input_ids"], [
        [8, 9, 3, 14, 32, 7, 10, 3, 14, 32, 7, 1, 0, 0, 0, 0],
        [8, 9, 4, 15, 33, 49, 7, 10, 3, 15, 33, 7, 1, 0, 0, 0]])
    np.testing.assert_array_equal(f["attention_mask"], [[1] * 12 + [0] * 4, [1] * 13 + [0] * 3])
    np.testing.assert_array_equal(f["labels"], [[11, 1, -100, -100], [12, 1, -100, -100]])
    np.testing.assert_array_equal(f["decoder_input_ids"], [[0, 11, 1, 0], [0, 12, 1, 0]])
    np.testing.assert_array_equal(f["decoder_attention_mask"], [[1, 1, 0, 0], [1, 1, 0, 0]])


def test_truncation_to_sequence_length(tmp_path):
    rows = [{"premise": "the cat runs in the park .", "hypothesis": "the cat runs .", "label": 2}]
    f = tokenize_training(rows, synthetic.make_tokenizer(), 5, 1, registry.get("t5"))
    np.testing.assert_array_equal(f["input_ids"], [[8, 9, 3, 14, 32]])
    np.testing.assert_array_equal(f["labels"], [[13]])


@pytest.mark.parametrize("suffix", ["csv", "parquet", "json"])
def test_other_file_types_load(tmp_path, suffix):
    import pandas as pd

    df = pd.DataFrame({"premise": ["the cat runs ."], "hypothesis": ["the cat runs ."], "label": [0]})
    path = str(tmp_path / f"validation_mismatched.{suffix}")
    {"csv": lambda: df.to_csv(path, index=False), "parquet": lambda: df.to_parquet(path),
     "json": lambda: df.to_json(path, orient="records")}[suffix]()
    assert load_rows(str(tmp_path), "validation_mismatched") == [
        {"premise": "the cat runs .", "hypothesis": "the cat runs .", "label": 0}]


@pytest.mark.parametrize("rows,message", [
    ([{"premise": "a", "label": 0}], r"row 0 \(line 1\): column 'hypothesis' is missing"),
    ([{"premise": "a", "hypothesis": "b", "label": 0}, {"premise": [3], "hypothesis": "b", "label": 0}],
     r"row 1 \(line 2\): column 'premise' must be text, got \[3\] \(list\)"),
    ([{"premise": True, "hypothesis": "b", "label": 0}], r"row 0 \(line 1\): column 'premise' must be text"),
    ([{"premise": "a", "hypothesis": "b", "label": "yes"}], r"row 0 \(line 1\): column 'label' must be 0, 1, 2"),
    ([{"premise": "a", "hypothesis": "b", "label": 7}], r"row 0 \(line 1\): column 'label' must be 0, 1, 2"),
])
def test_malformed_rows_name_file_row_and_column(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataError, match=message) as e:
        load_rows(path, "train")
    assert path in str(e.value)


def test_empty_and_unreadable_files(tmp_path):
    empty = tmp_path / "train.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="train.jsonl"):
        load_rows(str(empty), "train")
    bad = tmp_path / "x.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DataError, match="cannot be read"):
        load_rows(str(bad), "train")
    with pytest.raises(DataError, match="has no validation_mismatched"):
        load_rows(str(tmp_path / ".."), "validation_mismatched")


def test_hub_dataset_without_network_says_how_to_pass_a_file(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="--dataset PATH"):
        load_rows("glue/mnli", "validation_mismatched")


def test_synthetic_labels_follow_from_content():
    for r in synthetic.generate_split("train", 300):
        p, h = r["premise"].split(), r["hypothesis"].split()
        has_time = any(w in synthetic.TIMES for w in h)
        changed = any(w not in p for w in h if w not in synthetic.TIMES)
        assert r["label"] == (2 if changed else 1 if has_time else 0), r
    assert synthetic.generate_split("train", 5) == synthetic.generate_split("train", 5)
    assert synthetic.generate_split("validation", 5) != synthetic.generate_split("train", 5)


def _numbered(n):
    """n examples whose first prompt token is 3 + their index."""
    return Examples([np.array([3 + i, 1]) for i in range(n)], [np.array([5, 1]) for _ in range(n)])


def test_loader_is_deterministic_and_resumable():
    kw = dict(fmt=registry.get("t5").rows, shape=RowShape(4, 2, 2))
    a = TrainLoader(_numbered(10), 4, gradient_accumulation=2, seed=3, **kw)
    batches = [a.next_batch()["input_ids"][..., 0] - 3 for _ in range(5)]  # crosses two epoch boundaries
    assert batches[0].shape == (2, 2)
    seen = np.concatenate([b.ravel() for b in batches])
    assert sorted(seen[:10]) == list(range(10))  # an epoch visits every sample once
    b = TrainLoader(_numbered(10), 4, 2, seed=3, **kw)
    b.restore({"data_position": 8})
    np.testing.assert_array_equal(b.next_batch()["input_ids"][..., 0] - 3, batches[2])
    c = TrainLoader(_numbered(10), 4, 2, seed=4, **kw)
    assert not np.array_equal(c.next_batch()["input_ids"][..., 0] - 3, batches[0])


def test_accuracy_on_hand_written_predictions():
    labels = [0, 0, 1, 2, 2, 1]
    generated = ["entailment", "neutral", "neutral</s>", "contradiction", "maybe", " entailment "]
    r = score(labels, generated)
    assert r["correct"] == 3 and r["samples"] == 6 and r["accuracy"] == 0.5
    assert r["unknown"] == 1
    assert r["confusion_matrix"]["counts"] == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]]
    assert r["per_class"]["contradiction"] == {"support": 2, "correct": 1, "accuracy": 0.5}
    assert r["predictions"] == ["entailment", "neutral", "neutral", "contradiction", "unknown", "entailment"]
    assert r["generated"] == generated


# --------------------------------------------------------------------------- the caches (data/cache.py)


def _builds():
    from data import cache

    return dict(cache.BUILDS)


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


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_the_loader_holds_no_memory_per_example(tmp_path):
    """Three million examples of memory-mapped tokens (about 120 MiB on disk, more than SMALL: the computed
    shuffle) and 2000 held out: building the loader and drawing packed batches adds a few MiB, not the data."""
    from data import cache
    from data.loader import TaskStream, holdout_indices

    n = 3_000_000
    path = tmp_path / "tokens"
    path.mkdir()
    for name, k in (("input", 4), ("target", 2)):
        np.arange(n * k, dtype=np.int32).__mod__(100).astype(np.int32).tofile(path / f"{name}.bin")
        np.arange(0, n * k + 1, k, dtype=np.int64).tofile(path / f"{name}.off")
    (path / "meta.json").write_text(json.dumps({"n": n, "where": "generated"}))
    before = _rss_mib()
    tokens = cache.TokenSet(str(path))
    loader = TrainLoader(TaskStream(tokens.examples, holdout_indices(n, 2000, 0)), 32, 2, seed=1,
                         fmt=registry.get("t5").rows, shape=RowShape(64, 4, 16, packing=True))
    state = None
    for step in range(20):
        state = loader.state() if step == 10 else state
        last = loader.next_batch()
    grown = _rss_mib() - before
    assert grown < 24, f"{grown:.1f} MiB"  # the arrays are 126 MiB
    again = TrainLoader(TaskStream(tokens.examples, holdout_indices(n, 2000, 0)), 32, 2, seed=1,
                        fmt=registry.get("t5").rows, shape=RowShape(64, 4, 16, packing=True))
    again.restore(state)
    for _ in range(9):
        again.next_batch()
    np.testing.assert_array_equal(again.next_batch()["input_ids"], last["input_ids"])


def test_the_computed_shuffle_is_a_permutation():
    from data.loader import Shuffle

    for n in (1, 7, 1000, 4097):
        order = Shuffle(n, (3, 1))(np.arange(n))
        assert sorted(order) == list(range(n))
    assert not np.array_equal(Shuffle(1000, (3, 1))(np.arange(1000)), Shuffle(1000, (3, 2))(np.arange(1000)))


def test_the_fast_batch_encoding_gives_the_tokenizer_s_own_ids(tmp_path):
    """The cache tokenizes through the Rust tokenizer directly (data.tasks.FastEncoder): the family's inputs and
    targets get the ids the transformers tokenizer gives them (the word-level one and a learnt BPE one)."""
    from tests.mnli import train_tokenizer
    from data.tasks import encoder_of

    rows = synthetic.generate_split("train", 64, seed=4)
    texts = [f"premise: {r['premise']} hypothesis: {r['hypothesis']}" for r in rows] + ["", "unknown wörds"]
    for tok in (synthetic.make_tokenizer(), train_tokenizer(rows, 128, str(tmp_path / "bpe"), registry.get("t5"))):
        for family in (registry.get("t5"), registry.get("gptj")):
            assert family.encode_inputs(encoder_of(tok), texts) == family.encode_inputs(tok, texts)
            assert family.encode_targets(encoder_of(tok), texts) == family.encode_targets(tok, texts)


_TOKENIZERS: list = []


def _both_tokenizers() -> list:
    """The word-level tokenizer and a learnt BPE one (learnt once per test process)."""
    if not _TOKENIZERS:
        import tempfile
        from tests.mnli import train_tokenizer

        rows = synthetic.generate_split("train", 64, seed=4)
        with tempfile.TemporaryDirectory() as scratch:
            _TOKENIZERS.extend([synthetic.make_tokenizer(), train_tokenizer(rows, 128, scratch, registry.get("t5"))])
    return _TOKENIZERS


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(synthetic.vocabulary() + ["</s>", "<pad>", "wörds", "é", "\u4e2d", "  ", "\n",
                                                            "x" * 9, ".", "the cat", ""]), max_size=12),
       st.sampled_from([" ", "", "  "]))
def test_one_prompt_through_the_rust_tokenizer_gets_the_tokenizer_s_ids(words, sep):
    """A server's prompt goes alone to the Rust tokenizer's ``encode`` (data.tasks.FastEncoder, not its batch path):
    each family's inputs and targets get exactly the ids the transformers tokenizer gives that one text (special
    tokens written in the text, unknown words and characters, empty and blank texts included)."""
    from data.tasks import encoder_of

    text = sep.join(words)
    for tok in _both_tokenizers():
        for family in (registry.get("t5"), registry.get("gptj")):
            assert family.encode_inputs(encoder_of(tok), [text]) == family.encode_inputs(tok, [text]), text
            assert family.encode_targets(encoder_of(tok), [text]) == family.encode_targets(tok, [text]), text


def test_the_rust_encoding_ignores_truncation_and_padding_left_in_the_tokenizer():
    """A tokenizer.json may carry truncation and padding, and transformers' call sets them per call on the Rust
    tokenizer it shares: FastEncoder's copy has neither, so one text or several get the tokenizer's own ids, before
    and after a call of the tokenizer that set them."""
    from data.tasks import encoder_of

    tok = synthetic.make_tokenizer()
    tok.backend_tokenizer.enable_truncation(3)
    tok.backend_tokenizer.enable_padding(length=9)
    texts = ["the cat sleeps in the park .", "a dog"]
    encoder = encoder_of(tok)
    want = [tok([t])["input_ids"][0] for t in texts]
    assert [len(x) for x in want] == [8, 3]  # (the call itself neither truncates nor pads)
    assert [encoder([t])["input_ids"][0] for t in texts] == want and encoder(texts)["input_ids"] == want
    tok(texts, truncation=True, max_length=2, padding="max_length")  # a call that leaves both set
    assert [encoder([t])["input_ids"][0] for t in texts] == want and encoder(texts)["input_ids"] == want


@pytest.mark.parametrize("n,held", [(300, 37), (5000, 1)])
def test_the_held_out_rows_are_exactly_n_and_never_trained_on(tmp_path, n, held):
    """--holdout N: evaluation scores exactly N rows of the training split and the training stream visits every
    other row once and none of those N (each row's target names its index)."""
    from app.train_data import training_data
    from config import load_config
    from data.mixture import evaluation_set, tasks_of

    rows = [{"text": f"the dog runs {i % 7}", "summary": f"r{i}"} for i in range(n)]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)
    cfg = load_config("finetuning", "tiny", {
        "dataset": data, "input_template": "{text}", "target_column": "summary", "labels": None,
        "metrics": ["exact_match"], "tokenizer": "train", "holdout": held, "cache_dir": str(tmp_path / "cache")})
    loader = training_data(cfg, registry.get("t5"), run_dir=str(tmp_path / "run"))
    stream = loader.tasks[0]
    trained = [int(stream.index(j)) for j in range(stream.size)]
    td = tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed)[0]
    scored = [int(e.target[1:]) for e in evaluation_set(td).examples]
    assert len(scored) == len(set(scored)) == held
    assert len(trained) == len(set(trained)) == n - held
    assert not set(scored) & set(trained) and set(scored) | set(trained) == set(range(n))
    # and the stream reads those rows' tokens: the target at a trained index is that row's target
    j = trained[len(trained) // 2]
    assert loader.tokenizer.decode(stream.examples.targets[j], skip_special_tokens=True).replace(" ", "") == f"r{j}"


@pytest.mark.parametrize("mixed", [False, True])
def test_the_rows_held_out_follow_the_run_s_seed_for_a_task_alone_or_in_a_mixture(tmp_path, mixed):
    """Which rows --holdout keeps out is drawn from the run's seed (--seed), for a mixture's task as for a task
    alone: seeds 1 and 2 hold out holdout_indices(n, N, seed) each, and different rows."""
    from config import load_config
    from data.loader import holdout_indices
    from data.mixture import held_out, tasks_of

    data = write_jsonl(tmp_path / "rows.jsonl", [{"question": f"q {i}", "answer": f"a{i}"} for i in range(60)])
    held = {}
    for seed in (1, 2):
        if mixed:
            task = (f"{{name: qa, dataset: {data}, input_column: question, target_column: answer, labels: none, "
                    "holdout: 7}")
            over = {"mixture": ["tiny_headlines", task]}
        else:
            over = {"dataset": data, "input_template": "{question}", "target_column": "answer", "labels": None,
                    "holdout": 7}
        cfg = load_config("finetuning", "tiny", {**over, "seed": seed, "cache_dir": str(tmp_path / "cache")})
        td = tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed)[-1]
        assert td.part().seed == seed
        held[seed] = list(held_out(td)[1])
        assert held[seed] == list(holdout_indices(60, 7, seed))
    assert held[1] != held[2]
