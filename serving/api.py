"""OpenAI's completions and chat completions APIs as data: a request body checked into a ``Request`` (every problem
one ``ApiError`` naming the field and its limit, in OpenAI's error body), and the response bodies. No model here:
the limits come from the engine.

Nothing a client sends reaches the scheduler unchecked: the body's size, its JSON nesting (at most ``MAX_DEPTH``
levels), every field's type and range (integers in their bounds: ``top_k`` at most the vocabulary, ``seed`` 64
bits, ``logprobs`` at most the server's ``--max_logprobs``, ``n`` and ``best_of`` at most ``MAX_N``), every text
(no unpaired surrogate, no NUL character), and unknown fields (refused, as OpenAI refuses them).

``/v1/completions``: ``model``, ``prompt`` (a string, a list of strings, a list of token ids, or a list of such
lists), ``max_tokens`` (0 only with ``echo``: the prompt scored, nothing generated), ``temperature`` (0: greedy),
``top_p``, ``seed``, ``stop`` (a string or up to 4), ``n``, ``best_of``, ``logprobs`` (0 to --max_logprobs),
``echo``, ``stream``, ``stream_options`` (``include_usage``; vLLM's ``continuous_usage_stats``), ``user``,
``presence_penalty`` and ``frequency_penalty`` (-2 to 2), ``logit_bias`` (at most 300 token ids, -100 to 100),
``response_format`` (text, json_object, json_schema); ``suffix`` only at its default. ``/v1/chat/completions``:
``messages`` instead of ``prompt``, ``max_completion_tokens`` (or ``max_tokens``), ``logprobs`` true/false with
``top_logprobs``; tools only at their defaults. Extensions, as vLLM names them and bounds them: ``top_k`` (0 or -1:
off), ``return_token_ids`` (each choice carries its ``token_ids``, and ``prompt_token_ids``), ``ignore_eos``,
``min_tokens`` (at most max_tokens), ``min_p`` (0 to 1), ``repetition_penalty`` (> 0), ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``spaces_between_special_tokens``, ``allowed_token_ids``,
chat's ``echo`` and ``add_generation_prompt``, and structured outputs in both spellings (``structured_outputs``:
json, regex, choice, grammar, json_object; the older ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``), one a request.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

MAX_STOPS = 4
MAX_N = 16  # choices (n) and candidates (best_of) of one prompt
MAX_DEPTH = 16  # nesting of a request body's JSON (arrays and objects)
SEED_LOW, SEED_HIGH = -2 ** 63, 2 ** 64 - 1  # OpenAI's int64, and every unsigned 64-bit seed
ROLES = ("system", "developer", "user", "assistant")
# OpenAI's fields this server does not implement, with the values each may take (its defaults)
UNSUPPORTED = {"suffix": (None, ""), "bad_words": (None, []), "use_beam_search": (None, False),
               "truncate_prompt_tokens": (None,), "prompt_logprobs": (None,), "guided_whitespace_pattern": (None,),
               "guided_decoding_backend": (None,)}
CHAT_UNSUPPORTED = {**{k: v for k, v in UNSUPPORTED.items() if k != "suffix"}, "tools": (None, []),
                    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
                    "parallel_tool_calls": (None, True, False), "continue_final_message": (None, False)}
MAX_BIAS = 300  # logit_bias entries (OpenAI's bound)
MAX_STOP_IDS = 16  # stop_token_ids (a row's table holds them with its bias: serving/controls.py)


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error body (message, type, param, code)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}

    def body(self) -> dict:
        kind = {401: "authentication_error", 429: "rate_limit_error", 503: "service_unavailable_error"}.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return error_body(self.message, kind, self.param, self.code)


def error_body(message: str, kind: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """OpenAI's error body; a message or param that holds what a client sent (an unknown field's name) with an
    unpaired surrogate, which has no UTF-8 form, shows it escaped (``\\ud800``): the body can always be written."""
    return {"error": {"message": printable(message), "type": kind,
                      "param": None if param is None else printable(param), "code": code}}


def printable(x: str) -> str:
    """``x`` with each unpaired surrogate (no UTF-8 form) as its escape, ``\\ud800``; any other text as it is."""
    try:
        x.encode("utf-8")
        return x
    except UnicodeEncodeError:
        return x.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class Limits:
    """What a request may ask of this server."""

    max_tokens: int  # the most new tokens a request may ask for (the slots' cache holds this many)
    default_max_tokens: int  # max_tokens when a request names none (the checkpoint's output length)
    max_prompt_tokens: int  # the longest prompt, in tokens (the widest prompt the slots hold)
    max_prompt_chars: int  # the longest prompt, in characters, before it is tokenized (413 past it)
    max_prompts: int  # sequences in one request: prompts x best_of (413 past it; the server's slots + queue)
    max_body_bytes: int  # a request body (413 past it)
    vocab_size: int  # token ids below it; top_k at most it
    max_logprobs: int  # logprobs / top_logprobs at most it
    scores_prompts: bool  # echo with logprobs: the model scores its prompt (a causal model; T5 reads it encoded)


@dataclass(frozen=True)
class Request:
    """A checked completions or chat request. ``prompts``: strings or tuples of token ids (completions);
    ``messages``: ({role, content}, ...) with the content text (chat)."""

    chat: bool
    prompts: tuple
    messages: tuple
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: Optional[int]
    stop: tuple
    n: int
    best_of: int
    logprobs: Optional[int]  # the k best shown beside each token; None: no log-probabilities
    echo: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str = ""  # the model id it named: the base's, or a LoRA adapter's (docs/serving.md, "Many adapters")
    # OpenAI's penalties and bias, vLLM's extras (serving/controls.py carries the processors to the slots)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: tuple = ()  # ((token id, bias), ...)
    stop_token_ids: tuple = ()
    allowed_token_ids: tuple = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    continuous_usage_stats: bool = False  # usage on every streamed chunk
    add_generation_prompt: bool = True  # chat: the template's generation prompt
    constraint: Optional[tuple] = None  # structured outputs: (kind, spec, the field that gave it) (decoder/grammar.py)


def _bad(field: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{field} {message}", param=field, code=code)


def _show(x) -> str:
    return json.dumps(x)[:100]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(body: dict, field: str, default, low: int, high: int) -> int:
    x = body.get(field)
    if x is None:
        return default
    if not _is_int(x) or not low <= x <= high:
        raise _bad(field, f"must be an integer from {low} to {high} (got {_show(x)})")
    return x


def _number(body: dict, field: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    x = body.get(field)
    if x is None:
        return default
    # (the range first: math.isfinite raises OverflowError on an integer past a float's range, as JSON may send)
    ok = (_is_int(x) or isinstance(x, float)) and low <= x <= high and math.isfinite(x) and not (low_open and x == low)
    if not ok:
        raise _bad(field, f"must be a number in {'(' if low_open else '['}{low}, {high}] (got {_show(x)})")
    return float(x)


def _flag(body: dict, field: str) -> bool:
    x = body.get(field, False)
    if x is None:
        return False
    if not isinstance(x, bool):
        raise _bad(field, f"must be true or false (got {_show(x)})")
    return x


def text(field: str, x, empty_ok: bool = True) -> str:
    """A text field checked: a string of valid Unicode (no unpaired surrogate: it has no UTF-8 form) without NUL."""
    if not isinstance(x, str):
        raise _bad(field, f"must be a string (got {_show(x)})")
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(field, "holds an unpaired surrogate (\\ud800-\\udfff alone): send valid Unicode",
                   "invalid_text") from None
    if "\x00" in x:
        raise _bad(field, "holds a NUL character (\\u0000)", "invalid_text")
    if not empty_ok and not x:
        raise _bad(field, "must not be empty")
    return x


def _depth(x, limit: int) -> bool:
    """Whether a parsed JSON value nests more than ``limit`` arrays and objects (the outermost counted)."""
    level = [x] if isinstance(x, (list, dict)) else []
    for _ in range(limit):
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, (list, dict))]
        if not level:
            return False
    return bool(level)


def _json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    if _depth(body, MAX_DEPTH):
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
    return body


def _same(x, a) -> bool:
    """JSON equality: true is not 1, 0.0 is 0."""
    if isinstance(a, bool) or a is None:
        return x is a
    if _is_int(a):
        return (_is_int(x) or isinstance(x, float)) and x == a
    return x == a


def _fields(body: dict, fields: tuple, unsupported: dict, models) -> str:
    """The body's fields checked -> the model id it names, one of ``models`` (the ids served: one, or a collection:
    the base's and each LoRA adapter's; 404 for another)."""
    unknown = sorted(set(body) - set(fields) - set(unsupported))
    if unknown:
        raise ApiError(400, f"unrecognized request argument supplied: {', '.join(map(repr, unknown))[:200]}",
                       param=unknown[0][:100], code="unknown_parameter")
    if body.get("model") is None:
        raise ApiError(400, "model is required: the id GET /v1/models lists", param="model",
                       code="missing_required_parameter")
    model = text("model", body["model"])
    served = (models,) if isinstance(models, str) else tuple(models)
    if model not in served:
        names = ", ".join(map(repr, served[:8])) + (f" and {len(served) - 8} more" if len(served) > 8 else "")
        raise ApiError(404, f"the model {_show(model)} does not exist: this server serves {names} (GET /v1/models "
                            "lists them)", param="model", code="model_not_found")
    for field, allowed in unsupported.items():
        if field in body and not any(_same(body[field], a) for a in allowed):
            raise ApiError(400, f"{field}={_show(body[field])} is not supported by this server (leave it out, or "
                                f"pass {json.dumps(allowed[-1])})", param=field, code="unsupported_value")
    if body.get("user") is not None:
        text("user", body["user"])
    return model


def _prompts(body: dict, limits: Limits) -> tuple:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids -> (str | (int, ...), ...)."""
    if "prompt" not in body:
        raise ApiError(400, "prompt is required: a string, a list of strings, a list of token ids or a list of "
                            "such lists", param="prompt", code="missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)):
        items = [p]
    elif isinstance(p, list) and p and (all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p)):
        items = p
    else:
        raise _bad("prompt", "must be a string, a non-empty list of strings, a list of token ids, or a list of "
                             f"such lists, not a mixture (got {_show(p)})")
    if len(items) > limits.max_prompts:
        raise ApiError(413, f"prompt holds {len(items)} prompts: at most {limits.max_prompts} in one request, the "
                            f"sequences this server holds (--slots + --max_queue)", param="prompt",
                       code="too_many_prompts")
    return tuple(_prompt(x, limits) for x in items)


