"""What a checkpoint carries of its config: the model's shape (``MODEL_SHAPE``: the fields declared ``shape``), which
never needs repeating to load it, and the task it was trained on (``TASK_FIELDS``), which its validation and
inference use unless told otherwise."""

from __future__ import annotations

from typing import Optional

from config.fields import coerce
from config.schema import FIELDS, MODEL_SHAPE, TASK_FIELDS, Config


def saved_value(saved: dict, flag: str):
    """A field of a saved config (a checkpoint's, a nested mapping) by its flag's name, coerced; the field's default
    where the checkpoint predates it."""
    ref, value = FIELDS[flag], saved
    for p in ref.path:
        if not (isinstance(value, dict) and p in value):
            return coerce(ref, ref.default)
        value = value[p]
    return coerce(ref, value)


def travelling(saved: dict) -> dict:
    """{flag: value} of the TASK_FIELDS a saved config (a checkpoint's) set to other than their default: a field
    it predates or left at its default is absent, so the decoding preset's own value stands (the tiny preset
    scores the synthetic ``validation`` split, as it always has)."""
    values = {flag: saved_value(saved, flag) for flag in TASK_FIELDS}
    return {flag: v for flag, v in values.items() if v != coerce(FIELDS[flag], FIELDS[flag].default)}


def model_shape(source) -> dict:
    """{flag: value} of the MODEL_SHAPE fields of a config, or of a nested config mapping (a checkpoint's)."""
    out = {}
    for flag in MODEL_SHAPE:
        ref = FIELDS[flag]
        value = source
        for p in ref.path:  # a checkpoint saved before a field existed has its default
            value = value.get(p, ref.default) if isinstance(value, dict) else getattr(value, p)
        out[flag] = coerce(ref, value)
    return out


def shape_hint(current: Optional[Config], saved: Optional[dict]) -> str:
    """How to run a checkpoint saved with config ``saved`` (a nested mapping) whose weights do not fit ``current``:
    the shape flags it was trained with, where they differ."""
    if not saved:
        return "use the preset and flags of the run that wrote it"
    theirs = model_shape(saved)
    if not theirs.get("lora_rank"):  # weights without adapters are any LoRA run's base: its LoRA fields are no
        theirs = {k: v for k, v in theirs.items() if FIELDS[k].path[0] != "lora"}  # part of their shape
    ours = model_shape(current) if current is not None else {k: FIELDS[k].default for k in theirs}
    return ("it was trained with " + " ".join(f"--{k} {v}" for k, v in theirs.items() if v != ours[k])
            + ": pass the same (or that run's preset)")
