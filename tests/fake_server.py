"""The server (serving/http.py) over an engine over the fake backend (tests/fake_backend.py), on a free port, in a
thread of the test's process: what tests/serving/test_http.py and test_controls.py drive with raw HTTP and the openai
client. No JAX, no compilation."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Optional

import httpx
import openai
import uvicorn

from data.synthetic import make_tokenizer
from serving.engine import Engine, ServeOptions
from serving.http import MAX_HEADER_BYTES, Connections, Refusals, Server, header_timeout_protocol, make_app
from tests.fake_backend import FakeBackend

TOK = make_tokenizer()


KEY = "fake-key"


MODEL = "fake"


WAIT = 30


def encode(texts: list) -> list:
    return TOK(list(texts), add_special_tokens=True)["input_ids"]  # as T5 reads a prompt: its end-of-text last


def words(text: str) -> list:
    return TOK(text, add_special_tokens=False)["input_ids"]


class FakeServer:
    """serving/http.py's Server over an Engine over the fake backend, on a free port, in a thread of this process."""

    def __init__(self, max_queue: int = 8, scores_prompts: bool = True, **kw):
        tok = kw.pop("tokenizer", TOK)  # (another: its prompts read with its own special tokens)
        self.backend = FakeBackend(slots=4, max_prompt=32, steps=2, vocab=len(tok), top=5,
                                   scores_prompts=scores_prompts, eos_id=tok.eos_token_id,
                                   lora_slots=kw.pop("lora_slots", 0))
        for name, path in kw.pop("loras", ()):  # LoRA adapters served from the start (tests/serving/test_http.py)
            self.backend.adapters.install(self.backend.adapters.read(name, path))
        options = ServeOptions(slots=4, max_queue=max_queue, width=32, insert_rows=(1, 4), steps=2,
                               max_new_tokens=kw.pop("max_new_tokens", 64), max_prompt_chars=2000,
                               max_body_bytes=65536, model_id=MODEL, max_logprobs=5,
                               chat_template=kw.pop("chat_template", None))
        read = encode if tok is TOK else lambda texts: tok(list(texts), add_special_tokens=True)["input_ids"]
        self.engine = Engine(self.backend, tok, read, options, continues_prompt=kw.pop("continues_prompt", False))
        self.connections = Connections(kw.pop("max_connections", None))
        self.refusals = Refusals(self.engine.metrics, kw.pop("log_requests", logging.INFO))
        app = make_app(self.engine, KEY, body_timeout=kw.pop("body_timeout", 5.0),
                       on_fatal=lambda e: self.server.stop_fatally(e), connections=self.connections,
                       refusals=self.refusals)
        protocol = header_timeout_protocol(kw.pop("header_timeout", 5.0), self.connections, self.refusals,
                                           kw.pop("max_header_bytes", MAX_HEADER_BYTES))
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", http=protocol,
                                timeout_keep_alive=5)
        self.server = Server(config, self.engine, kw.pop("grace", 30.0), self._listening)
        self.url = None
        self.http = httpx.Client(timeout=WAIT)  # one client: making one per request costs its TLS set-up each time
        self.up = threading.Event()
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        assert self.up.wait(WAIT), "the server did not start"

    def _listening(self, host, port):
        self.host, self.port, self.url = host, port, f"http://{host}:{port}"
        self.up.set()

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, timeout=WAIT, **{"max_retries": 0, **kw})

    def post(self, body, path: str = "/v1/completions", headers: Optional[dict] = None, **kw) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
        return self.http.post(self.url + path, content=content, headers=h, **kw)

    def metric(self, name: str) -> float:
        text = self.engine.metrics.text().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def serves(self) -> None:
        """A normal request is answered as the fake model answers it."""
        r = self.post({"model": MODEL, "prompt": "the cat", "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "the cat", r.text  # its prompt, then its end-of-text

    def gated_stream(self) -> tuple:
        """A streamed request of 9 tokens held by the fake device (its advances read only once ``gate`` is set) ->
        (gate, its client, its streamed response)."""
        gate = threading.Event()
        self.backend.gate = gate
        client = httpx.Client(timeout=WAIT, headers={"Authorization": f"Bearer {KEY}"})
        stream = client.send(client.build_request("POST", self.url + "/v1/completions", json={
            "model": MODEL, "prompt": words("the cat"), "max_tokens": 9, "stream": True}), stream=True)
        return gate, client, stream

    def wait_for(self, check, what: str) -> None:
        deadline = time.monotonic() + WAIT
        while not check():
            assert time.monotonic() < deadline, f"{what} within {WAIT} s"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT)
        self.http.close()
