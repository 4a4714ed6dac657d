"""The server (run_server.py), driven over HTTP on 127.0.0.1 with the openai client and raw requests: greedy
outputs token for token those of run_inference.py under 16 concurrent requests of mixed lengths (both families),
seeded sampling alone == among others, streaming and stop strings, every bad input (400 naming the field), 401
without the key, 413 past the size limits, 429 on a full queue, a disconnected client's slot freed and reused,
SIGTERM with requests in flight (finished within the grace period, or ended with an error after it; exit 0).

Cheap by design: one random-init tiny checkpoint per family, saved in-process; one server process per family for
the whole module (4 slots, two prompt widths, one join size: three compiled programs each), started together;
every request loop bounded in count and time.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from config.presets import load_config, to_dict
from data.tasks import load_tokenizer
from graphs.graphs import Graphs
from modelling import decoding, slots
from utils import checkpoint as ckpt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key-42"
OUTPUT = 40  # run_inference's output length in the parity test: the longest max_tokens asked for there
START_TIMEOUT = 600  # seconds for a server to compile its programs and listen (2 shared cores)
WAIT = 60  # seconds any one wait for the server may take
WORDS = ("the a cat dog bird horse child woman in at sleeps eats runs park house garden small red old . "
         "mnli hypothesis: premise:").split()


def save_random_checkpoint(preset: str, directory: str) -> None:
    """A random-init checkpoint of a preset (greedy parity needs no training), saved as run_finetuning saves one."""
    cfg = load_config("finetuning", preset, {})
    params = Graphs(cfg).init_params(7)
    mgr = ckpt.manager(directory)
    ckpt.save(mgr, 1, params, None, {"step": 1, "seed": cfg.model.seed, "config": to_dict(cfg)})
    mgr.wait_until_finished()
    mgr.close()


class Server:
    """A run_server.py process and where it listens."""

    def __init__(self, name: str, load: str, *flags: str):
        self.name, self.load = name, load
        cmd = [sys.executable, os.path.join(ROOT, "run_server.py"), "--load", load, "--port", "0", "--slots", "4",
               "--max_queue", "16", "--prompt_widths", "16", "32", "--join_sizes", "4", "--output_length", "256",
               "--max_body_bytes", "65536", "--max_prompt_chars", "2000", *flags]
        env = {**os.environ, "FLAN_T5_API_KEY": KEY}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines, self.err = queue.Queue(), []
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout], daemon=True).start()
        threading.Thread(target=lambda: [self.err.append(x) for x in self.proc.stderr], daemon=True).start()
        self.url, self.long = None, {}

    def ready(self) -> "Server":
        deadline = time.monotonic() + START_TIMEOUT
        while self.url is None:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"{self.name} server did not start: {''.join(self.err[-20:])}") from None
            if line.startswith("serving "):
                self.url = line.split(" on ")[1].split()[0]
                self.model = line.split()[1]
        return self

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=WAIT)

    def post(self, body, key: str = KEY, **kw) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + "/v1/completions", content=content, timeout=WAIT,
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}, **kw)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def wait_for(self, check, what: str) -> None:
        deadline = time.monotonic() + WAIT
        while not check():
            assert time.monotonic() < deadline, f"{self.name}: {what} within {WAIT} s"
            time.sleep(0.05)

    def long_prompt(self, tokens: int) -> str:
        """A prompt whose greedy output runs ``tokens`` tokens (no end-of-text before): requests that surely hold
        their slot that long (a random model writes its end-of-text now and then)."""
        if tokens not in self.long:
            for text in prompts(8, seed=20):
                r = self.post({"prompt": text, "max_tokens": tokens, "temperature": 0}).json()
                if r["choices"][0]["finish_reason"] == "length":
                    self.long[tokens] = text
                    break
        return self.long[tokens]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    out = {"t5": str(root / "t5"), "gptj": str(root / "gptj")}
    save_random_checkpoint("tiny", out["t5"])
    save_random_checkpoint("gptj_tiny", out["gptj"])
    return out


@pytest.fixture(scope="module")
def servers(checkpoints):
    """Both servers, started together (each compiles while the other does); T5's drains for 60 s on SIGTERM,
    GPT-J's ends its held requests at once (and takes up to 1024 new tokens: requests that outlast a signal)."""
    started = {"t5": Server("t5", checkpoints["t5"], "--grace_period", "60"),
               "gptj": Server("gptj", checkpoints["gptj"], "--grace_period", "0", "--output_length", "1024")}
    try:
        yield {k: s.ready() for k, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def prompts(n: int, seed: int) -> list:
    """n prompts of mixed lengths (2 to 25 words), from the synthetic tokenizer's words."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(2, 26)))) for _ in range(n)]


def run_inference_tokens(load: str, texts: list, monkeypatch) -> np.ndarray:
    """run_inference.py --prompt's greedy tokens [n, OUTPUT] (and its texts), the driver run as a user runs it."""
    import run_inference
    from app import predict

    seen = []
    original = predict.Predictor.predict_tokens

    def spy(self, params, feats, tokenizer):
        seen.append(original(self, params, feats, tokenizer))
        return seen[-1]

    monkeypatch.setattr(predict.Predictor, "predict_tokens", spy)
    out = run_inference.main(["--load", load, "--prompt", *texts, "--output_length", str(OUTPUT),
                              "--micro_batch_size", str(len(texts))])
    return seen[0], [r["ours"] for r in out]


def expected(row: np.ndarray, max_tokens: int, eos: int) -> tuple:
    """(the tokens a request of max_tokens gets from a greedy row, its finish_reason)."""
    row = row.tolist()[:max_tokens]
    return (row[:row.index(eos) + 1], "stop") if eos in row else (row, "length")


@pytest.mark.parametrize("family", ["t5", "gptj"])
def test_greedy_equals_run_inference_under_16_concurrent_requests(servers, checkpoints, family, monkeypatch):
    server = servers[family]
    texts = prompts(16, seed=1 if family == "t5" else 2)
    ref, ref_texts = run_inference_tokens(checkpoints[family], texts, monkeypatch)
    tokenizer = load_tokenizer("synthetic")
    lengths = [OUTPUT if i % 4 == 0 else 3 + 7 * (i % 5) for i in range(len(texts))]  # mixed: 3 to 40
    client = server.client()

    def ask(i):
        return client.completions.create(model=server.model, prompt=texts[i], max_tokens=lengths[i], temperature=0,
                                         extra_body={"return_token_ids": True})

    with ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(ask, range(len(texts))))
    assert len({len(tokenizer(t)["input_ids"]) for t in texts}) > 5  # prompts of mixed lengths
    for i, a in enumerate(answers):
        tokens, reason = expected(ref[i], lengths[i], tokenizer.eos_token_id)
        (c,) = a.choices
        assert c.token_ids == tokens, (i, texts[i])
        assert c.finish_reason == reason and a.usage.completion_tokens == len(tokens), (i, tokens, lengths[i], c)
        assert c.text == tokenizer.decode(tokens, skip_special_tokens=True)
        if lengths[i] == OUTPUT:
            assert c.text == ref_texts[i]  # run_inference's own text
    assert len({tuple(a.choices[0].token_ids) for a in answers}) > 8  # the outputs differ: a real check


