"""The server (run_server.py) on real models, driven over HTTP on 127.0.0.1 with the openai client and raw
requests: greedy outputs token for token those of run_inference.py under 16 concurrent requests of mixed lengths
(both families); log-probabilities (of the completion, and with echo of GPT-J's prompt) equal to Hugging Face's
float32 forward pass of the same weights within 1e-4, before temperature and top-k, in both the completions and
the chat shapes; token-id prompts, n and best_of with a seed per choice, chat; seeded sampling alone == among
others, streaming and stop strings, the real engine's limits (the top_k that crashed the decoding loop is a 400),
401 without the key, 413 past the size limits, SIGTERM with requests in flight (finished within the grace period,
or ended with an error after it; exit 0); XLA's threads sized by a decoding step of all the slots; each server's
attention spans compiled and timed.

What needs no model (the HTTP layer's refusals, the fuzz corpus, 429, clients that go away, failing calls, drain) is
tests/serving/test_http.py's, over a fake backend; the scheduler's own rules are tests/serving/test_scheduler.py's;
the thread counts' rules are tests/app/test_runtime.py's.

Cheap by design: one random-init tiny checkpoint per family, saved in-process; one server process per family for
the whole module (4 slots, prompts up to 32 tokens), started together; every request loop bounded in count
and time."""

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
import numpy as np
import openai
import pytest
import torch

from app.hf_generate import hf_model_of
from config.presets import load_config, to_dict
from data.tokenizer import load_tokenizer
from graphs.graphs import Graphs
from tests.helpers import ROOT, machine, threads_passed
from utils import checkpoint as ckpt

pytestmark = pytest.mark.slow  # (a server process per family, each compiling its programs)


KEY = "test-key-42"


OUTPUT = 40  # run_inference's output length in the parity test: the longest max_tokens asked for there


START_TIMEOUT = 600  # seconds for a server to compile its programs and listen (2 shared cores)


WAIT = 60  # seconds any one wait for the server may take


WORDS = ("the a cat dog bird horse child woman in at sleeps eats runs park house garden small red old . "
         "mnli hypothesis: premise:").split()


def save_random_checkpoint(preset: str, directory: str) -> tuple:
    """A random-init checkpoint of a preset (greedy parity needs no training), saved as run_finetuning saves one ->
    (its config, its weights on the host)."""
    cfg = load_config("finetuning", preset, {})
    graphs = Graphs(cfg)
    params = graphs.init_params(7)
    mgr = ckpt.manager(directory)
    ckpt.save(mgr, 1, params, None, {"step": 1, "seed": cfg.model.seed, "config": to_dict(cfg)})
    mgr.wait_until_finished()
    mgr.close()
    return cfg, graphs.family, jax.tree.map(np.asarray, params)


class Server:
    """A run_server.py process and where it listens."""

    def __init__(self, name: str, load: str, *flags: str):
        self.name, self.load = name, load
        cmd = [sys.executable, os.path.join(ROOT, "run_server.py"), "--load", load, "--port", "0", "--slots", "4",
               "--max_queue", "16", "--prompt_width", "32", "--output_length", "256",
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
                self.banner = line
                self.url = line.split(" on ")[1].split()[0]
                self.model = line.split()[1]
        return self

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=WAIT)

    def post(self, body, key: str = KEY, **kw) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps({"model": self.model, **body})
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
def models(tmp_path_factory):
    """{family: (config, family, host weights)} of the checkpoints served."""
    root = tmp_path_factory.mktemp("serve")
    return {"t5": (str(root / "t5"), *save_random_checkpoint("tiny", str(root / "t5"))),
            "gptj": (str(root / "gptj"), *save_random_checkpoint("gptj_tiny", str(root / "gptj")))}


@pytest.fixture(scope="module")
def checkpoints(models):
    return {k: v[0] for k, v in models.items()}