def _prompt(x, limits: Limits):
    if isinstance(x, str):
        text("prompt", x)
        if len(x) > limits.max_prompt_chars:
            raise ApiError(413, f"prompt of {len(x)} characters: at most {limits.max_prompt_chars}", param="prompt",
                           code="prompt_too_large")
        if not x.strip():
            raise _bad("prompt", "is empty (or only whitespace): give the model some text to read", "empty_prompt")
        return x
    if not x or not all(_is_int(t) and 0 <= t < limits.vocab_size for t in x):
        raise _bad("prompt", f"token id lists must be non-empty lists of integers from 0 to {limits.vocab_size - 1}"
                             f" (got {_show(x)})")
    if len(x) > limits.max_prompt_tokens:
        raise _bad("prompt", f"is {len(x)} tokens long: this server reads at most {limits.max_prompt_tokens} "
                             "(--prompt_width)", "context_length_exceeded")
    return tuple(x)


def _stop(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not 1 <= len(stops) <= MAX_STOPS:
        raise _bad("stop", f"must be a non-empty string or a list of at most {MAX_STOPS} of them (got {_show(stop)})")
    return tuple(text("stop", s, empty_ok=False) for s in stops)


def _stream_options(body: dict, stream: bool) -> tuple:
    """(include_usage, continuous_usage_stats: usage on every chunk, as vLLM's)."""
    opts = body.get("stream_options")
    if opts is None:
        return False, False
    if not stream:
        raise _bad("stream_options", "is only taken with stream=true")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise _bad("stream_options", 'must be an object with "include_usage" and "continuous_usage_stats" only')
    return _flag(opts, "include_usage"), _flag(opts, "continuous_usage_stats")


def _token_ids(body: dict, field: str, limits: Limits, most: int) -> tuple:
    """A list of at most ``most`` token ids of the model's vocabulary (none: ())."""
    x = body.get(field)
    if x is None:
        return ()
    if not isinstance(x, list) or len(x) > most or not all(_is_int(t) and 0 <= t < limits.vocab_size for t in x):
        raise _bad(field, f"must be a list of at most {most} token ids from 0 to {limits.vocab_size - 1} (got "
                          f"{_show(x)})")
    return tuple(dict.fromkeys(x))


def _logit_bias(body: dict, limits: Limits) -> tuple:
    """OpenAI's logit_bias: {token id (a JSON key, so a string): bias from -100 to 100}, at most MAX_BIAS of them
    -> ((id, bias), ...)."""
    x = body.get("logit_bias")
    if x is None:
        return ()
    if not isinstance(x, dict) or len(x) > MAX_BIAS:
        raise _bad("logit_bias", f"must be an object of at most {MAX_BIAS} token ids, each mapped to a bias from -100 "
                                 f"to 100 (got {_show(x) if not isinstance(x, dict) else f'{len(x)} entries'})")
    out = []
    for k, v in x.items():
        if not (isinstance(k, str) and k.strip().lstrip("-").isdigit() and 0 <= int(k) < limits.vocab_size):
            raise _bad("logit_bias", f"keys must be token ids from 0 to {limits.vocab_size - 1} (got {_show(k)})")
        if not ((_is_int(v) or isinstance(v, float)) and -100 <= v <= 100 and math.isfinite(v)):
            raise _bad("logit_bias", f"values must be numbers from -100 to 100 (got {_show(v)})")
        out.append((int(k), float(v)))
    return tuple(out)


def _extras(body: dict, limits: Limits, max_tokens: int, stream: bool) -> dict:
    """OpenAI's penalties and bias and vLLM's sampling extras, checked, as ``Request`` fields."""
    include_usage, continuous = _stream_options(body, stream)
    out = dict(
        include_usage=include_usage, continuous_usage_stats=continuous,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 3.4e38, low_open=True),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0), ignore_eos=_flag(body, "ignore_eos"),
        logit_bias=_logit_bias(body, limits), stop_token_ids=_token_ids(body, "stop_token_ids", limits, MAX_STOP_IDS),
        allowed_token_ids=_token_ids(body, "allowed_token_ids", limits, limits.vocab_size),
        include_stop_str_in_output=_flag(body, "include_stop_str_in_output"),
        skip_special_tokens=_flag_true(body, "skip_special_tokens"),
        spaces_between_special_tokens=_flag_true(body, "spaces_between_special_tokens"),
        constraint=_constraint(body))
    out["min_tokens"] = _int(body, "min_tokens", 0, 0, max_tokens)
    if body.get("allowed_token_ids") is not None and not out["allowed_token_ids"]:
        raise _bad("allowed_token_ids", "must hold at least one token id (an empty list allows no token)")
    return out


