"""The Hugging Face hub when there is no network (utils/hub.py): a tokenizer or a data set that is not in the local
cache is one line at once naming the offline choice (``--tokenizer train``, ``--dataset PATH``), with no request made
and no retries waited for."""

import time

import pytest


def test_no_network_is_one_line_at_once_naming_the_offline_choice(monkeypatch):
    from data.sources import DataError
    from data.tokenizer import load_tokenizer
    from utils import hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "reachable", lambda timeout=3.0: False)  # as on a machine with no network
    t0 = time.time()
    with pytest.raises(DataError, match=r"no network .* --tokenizer train"):
        load_tokenizer("google/flan-t5-small-not-cached")
    assert time.time() - t0 < 20  # the hub's retries took 52 s


def test_no_network_for_a_hub_data_set_is_one_line_without_a_download_attempt(monkeypatch):
    """--config small offline: its data set (nyu-mll/glue) is looked up in the local cache alone, then refused in one
    line naming --dataset PATH; no request is made (datasets' retries took 25 s)."""
    import datasets

    from data.sources import DataError, read
    from utils import hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "reachable", lambda timeout=3.0: False)
    calls = []

    def load_dataset(*a, **kw):
        calls.append(datasets.config.HF_HUB_OFFLINE)
        raise FileNotFoundError("not in the cache")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(DataError, match=r"no network .* --dataset PATH") as e:
        read("nyu-mll/glue", "train", hub_config="mnli")
    assert calls == [True] and "\n" not in str(e.value)  # the cache, offline; never the network