@pytest.fixture(scope="module")
def servers(checkpoints):
    """Both servers, started together (each compiles while the other does); T5's drains for 60 s on SIGTERM,
    GPT-J's ends its held requests at once (and takes up to 1024 new tokens: requests that outlast a signal): every
    test of both goes through both."""
    started = {"t5": Server("t5", checkpoints["t5"], "--grace_period", "60", "--attention_spans", "4"),
               "gptj": Server("gptj", checkpoints["gptj"], "--grace_period", "0", "--output_length", "1024",
                              "--cpu_threads", "1", "--attention_spans", "4", "--access_log", "--log_requests",
                              "warning")}
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
    from decoder.decoder import Decoder

    seen = []
    original = Decoder.predict_tokens

    def spy(self, params, feats):
        seen.append(original(self, params, feats))
        return seen[-1]

    monkeypatch.setattr(Decoder, "predict_tokens", spy)
    out = run_inference.main(["--load", load, "--prompt", *texts, "--output_length", str(OUTPUT),
                              "--micro_batch_size", str(len(texts))])
    return seen[0], [r["ours"] for r in out]


def expected(row: np.ndarray, max_tokens: int, eos: int) -> tuple:
    """(the tokens a request of max_tokens gets from a greedy row, its finish_reason)."""
    row = row.tolist()[:max_tokens]
    return (row[:row.index(eos) + 1], "stop") if eos in row else (row, "length")


@pytest.mark.parametrize("family", ["t5", "gptj"])
def test_greedy_equals_run_inference_under_16_concurrent_requests(servers, models, checkpoints, family, monkeypatch):
    """run_inference.py --prompt TEXT reads the task's input (GPT-J: TEXT target:); /v1/completions reads its prompt
    as given, so it is sent the text in the task's format (the family's ``prompt``)."""
    server, fam = servers[family], models[family][2]
    assert server.banner.rstrip().endswith("a free slot joins at once)")  # the default on a CPU device (the backend's)
    texts = prompts(16, seed=1 if family == "t5" else 2)
    ref, ref_texts = run_inference_tokens(checkpoints[family], texts, monkeypatch)
    tokenizer = load_tokenizer("synthetic")
    lengths = [OUTPUT if i % 4 == 0 else 3 + 7 * (i % 5) for i in range(len(texts))]  # mixed: 3 to 40
    client = server.client()

    def ask(i):
        return client.completions.create(model=server.model, prompt=fam.prompt(texts[i]), max_tokens=lengths[i],
                                         temperature=0, extra_body={"return_token_ids": True})

    with ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(ask, range(len(texts))))
    assert len({len(tokenizer(t)["input_ids"]) for t in texts}) > 5  # prompts of mixed lengths
    for i, a in enumerate(answers):
        tokens, reason = expected(ref[i], lengths[i], tokenizer.eos_token_id)
        (c,) = a.choices
        assert c.token_ids == tokens, (i, texts[i])
        assert c.finish_reason == reason and a.usage.completion_tokens == len(tokens), (i, tokens, lengths[i], c)
        # GPT-J's completion continues its prompt: read after the prompt's last tokens, its first word keeps its
        # space (issue 69's "in theriver"); T5's answer is a text of its own
        ctx = fam.encode_inputs(tokenizer, [fam.prompt(texts[i])])[0][-6:] if fam.continues_prompt else []
        read = tokenizer.decode(ctx + tokens, skip_special_tokens=True)[len(tokenizer.decode(ctx)):]
        assert c.text == read and (not fam.continues_prompt or not read or read.startswith(" "))
        if lengths[i] == OUTPUT:
            assert c.text == (" " if fam.continues_prompt and read else "") + ref_texts[i]  # run_inference's text
    assert len({tuple(a.choices[0].token_ids) for a in answers}) > 8  # the outputs differ: a real check


@pytest.mark.parametrize("more,platforms,given,want,by", [
    (-1, "cpu", None, 3, "--slots"), (0, "cpu", None, 0, "--slots"), (0, "cuda", None, 3, "--slots"),
    (0, "cpu", 2, 2, "--slots"), (-1, "cpu", 0, 0, "--slots"),
    (-1, "cpu", None, 3, "--micro_batch_size"), (0, "cpu", None, 0, "--micro_batch_size")])
