"""Every sampling control a client sends (serving/api.py, serving/controls.py, serving/engine.py), through the openai
client against the server over the fake backend (tests/serving/test_http.py's FakeServer; no JAX, no compilation):
OpenAI's penalties and logit_bias and vLLM's extras reach every choice's row as the slots read it (streamed or not,
n > 1, both endpoints); ignore_eos gives exactly max_tokens tokens; continuous usage on every chunk; the text
options; chat's echo and add_generation_prompt; structured outputs in each spelling (response_format, guided_*,
structured_outputs) on both endpoints, their answers valid, each constrained row with a key of its own, closed at its
end; a constrained and a free request side by side each giving what it gives alone; and the 400s, each naming its
field. What the device does with each row is tests/modelling/test_continuous.py's; the real servers',
tests/drivers/test_run_server.py's."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from serving.controls import ALWAYS, TABLE
from tests.fake_server import MODEL, TOK, FakeServer, words
from tests.tokenizer_kinds import make

EOS = TOK.eos_token_id


@pytest.fixture(scope="module")
def server():
    s = FakeServer()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def json_server():
    """A fake server over a byte-level BPE (JSON's characters are tokens of it)."""
    s = FakeServer(tokenizer=make("bytelevel"))
    yield s
    s.stop()


def new_rows(server, before: int) -> list:
    return server.backend.controls[before:]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_each_sampling_field_reaches_every_choices_row_as_the_slots_read_it(server, stream, chat):
    """presence/frequency (OpenAI's), logit_bias (held always), repetition_penalty, min_p, ignore_eos, min_tokens
    (the end-of-text token held below it, unless ignore_eos, and each stop token) and stop_token_ids: each of the n
    choices' rows as ``pack_joiners`` packs it; a request that asks for none: None."""
    client = server.client()
    stop = words("park .")
    extra = {"repetition_penalty": 1.25, "min_p": 0.05, "min_tokens": 2, "stop_token_ids": stop}
    ask = dict(model=MODEL, n=2, max_tokens=6, presence_penalty=0.5, frequency_penalty=-1.5,
               logit_bias={"3": -100, "7": 2.5}, stream=stream, extra_body=extra)
    before = len(server.backend.controls)
    if chat:
        out = client.chat.completions.create(messages=[{"role": "user", "content": "the cat"}], **ask)
    else:
        out = client.completions.create(prompt="the cat", **ask)
    if stream:
        list(out)
    held = ((EOS, float("-inf"), 2),) + tuple((t, float("-inf"), 2) for t in stop)
    row = (0.5, -1.5, 1.25, 0.05, False, 0, ((3, -100.0, ALWAYS), (7, 2.5, ALWAYS)) + held)
    assert new_rows(server, before) == [row, row]
    before = len(server.backend.controls)
    client.completions.create(model=MODEL, prompt="a dog", max_tokens=2, extra_body={"ignore_eos": True,
                                                                                      "min_tokens": 1})
    assert new_rows(server, before) == [(0.0, 0.0, 1.0, 0.0, True, 0, ())]  # (ignore_eos: no end-of-text held)
    before = len(server.backend.controls)
    client.completions.create(model=MODEL, prompt="a dog", max_tokens=2, temperature=0)
    assert new_rows(server, before) == [None]


@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_gives_exactly_max_tokens_tokens(server, stream):
    """vLLM's ignore_eos (what load generators send with a fixed output length): the fake writes its prompt and
    its end-of-text token, again and again, and the answer holds max_tokens tokens, "length"."""
    client = server.client()
    kw = dict(model=MODEL, prompt="the cat", max_tokens=7, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True}, stream=stream)
    if stream:
        chunks = list(client.completions.create(**kw, stream_options={"include_usage": True}))
        ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
        reason, usage = [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1].usage
    else:
        out = client.completions.create(**kw)
        ids, reason, usage = out.choices[0].token_ids, out.choices[0].finish_reason, out.usage
    prompt = words("the cat") + [EOS]
    assert ids == (prompt * 3)[:7] and reason == "length" and usage.completion_tokens == 7
    plain = client.completions.create(**{**kw, "extra_body": {"return_token_ids": True}, "stream": False})
    assert plain.choices[0].token_ids == prompt and plain.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_gives_every_chunk_its_choices_tokens_so_far(server, chat):
    """stream_options.continuous_usage_stats: every chunk carries usage, its prompt's tokens and its choice's tokens
    so far (vLLM's); each choice's last chunk counts all of its tokens, and together they are the final usage."""
    client = server.client()
    kw = dict(model=MODEL, n=2, max_tokens=5, stream=True, seed=3, extra_body={"return_token_ids": True},
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    if chat:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "the cat sleeps"}], **kw))
    else:
        chunks = list(client.completions.create(prompt="the cat sleeps", **kw))
    so_far, last = {0: 0, 1: 0}, {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        so_far[choice.index] += len(choice.token_ids or [])
        assert c.usage is not None and c.usage.completion_tokens == so_far[choice.index], c
        assert c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens  # (one prompt)
        last[choice.index] = c.usage.completion_tokens
    assert not chunks[-1].choices and sum(last.values()) == chunks[-1].usage.completion_tokens > 0
    plain = list(client.completions.create(**{**kw, "prompt": "the cat", "stream_options": {"include_usage": True}}))
    assert all(c.usage is None for c in plain[:-1])  # without it: usage at the end alone


def test_the_text_options_special_tokens_and_the_stop_string_kept(server):
    client = server.client()
    plain = client.completions.create(model=MODEL, prompt="the cat", max_tokens=5, temperature=0)
    special = client.completions.create(model=MODEL, prompt="the cat", max_tokens=5, temperature=0,
                                        extra_body={"skip_special_tokens": False,
                                                    "spaces_between_special_tokens": False})
    assert plain.choices[0].text == "the cat" and special.choices[0].text == "the cat </s>"
    for stream in (False, True):
        kept = client.completions.create(model=MODEL, prompt="the cat sleeps in the park", max_tokens=9,
                                         temperature=0, stop=["sleeps"], stream=stream,
                                         extra_body={"include_stop_str_in_output": True})
        text = "".join(c.choices[0].text for c in kept) if stream else kept.choices[0].text
        assert text == "the cat sleeps"


def test_chat_echo_prefixes_the_last_assistant_message_and_add_generation_prompt_reaches_the_template(tmp_path):
    """vLLM's chat extras: echo puts the last message before the answer where it is the assistant's (the answer
    continues it); add_generation_prompt is the template's own variable."""
    template = ("{%- for m in messages %}{{ m['content'] }} {% endfor -%}"
                "{%- if add_generation_prompt %}in{% endif %}")
    s = FakeServer(chat_template=template)
    try:
        client = s.client()
        messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "a dog"}]
        kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                  extra_body={"return_token_ids": True})
        plain = client.chat.completions.create(**kw)
        echo = client.chat.completions.create(**{**kw, "extra_body": {"echo": True, "return_token_ids": True}})
        assert echo.choices[0].message.content == "a dog" + plain.choices[0].message.content
        streamed = list(client.chat.completions.create(**{**kw, "stream": True, "extra_body": {"echo": True}}))
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == echo.choices[0].message.content
        bare = client.chat.completions.create(**{**kw, "extra_body": {"add_generation_prompt": False,
                                                                     "return_token_ids": True}})
        assert plain.choices[0].prompt_token_ids == words("the cat a dog in") + [EOS]
        assert bare.choices[0].prompt_token_ids == words("the cat a dog") + [EOS]
    finally:
        s.stop()


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"enum": ["x", "y"]}}},
          "required": ["name", "age"]}
