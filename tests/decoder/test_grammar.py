"""Constrained decoding's host side (decoder/grammar.py): the matchers the device asks at each step, and the
grammars xgrammar compiles over the project's own token pieces, for every tokenizer kind (tests/tokenizer_kinds.py).

``HostMasks``: a key's first question fills its first mask; the same question again (another tp device) is
answered from the cache, the token accepted once; the next index accepts the row's last token; an unknown or closed
key, or a row without one, allows every token; a finished grammar allows its end-of-text token alone, and so does a
row fed a token out of order. ``Grammars``: each grammar compiled once and then served from the cache; what xgrammar
refuses is a GrammarError naming the field, its reason one line; a grammar no token can start (JSON with the
synthetic vocabulary: no brace) is refused at once. Then walks: random tokens among those each mask allows, to the
end-of-text token, give texts (decoded as the client reads them) that validate against their JSON schema, match
their regular expression, are one of the choices, for every tokenizer kind (a T5-like tokenizer's first word loses
its space in the text the client reads: the grammar takes one optional space first)."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from decoder.grammar import Allowed, GrammarError, Grammars, HostMasks
from tests.tokenizer_kinds import KINDS, make


class Counting:
    """A constraint whose matcher allows the tokens given for each index and counts what it accepted."""

    def __init__(self, steps: list, words: int):
        self.steps, self.words, self.accepted, self.made = steps, words, [], 0

    def matcher(self):
        self.made += 1
        return self

    def accept(self, token: int) -> bool:
        self.accepted.append(token)
        return True

    def fill(self, out, row):
        out[row] = Allowed(self.steps[len(self.accepted)], self.words).bits

    def terminated(self) -> bool:
        return len(self.accepted) >= len(self.steps)


def allowed_of(mask: np.ndarray) -> list:
    bits = mask.view(np.uint32)
    return [t for t in range(32 * len(bits)) if bits[t // 32] >> np.uint32(t % 32) & 1]


def test_a_keys_matcher_accepts_each_token_once_and_answers_a_repeated_question_from_its_cache():
    masks = HostMasks(70, eos_id=1)
    c = Counting([[5, 6], [7], [1, 9]], masks.words)
    key, other = masks.open(c), masks.open(Allowed([3], masks.words))
    assert (key, other) == (1, 2) and masks.open(Allowed([4], masks.words)) == 3  # unique, from 1
    ask = lambda k, i, t: masks(np.array(k), np.array(i), np.array(t))  # noqa: E731
    first = ask([key, 0, other, 99], [0, 0, 0, 0], [-1, 7, -1, 3])
    assert allowed_of(first[0]) == [5, 6] and allowed_of(first[2]) == [3]
    assert (first[1] == -1).all() and (first[3] == -1).all()  # no key, an unknown key: every token
    again = ask([key], [0], [-1])  # another tp device asks the same
    assert allowed_of(again[0]) == [5, 6] and c.accepted == [] and c.made == 1
    second = ask([key, key], [1, 1], [6, 6])  # (twice in one call too)
    assert allowed_of(second[0]) == allowed_of(second[1]) == [7] and c.accepted == [6]
    third = ask([key], [2], [7])
    assert allowed_of(third[0]) == [1, 9] and c.accepted == [6, 7]
    done = ask([key], [3], [1])  # its grammar finished: its end-of-text token alone
    assert allowed_of(done[0]) == [1] and c.accepted == [6, 7, 1]
    skipped = ask([other], [2], [3])  # index 2 after 0: a token it never saw, out of order
    assert allowed_of(skipped[0]) == [1]
    masks.close(key)
    assert (ask([key], [4], [1])[0] == -1).all()  # closed: every token
    assert masks.asked == 7  # (each call counted once, its rows all told)


def test_a_batch_searchs_row_starts_anew_at_its_first_token():
    masks = HostMasks(40, eos_id=1)
    c = Counting([[5], [6], [7]] * 2, masks.words)
    masks.open(c, key=9)
    ask = lambda i, t: allowed_of(masks(np.array([9]), np.array([i]), np.array([t]))[0])  # noqa: E731
    assert ask(0, -1) == [5] and ask(1, 5) == [6] and c.made == 1
    c.accepted.clear()
    assert ask(0, 3) == [5] and c.made == 2  # the next batch's row under the same key: a fresh matcher


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}, "ok": {"type": "boolean"},
    "place": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}$"}},
              "required": ["code"]}}, "required": ["name", "age", "place"]}


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    tok = make(request.param)
    return request.param, tok, Grammars(tok, len(tok), tok.eos_token_id)


@pytest.mark.parametrize("name", [k for k in KINDS if k != "synthetic"])  # (the synthetic words hold no JSON, regex
def test_each_grammar_compiles_once_then_comes_from_the_cache(name):  # or EBNF text: its refusal has a test of its own)
    tok = make(name)
    grammars = Grammars(tok, len(tok), tok.eos_token_id)
    for k, spec in (("json_schema", SCHEMA), ("json_object", None), ("regex", "[a-z]{2,4}"),
                    ("choice", ["yes", "no"]), ("grammar", 'root ::= "a" ("b" | "c")')):
        one = grammars.compile(k, spec, "f")
        assert grammars.compile(k, spec, "f") is one and one.seconds > 0
    assert grammars.compile("json_schema", {**SCHEMA, "required": ["name"]}, "f") is not \
        grammars.compile("json_schema", SCHEMA, "f")  # another schema, another grammar


@pytest.mark.parametrize("kind_, spec, words", [
    ("json_schema", {"type": "bogus"}, "bogus"), ("regex", "(", None), ("grammar", "root ::= ", None),
    ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, None)])
def test_what_xgrammar_refuses_is_one_line_naming_the_field_without_its_source_location(kind_, spec, words):
    tok = make("bytelevel")
    with pytest.raises(GrammarError) as e:
        Grammars(tok, len(tok), tok.eos_token_id).compile(kind_, spec, "response_format")
    assert e.value.field == "response_format" and e.value.reason and "\n" not in e.value.reason
    assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.cc:\d+", e.value.reason), e.value.reason
    if words:
        assert words in e.value.reason


def test_a_grammar_no_token_can_start_is_refused_naming_why():
    """The synthetic vocabulary has no brace (as Flan-T5's real one has none): JSON cannot be written with it."""
    tok = make("synthetic")
    grammars = Grammars(tok, len(tok), tok.eos_token_id)
    for kind_, spec in (("json_object", None), ("json_schema", SCHEMA)):
        with pytest.raises(GrammarError, match="no token of this model's vocabulary can start it"):
            grammars.compile(kind_, spec, "guided_json")
    assert grammars.compile("choice", ["the cat", "a dog"], "guided_choice") is not None  # its own words: fine


def walk(grammar, tok, rng, most: int = 200) -> list:
    """Random tokens among those the grammar allows at each step (its end-of-text token where allowed, half the
    time) until the end-of-text token; None where ``most`` tokens did not finish it."""
    m, out = grammar.matcher(), []
    words = -(-len(tok) // 32)
    for _ in range(most):
        mask = np.zeros((1, words), np.int32)
        m.fill(mask, 0)
        allowed = [t for t in allowed_of(mask[0]) if t < len(tok)]  # (bits past the vocabulary: none of its)
        assert allowed, out
        eos = tok.eos_token_id
        t = eos if eos in allowed and rng.random() < 0.5 else int(rng.choice([a for a in allowed if a != eos] or [eos]))
        assert m.accept(t)
        if t == eos:
            return out
        out.append(t)
    return None


CHOICES = ["positive", "negative", "neutral", "not sure"]


def test_random_walks_of_each_grammar_give_texts_that_validate_match_or_are_a_choice(kind):
    """30 walks a grammar (every token chosen among those allowed): each that finishes is valid as the client reads
    its text, and at least a third finish (a walk inside a free JSON string may run long)."""
    name, tok, grammars = kind
    specs = [("choice", CHOICES), ("regex", r"[a-c]{1,3}-[0-9]{2}")]
    if name != "synthetic":
        specs += [("json_schema", SCHEMA), ("json_object", None)]
    else:
        specs = [("choice", ["the cat", "a dog sleeps"])]
    rng = np.random.default_rng(0)
    for k, spec in specs:
        g = grammars.compile(k, spec, "f")
        texts = [tok.decode(t, skip_special_tokens=True) for t in (walk(g, tok, rng) for _ in range(30))
                 if t is not None]
        assert len(texts) >= 10, (name, k)
        for text in texts:
            # (xgrammar's JSON strings take a control character raw, which RFC 8259 wants escaped: Python reads
            # them with strict=False; a random walk writes them, a model rarely does)
            if k == "json_schema":
                jsonschema.validate(json.loads(text, strict=False), SCHEMA)
            elif k == "json_object":
                assert isinstance(json.loads(text, strict=False), dict), text
            elif k == "regex":
                assert re.fullmatch(spec, text), (name, text)
            else:
                assert text in spec, (name, text)


@pytest.mark.parametrize("kind_, spec", [("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}},
                                                          "required": ["a"]}), ("json_object", None)])
def test_a_json_answer_holds_at_most_twenty_whitespace_characters_in_a_row(kind_, spec):
    """Between JSON's marks a run of whitespace is bounded (``WHITESPACE``: 20, line breaks and spaces alike): the
    20th is allowed, the 21st is not, and after a mark a new run may start (a model cannot write spaces until
    max_tokens; pretty-printed JSON fits)."""
    from decoder.grammar import WHITESPACE

    tok = make("bytelevel")
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    (space,), (newline,), (brace,) = ids(" "), ids("\n"), ids("{")
    m = Grammars(tok, len(tok), tok.eos_token_id).compile(kind_, spec, "f").matcher()
    assert WHITESPACE == 20 and m.accept(brace)
    assert all(m.accept(newline if i % 5 == 0 else space) for i in range(WHITESPACE))
    assert not m.accept(space) and not m.accept(newline)
    for t in ids('"a":'):
        assert m.accept(t)
    assert all(m.accept(space) for _ in range(WHITESPACE)) and not m.accept(space)