def test_the_server_sizes_xla_s_pool_by_a_decoding_step_of_all_its_slots(monkeypatch, checkpoints, more, platforms,
                                                                          given, want, by):
    """run_server.py passes set_cpu_threads, before JAX starts, server_cpu_threads of a decoding step of every slot
    (the slots, --slots or by default micro_batch_size x data_parallel, x the loaded model's step): from the slots
    whose step reaches HEAVY_STEP_FLOPS (``more`` 0) every core on a CPU, one slot fewer a core left; --cpu_threads
    as given; --plan the flag as given (0 by default)."""
    import math

    import run_server
    from app import runtime
    from app.flops import decode_step_flops

    machine(monkeypatch, 4, platforms)
    passed = threads_passed(monkeypatch)  # (the server's first step after reading its config: nothing else runs)
    per = decode_step_flops(load_config("inference", "tiny").model)  # (the checkpoint's shape: tiny's)
    slots = math.ceil(runtime.HEAVY_STEP_FLOPS / per) + more
    flags = ["--load", checkpoints["t5"], by, str(slots)]  # (the tiny preset: data_parallel 1)
    flags += [] if given is None else ["--cpu_threads", str(given)]
    with pytest.raises(SystemExit):
        run_server.main(flags)
    with pytest.raises(SystemExit):  # --plan serves nothing: no core left, the flag as given
        run_server.main(flags + ["--plan"])
    assert passed == [want, given or 0]


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
                      json={"model": server.model, "prompt": text, "max_tokens": 5, "temperature": 0,
                            "stream": True}) as r:
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


BAD = [  # (family, body, status, param, words the message holds): the limits of the real engines
    ("t5", {"prompt": "a", "top_k": 2 ** 31}, 400, "top_k", "from -1 to 128"),  # crashed the decoding loop once
    ("t5", {"prompt": "a", "top_k": 129}, 400, "top_k", "from -1 to 128"),  # at most the model's vocabulary
    ("gptj", {"prompt": [5, 128]}, 400, "prompt", "from 0 to 127"),
    ("t5", {"prompt": " ".join(["cat"] * 40)}, 400, "prompt", "at most 32"),
    ("gptj", {"prompt": list(range(3, 40))}, 400, "prompt", "at most 32"),
    ("t5", {"prompt": "a", "max_tokens": 257}, 400, "max_tokens", "from 1 to 256"),
    ("t5", {"prompt": "a", "echo": True, "logprobs": 1}, 400, "echo", "encoder"),
    ("t5", {"prompt": "a", "logprobs": 21}, 400, "logprobs", "from 0 to 20"),
    ("t5", {"prompt": "   "}, 400, "prompt", "empty"),  # T5 would read its end-of-text alone
    ("gptj", {"prompt": ""}, 400, "prompt", "empty"),  # GPT-J would read nothing: both refuse alike
]


def test_the_real_engines_limits_are_400s_naming_the_field_and_the_server_serves_after(servers):
    for family, body, status, param, words in BAD:
        server = servers[family]
        r = server.post(body)
        error = r.json()["error"]
        assert (r.status_code, error["param"]) == (status, param), (body, r.text)
        assert words in error["message"] and error["type"] == "invalid_request_error", (body, error)
    for server in servers.values():
        assert server.post({"prompt": "a dog", "max_tokens": 2, "top_k": 128, "temperature": 1}).status_code == 200
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the openai client sees the same
        servers["t5"].client().completions.create(model=servers["t5"].model, prompt="a", max_tokens=1000)


def hf_logprobs(cfg, family, params, prompt: list, tokens: list) -> np.ndarray:
    """Hugging Face's float32 log-probabilities [len(tokens), V] at each new token's place, given the prompt and the
    tokens before it: the model's own, no warper."""
    model = hf_model_of(cfg, family, params).float()
    with torch.no_grad():
        if family.causal:
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        else:
            logits = model(input_ids=torch.tensor([prompt]),
                           decoder_input_ids=torch.tensor([[0] + tokens[:-1]])).logits[0]
    return torch.log_softmax(logits.double(), -1).numpy()


