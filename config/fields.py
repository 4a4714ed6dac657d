"""Reading the config's declarations: ``spec`` (what a field declares of itself: its flag, bounds, choices, whether
it is part of the model's shape ...), each leaf field as a ``FieldRef`` (its flat flag, path, type, default and
docstring, which is its --help text), and converting a YAML or command-line value to a field's type (``coerce``).
Generic over any dataclass tree: config/schema.py declares the fields, this module reads them."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import yaml

from utils.errors import ConfigError

def spec(default=dataclasses.MISSING, *, flag: Optional[str] = None, minimum: Optional[int] = None,
         choices: tuple = (), bounds: Optional[tuple] = None, shape: bool = False, training: bool = False,
         ipu: bool = False, items: type = float, travels: bool = False):
    """A config field with what ``Config.validate`` and the drivers need to know of it, declared with the field:

    flag: its flat CLI flag when not its own name; minimum: the least value of an int; choices: the values a
    str may take; bounds: (low, high, low inclusive, high inclusive, an example) of a float, which must also be
    finite; shape: part of the model's shape (a checkpoint or an HF config.json carries it); training: read only
    by training (the decoding drivers accept it but do not list it); ipu: meaningful only on IPUs (kept so the
    original's configs load; a value other than the default is said once, and has no effect); items: the type of a
    tuple's items (float or str; a tuple of choices checks each item); travels: the task a checkpoint was trained
    on (with the whole task section): its validation and inference use it unless told otherwise."""
    meta = {k: v for k, v in dict(flag=flag, minimum=minimum, choices=choices, bounds=bounds, shape=shape,
                                    training=training, ipu=ipu, items=items if items is not float else None,
                                    travels=travels).items() if not (v is None or v is False or v == ())}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class FieldRef:
    """One leaf field of the config: its flat flag, its path and its type."""

    flag: str
    path: tuple
    type: Any
    default: Any
    doc: str
    meta: dict = field(default_factory=dict)  # what ``spec`` declared of it


def _field_docs(cls) -> dict:
    """Docstrings of dataclass fields: the string literal right after each field."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def leaf_fields(cls, prefix: tuple = ()) -> list:
    """All leaf fields of a config class, depth first, with their flat flag names."""
    hints = typing.get_type_hints(cls)
    docs = {**_field_docs(cls), **{f.name: f.metadata["doc"] for f in fields(cls) if "doc" in f.metadata}}
    out = []
    for f in fields(cls):
        typ = hints[f.name]
        if dataclasses.is_dataclass(typ):
            out += leaf_fields(typ, prefix + (f.name,))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(FieldRef(f.metadata.get("flag", f.name), prefix + (f.name,), typ, default, docs.get(f.name, ""),
                            _declared(f)))
    flags = [r.flag for r in out]
    dup = {x for x in flags if flags.count(x) > 1}
    assert not dup, f"config flags must be unique, duplicated: {dup}"
    return out



def extend_section(section, declared) -> list:
    """Adds the fields of dataclass ``declared`` (a model family's own options: modelling/family.py) to the config
    section class ``section``, in place, with what each declares (``spec``, its docstring, which becomes its --help
    text): the section's instances made after this hold them, and ``leaf_fields`` lists them, after the section's own
    values and before its subsections (where --help, the reference and a saved config show them). A field the section
    already holds with the same type, default and ``spec`` is shared (two families with one option); another
    declaration of the same name is a ConfigError, raised before anything changes. -> the names added."""
    hints, have = typing.get_type_hints(declared), {f.name: f for f in fields(section)}
    theirs = typing.get_type_hints(section)
    docs, added = _field_docs(declared), []
    for f in fields(declared):
        if f.name in have:
            old = have[f.name]
            if (theirs[f.name], old.default, old.default_factory, _declared(old)) != \
                    (hints[f.name], f.default, f.default_factory, _declared(f)):
                raise ConfigError(f"config field {f.name!r} is declared twice, differently ({section.__name__} and "
                                  f"{declared.__name__}): give the new option another name")
            continue
        added.append(f)
    if not added:
        return []
    # dataclass() processes a class's own annotations, taking a Field found on the class as the field's declaration,
    # and never replaces methods the class already has: so the generated ones go, and every field is declared anew.
    for name in ("__init__", "__repr__", "__eq__", "__match_args__"):
        if name in section.__dict__:
            delattr(section, name)
    own = dict(section.__dict__.get("__annotations__", {}))
    values = [f for f in fields(section) if not dataclasses.is_dataclass(theirs[f.name])]
    order = values + added + [f for f in fields(section) if dataclasses.is_dataclass(theirs[f.name])]
    for f in order:
        meta = dict(f.metadata)
        if f in added and f.name in docs:
            meta["doc"] = docs[f.name]
        setattr(section, f.name, field(default=f.default, default_factory=f.default_factory, init=f.init,
                                       repr=f.repr, compare=f.compare, metadata=meta))
    section.__annotations__ = {f.name: own.get(f.name, hints.get(f.name)) for f in order}
    params = section.__dataclass_params__
    dataclass(section, init=params.init, repr=params.repr, eq=params.eq, order=params.order,
              unsafe_hash=params.unsafe_hash, frozen=params.frozen)
    return [f.name for f in added]


def _declared(f) -> dict:
    """What a field's ``spec`` declared: its metadata less the docstring ``extend_section`` keeps there."""
    return {k: v for k, v in f.metadata.items() if k != "doc"}


def _base_type(typ):
    if typing.get_origin(typ) is typing.Union:
        args = [t for t in typing.get_args(typ) if t is not type(None)]
        return args[0]
    return typ


def coerce(ref: FieldRef, value: Any) -> Any:
    """Converts a YAML or CLI value to the field's type; ConfigError if it cannot."""
    typ = _base_type(ref.type)
    if value is None:
        if typing.get_origin(ref.type) is typing.Union:
            return None
        raise ConfigError(f"{ref.flag} must not be empty: give it a {typ.__name__} value")
    bad = ConfigError(f"{ref.flag}={value!r} is not a valid {typ.__name__}: pass --{ref.flag} with a {typ.__name__} value")
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad
    if typ is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        raise bad
    if typ is float:
        if isinstance(value, bool):
            raise bad
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad from None
    if typ is str:
        if isinstance(value, (dict, list)):
            raise bad
        return str(value)
    if typ is tuple:
        return _coerce_tuple(ref, value, bad)
    return value


def _coerce_tuple(ref: FieldRef, value, bad):
    """A tuple field's value: floats (the default), words (``items=str``: a list, or one string split at
    commas; none or an empty string is unset where the field may be), or mappings (``items=dict``)."""
    if ref.meta.get("items") is dict:
        return _coerce_mappings(ref, value)
    words = ref.meta.get("items") is str
    if words and isinstance(value, str):
        if value.strip().lower() in ("none", "") and typing.get_origin(ref.type) is typing.Union:
            return None
        value = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, str):
        value = [v for v in value.replace(",", " ").split()]
    if not isinstance(value, (list, tuple)):
        value = [value]
    if words:
        if len(value) == 1 and str(value[0]).lower() == "none" and typing.get_origin(ref.type) is typing.Union:
            return None
        return tuple(str(v) for v in value)
    try:
        return tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise bad from None


