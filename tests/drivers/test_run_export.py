"""run_export.py and run_server.py without a model say what they would do (export's help is short); the export
folder is not tracked by git."""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import ROOT
from tests.helpers import fails as _fails


# ---------------------------------------------------------------------- 14. the decoding drivers without --load
def test_export_and_server_without_a_model_say_what_they_would_do_and_export_s_help_is_short(capsys):
    import run_export
    import run_server

    _fails(capsys, run_export.main, ["--output", "/tmp/never"], "nothing to export: pass --load CKPT")
    _fails(capsys, run_server.main, [], "nothing to serve: pass --load CKPT")
    with pytest.raises(SystemExit):
        run_export.main(["--help"])
    shown = capsys.readouterr().out
    assert shown.startswith("usage: run_export.py (--load CKPT | --hf_model NAME_OR_DIR) --output DIR")
    assert len(shown.splitlines()) < 60 and "--learning_rate" not in shown and "--load" in shown


def test_the_export_folder_is_not_tracked_by_git():
    for path in ("hf/lora/adapter_config.json", "hf/merged/model.safetensors", ".venv/bin/python"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