@pytest.mark.parametrize("family", ["t5", "gptj"])
def test_logprobs_are_the_models_own_equal_to_a_float32_forward_pass(servers, models, family):
    """Each token's log-probability and the 5 best, greedy or sampled (temperature 1.5, top-k 5: the model's own
    before them), in the completions and the chat shapes, and with echo the prompt's (GPT-J), all equal to HF's
    float32 forward pass within 1e-4."""
    server, (_, cfg, fam, params) = servers[family], models[family]
    client, text = server.client(), prompts(1, seed=11)[0]
    prompt = fam.encode_inputs(load_tokenizer("synthetic"), [text])[0]
    ask = dict(model=server.model, prompt=text, max_tokens=12, logprobs=5, extra_body={"return_token_ids": True})
    greedy = client.completions.create(temperature=0, **ask).choices[0]
    sampled = client.completions.create(temperature=1.5, seed=3, **{**ask, "extra_body": {
        "return_token_ids": True, "top_k": 5}}).choices[0]
    for c in (greedy, sampled):
        ref = hf_logprobs(cfg, fam, params, prompt, c.token_ids)
        np.testing.assert_allclose(c.logprobs.token_logprobs, ref[np.arange(len(c.token_ids)), c.token_ids],
                                   atol=1e-4)
        for top, row in zip(c.logprobs.top_logprobs, ref):  # the 5 most likely texts, and the chosen token's
            assert max(top.values()) == pytest.approx(row.max(), abs=1e-4) and 5 <= len(top) <= 6
    assert len(greedy.token_ids) >= 3 and sampled.token_ids != greedy.token_ids
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": text}],
                                          max_tokens=12, temperature=0, logprobs=True, top_logprobs=5).choices[0]
    # (a chat message is the task's input: the text in the family's prompt format, GPT-J's ' target:' after it)
    rendered = client.completions.create(temperature=0, **{**ask, "prompt": fam.prompt(text)}).choices[0]
    assert chat.message.content == rendered.text
    ref = hf_logprobs(cfg, fam, params, fam.encode_inputs(load_tokenizer("synthetic"), [fam.prompt(text)])[0],
                      rendered.token_ids)
    np.testing.assert_allclose([[t.logprob for t in e.top_logprobs] for e in chat.logprobs.content],
                               -np.sort(-ref, axis=1)[:, :5], atol=1e-4)
    if fam.scores_prompts:
        echo = client.completions.create(model=server.model, prompt=prompt, max_tokens=0, echo=True,
                                         logprobs=3).choices[0]
        ref = hf_logprobs(cfg, fam, params, prompt[:1], prompt[1:])  # each prompt token given the ones before
        lp = echo.logprobs
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt)
        np.testing.assert_allclose(lp.token_logprobs[1:], ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)
        assert echo.text == text


def test_token_id_prompts_n_and_best_of(servers):
    server = servers["gptj"]
    client, text = server.client(), prompts(1, seed=12)[0]
    ids = load_tokenizer("synthetic")(text, add_special_tokens=False)["input_ids"]
    ask = dict(model=server.model, max_tokens=10, extra_body={"return_token_ids": True})
    by_text = client.completions.create(prompt=text, temperature=0, **ask).choices[0]
    by_ids = client.completions.create(prompt=[ids, ids], temperature=0, **ask).choices
    assert [c.token_ids for c in by_ids] == [by_text.token_ids] * 2 and by_ids[1].index == 1
    seeded = dict(prompt=text, temperature=1.0, seed=77, logprobs=0, **ask)
    one, two, three = (client.completions.create(n=n, **seeded).choices for n in (1, 2, 3))
    assert three[0].token_ids == one[0].token_ids and three[1].token_ids == two[1].token_ids  # choice i: its seed
    assert len({tuple(c.token_ids) for c in three}) >= 2
    best = client.completions.create(n=1, best_of=3, **seeded).choices
    sums = [sum(c.logprobs.token_logprobs) for c in three]
    assert len(best) == 1 and best[0].token_ids == three[int(np.argmax(sums))].token_ids  # the most likely


