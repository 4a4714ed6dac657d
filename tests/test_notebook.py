"""The notebook walkthrough (notebooks/flan_t5_mnli.ipynb) runs top to bottom on this CPU, offline, so it
cannot drift from the code; its committed form carries no outputs."""

import os
import re

import nbformat
import pytest

from tests.env import RUN_FAST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "notebooks", "flan_t5_mnli.ipynb")


def test_the_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_the_notebook_runs_top_to_bottom(monkeypatch):
    """Its kernel trains 300 steps: compiled at -O1 (tests/env.py's ``RUN_FAST``), not with the tests' fast
    compilation, whose code steps 2-4x slower."""
    from nbclient import NotebookClient

    monkeypatch.setenv("XLA_FLAGS", RUN_FAST + " --xla_force_host_platform_device_count=8")  # the kernel inherits it

    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": os.path.join(ROOT, "notebooks")}}).execute()
    text = "\n".join(o.get("text", "") if o.output_type == "stream" else str(o.get("data", {}).get("text/plain", ""))
                     for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    accuracy = float(re.search(r"accuracy ([0-9.]+)% on 1000 samples", text).group(1))
    print(f"notebook accuracy {accuracy}%")
    assert accuracy >= 80, text[-2000:]  # 300 steps of the tiny preset learn the synthetic task
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the loss curve and the confusion matrix, inline