DOC = '{"name": "Ada", "age": 36, "tags": ["x", "y"]}'


def _answers(client, chat: bool, stream: bool, prompt: str, reasons: bool = False, **kw) -> list:
    """Each of the n = 2 choices' text (with ``reasons``: (text, finish_reason))."""
    ask = dict(model=MODEL, n=2, max_tokens=40, temperature=0, stream=stream, **kw)
    if chat:
        out = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **ask)
    else:
        out = client.completions.create(prompt=prompt, **ask)
    if not stream:
        got = [(c.message.content if chat else c.text, c.finish_reason) for c in out.choices]
    else:
        texts, why = ["", ""], [None, None]
        for c in out:
            for ch in c.choices:
                texts[ch.index] += (ch.delta.content or "") if chat else ch.text
                why[ch.index] = ch.finish_reason or why[ch.index]
        got = list(zip(texts, why))
    return got if reasons else [t for t, _ in got]


SPELLINGS = [  # (how it is asked, a prompt the fake follows, another, the answer's check)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                 "strict": True}}}, DOC, "hello",
     lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ({"response_format": {"type": "json_object"}}, DOC, "hello", lambda t: isinstance(json.loads(t), dict)),
    ({"extra_body": {"guided_json": SCHEMA}}, DOC, "[1]", lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ({"extra_body": {"structured_outputs": {"json": json.dumps(SCHEMA)}}}, DOC, "x",
     lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ({"extra_body": {"guided_choice": ["positive", "negative"]}}, "negative", "neutral",
     lambda t: t in ("positive", "negative")),
    ({"extra_body": {"structured_outputs": {"choice": ["positive", "negative"]}}}, "positive", "zzz",
     lambda t: t in ("positive", "negative")),
    ({"extra_body": {"guided_regex": "[a-c]+-[0-9]{2}"}}, "abc-12", "hello",
     lambda t: re.fullmatch("[a-c]+-[0-9]{2}", t)),
    ({"extra_body": {"structured_outputs": {"regex": "[a-c]+-[0-9]{2}"}}}, "cab-07", "!",
     lambda t: re.fullmatch("[a-c]+-[0-9]{2}", t)),
    ({"extra_body": {"guided_grammar": 'root ::= "yes" | "no"'}}, "no", "maybe", lambda t: t in ("yes", "no")),
    ({"extra_body": {"structured_outputs": {"json_object": True}}}, DOC, "hi", lambda t: json.loads(t)),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("spelling", range(len(SPELLINGS)))
def test_structured_outputs_in_each_spelling_give_valid_answers_on_both_endpoints(json_server, spelling, chat,
                                                                                 stream):
    """A prompt the fake writes (a valid answer) comes back as it is; one it would not (the fake then writes the
    lowest token the grammar allows) comes back valid where it ends ("stop"), and "length" where only max_tokens
    ended it (a JSON string the fake never closes); n = 2, each choice its own matcher; every key closed at the
    end."""
    kw, good, bad, check = SPELLINGS[spelling]
    if "response_format" in kw and not chat:
        kw = {"extra_body": kw}  # (the openai client's completions take it in the body)
    client = json_server.client()
    assert _answers(client, chat, stream, good, reasons=True, **kw) == [(good, "stop")] * 2
    for text, why in _answers(client, chat, stream, bad, reasons=True, **kw):
        if why == "stop":
            check(text)
        else:
            assert why == "length", text
    assert json_server.backend.masks.rows == {}  # every constrained row's key closed


def test_a_constrained_and_a_free_request_side_by_side_each_give_what_they_give_alone(json_server):
    client = json_server.client(max_retries=3)
    choice = dict(extra_body={"guided_choice": ["positive", "negative"]})
    alone = [_answers(client, False, False, "neutral", **choice), _answers(client, False, False, "a free one")]
    with ThreadPoolExecutor(6) as pool:  # (12 sequences: the 4 slots and the queue of 8)
        futures = [pool.submit(_answers, client, False, False, "neutral", **choice) if i % 2 == 0 else
                   pool.submit(_answers, client, False, False, "a free one") for i in range(6)]
        together = [f.result() for f in futures]
    for i, t in enumerate(together):
        assert t == alone[i % 2], i
    assert alone[1][0].startswith("a free onea free one") and alone[0][0] in ("positive", "negative")


def test_allowed_token_ids_restrict_every_token(server):
    out = server.client().completions.create(model=MODEL, prompt="the cat sleeps", max_tokens=6, n=2,
                                             extra_body={"allowed_token_ids": words("the sleeps"),
                                                         "return_token_ids": True})
    for c in out.choices:
        assert set(c.token_ids) <= set(words("the sleeps")) | {EOS} and c.token_ids


REFUSED = [  # (server, body fields, param, words of its message)
    ("json", {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema", "bogus"),
    ("json", {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/x"}}}}, "guided_json", "cannot"),
    ("json", {"guided_regex": "("}, "guided_regex", "cannot be followed"),
    ("json", {"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar", "cannot be followed"),
    ("json", {"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "one structured output"),
    ("json", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex", "one structured output"),
    ("plain", {"response_format": {"type": "json_object"}}, "response_format", "no token of this model's vocabulary"),
    ("plain", {"logit_bias": {str(i % 64): 1 for i in range(301)}}, "logit_bias", None),  # (64 distinct keys: fine)
    ("plain", {"logit_bias": {"64": 1}}, "logit_bias", "from 0 to 63"),
    ("plain", {"stop_token_ids": [64]}, "stop_token_ids", "from 0 to 63"),
    ("plain", {"allowed_token_ids": [99]}, "allowed_token_ids", "from 0 to 63"),
    ("plain", {"min_tokens": 9, "max_tokens": 8}, "min_tokens", "from 0 to 8"),
    ("plain", {"repetition_penalty": 0}, "repetition_penalty", None),
    ("plain", {"structured_outputs": {"choice": ["a"], "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace", "not supported"),
]


@pytest.mark.parametrize("which, fields, param, said", REFUSED)
def test_a_bad_control_is_a_400_naming_its_field_and_why(server, json_server, which, fields, param, said):
    s = json_server if which == "json" else server
    if param == "logit_bias" and said is None:  # 301 entries of 64 ids: a JSON object keeps the last of each
        assert s.post({"model": MODEL, "prompt": "a dog", "max_tokens": 2, **fields}).status_code == 200
        wide = {"logit_bias": {str(i): 1 for i in range(301)}}
        r = FakeServer.post(s, {"model": MODEL, "prompt": "a dog", **wide})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
        return
    for path, body in (("/v1/completions", {"prompt": "a dog"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a dog"}]})):
        r = s.post({"model": MODEL, **body, **fields}, path)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param, (path, r.text)
        assert said is None or said in error["message"], error["message"]
    with pytest.raises(openai.BadRequestError):
        s.client().completions.create(model=MODEL, prompt="a dog", extra_body=fields)
    s.serves() if s is server else None


def test_the_limits_agree_with_the_slots_table():
    """A request's table (logit_bias, then the end-of-text and stop tokens min_tokens holds) fits a row's, and the
    constants the server and the device read are one."""
    from modelling import processors
    from serving import api

    assert TABLE == processors.TABLE and ALWAYS == processors.UNTIL_ALWAYS
    assert api.MAX_BIAS + 1 + api.MAX_STOP_IDS <= TABLE