@pytest.mark.parametrize("family", ["t5", "gptj"])
def test_chat_through_the_openai_client(servers, models, family):
    """One user message is the task's input: read as its text in the task's prompt format sent to /v1/completions
    (no template: the documented default; T5's format is the text, GPT-J's the text and ' target:')."""
    server, fam = servers[family], models[family][2]
    client, text = server.client(), prompts(1, seed=13)[0]
    messages = [{"role": "user", "content": text}]
    chat = client.chat.completions.create(model=server.model, messages=messages, max_tokens=10, temperature=0)
    plain = client.completions.create(model=server.model, prompt=fam.prompt(text), max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == plain.choices[0].text and chat.usage == plain.usage
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=10,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


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


def test_each_refusal_is_a_line_at_log_requests_level_the_access_log_on_request_and_bad_http_a_json_400(servers):
    """--log_requests warning: a refusal is one WARNING line naming the request and why; --access_log: uvicorn's
    line a request, with this process's time and level, as a malformed request's 400 (OpenAI's JSON, counted) is;
    the T5 server (neither flag) logs its refusals at INFO and has no access log."""
    import re
    import socket

    stamped = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING) ")
    server = servers["gptj"]
    assert server.post({"prompt": "a", "max_tokens": 0}).status_code == 400
    host, port = server.url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
    sock.settimeout(WAIT)
    reply = b""
    while chunk := sock.recv(4096):
        reply += chunk
    assert reply.startswith(b"HTTP/1.1 400 ") and json.loads(reply.split(b"\r\n\r\n")[1])["error"]["code"] == \
        "malformed_request"
    assert server.metric('flan_t5_rejected_requests_total{status="400"}') >= 2

    def lines(s, words):
        return [x for x in s.err if words in x]

    server.wait_for(lambda: lines(server, "a malformed HTTP request") and lines(server, '"GET /metrics HTTP/1.1" 200'),
                    "the lines")
    refused = lines(server, "refused POST /v1/completions from 127.0.0.1:")
    assert any("400 max_tokens" in x for x in refused), refused
    assert all(stamped.match(x) and " WARNING " in x for x in refused + lines(server, "a malformed HTTP request"))
    assert all(stamped.match(x) for x in lines(server, '"GET /metrics HTTP/1.1" 200'))
    t5 = servers["t5"]
    assert t5.post({"prompt": "a", "max_tokens": 0}).status_code == 400
    t5.wait_for(lambda: lines(t5, "refused POST /v1/completions"), "the T5 server's line")
    assert all(" INFO " in x for x in lines(t5, "refused POST")) and not lines(t5, '"POST /v1/completions HTTP/1.1"')
# --------------------------------------------------------------------------- the sampling controls on the real models


def _tokens(server, prompt, **kw) -> tuple:
    """(token ids, finish_reason) of a greedy completion asking ``kw`` (the extras in the body)."""
    r = server.post({"prompt": prompt, "temperature": 0, "return_token_ids": True, **kw}).json()
    assert "choices" in r, r
    return r["choices"][0]["token_ids"], r["choices"][0]["finish_reason"]


def test_a_repetition_penalty_served_gives_run_inferences_tokens_with_the_same_processor(servers, checkpoints,
                                                                                        monkeypatch):
    """GPT-J's slots penalise the prompt's tokens and the row's own (HF's repetition penalty, which
    run_inference.py's search is held to: tests/modelling/test_processors.py): the same tokens, alone and beside
    free requests."""
    import run_inference
    from decoder.decoder import Decoder
    from modelling import registry

    server, texts = servers["gptj"], prompts(3, seed=30)
    seen, original = [], Decoder.predict_tokens
    monkeypatch.setattr(Decoder, "predict_tokens", lambda self, p, f: seen.append(original(self, p, f)) or seen[-1])
    run_inference.main(["--load", checkpoints["gptj"], "--prompt", *texts, "--output_length", "12",
                        "--micro_batch_size", "3", "--repetition_penalty", "1.8"])
    fam = registry.get("gptj")
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda t: _tokens(server, fam.prompt(t), max_tokens=12, repetition_penalty=1.8)[0],
                            texts))
        free = [pool.submit(_tokens, server, fam.prompt(t), max_tokens=12) for t in texts]
        assert not all(f.result()[0] == g for f, g in zip(free, got))  # the penalty bites
    for row, tokens in zip(seen[0], got):
        assert tokens == expected(row, 12, load_tokenizer("synthetic").eos_token_id)[0]