def _flag_true(body: dict, field: str) -> bool:
    """A flag whose default is true."""
    return True if body.get(field) is None else _flag(body, field)


GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}  # vLLM's older spelling of structured_outputs' fields
STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
              "json_object": "json_object"}


def _constraint(body: dict) -> Optional[tuple]:
    """Structured outputs, whichever spelling: response_format (OpenAI's json_object, json_schema), vLLM's
    guided_json / guided_regex / guided_choice / guided_grammar, or its structured_outputs object -> (kind, spec, the
    field) or None; at most one of them."""
    found = [c for c in [_response_format(body)] + [_guided(body[f], k, f) for f, k in GUIDED.items()
                                                     if body.get(f) is not None] + [_structured(body)] if c]
    if len(found) > 1:
        raise _bad(found[1][2], f"cannot be used with {found[0][2]}: a request takes one structured output")
    return found[0] if found else None


def _response_format(body: dict) -> Optional[tuple]:
    rf = body.get("response_format")
    if rf is None:
        return None
    field = "response_format"
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(rf, dict) or rf.get("type") not in kinds:
        raise _bad(field, f'must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": "json_schema", '
                          f'"json_schema": {{"name": ..., "schema": ...}}}} (got {_show(rf)})')
    if rf["type"] != "json_schema":
        if set(rf) - {"type"}:
            raise _bad(field, f'of type {rf["type"]} takes no other key (got {_show(sorted(rf))})')
        return None if rf["type"] == "text" else ("json_object", None, field)
    js = rf.get("json_schema")
    if set(rf) - {"type", "json_schema"} or not isinstance(js, dict) or set(js) - {"name", "schema", "strict",
                                                                                  "description"}:
        raise _bad(field, 'of type json_schema takes "json_schema": {"name", "schema", "strict", "description"} '
                          f"(got {_show(rf)})")
    text(f"{field}.json_schema.name", js.get("name"), empty_ok=False)
    if js.get("strict") is not None:
        _flag(js, "strict")
    if js.get("schema") is None:
        return "json_object", None, field
    return _guided(js["schema"], "json_schema", f"{field}.json_schema.schema")


