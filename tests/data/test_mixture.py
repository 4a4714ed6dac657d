"""Mixtures of tasks (data/mixture.py, data/loader.py): a mixture's stream is deterministic for a seed, resumes
exactly and follows its rates (explicit, or examples-proportional with a cap); the rows held out are exactly N,
never trained on, and follow the run's seed; --eval_every on a single file with nothing held out is refused; a
directory of splits is scored on its validation file and a mixture task's split is named as set; the tiny_mixture
preset learns both of its tasks; --eval_every and run_validation.py score each task with its own metrics and name it
(both families); the checkpoint carries its mixture."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import run_finetuning
import run_validation
from config import load_config
from data import mixture
from data.loader import BLOCK, TrainLoader
from data.packing import Examples
from modelling import registry
from modelling.rows import RowShape
from tests.env import run_optimized
from tests.helpers import SMALL, nli_file, params_at, qa_dir, write_jsonl
from tests.helpers import fails as _fails


def _numbered(n, first):
    """n examples whose input is [first + index, eos]."""
    return Examples([np.array([first + i, 1]) for i in range(n)], [np.array([5, 1]) for _ in range(n)])


def test_a_mixture_stream_is_deterministic_resumable_and_follows_its_rates():
    tasks = [_numbered(50, 1000), _numbered(400, 2000)]
    kw = dict(fmt=registry.get("t5").rows, shape=RowShape(8, 2, 4, packing=True), rates=[1.0, 3.0])
    a = TrainLoader(tasks, 8, 2, seed=3, **kw)
    batches, states, counts = [], [], []
    for _ in range(40):
        states.append(a.state())
        batches.append(a.next_batch())
        counts.append(a.batch_tasks)
    # the draws follow the rates: a quarter of the examples from the first task (which wraps into its next epochs)
    share = np.sum(counts, axis=0) / np.sum(counts)
    assert abs(share[0] - 0.25) < 0.05 and states[-1]["data_task_positions"][0] > 50, share
    firsts = np.concatenate([b["input_ids"][..., 0].ravel() for b in batches])
    assert set(firsts[firsts > 0] // 1000) == {1, 2}
    for k in (7, 23):  # resumed from a checkpoint's state: exactly the same next batches
        b = TrainLoader(tasks, 8, 2, seed=3, **kw)
        b.restore(json.loads(json.dumps(states[k])))
        for want in batches[k:k + 3]:
            got = b.next_batch()
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
    c = TrainLoader(tasks, 8, 2, seed=4, **kw)
    assert not np.array_equal(c.next_batch()["input_ids"], batches[0]["input_ids"])
    # examples-proportional with T5's cap K, and explicit rates
    cfg = load_config("finetuning", "tiny_mixture", {"mixture_cap": 500})
    assert mixture.rates(cfg.mixture, [20000, 300]) == [500.0, 300.0]
    cfg = load_config("finetuning", "tiny_mixture", {"mixture_rates": [1, 3]})
    assert mixture.rates(cfg.mixture, [20000, 300]) == [1.0, 3.0]
    assert mixture.shares(["a", "b"], [20000, 300], [1.0, 3.0])["b"] == {"examples": 300, "rate": 3.0, "share": 0.75}


# --------------------------------------------------------------------------- the stream's contracts, as properties
PROPERTY = settings(max_examples=12, deadline=None)


def _loader(sizes, rates, seed, rows=1, family="t5", packing=False, concat=False):
    """A mixture of tasks of ``sizes`` numbered examples: task t's example i has input [1000 (t + 1) + i, eos]
    (inputs of 2 to 5 tokens: the packer and a causal stream cut and hold some over)."""
    tasks = [Examples([np.array([1000 * (t + 1) + i] * (1 + i % 4) + [1]) for i in range(n)],
                      [np.array([5, 1]) for _ in range(n)]) for t, n in enumerate(sizes)]
    shape = RowShape(8, 2, 4, packing=packing, concat=concat)
    return TrainLoader(tasks, rows, 1, seed=seed, fmt=registry.get(family).rows, shape=shape, rates=rates)


def _stream(loader, n):
    """The next n global ids of the stream, and each one's task."""
    it = loader._stream()
    ids = np.fromiter((next(it) for _ in range(n)), np.int64, n)
    return ids, np.searchsorted(loader.starts, ids, side="right") - 1


