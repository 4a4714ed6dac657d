"""The docs' client snippets run as printed: every Python block of README.md and docs/ that uses the `openai` client
runs against the servers its page starts (`run_server.py --load ckpt/...`, with the page's flags and key) on the
checkpoints the quickstart makes (random weights of the same presets: the same task, output length and tokenizer), its
addresses alone rewritten to the test's ports. A request the server refuses (a 4xx) raises in the client, so a
snippet asking more than a checkpoint allows (`max_tokens` past its output length) fails here."""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
import threading

import pytest

from tests.env import ROOT, child_env

pytestmark = pytest.mark.slow  # (a server process per checkpoint the docs name)

PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
URL = re.compile(r"http://127\.0\.0\.1:(\d+)/v1")
START_TIMEOUT = 600  # seconds for a server to compile its programs and listen (2 shared cores)


def quickstart_checkpoints() -> dict:
    """{checkpoint directory: preset} of what `make quickstart` trains (the Makefile's loop)."""
    make = open(os.path.join(ROOT, "Makefile")).read()
    loop = re.search(r'for run in ((?:"[\w/]+ [\w/]+" ?)+); do', make).group(1)
    return {ckpt: preset for preset, ckpt in re.findall(r'"([\w/]+) ([\w/]+)"', loop)}


def client_snippets(text: str) -> list:
    """The Python blocks of a page that use the openai client."""
    return [b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) if "from openai import" in b]


def launches(text: str, checkpoints: dict) -> dict:
    """{port: (checkpoint directory, [the server's other flags], the key or None)} of the page's
    `run_server.py --load CKPT` commands on the quickstart's checkpoints, adapters none (port 8000 unless --port
    says)."""
    found = {}
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "run_server.py" not in words or "--load" not in words:
                continue
            env = dict(w.split("=", 1) for w in words[:words.index("python3")] if "=" in w)
            args = words[words.index("run_server.py") + 1:]
            ckpt = args[args.index("--load") + 1]
            if ckpt not in checkpoints or "--lora" in args:
                continue  # (a server of adapters the quickstart does not train: no client snippet reaches it)
            port = int(args[args.index("--port") + 1]) if "--port" in args else 8000
            rest, skip = [], {"--load", "--port", "--host"}
            for i, a in enumerate(args):
                if a not in skip and (i == 0 or args[i - 1] not in skip):
                    rest.append(a)
            assert port not in found, f"two servers of the docs on port {port}"
            found[port] = (ckpt, rest, env.get("FLAN_T5_API_KEY"))
    return found


class Server:
    """run_server.py on a checkpoint, on a free port of 127.0.0.1, its start-up line read for the address."""

    def __init__(self, load: str, flags: list, key):
        env = child_env(None, **({"FLAN_T5_API_KEY": key} if key else {}))
        argv = [sys.executable, os.path.join(ROOT, "run_server.py"), "--load", load, "--port", "0", *flags]
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.url, self.err = None, []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def ready(self) -> str:
        timer = threading.Timer(START_TIMEOUT, self.proc.kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                if line.startswith("serving "):
                    self.url = line.split(" on ")[1].split()[0]
                    break
        finally:
            timer.cancel()
        assert self.url, "".join(self.err[-20:])
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        return self.url

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_snippet(code: str, urls: dict) -> dict:
    """Runs a snippet with its addresses rewritten ({port of the docs: the test server's URL}) -> its names."""
    for port in {int(p) for p in URL.findall(code)}:
        assert port in urls, f"the snippet reaches port {port}, which no server of its page listens on"
    code = URL.sub(lambda m: urls[int(m.group(1))] + "/v1", code)
    names = {"print": lambda *a, **k: None}
    exec(compile(code, "<snippet>", "exec"), names)  # noqa: S102 -- the docs' own code, run as a reader runs it
    return names


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{page: {port of the docs: URL}} with a server per checkpoint the pages start, on random-init checkpoints of
    the quickstart's presets saved under the names the docs give them (the model id is the directory's name)."""
    from tests.helpers import save_random_checkpoint

    checkpoints, root = quickstart_checkpoints(), tmp_path_factory.mktemp("quickstart")
    texts = {p: open(p).read() for p in PAGES}
    wanted = {p: launches(t, checkpoints) for p, t in texts.items() if client_snippets(t)}
    servers, urls = {}, {}
    try:
        for page, found in wanted.items():
            for port, (ckpt, flags, key) in found.items():
                spec = (ckpt, tuple(flags), key)
                if spec not in servers:
                    path = root / ckpt
                    if not path.exists():
                        save_random_checkpoint(checkpoints[ckpt], str(path))
                    servers[spec] = Server(str(path), flags, key)
        ready = {spec: s.ready() for spec, s in servers.items()}
        for page, found in wanted.items():
            urls[page] = {port: ready[(ckpt, tuple(flags), key)] for port, (ckpt, flags, key) in found.items()}
        yield urls
    finally:
        for s in servers.values():
            s.stop()


def test_the_docs_show_client_snippets_and_the_servers_they_reach():
    """The reading finds what it should: the README's and serving.md's snippets, the quickstart's two checkpoints
    served, serving.md's second server on its port with its key."""
    checkpoints = quickstart_checkpoints()
    assert checkpoints == {"ckpt/tiny": "tiny", "ckpt/gptj": "gptj_tiny"}
    pages = {os.path.relpath(p, ROOT) for p in PAGES if client_snippets(open(p).read())}
    assert {"README.md", "docs/serving.md"} <= pages
    serving = launches(open(os.path.join(ROOT, "docs", "serving.md")).read(), checkpoints)
    assert serving[8000] == ("ckpt/tiny", [], None) and serving[8080] == ("ckpt/gptj", ["--slots", "16"], "secret")


@pytest.mark.parametrize("page", ["README.md", "docs/serving.md"])
def test_every_client_snippet_runs_as_printed(served, page):
    path = os.path.join(ROOT, page)
    for code in client_snippets(open(path).read()):
        names = run_snippet(code, served[path])
        assert names["r"].choices[0].finish_reason in ("stop", "length")
        assert names["chat"].choices[0].message.role == "assistant"


def test_a_snippet_asking_past_the_checkpoints_output_length_fails(served):
    """The check bites: the README's request with `max_tokens=8` of `tiny`, whose output length is 5, is the 400
    a reader got."""
    import openai

    path = os.path.join(ROOT, "README.md")
    code, = client_snippets(open(path).read())
    assert "max_tokens=5" in code
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an integer from 1 to 5"):
        run_snippet(code.replace("max_tokens=5", "max_tokens=8"), served[path])
