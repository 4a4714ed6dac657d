"""The project's error base class: an expected failure, reported as one line that names the problem and the fix.

Every driver runs under ``utils.cli.entry``, which prints such an error as ``error: <message>``
and exits with its ``exit_code``, without a traceback. Anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


class FlanT5Error(Exception):
    """An expected failure: bad input, a missing file, a run that will not fit."""

    exit_code = 2


class TrainingDiverged(FlanT5Error):
    """The loss or the gradient norm became non-finite."""

    exit_code = 3


class OutOfMemory(FlanT5Error):
    """A device ran out of memory."""

    exit_code = 4