_rates = st.lists(st.integers(1, 6), min_size=2, max_size=4)


@PROPERTY
@given(rates=_rates, seed=st.integers(0, 2 ** 32 - 1))
def test_a_long_mixture_stream_follows_its_rates_and_no_two_blocks_draw_alike(rates, seed):
    """Guards the block in the draw's seed (without it every BLOCK positions repeat one task sequence), and the
    rates: over 8 blocks each task's share is its rate's, within 5 standard deviations."""
    loader = _loader([50] * len(rates), rates, seed)
    n = 8 * BLOCK
    _, tasks = _stream(loader, n)
    blocks = {tasks[b * BLOCK:(b + 1) * BLOCK].tobytes() for b in range(8)}
    assert len(blocks) == 8
    p = np.asarray(rates) / sum(rates)
    share = np.bincount(tasks, minlength=len(rates)) / n
    assert np.all(np.abs(share - p) < 5 * np.sqrt(p * (1 - p) / n)), (share, p)


@PROPERTY
@given(k=st.integers(2, 3), n=st.integers(10, 40), seed=st.integers(0, 2 ** 32 - 1))
def test_equal_size_tasks_each_visit_their_examples_in_an_order_of_their_own(k, n, seed):
    """Guards the task index in an epoch's order (without it equal-size tasks of a mixture visit their examples in
    the same order): each task's epoch is a permutation of its examples, its own, and the next epoch another."""
    loader = _loader([n] * k, [1] * k, seed)
    ids, tasks = _stream(loader, 5 * n * k)
    orders = [ids[tasks == t] - loader.starts[t] for t in range(k)]
    assert all(len(o) >= 2 * n for o in orders)
    for o in orders:
        assert sorted(o[:n]) == sorted(o[n:2 * n]) == list(range(n)) and list(o[:n]) != list(o[n:2 * n])
    firsts = {tuple(o[:n]) for o in orders}
    assert len(firsts) == k


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(3, 30), min_size=1, max_size=3), seed=st.integers(0, 1000),
       layout=st.sampled_from([("t5", False, False), ("t5", True, False), ("gptj", True, False),
                               ("gptj", True, True)]),
       rows=st.integers(1, 3), batches=st.integers(1, 12), data=st.data())
def test_a_stream_resumed_at_any_batch_continues_as_the_uninterrupted_one(sizes, seed, layout, rows, batches, data):
    """Resume at any position (one task or a mixture; padded, packed, or a causal LM's concatenated stream, whose
    held-over examples and cut example travel in the state): the same batches as the run that never stopped."""
    family, packing, concat = layout
    rates = data.draw(st.lists(st.integers(1, 4), min_size=len(sizes), max_size=len(sizes)))
    a = _loader(sizes, rates, seed, rows, family, packing, concat)
    states, want = [], []
    for _ in range(batches + 2):
        states.append(json.loads(json.dumps(a.state())))
        want.append(a.next_batch())
    k = data.draw(st.integers(0, batches))
    b = _loader(sizes, rates, seed, rows, family, packing, concat)
    b.restore(states[k])
    for w in want[k:]:
        got = b.next_batch()
        assert set(got) == set(w) and all(np.array_equal(got[key], w[key]) for key in w)
    assert b.state() == a.state()


def test_a_holdout_of_every_training_row_is_refused_and_one_less_is_not():
    """Guards ``holdout >= n`` (with ``>`` a holdout of every row was accepted: a run of 0 training examples)."""
    from data.sources import DataError

    for n in (1, 5, 300):
        with pytest.raises(DataError, match=f"--holdout {n} holds out every one of the {n} training examples of f"):
            mixture.held_rows(SimpleNamespace(holdout=n, seed=0), n, "f")
        with pytest.raises(DataError, match="pass a smaller --holdout"):
            mixture.held_rows(SimpleNamespace(holdout=n + 1, seed=0), n, "f")
        held = mixture.held_rows(SimpleNamespace(holdout=n - 1, seed=3), n, "f")
        assert len(held) == len(set(held.tolist())) == n - 1 and list(held) == sorted(held) and np.all(held < n)


