"""Logging of the drivers: one format, lines above a progress bar on a terminal, process 0 alone at INFO."""

from __future__ import annotations

import logging
import sys

from app.runtime import distributed_requested, rank_from_env

logger = logging.getLogger("flan_t5")


class _ProgressFriendly(logging.StreamHandler):
    """On a terminal, log lines are written above the progress bar (tqdm.write) instead of through it."""

    def emit(self, record):
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup_logging(level: int = logging.INFO) -> None:
    """The drivers' log lines on stderr."""
    handlers = [_ProgressFriendly(sys.stderr)] if sys.stderr.isatty() else None
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        handlers=handlers)
    if distributed_requested() and rank_from_env() > 0:  # from the start, before JAX knows the process index
        logger.setLevel(logging.WARNING)
    for noisy in ("absl", "orbax", "jax", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