def _guided(spec, kind: str, field: str) -> tuple:
    """A structured output's spec checked for its kind -> (kind, spec, field)."""
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as e:
                raise _bad(field, f"is not valid JSON ({e})") from None
        if not isinstance(spec, dict):
            raise _bad(field, f"must be a JSON schema (an object; got {_show(spec)})")
    elif kind == "choice":
        if not isinstance(spec, list) or not spec or len(spec) > 1024:
            raise _bad(field, f"must be a list of 1 to 1024 texts (got {_show(spec)})")
        spec = [text(field, t) for t in spec]
    elif kind == "json_object":
        if spec is not True:
            raise _bad(field, f"must be true (got {_show(spec)})")
        return "json_object", None, field
    else:
        text(field, spec, empty_ok=False)
    return kind, spec, field


def _structured(body: dict) -> Optional[tuple]:
    so = body.get("structured_outputs")
    if so is None:
        return None
    field = "structured_outputs"
    if not isinstance(so, dict):
        raise _bad(field, f"must be an object with one of {', '.join(STRUCTURED)} (got {_show(so)})")
    unknown = set(so) - set(STRUCTURED) - {"disable_any_whitespace", "disable_additional_properties"}
    if unknown:
        raise _bad(field, f"takes {', '.join(STRUCTURED)} (one of them), disable_any_whitespace and "
                          f"disable_additional_properties (false); not {', '.join(sorted(map(repr, unknown)))[:100]}")
    for flag in ("disable_any_whitespace", "disable_additional_properties"):
        if _flag(so, flag):
            raise _bad(f"{field}.{flag}", "is not supported by this server (leave it out, or pass false)",
                       "unsupported_value")
    given = [k for k in STRUCTURED if so.get(k) is not None]
    if len(given) != 1:
        raise _bad(field, f"must give exactly one of {', '.join(STRUCTURED)} (got {len(given)})")
    return _guided(so[given[0]], STRUCTURED[given[0]], f"{field}.{given[0]}")