@pytest.mark.parametrize("flags,message", [
    (["--mixture_rates", "1"], "give one rate (>= 0, not all 0) for each of the 2 mixture tasks"),
    (["--mixture", "tiny", "nope"], "mixture task 'nope' is not a preset of config/finetuning.yml"),
    (["--mixture", "{name: a, dataset: synthetic}", "{name: a, dataset: synthetic}"], "appear more than once"),
    (["--mixture", "{name: a, dataset: synthetic, metrics: [accuracy], labels: none}"],
     "mixture task 'a': metrics accuracy needs a label set"),
])
def test_a_bad_mixture_is_one_line_naming_the_fix(flags, message):
    from app.args import parse_config
    from config import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_config("finetuning", "", "tiny_mixture", flags)


@pytest.mark.slow
def test_the_tiny_mixture_learns_both_tasks_and_each_is_scored_and_named(tmp_path):
    """The tiny T5 on the synthetic NLI task and the headlines task at once (a tokenizer learnt from both): each task
    is scored with its own metrics during training and by validation with no task flag (the checkpoint carries the
    mixture). Measured at 100 steps: NLI accuracy 0.70 (chance 1/3), headlines exact match 0.51 (chance < 1%)."""
    save = str(tmp_path / "ck")
    log = run_optimized("run_finetuning.py", ["--config", "tiny_mixture", "--steps", "100", "--eval_every", "100",
                                              "--eval_rows", "64", "--save", save, "--checkpoint_steps", "0"])
    lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    assert lines[0]["mixture"] == {"nli": {"examples": 20000, "rate": 20000.0, "share": 0.5},
                                   "headlines": {"examples": 20000, "rate": 20000.0, "share": 0.5}}
    assert lines[0]["examples_nli"] + lines[0]["examples_headlines"] == lines[0]["examples"]
    last = lines[-1]
    assert last["eval_nli_accuracy"] > 0.5 and last["eval_headlines_exact_match"] > 0.25, last
    assert last["eval_headlines_rougeL"] >= last["eval_headlines_exact_match"]
    assert last["eval_score"] == pytest.approx((last["eval_nli_accuracy"] + last["eval_headlines_exact_match"]) / 2)
    assert "the best mixture eval_score" in log
    run_validation.main(["--load", save, "--limit", "32"])
    nli, headlines = (json.load(open(os.path.join(save, f"validation_{t}_step100_first32.json")))
                      for t in ("nli", "headlines"))
    assert nli["task"] == "nli" and nli["metrics"] == ["accuracy"] and nli["dataset"] == "synthetic"
    assert headlines["task"] == "headlines" and set(headlines["scores"]) == {"exact_match", "rouge1", "rouge2",
                                                                             "rougeL"}
    assert nli["accuracy"] > 0.5 and headlines["scores"]["exact_match"] > 0.25


GPTJ_MIXTURE = ["--config", "gptj_tiny", "--tokenizer", "train", "--global_batch_size", "8", "--micro_batch_size", "2",
                "--warmup_steps", "0", "--loss_tokens", "target", "--mixture", "{name: nli, dataset: synthetic}",
                "{name: headlines, dataset: synthetic-headlines, input_template: 'summarize: {text}', "
                "target_column: summary, labels: none, split: validation}", "--mixture_rates", "1", "3"]


