"""The two commands on a fresh machine (issue 45): a clean copy of the repository (its tracked files, no virtual
environment, no checkpoints), then `make quickstart` and `make test` as a new user types them. They make .venv from
the requirements (seeing the packages this Python has: nothing is downloaded), train and validate the tiny presets
offline, and run the test command; a second `make` installs nothing and trains nothing again."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.env import ROOT, child_env

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def fresh_clone(dest) -> str:
    """The repository's files as a fresh clone has them (tracked, and new files not ignored), nothing else."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, f)):
            os.makedirs(os.path.dirname(os.path.join(dest, f)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, f), os.path.join(dest, f))
    return str(dest)


def make(repo: str, *args: str, timeout: float = 900) -> str:
    """``make ARGS`` in ``repo`` as a user's shell runs it (no virtual environment active) -> its output."""
    env = {k: v for k, v in child_env().items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
    p = subprocess.run(["make", *args, f"PYTHON={sys.executable}"], cwd=repo, env=env, capture_output=True,
                       text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"make {' '.join(args)} exited {p.returncode}:\n{out[-3000:]}"
    return out


@pytest.mark.slow  # (both drivers trained and validated on a fresh clone: 83 s)
def test_make_quickstart_and_make_test_on_a_fresh_clone(tmp_path):
    base = subprocess.run([getattr(sys, "_base_executable", sys.executable), "-c", "import jax, transformers"],
                          capture_output=True)
    if sys.prefix != sys.base_prefix and base.returncode:
        pytest.skip("this Python is a virtual environment over one without the requirements: a fresh .venv would "
                    "download them (run the suite from an interpreter that has them, as CI's .ci/run does)")
    repo = fresh_clone(tmp_path / "clone")
    assert not os.path.exists(os.path.join(repo, ".venv")) and not os.path.exists(os.path.join(repo, "ckpt"))
    out = make(repo, "quickstart", "STEPS=2", "VALIDATE=--limit 8")
    assert os.path.isfile(os.path.join(repo, ".venv", ".installed")) and "pip install" in out
    for run in ("tiny", "gptj"):
        assert os.path.isfile(os.path.join(repo, "ckpt", run, "2", "commit_success.txt")), out[-2000:]
    assert out.count("accuracy") >= 2, out[-2000:]  # each validated
    # then, as the docs' set-up says, a driver runs as printed in the environment activated (not this Python)
    shell = {k: v for k, v in child_env().items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
    run = subprocess.run(["bash", "-c", "source .venv/bin/activate && python3 -c 'import sys; print(sys.prefix)' && "
                          "python3 run_finetuning.py --help"], cwd=repo, env=shell, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert os.path.realpath(run.stdout.splitlines()[0]) == os.path.realpath(os.path.join(repo, ".venv"))
    assert "--config" in run.stdout
    again = make(repo, "quickstart", "VALIDATE=--limit 8")  # set up and trained already: validated again alone
    assert "pip install" not in again and "holds a trained tiny run" in again and "training" not in again
    tests = make(repo, "test", "TESTS=tests/test_docs.py -k front_page")
    assert "1 passed" in tests and "pip install" not in tests