@pytest.mark.parametrize("family", ["t5", "gptj"])
def test_bias_min_tokens_and_ignore_eos_do_what_they_say_on_the_real_models(servers, family):
    server = servers[family]
    eos = load_tokenizer("synthetic").eos_token_id
    text = prompts(1, seed=31)[0]
    free, _ = _tokens(server, text, max_tokens=8)
    # logit_bias: -100 takes the first token away, +100 on another writes it at every step
    assert _tokens(server, text, max_tokens=6, logit_bias={str(free[0]): -100})[0][0] != free[0]
    assert _tokens(server, text, max_tokens=6, logit_bias={"9": 100})[0] == [9] * 6
    # the end-of-text token biased up ends it at once; min_tokens 5 holds it back for 5 tokens, not 6; ignore_eos
    # writes it and goes on: exactly max_tokens tokens
    up = {str(eos): 100}
    assert _tokens(server, text, max_tokens=8, logit_bias=up) == ([eos], "stop")
    held, reason = _tokens(server, text, max_tokens=8, logit_bias=up, min_tokens=5)
    assert len(held) == 6 and eos not in held[:5] and held[5] == eos and reason == "stop"
    assert _tokens(server, text, max_tokens=7, logit_bias=up, ignore_eos=True) == ([eos] * 7, "length")
    # the embedding's rows past the tokenizer's 64 ids are never drawn (issue 69), even at temperature 2
    drawn = server.post({"prompt": text, "max_tokens": 40, "temperature": 2.0, "seed": 5, "ignore_eos": True,
                         "return_token_ids": True}).json()["choices"][0]["token_ids"]
    assert len(drawn) == 40 and max(drawn) < 64