@pytest.mark.slow
def test_a_gptj_mixture_resumes_exactly_and_each_task_is_scored_by_name(tmp_path, caplog):
    """GPT-J on a one-off mixture (flags): stopped and resumed, its stream ends where the uninterrupted one does
    (each task's position; the weights then follow, as every resume test shows); --eval_every and validation name
    each task's scores, validation with no task flag (the checkpoint carries the mixture) and warning when
    references are longer than output_length."""
    from app.args import parse_config
    from app.train_data import training_data

    b = str(tmp_path / "b")
    run_finetuning.main(GPTJ_MIXTURE + ["--steps", "2", "--save", b])
    run_finetuning.main(GPTJ_MIXTURE + ["--steps", "3", "--save", b, "--load", b, "--eval_every", "3",
                                        "--eval_rows", "8"])
    meta, _ = params_at(b, 3)
    cfg, _ = parse_config("finetuning", "", "gptj_tiny", GPTJ_MIXTURE[2:])
    straight = training_data(cfg, registry.get("gptj"), str(tmp_path / "run"))  # the cache: nothing tokenized
    for _ in range(3):
        straight.next_batch()
    assert straight.state() == {k: meta[k] for k in ("data_position", "data_pending", "data_task_positions")}
    assert [t["name"] for t in meta["config"]["mixture"]["tasks"]] == ["nli", "headlines"]
    last = [json.loads(x) for x in open(os.path.join(b, "metrics.jsonl"))][-1]
    assert {"eval_nli_accuracy", "eval_headlines_exact_match", "eval_headlines_rougeL", "eval_score"} <= set(last)
    with caplog.at_level(logging.WARNING, logger="flan_t5"):
        run_validation.main(["--load", b, "--limit", "4", "--output_length", "1"])
    assert "references of synthetic-headlines:validation are longer than output_length 1 tokens" in caplog.text
    assert "pass --output_length" in caplog.text
    for name in ("nli_mismatched", "headlines"):  # each task's split: validation_mismatched, validation
        assert json.load(open(os.path.join(b, f"validation_{name}_step3_first4.json")))["samples"] == 4


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


def test_eval_every_on_a_single_file_with_nothing_held_out_is_refused_and_leaves_no_directory(tmp_path, capsys,
                                                                                              monkeypatch):
    import run_finetuning

    data = nli_file(tmp_path / "train.jsonl")
    monkeypatch.chdir(tmp_path)  # (the fresh run directory goes under ./runs)
    save = tmp_path / "ck"
    _fails(capsys, run_finetuning.main, SMALL + ["--dataset", data, "--steps", "2", "--eval_every", "1",
                                                 "--save", str(save)], "pass --holdout N to score N rows held out")
    _fails(capsys, run_finetuning.main, SMALL + ["--dataset", data, "--steps", "2", "--eval_every", "1"],
           "--eval_every would score rows the run trains on")
    assert not save.exists() and not (tmp_path / "runs").exists()  # nothing of the refused runs is left
    # --load of a directory that does not exist makes none
    nope = tmp_path / "nope"
    _fails(capsys, run_finetuning.main, SMALL + ["--load", str(nope), "--save", str(nope)], str(nope))
    assert not nope.exists()


QA_TASK = "{{name: qa, dataset: {}, input_column: question, target_column: answer, labels: none}}"


def test_a_directory_of_splits_is_scored_on_its_validation_file_and_a_mixture_task_s_split_is_named_as_set(
        tmp_path, capsys):
    import run_finetuning
    from config import load_config
    from data import cache
    from data.mixture import evaluation_sets, tasks_of

    own = qa_dir(tmp_path / "qa")
    cfg = load_config("finetuning", "tiny", {"mixture": ["tiny_headlines", QA_TASK.format(own)]})
    qa = tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed)[1]
    assert qa.split == "validation"  # not told: the directory's validation file
    assert evaluation_sets([qa])[0].what.endswith("validation.jsonl")
    # --split reaches the mapping tasks that name none (it did not: the default was always MNLI's)
    dev = qa_dir(tmp_path / "dev", ("train", "dev"))
    cfg = load_config("finetuning", "tiny", {"mixture": ["tiny_headlines", QA_TASK.format(dev)], "split": "dev"})
    assert tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed)[1].split == "dev"
    assert evaluation_sets(tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed))[1].what.endswith("dev.jsonl")
    # a split that is not there: the fix names the mapping key that works, before anything is read or tokenized
    val = qa_dir(tmp_path / "val", ("train", "valid"))
    argv = ["--config", "tiny", "--mixture", "tiny_headlines", QA_TASK.format(val), "--eval_every", "2",
            "--steps", "2", "--tokenizer", "train", "--vocab_size", "256"]
    before = dict(cache.BUILDS)
    err = _fails(capsys, run_finetuning.main, argv, "in task qa's mapping")
    assert "name one of its splits (train, valid) with split: NAME in task qa's mapping" in err, err
    assert cache.BUILDS == before  # nothing read or tokenized first (it was, for 12-19 s)
