"""The OpenAI completions API as data: a request body checked into a ``Completion`` (every problem one
``ApiError`` naming the field and its limit, in OpenAI's error body), and the response bodies. No model here: the
limits come from the engine.

Fields (OpenAI's ``/v1/completions``): ``model``, ``prompt`` (a string or a list of strings), ``max_tokens``,
``temperature`` (0: greedy), ``top_p``, ``seed``, ``stop`` (a string or up to 4), ``n`` (1), ``stream``,
``stream_options`` (``include_usage``); OpenAI's other fields are accepted at their defaults (``echo`` false,
``logprobs`` null, ``best_of`` 1, penalties 0, no ``logit_bias``, no ``suffix``, any ``user``) and refused
otherwise. Extensions, as vLLM names them: ``top_k`` (0 or -1: off) and ``return_token_ids`` (each choice carries
its ``token_ids``, and ``prompt_token_ids``). Any other field is refused, as OpenAI refuses it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

MAX_STOPS = 4
SEED_LIMIT = 2 ** 32
# OpenAI's fields this server does not implement, with the one value each may take (the default)
UNSUPPORTED = {"echo": (False,), "logprobs": (None,), "best_of": (None, 1), "suffix": (None,),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {})}


class ApiError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error body (message, type, param, code)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable_error"}.get(self.status, "invalid_request_error")
        return error_body(self.message, kind, self.param, self.code)


def error_body(message: str, kind: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Limits:
    """What a request may ask of this server."""

    max_tokens: int  # the most new tokens a request may ask for (the slots' cache holds this many)
    default_max_tokens: int  # max_tokens when a request names none (the checkpoint's output length)
    max_prompt_tokens: int  # the longest prompt, in tokens (the widest prompt the slots hold)
    max_prompt_chars: int  # the longest prompt, in characters, before it is tokenized (413 past it)
    max_prompts: int  # prompts in one request (413 past it)
    max_body_bytes: int  # a request body (413 past it)


@dataclass(frozen=True)
class Completion:
    """A checked completions request."""

    prompts: tuple
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: Optional[int]
    stop: tuple
    stream: bool
    include_usage: bool
    return_token_ids: bool


def _bad(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field} {message}", param=field, code="invalid_value")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def _int(body: dict, field: str, default, low: int, high: Optional[int] = None) -> int:
    x = body.get(field)
    if x is None:
        return default
    if not _is_int(x) or x < low or (high is not None and x > high):
        span = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise _bad(field, f"must be an integer {span} (got {json.dumps(x)})")
    return x


def _number(body: dict, field: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    x = body.get(field)
    if x is None:
        return default
    if not _is_number(x) or x > high or x < low or (low_open and x == low):
        span = f"in ({low}, {high}]" if low_open else f"in [{low}, {high}]"
        raise _bad(field, f"must be a number {span} (got {json.dumps(x)})")
    return float(x)


def _prompts(body: dict, limits: Limits) -> tuple:
    if "prompt" not in body:
        raise ApiError(400, "prompt is required: a string or a list of strings", param="prompt",
                       code="missing_required_parameter")
    prompt = body["prompt"]
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise _bad("prompt", "must be a string or a non-empty list of strings (token id lists are not taken)")
    if len(prompts) > limits.max_prompts:
        raise ApiError(413, f"prompt holds {len(prompts)} prompts: at most {limits.max_prompts} in one request",
                       param="prompt", code="too_many_prompts")
    for p in prompts:
        if len(p) > limits.max_prompt_chars:
            raise ApiError(413, f"prompt of {len(p)} characters: at most {limits.max_prompt_chars}",
                           param="prompt", code="prompt_too_large")
    return tuple(prompts)


def _stop(body: dict) -> tuple:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise _bad("stop", f"must be a non-empty string or a list of at most {MAX_STOPS} of them "
                           f"(got {json.dumps(stop)[:100]})")
    return tuple(stops)


def _unsupported(body: dict) -> None:
    for field, allowed in UNSUPPORTED.items():
        if field in body and body[field] not in allowed:
            raise ApiError(400, f"{field}={json.dumps(body[field])[:100]} is not supported by this server (leave it "
                                f"out, or pass {json.dumps(allowed[-1])})", param=field, code="unsupported_value")
    if "user" in body and not isinstance(body["user"], str):
        raise _bad("user", "must be a string")


def _flag(body: dict, field: str) -> bool:
    x = body.get(field, False)
    if x is None:
        return False
    if not isinstance(x, bool):
        raise _bad(field, f"must be true or false (got {json.dumps(x)[:100]})")
    return x


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise _bad("stream_options", "is only taken with stream=true")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise _bad("stream_options", 'must be an object with "include_usage" only')
    return _flag(opts, "include_usage")


FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
          "stream_options", "return_token_ids", "user") + tuple(UNSUPPORTED)


def parse_completion(raw: bytes, limits: Limits, model_id: str) -> Completion:
    """A request body -> the checked request, or ApiError (400: malformed JSON, an unknown field, a value of the
    wrong type or out of range; 404: another model; 413: a prompt or a list of prompts past the limits)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ApiError(400, f"unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0],
                       code="unknown_parameter")
    model = body.get("model")
    if model is not None and model != model_id:
        raise ApiError(404, f"the model {json.dumps(model)[:100]} does not exist: this server serves {model_id!r}",
                       param="model", code="model_not_found")
    _unsupported(body)
    _int(body, "n", 1, 1, 1)
    stream = _flag(body, "stream")
    return Completion(
        prompts=_prompts(body, limits),
        max_tokens=_int(body, "max_tokens", limits.default_max_tokens, 1, limits.max_tokens),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_int(body, "top_k", 0, -1),
        seed=_int(body, "seed", None, 0, SEED_LIMIT - 1),
        stop=_stop(body), stream=stream, include_usage=_stream_options(body, stream),
        return_token_ids=_flag(body, "return_token_ids"))


# --------------------------------------------------------------------------- response bodies


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(index: int, text: str, finish_reason: Optional[str], token_ids: Optional[list] = None,
           prompt_ids: Optional[list] = None) -> dict:
    c = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        c["token_ids"] = token_ids
    if prompt_ids is not None:
        c["prompt_token_ids"] = prompt_ids
    return c


def completion(rid: str, created: int, model: str, choices: list, use: Optional[dict]) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def models(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "flan-t5"}]}
