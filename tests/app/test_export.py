"""Export (app/export.py, through run_export.py): a LoRA checkpoint's adapters in PEFT's format name their base as
--output was given, so PEFT loads them after their folder moves."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import SMALL


# ------------------------------------------------------------------ 15. PEFT's base path, 16. hf/ in .gitignore
@pytest.mark.slow
def test_a_peft_export_names_its_base_as_output_was_given_and_loads_after_its_folder_moves(tmp_path, monkeypatch):
    import run_export
    import run_finetuning

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    run_finetuning.main(SMALL + ["--lora_rank", "2", "--lora_random_base", "--steps", "1", "--save", "ck"])
    run_export.main(["--load", "ck", "--output", "hf/lora", "--peft"])
    config = json.load(open(project / "hf" / "lora" / "adapter_config.json"))
    assert config["base_model_name_or_path"] == os.path.join("hf", "lora", "base")
    moved = tmp_path / "moved"
    os.rename(project, moved)
    monkeypatch.chdir(moved)
    peft = pytest.importorskip("peft")
    model = peft.AutoPeftModelForSeq2SeqLM.from_pretrained("hf/lora")  # base and adapters, found where they moved
    assert model.peft_config["default"].r == 2