def test_per_row_warpers_equal_the_batch_warpers():
    """Sampling in the slots: each row's warped scores are decoding.warp's with that row's options."""
    rows = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 12, 0.6), (1.0, 200, 0.95)]
    scores = jax.random.normal(jax.random.key(0), (len(rows), 64)) * 3
    s = slots.Sampling(jnp.asarray([r[0] for r in rows], jnp.float32), jnp.asarray([r[1] for r in rows], jnp.int32),
                       jnp.asarray([1.0 - r[2] if r[2] < 1 else 0.0 for r in rows], jnp.float32),
                       jnp.zeros(len(rows), jnp.uint32))
    ours = np.asarray(slots.warp_rows(scores, s))
    for i, (t, k, p) in enumerate(rows):
        theirs = np.asarray(decoding.warp(scores[i:i + 1], decoding.Options(1, temperature=t, top_k=k, top_p=p)))
        np.testing.assert_array_equal(ours[i], theirs[0])
    assert np.isinf(ours[1]).sum() == 64 - 5 and np.isinf(ours[3]).sum() >= 64 - 12


def test_a_server_on_a_non_local_address_without_a_key_says_so():
    from serving.engine import check_exposure

    line = check_exposure("0.0.0.0", None)
    assert "0.0.0.0" in line and "--api_key" in line and "\n" not in line
    assert check_exposure("0.0.0.0", "k") is None and check_exposure("127.0.0.1", None) is None


def test_a_seeded_request_gives_the_same_text_alone_or_among_others(servers):
    server = servers["t5"]
    client = server.client()
    ask = dict(model=server.model, max_tokens=30, temperature=0.9, top_p=0.9, seed=1234,
               extra_body={"return_token_ids": True, "top_k": 40})
    text = prompts(1, seed=5)[0]
    alone = client.completions.create(prompt=text, **ask).choices[0]
    others = [dict(prompt=p, model=server.model, max_tokens=5 + 9 * i, temperature=[0, 1.0, 0.5][i % 3], seed=i)
              for i, p in enumerate(prompts(7, seed=6))]
    with ThreadPoolExecutor(8) as pool:
        crowd = [pool.submit(client.completions.create, **o) for o in others[:4]]
        among = pool.submit(client.completions.create, prompt=text, **ask)
        crowd += [pool.submit(client.completions.create, **o) for o in others[4:]]
        among = among.result().choices[0]
        assert all(len(f.result().choices) == 1 for f in crowd)
    assert among.token_ids == alone.token_ids and among.text == alone.text
    other_seed = client.completions.create(prompt=text, **{**ask, "seed": 99}).choices[0]
    assert other_seed.token_ids != alone.token_ids  # the seed decides the draws


