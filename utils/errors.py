"""The project's errors: an expected failure, reported as one line that names the problem and the fix.

Every driver runs under ``app.entry.entry``, which prints such an error as ``error: <message>``
and exits with its ``exit_code``, without a traceback. Anything else is a bug and keeps its
traceback. The errors every floor raises live here, at the bottom.
"""

from __future__ import annotations


class FlanT5Error(Exception):
    """An expected failure: bad input, a missing file, a run that will not fit."""

    exit_code = 2


class ConfigError(FlanT5Error, ValueError):
    """A configuration problem; its message names the field and the fix."""


class DataError(FlanT5Error, ValueError):
    """A missing, unreadable or malformed dataset; the message names the file, row and column."""


class CheckpointError(FlanT5Error, RuntimeError):
    """A missing or unreadable model checkpoint; the message says how to fix it."""


class TrainingDiverged(FlanT5Error):
    """The loss or the gradient norm became non-finite."""

    exit_code = 3


class OutOfMemory(FlanT5Error):
    """A device ran out of memory."""

    exit_code = 4
