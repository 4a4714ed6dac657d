"""The training loader (data/loader.py): deterministic and resumable, its shuffle computed (a permutation), and no
memory held per example over millions of memory-mapped ones."""

import json

import numpy as np

from data.loader import TrainLoader
from data.packing import Examples
from modelling import registry
from modelling.rows import RowShape


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