def _coerce_mappings(ref: FieldRef, value) -> tuple:
    """A tuple of mappings (``items=dict``): each a mapping, a mapping in YAML's flow style ("{name: qa, ...}"), or a
    name (a reference the preset loader resolves); "none" alone: empty. Values are plain (lists, not tuples)."""
    items = [value] if isinstance(value, (str, dict)) else list(value or ())
    if len(items) == 1 and isinstance(items[0], str) and items[0].strip().lower() in ("none", ""):
        return ()
    out = []
    for item in items:
        if isinstance(item, str) and item.strip().startswith("{"):
            try:
                item = yaml.safe_load(item)
            except yaml.YAMLError as e:
                raise ConfigError(f"{ref.flag}: {item!r} is not a mapping ({str(e).splitlines()[0]}): write it as "
                                  "\"{key: value, ...}\" (quote a value holding braces or a colon)") from None
        if isinstance(item, dict):
            item = {str(k): _plain(k, v) for k, v in item.items()}
        elif not isinstance(item, str):
            raise ConfigError(f"{ref.flag}: {item!r} is neither a name nor a mapping")
        out.append(item)
    return tuple(out)


def _plain(key, value):
    """A mapping item's value as a saved config holds it: lists for tuples, none for an unset label set."""
    if isinstance(value, tuple):
        value = list(value)
    if key == "labels" and (value is None or (isinstance(value, str) and value.strip().lower() in ("none", ""))):
        return None
    if key in ("labels", "metrics") and isinstance(value, str):
        return [v.strip() for v in value.replace(",", " ").split() if v.strip()]
    return value


def get_path(cfg, path):
    for p in path:
        cfg = getattr(cfg, p)
    return cfg


def set_path(cfg, path, value):
    for p in path[:-1]:
        cfg = getattr(cfg, p)
    setattr(cfg, path[-1], value)