def test_a_constrained_and_a_free_request_in_one_batch_each_give_what_they_give_alone(servers):
    """T5's slots: requests held to a choice of texts (a grammar, asked of the host at each step from inside the
    decoding loop) beside free ones, all at once, each the tokens it gets alone; every constrained answer one of
    the choices; JSON, which the synthetic vocabulary cannot write, a 400 naming the field."""
    server = servers["t5"]
    client = server.client()
    choices = ["the cat sleeps", "a dog runs in the park", "red"]
    texts = prompts(6, seed=32)

    def ask(i):
        kw = {"extra_body": {"guided_choice": choices}} if i % 2 == 0 else {}
        return client.completions.create(model=server.model, prompt=texts[i], max_tokens=12, temperature=0,
                                         **kw).choices[0].text

    alone = [ask(i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(ask, range(6)))
    assert together == alone
    assert all(alone[i] in choices for i in range(0, 6, 2)) and not all(a in choices for a in alone[1::2])
    r = server.post({"prompt": "a", "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "no token of this model's vocabulary" in r.json()["error"]["message"]


def _open_stream(server, body: dict):
    """A streaming request, its first event read: (client, response, its lines) -- the request holds its slot. Its
    events carry their token ids, so that the first comes with the first tokens (a random model's tokens often
    decode to no text, and an event without text or ids is not sent)."""
    client = httpx.Client(timeout=WAIT, headers={"Authorization": f"Bearer {KEY}"})
    response = client.send(client.build_request("POST", server.url + "/v1/completions",
                                                json={"model": server.model, **body, "stream": True,
                                                      "return_token_ids": True}),
                           stream=True)
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    first = next(line for line in lines if line)
    assert first.startswith("data: {"), first
    return client, response, lines


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


def test_each_server_compiles_its_attention_spans_and_times_them(servers):
    """--attention_spans 4 reaches the programs: four decoding programs, the cache's columns in quarters (T5's: its
    256 new tokens; GPT-J's: the prompt width, 32, and its 1024 new tokens), each timed at start-up; beside them the
    inserts of 1 and 4 packed rows (4 slots: --insert_rows' default) and GPT-J's one score program, whatever the
    prompts' lengths: the start-up line counts them."""
    for name, spans in (("t5", [64, 128, 192, 256]), ("gptj", [264, 528, 792, 1056])):
        deadline = time.monotonic() + WAIT
        while "attention spans' decoding calls" not in "".join(servers[name].err) and time.monotonic() < deadline:
            time.sleep(0.1)  # (stderr is read on a thread of its own)
        text = "".join(servers[name].err)
        assert f"attention spans {spans})" in text and "attention spans' decoding calls" in text, name
        timed = text.split("attention spans' decoding calls")[1].splitlines()[0]
        assert [int(x.split(":")[0]) for x in timed.split("ms): ")[1].split(", ")[::2]] == spans, timed
        programs = 2 + len(spans) + (name == "gptj")
        assert f"compiled {programs} slot programs in " in text and "packed into 1/4 rows an insert" in text, name


# --------------------------------------------------------------------------- LoRA adapters served side by side


@pytest.fixture(scope="module")
def loras(models, tmp_path_factory):
    """(the T5 checkpoint served, {name: LoRA checkpoint over it}): sql (q, v; rank 2), chat (q, v, o, wo; rank 4),
    code (q, v; rank 4: loaded while the server runs), big (rank 8), and other (over other weights)."""
    from tests.helpers import base_fingerprint, save_lora_checkpoint

    root, base = tmp_path_factory.mktemp("loras"), models["t5"][0]
    digest = base_fingerprint(base)
    specs = {"sql": (2, 8.0, ("q", "v")), "chat": (4, 16.0, ("q", "v", "o", "wo")), "code": (4, 4.0, ("q", "v")),
             "big": (8, 16.0, ("q", "v")), "other": (2, 8.0, ("q", "v"))}
    return base, {name: save_lora_checkpoint("tiny", str(root / name), base, "0123456789abcdef" if name == "other"
                                             else digest, r, alpha, targets, seed=i)
                  for i, (name, (r, alpha, targets)) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def lora_server(loras):
    base, paths = loras
    server = Server("t5 adapters", base, "--model_name", "base", "--lora", f"sql={paths['sql']}",
                    f"chat={paths['chat']}", "--max_loras", "3", "--lora_target_modules", "q", "v", "o", "wo")
    try:
        yield server.ready()
    finally:
        server.stop()


def test_adapters_served_side_by_side_answer_as_each_merged_alone_and_load_and_unload(lora_server, loras, monkeypatch):
    """12 concurrent requests of the base and two adapters mixed: each one's greedy tokens equal run_inference.py's of
    its own checkpoint (an adapter's: merged into its base); GET /v1/models lists the three (parent: the base); an
    adapter loaded over HTTP is served at once as its run_inference.py; one unloaded is a 404 after; a bad path
    and a rank above the stack's are 400s naming why; the unloaded adapter exported to PEFT's format (run_export.py
    --peft) and loaded from that directory answers as its checkpoint."""
    base, paths = loras
    server = lora_server
    texts = prompts(12, seed=21)
    names = ["base", "sql", "chat"]
    refs = {name: run_inference_tokens(base if name == "base" else paths[name], texts, monkeypatch)[0]
            for name in names + ["code"]}
    assert sum(refs["sql"][i].tolist() != refs["base"][i].tolist() for i in range(12)) >= 6  # (adapters matter)
    tokenizer, client = load_tokenizer("synthetic"), server.client()
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == names and cards["sql"].parent == cards["chat"].parent == "base"

    def ask(i, model=None):
        model = model or names[i % 3]
        a = client.completions.create(model=model, prompt=texts[i], max_tokens=OUTPUT, temperature=0,
                                      extra_body={"return_token_ids": True})
        return model, a

    with ThreadPoolExecutor(12) as pool:
        for i, (model, a) in enumerate(pool.map(ask, range(12))):
            assert a.model == model and a.choices[0].token_ids == expected(refs[model][i], OUTPUT,
                                                                           tokenizer.eos_token_id)[0], (i, model)
    admin = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "code", "lora_path": paths["code"]},
                   headers=admin, timeout=WAIT)
    assert r.status_code == 200, r.text
    for i in (0, 5):
        assert ask(i, "code")[1].choices[0].token_ids == expected(refs["code"][i], OUTPUT, tokenizer.eos_token_id)[0]
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=admin,
                      timeout=WAIT).status_code == 200
    with pytest.raises(openai.NotFoundError):
        ask(0, "sql")
    assert [m.id for m in client.models.list().data] == ["base", "chat", "code"]
    import run_export

    peft_dir = os.path.join(os.path.dirname(paths["sql"]), "sql_peft")
    run_export.main(["--load", paths["sql"], "--output", peft_dir, "--peft"])
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "sqlpeft", "lora_path": peft_dir},
                   headers=admin, timeout=WAIT)
    assert r.status_code == 200, r.text
    for i in (0, 4):
        assert ask(i, "sqlpeft")[1].choices[0].token_ids == expected(refs["sql"][i], OUTPUT,
                                                                     tokenizer.eos_token_id)[0]
    for name, path, why in (("x", "/no/such/ckpt", "no checkpoint at /no/such/ckpt"),
                            ("big", paths["big"], "its rank is 8, above the server's --max_lora_rank 4")):
        r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                       headers=admin, timeout=WAIT)
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text


