"""A sequence's sampling controls beyond temperature, top-k and top-p, as the scheduler carries them to the slots:
OpenAI's penalties and ``logit_bias``, vLLM's ``repetition_penalty``, ``min_p``, ``min_tokens``, ``ignore_eos`` and
``stop_token_ids``, and the allowed tokens a grammar or ``allowed_token_ids`` give (decoder/grammar.py's, asked of the
host at each step under the row's key). No JAX here: ``row`` is what an insert packs for the row
(decoder/slot_programs.py's ``pack_joiners``), modelling/processors.py's ``RowControls`` on the device.

A row's table (``processors.TABLE`` entries) holds its bias, each entry held always, and, below ``min_tokens``, its
end-of-text token (unless ``ignore_eos``) and its stop tokens at -inf: what vLLM's ``min_tokens`` holds back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ALWAYS = 2 ** 31 - 1  # an entry held at every token (modelling/processors.py's UNTIL_ALWAYS)
TABLE = 320  # a row's table (modelling/processors.py's TABLE; tests/serving hold the two equal)


@dataclass(frozen=True)
class Controls:
    """One sequence's controls (serving/api.py's checked fields): every default asks for nothing."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_ids: tuple = ()  # tokens that end the sequence (kept in its output, as vLLM keeps them)
    bias: tuple = ()  # ((token id, bias), ...)
    constraint: Any = None  # the allowed tokens asked of the host (a grammar, or a set of ids); None: any token

    def entries(self, eos_id: int) -> tuple:
        """The row's table: ((token, bias, held below this token index), ...)."""
        held = ((() if self.ignore_eos else (eos_id,)) + tuple(self.stop_ids)) if self.min_tokens else ()
        return (tuple((int(t), float(b), ALWAYS) for t, b in self.bias)
                + tuple((int(t), float("-inf"), int(self.min_tokens)) for t in dict.fromkeys(held)))

    def row(self, key: int, eos_id: int) -> tuple:
        """What an insert packs for the row: (presence, frequency, repetition, min_p, ignore_eos, the host's key
        (0: none), the table's entries)."""
        return (self.presence, self.frequency, self.repetition, self.min_p, self.ignore_eos, key,
                self.entries(eos_id))


NONE = Controls()