def _choices(body: dict, stream: bool) -> tuple:
    """(n, best_of): best_of candidates a prompt, the n most likely returned."""
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = _int(body, "best_of", n, n, MAX_N) if body.get("best_of") is not None else n
    if best_of > n and stream:
        raise _bad("best_of", "cannot be used with stream=true: the candidates are ranked at their end")
    return n, best_of


COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
          "return_token_ids", "user", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
          "response_format", "ignore_eos", "min_tokens", "min_p", "repetition_penalty", "stop_token_ids",
          "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids",
          "structured_outputs") + tuple(GUIDED)
COMPLETION_FIELDS = COMMON + ("prompt", "best_of", "echo")
CHAT_FIELDS = COMMON + ("messages", "max_completion_tokens", "top_logprobs", "echo", "add_generation_prompt")


def _sampling(body: dict, limits: Limits, max_tokens: int, logprobs, echo: bool, chat: bool, prompts: tuple,
              messages: tuple, model: str = "") -> Request:
    stream = _flag(body, "stream")
    n, best_of = _choices(body, stream)
    sequences = len(prompts or [messages]) * best_of
    if sequences > limits.max_prompts:
        raise ApiError(413, f"the request asks for {sequences} sequences (prompts x best_of): at most "
                            f"{limits.max_prompts} in one request, the sequences this server holds (--slots + "
                            "--max_queue)", param="best_of" if best_of > 1 else "prompt", code="too_many_prompts")
    seed = _int(body, "seed", None, SEED_LOW, SEED_HIGH)
    return Request(
        chat=chat, prompts=prompts, messages=messages, max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_int(body, "top_k", 0, -1, limits.vocab_size), seed=None if seed is None else seed % 2 ** 64,
        stop=_stop(body), n=n, best_of=best_of, logprobs=logprobs, echo=echo, stream=stream,
        return_token_ids=_flag(body, "return_token_ids"), add_generation_prompt=_flag_true(body, "add_generation_prompt"),
        model=model, **_extras(body, limits, max_tokens, stream))


