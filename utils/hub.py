"""The Hugging Face hub, for downloads only when they can happen: the local cache first, then a quick check that
the hub answers at all (a machine with no network would otherwise spend a minute in retries before failing)."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")


def reachable(timeout: float = 3.0) -> bool:
    """Whether the hub's endpoint accepts a connection within ``timeout`` seconds."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


def fetch(load, name: str, what: str, fix: str, error):
    """``load(local_files_only=True)`` from the cache; else, when the hub answers, ``load(local_files_only=False)``;
    else ``error`` (an exception class) at once: no network, what could not be had, and ``fix``."""
    try:
        return load(local_files_only=True)
    except Exception:
        pass
    if offline() or not reachable():
        raise error(f"cannot download {what} '{name}': no network (the Hugging Face hub does not answer"
                    f"{'; HF_HUB_OFFLINE is set' if offline() else ''}) and it is not in the local cache: {fix}")
    return load(local_files_only=False)
