"""Reading the config's declarations (config/fields.py): a count that may be zero may not be negative; a family's
own fields join a section with what each declares."""

import pytest

import modelling.registry  # noqa: F401 (the families' own fields are config fields: kv_heads is GPT-J's)
from config import ConfigError, load_config


@pytest.mark.parametrize("flag", ["warmup_steps", "steps", "eval_every", "checkpoint_steps", "to_keep", "holdout",
                                  "packed_decoder_length", "num_proc", "mixture_cap", "decoder_layers", "kv_heads"])
def test_a_count_that_may_be_zero_may_not_be_negative(flag):
    """Every field declared ``minimum=0`` refuses -1 with a one-line error naming it. ``spec`` once kept only the
    truthy parts of a declaration, so a minimum of 0 was dropped and every one of these took -1 silently."""
    from config.fields import spec

    assert spec(0, minimum=0).metadata == {"minimum": 0} and spec(1, minimum=1).metadata == {"minimum": 1}
    with pytest.raises(ConfigError, match=f"{flag}=-1 must not be negative: pass --{flag} 0 or more"):
        load_config("finetuning", "tiny", {flag: -1})


def test_a_family_s_own_fields_join_a_section_with_what_each_declares():
    """config.fields.extend_section, which adds a model family's own fields (``Family.config_options``) to a config
    section: the new field is a leaf with its path, docstring (its --help text) and ``spec``; the section's own fields
    keep theirs; instances, equality, repr and asdict see the new field; a second identical declaration adds nothing,
    a different one is refused before anything changes."""
    import dataclasses
    from dataclasses import dataclass, field
    from typing import ClassVar

    from config.fields import extend_section, leaf_fields, spec

    @dataclass
    class Sec:
        a: int = spec(1, minimum=1, shape=True)
        """A's own doc."""

    @dataclass
    class Root:
        sec: Sec = field(default_factory=Sec)

    @dataclass(frozen=True)
    class Mine:
        section: ClassVar[str] = "sec"
        window: int = spec(0, minimum=0, shape=True)
        """How far a token looks back."""

    assert extend_section(Sec, Mine) == ["window"]
    refs = {r.flag: r for r in leaf_fields(Root)}
    assert list(refs) == ["a", "window"]
    assert (refs["window"].path, refs["window"].doc, refs["window"].meta, refs["window"].default) == \
        (("sec", "window"), "How far a token looks back.", {"minimum": 0, "shape": True}, 0)
    assert (refs["a"].doc, refs["a"].meta, refs["a"].default) == ("A's own doc.", {"minimum": 1, "shape": True}, 1)
    assert Root().sec.window == 0 and Sec(a=2, window=3) == Sec(2, 3) != Sec(2, 4)
    assert repr(Sec(window=5)) == "test_a_family_s_own_fields_join_a_section_with_what_each_declares.<locals>." \
        "Sec(a=1, window=5)" and dataclasses.asdict(Root()) == {"sec": {"a": 1, "window": 0}}
    assert extend_section(Sec, Mine) == []

    @dataclass(frozen=True)
    class Clash:
        section: ClassVar[str] = "sec"
        window: int = spec(8)
        """Another window."""

    @dataclass(frozen=True)
    class Stricter:
        section: ClassVar[str] = "sec"
        window: int = spec(0, minimum=1, shape=True)
        """How far a token looks back."""

    for other in (Clash, Stricter):
        with pytest.raises(ConfigError, match="'window' is declared twice"):
            extend_section(Sec, other)
    assert [f.name for f in dataclasses.fields(Sec)] == ["a", "window"] and Sec().window == 0

    @dataclass
    class Outer:  # a section with a subsection: an added value goes before the subsection, as --help lists them
        b: int = 1
        """B."""
        sec: Sec = field(default_factory=Sec)

    @dataclass(frozen=True)
    class More:
        section: ClassVar[str] = "outer"
        c: str = spec("x", choices=("x", "y"))
        """C."""

    extend_section(Outer, More)
    assert [r.flag for r in leaf_fields(Outer)] == ["b", "c", "a", "window"] and Outer().c == "x"