def parse_completion(raw: bytes, limits: Limits, models) -> Request:
    """A /v1/completions body -> the checked request, or ApiError (400: malformed JSON, an unknown field, a value of
    the wrong type or out of range; 404: a model not among ``models``, the ids served; 413: past the size limits)."""
    body = _json(raw)
    model = _fields(body, COMPLETION_FIELDS, UNSUPPORTED, models)
    echo = _flag(body, "echo")
    logprobs = _int(body, "logprobs", None, 0, limits.max_logprobs)
    if echo and logprobs is not None and not limits.scores_prompts:
        raise _bad("echo", "with logprobs is not available for this model: its prompt is read by the encoder, which "
                           "gives no log-probabilities of the prompt's tokens (echo alone returns the prompt's text)",
                   "unsupported_value")
    max_tokens = _int(body, "max_tokens", limits.default_max_tokens, 0 if echo else 1, limits.max_tokens)
    return _sampling(body, limits, max_tokens, logprobs, echo, False, _prompts(body, limits), (), model)


def _content(i: int, content) -> str:
    field = f"messages[{i}].content"
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or set(part) - {"type", "text"}:
                raise _bad(field, 'parts must be {"type": "text", "text": ...} (this model reads text only)')
            parts.append(text(field, part.get("text")))
        return "".join(parts)
    return text(field, content)


def _messages(body: dict, limits: Limits) -> tuple:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages is required: a non-empty list of {role, content}", param="messages",
                       code="missing_required_parameter" if msgs is None else "invalid_value")
    if len(msgs) > 256:
        raise ApiError(413, f"messages holds {len(msgs)} messages: at most 256", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or set(m) - {"role", "content", "name"}:
            raise _bad(f"messages[{i}]", f"must be an object with a role ({', '.join(ROLES)}), a content and "
                                         f"optionally a name (got {_show(m)})")
        if m.get("name") is not None:
            text(f"messages[{i}].name", m["name"])
        out.append({"role": m["role"], "content": _content(i, m.get("content"))})
    chars = sum(len(m["content"]) for m in out)
    if chars > limits.max_prompt_chars:
        raise ApiError(413, f"messages hold {chars} characters: at most {limits.max_prompt_chars}",
                       param="messages", code="prompt_too_large")
    return tuple(out)


def parse_chat(raw: bytes, limits: Limits, models) -> Request:
    """A /v1/chat/completions body -> the checked request, or ApiError (as parse_completion)."""
    body = _json(raw)
    model = _fields(body, CHAT_FIELDS, CHAT_UNSUPPORTED, models)
    messages = _messages(body, limits)
    wants = _flag(body, "logprobs")
    top = _int(body, "top_logprobs", None, 0, limits.max_logprobs)
    if top is not None and not wants:
        raise _bad("top_logprobs", "is only taken with logprobs=true")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, field, limits.default_max_tokens, 1, limits.max_tokens)
    return _sampling(body, limits, max_tokens, (top or 0) if wants else None, _flag(body, "echo"), True, (),
                     messages, model)


