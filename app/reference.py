"""docs/configuration.md: every config field, each a flat flag of every driver, from the config's own declarations
(its section, default, checks and docstring) and the model families' (the fields a family declares as its own,
modelling/registry.py adds to the config), so the reference never disagrees with ``--help``.

    python3 -m app.reference --output docs/configuration.md     # tests/test_docs.py checks it is current
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing

from config.fields import _base_type
from config.schema import Config, FIELDS
from modelling import registry

HEAD = """# Configuration: every field

Every field below is a flag of every driver (`--micro_batch_size 2`) and a key of a preset's section in
`config/finetuning.yml` or `config/inference.yml` (`execution: {micro_batch_size: 2}`); a flag overrides the
preset. `python3 run_finetuning.py --config PRESET --help` shows the preset's value of each. Generated from
`config/schema.py` and the model families' own fields by `python3 -m app.reference --output docs/configuration.md`
(a test checks it is current).
"""


def _shown(value) -> str:
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value) if value else "(none)"
    return "(unset)" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _notes(ref, declared_by: dict) -> str:
    """What a field's row says it checks; ``declared_by``: registry.owners()."""
    meta, notes = ref.meta, []
    owners = declared_by.get(ref.flag, [])
    if owners:
        notes.append(f"declared by the {', '.join(owners)} famil{'ies' if len(owners) > 1 else 'y'} (another "
                     "family refuses it set)")
    if meta.get("choices"):
        notes.append("one of " + ", ".join(f"`{c}`" for c in meta["choices"]))
    if "minimum" in meta:
        notes.append(f"at least {meta['minimum']}")
    if meta.get("shape"):
        notes.append("part of the model's shape (a checkpoint carries it)")
    if meta.get("training"):
        notes.append("training only")
    if meta.get("ipu"):
        notes.append("IPU-only: no effect here")
    return "; ".join(notes)


def _sections() -> list:
    """(name, class docstring, [FieldRef]) of each section of Config, in its order."""
    hints = typing.get_type_hints(Config)
    out = []
    for f in dataclasses.fields(Config):
        refs = [r for r in FIELDS.values() if r.path[0] == f.name]
        out.append((f.name, " ".join((hints[f.name].__doc__ or "").split()), refs))
    return out


def markdown() -> str:
    """The whole reference, as docs/configuration.md holds it."""
    lines, declared_by = [HEAD], registry.owners()
    for name, doc, refs in _sections():
        lines += [f"## `{name}`", "", doc, "", "| flag | type | default | checks | what it says |",
                  "|---|---|---|---|---|"]
        for r in refs:
            typ = _base_type(r.type).__name__
            key = ".".join(r.path)
            what = (r.doc or "").replace("|", "\\|")
            lines.append(f"| `--{r.flag}` (`{key}`) | {typ} | `{_shown(r.default)}` | {_notes(r, declared_by)} | {what} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", default=None, metavar="FILE", help="write it here (default: print it)")
    args = p.parse_args(argv)
    text = markdown()
    if args.output:
        tmp = args.output + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.output)
    else:
        sys.stdout.write(text)
    return text


if __name__ == "__main__":
    main()