def test_an_adapter_s_request_held_to_a_choice_answers_as_alone_beside_other_models(lora_server):
    """Requests that name an adapter and hold their answer to a choice of texts (a grammar, the host asked at each
    step), beside the base's and the adapter's free ones, all at once: each the text it gets alone, every
    constrained answer one of the choices, and an adapter's constrained answers not all the base's."""
    client = lora_server.client()
    choices = ["the cat sleeps", "a dog runs in the park", "red", "the park"]
    texts = prompts(8, seed=41)
    models = ["chat", "base", "base", "chat", "chat", "base", "chat", "chat"]  # (chat: served throughout the module)

    def ask(i, model=None):
        kw = {"extra_body": {"guided_choice": choices}} if i % 2 == 0 else {}
        return client.completions.create(model=model or models[i], prompt=texts[i], max_tokens=12, temperature=0,
                                         **kw).choices[0].text

    alone = [ask(i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    assert together == alone
    assert all(alone[i] in choices for i in range(0, 8, 2))
    held = [i for i in range(0, 8, 2) if models[i] != "base"]
    assert [ask(i, "base") for i in held] != [alone[i] for i in held]  # (the adapters change what is chosen)


@pytest.mark.parametrize("case,message", [
    ("other", "adapter x ({other}) was trained on the weights of {base}/1 (fingerprint 0123456789abcdef), not on the "
              "base served, {base} (fingerprint "),
    ("missing", "adapter x: no checkpoint at /no/such/ckpt"),
    ("big", "adapter x ({big}): its rank is 8, above the server's --max_lora_rank 4: restart it with "
            "--max_lora_rank 8"),
    ("lora_load", "holds LoRA adapters, and adapters are served over the model they were trained on")])
def test_an_adapter_the_server_cannot_serve_is_refused_at_start_up_in_one_line(loras, capsys, case, message):
    import run_server
    from tests.helpers import fails

    base, paths = loras
    load = paths["sql"] if case == "lora_load" else base
    path = "/no/such/ckpt" if case == "missing" else paths.get(case, paths["sql"])
    argv = ["--load", load, "--lora", f"x={path}", "--max_lora_rank", "4", "--cpu_threads", "0", "--port", "0"]
    fails(capsys, run_server.main, argv, message.format(base=base, **paths))