# --------------------------------------------------------------------------- response bodies


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: Optional[list]) -> Optional[dict]:
    """TokenLogprobs (serving/output.py) as the legacy API shows them: each token's top_logprobs the k most likely
    texts (the output side made them distinct: ``Output.distinct``) and the token itself (up to k + 1 entries; the
    prompt's first token: null)."""
    if entries is None:
        return None
    tops = []
    for e in entries:
        if e.top is None:
            tops.append(None)
            continue
        top = {}
        for t, lp in e.top:
            top.setdefault(t, lp)
        top.setdefault(e.token, e.logprob)
        tops.append(top)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": [e.offset for e in entries]}


def _utf8(t: str) -> list:
    return list(t.encode("utf-8", "replace"))


def chat_logprobs(entries: Optional[list]) -> Optional[dict]:
    """TokenLogprobs as the chat API shows them: {content: [{token, logprob, bytes, top_logprobs: [...]}]}."""
    if entries is None:
        return None
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": _utf8(e.token),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": _utf8(t)} for t, lp in e.top or []]}
                        for e in entries]}


def choice(req: Request, index: int, text_: str, finish_reason: Optional[str], logprobs: Optional[list],
           token_ids: Optional[list] = None, prompt_ids: Optional[list] = None, delta: Optional[bool] = None) -> dict:
    """One choice of a completion (``delta``: of a chat chunk, True on its first)."""
    if not req.chat:
        c = {"index": index, "text": text_, "logprobs": completion_logprobs(logprobs), "finish_reason": finish_reason}
    elif delta is None:
        c = {"index": index, "message": {"role": "assistant", "content": text_}, "logprobs": chat_logprobs(logprobs),
             "finish_reason": finish_reason}
    else:
        d = {"role": "assistant", "content": text_} if delta else ({"content": text_} if text_ else {})
        c = {"index": index, "delta": d, "logprobs": chat_logprobs(logprobs), "finish_reason": finish_reason}
    if token_ids is not None:
        c["token_ids"] = token_ids
    if prompt_ids is not None:
        c["prompt_token_ids"] = prompt_ids
    return c


def completion(req: Request, rid: str, created: int, model: str, choices: list, use: Optional[dict],
               chunk: bool = False) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if req.chat else "text_completion"
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def models(model: str, created: int, adapters: tuple = (), root=None) -> dict:
    """GET /v1/models: the base ``model`` (``root``: where its weights come from) and each LoRA adapter served over
    it, ``adapters`` [(name, path)], as vLLM lists them: the adapter's ``root`` its path, its ``parent`` the base."""
    card = lambda i, r, parent: {"id": i, "object": "model", "created": created, "owned_by": "flan-t5",  # noqa: E731
                                 "root": r, "parent": parent}
    return {"object": "list", "data": [card(model, root or model, None)] + [card(n, p, model) for n, p in adapters]}


# --------------------------------------------------------------------------- loading and unloading LoRA adapters


def parse_load_adapter(raw: bytes) -> tuple:
    """POST /v1/load_lora_adapter's body (vLLM's: {"lora_name": ..., "lora_path": ...}) -> (name, path), or ApiError
    (400: malformed JSON, an unknown field, a name or path missing or not a non-empty string)."""
    body = _json(raw)
    return _adapter_fields(body, ("lora_name", "lora_path"))


def parse_unload_adapter(raw: bytes) -> str:
    """POST /v1/unload_lora_adapter's body (vLLM's: {"lora_name": ...}) -> the name, or ApiError (400)."""
    return _adapter_fields(_json(raw), ("lora_name",))[0]


def _adapter_fields(body: dict, fields: tuple) -> tuple:
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise ApiError(400, f"unrecognized request argument supplied: {', '.join(map(repr, unknown))[:200]}",
                       param=unknown[0][:100], code="unknown_parameter")
    out = []
    for field in fields:
        if body.get(field) is None:
            raise ApiError(400, f"{field} is required", param=field, code="missing_required_parameter")
        out.append(text(field, body[field], empty_ok=False))
    return tuple(out)