def test_streaming_and_stop_strings(servers):
    server = servers["t5"]
    client = server.client()
    text = prompts(1, seed=8)[0]
    whole = client.completions.create(model=server.model, prompt=text, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=server.model, prompt=text, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT,
                      json={"prompt": text, "max_tokens": 5, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    # a stop string: the text ends before it, finish_reason "stop", streamed or not
    words = whole.choices[0].text.split()
    assert len(words) >= 3, whole
    stop = " " + words[2]
    cut = whole.choices[0].text[:whole.choices[0].text.index(stop)]
    stopped = client.completions.create(model=server.model, prompt=text, max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].text == cut and stopped.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=server.model, prompt=text, max_tokens=24, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut and streamed[-1].choices[0].finish_reason == "stop"


BAD = [  # (body, status, param, words the message holds)
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    ({"max_tokens": 5}, 400, "prompt", "required"),
    ({"prompt": "a", "frobnicate": 1}, 400, "frobnicate", "unrecognized"),
    ({"prompt": 7}, 400, "prompt", "string"),
    ({"prompt": []}, 400, "prompt", "non-empty"),
    ({"prompt": [3, 4, 5]}, 400, "prompt", "token id"),
    ({"prompt": "a", "max_tokens": "5"}, 400, "max_tokens", "from 1 to 256"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "from 1 to 256"),
    ({"prompt": "a", "max_tokens": 257}, 400, "max_tokens", "from 1 to 256"),
    ({"prompt": "a", "temperature": "hot"}, 400, "temperature", "[0.0, 2.0]"),
    ({"prompt": "a", "temperature": 2.5}, 400, "temperature", "[0.0, 2.0]"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p", "(0.0, 1.0]"),
    ({"prompt": "a", "top_k": -2}, 400, "top_k", "at least -1"),
    ({"prompt": "a", "seed": -1}, 400, "seed", "from 0 to 4294967295"),
    ({"prompt": "a", "seed": 1.5}, 400, "seed", "integer"),
    ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ({"prompt": "a", "stop": ""}, 400, "stop", "non-empty"),
    ({"prompt": "a", "n": 2}, 400, "n", "from 1 to 1"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream", "true or false"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream=true"),
    ({"prompt": "a", "echo": True}, 400, "echo", "not supported"),
    ({"prompt": "a", "logprobs": 2}, 400, "logprobs", "not supported"),
    ({"prompt": "a", "model": "gpt-4"}, 404, "model", "does not exist"),
    ({"prompt": " ".join(["cat"] * 40)}, 400, "prompt", "at most 32"),
]


def test_bad_input_is_a_400_naming_the_field_and_the_limit(servers):
    server = servers["t5"]
    before = server.metric('flan_t5_rejected_requests_total{status="400"}')
    for body, status, param, words in BAD:
        r = server.post(body)
        error = r.json()["error"]
        assert (r.status_code, error["param"]) == (status, param), (body, r.text)
        assert words in error["message"] and error["type"] == "invalid_request_error", (body, error)
    assert server.metric('flan_t5_rejected_requests_total{status="400"}') - before == sum(b[1] == 400 for b in BAD)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the openai client sees the same
        server.client().completions.create(model=server.model, prompt="a", max_tokens=1000)
    empty = servers["gptj"].post({"prompt": ""})  # GPT-J reads no token of it (T5 reads its end-of-text)
    assert empty.status_code == 400 and "no tokens" in empty.json()["error"]["message"]


def test_the_key_is_needed_everywhere_but_health(servers):
    server = servers["gptj"]
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(server.url + path, timeout=WAIT).status_code == 401
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}, timeout=WAIT).status_code == 401
        assert httpx.get(server.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=WAIT).status_code == 200
    r = server.post({"prompt": "a", "max_tokens": 2}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").completions.create(model=server.model, prompt="a", max_tokens=2)
    assert httpx.get(server.url + "/health", timeout=WAIT).json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model] == [os.path.basename(server.load)]


def test_size_limits_are_a_413(servers):
    server = servers["gptj"]
    big = server.post({"prompt": "a", "user": "x" * 70000})  # body past --max_body_bytes 65536
    assert big.status_code == 413 and "65536 bytes" in big.json()["error"]["message"]
    long = server.post({"prompt": "cat " * 600})  # 2400 characters, past --max_prompt_chars 2000
    assert long.status_code == 413 and long.json()["error"]["param"] == "prompt" and "2000" in long.text
    many = server.post({"prompt": ["a"] * 21})  # more prompts than the server holds (4 slots + 16 queued)
    assert many.status_code == 413 and "at most 20" in many.json()["error"]["message"]


def _open_stream(server, body: dict):
    """A streaming request, its first event read: (client, response, its lines) -- the request holds its slot. Its
    events carry their token ids, so that the first comes with the first tokens (a random model's tokens often
    decode to no text, and an event without text or ids is not sent)."""
    client = httpx.Client(timeout=WAIT, headers={"Authorization": f"Bearer {KEY}"})
    response = client.send(client.build_request("POST", server.url + "/v1/completions",
                                                json={**body, "stream": True, "return_token_ids": True}),
                           stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    first = next(line for line in lines if line)
    assert first.startswith("data: {"), first
    return client, response, lines


def test_a_full_queue_is_a_429_with_retry_after(servers):
    server = servers["gptj"]
    # 20 sequences of 256 tokens: 4 in the slots, 16 queued; none ends before 256 steps
    text = server.long_prompt(256)
    client, response, _ = _open_stream(server, {"prompt": [text] * 20, "max_tokens": 256, "temperature": 0})
    try:
        r = server.post({"prompt": "a dog", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error", r.text
        assert int(r.headers["retry-after"]) >= 1
    finally:
        response.close()
        client.close()
    server.wait_for(lambda: server.metric("flan_t5_running_slots") == 0 and server.metric("flan_t5_queue_depth") == 0,
                    "the filler's 20 sequences cancelled")
    assert server.post({"prompt": "a dog", "max_tokens": 2}).status_code == 200


def test_a_disconnected_client_frees_its_slot(servers):
    server = servers["t5"]
    cancelled = server.metric('flan_t5_requests_total{outcome="cancelled"}')
    generated = server.metric("flan_t5_generated_tokens_total")
    text = server.long_prompt(256)
    streams = [_open_stream(server, {"prompt": text, "max_tokens": 256, "temperature": 0}) for _ in range(4)]
    for client, response, _ in streams:  # the four slots held, then every client goes away
        response.close()
        client.close()
    server.wait_for(lambda: server.metric('flan_t5_requests_total{outcome="cancelled"}') - cancelled == 4,
                    "4 sequences cancelled")
    assert server.metric("flan_t5_running_slots") == 0
    assert server.metric("flan_t5_generated_tokens_total") - generated < 4 * 256  # they stopped early
    client = server.client()  # the slots serve others
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda p: client.completions.create(model=server.model, prompt=p, max_tokens=6,
                                                                  temperature=0), prompts(4, 10)))
    assert [a.usage.completion_tokens <= 6 and a.choices[0].finish_reason in ("stop", "length") for a in done] == \
        [True] * 4


def test_sigterm_finishes_the_requests_in_flight_then_exits_0(servers):
    server = servers["t5"]
    text = server.long_prompt(256)
    streams = [_open_stream(server, {"prompt": text, "max_tokens": 256, "temperature": 0, "stream_options":
                                     {"include_usage": True}}) for _ in range(3)]
    server.proc.send_signal(signal.SIGTERM)
    refused = server.post({"prompt": "a cat", "max_tokens": 2})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert httpx.get(server.url + "/health", timeout=WAIT).status_code == 503
    for client, response, lines in streams:
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        response.close()
        client.close()
        assert events[-1]["usage"]["completion_tokens"] >= 1
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        assert events[-1]["usage"]["completion_tokens"] == 256  # finished whole
    assert server.proc.wait(WAIT) == 0


def test_sigterm_after_the_grace_period_ends_the_requests_with_an_error_then_exits_0(servers):
    server = servers["gptj"]  # --grace_period 0
    text = server.long_prompt(1024)
    streams = [_open_stream(server, {"prompt": text, "max_tokens": 1024, "temperature": 0}) for _ in range(2)]
    server.proc.send_signal(signal.SIGTERM)
    for client, response, lines in streams:
        events = [line for line in lines if line]
        response.close()
        client.close()
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]  # ended, not silently dropped
        assert error["code"] == "shutting_down" and "shut down" in error["message"]
    assert server.proc.wait(WAIT) == 0
    with pytest.raises(httpx.ConnectError):  # it no longer listens
        httpx.get(server.url + "/health", timeout=WAIT)
