"""The drivers' arguments (app/args.py): one flat flag per config field, every field in --help with the preset's
values and no internal names, paths checked writable before the model is built, and ``--tokenizer train`` on a
resume meaning the tokenizer the run learnt."""

from __future__ import annotations

import pytest

import run_finetuning
import run_validation
from app.args import parse_config
from config.schema import FIELDS
from tests.helpers import SMALL, fails


def test_cli_flat_flags(capsys):
    cfg, args = parse_config("finetuning", "t", "tiny", ["--config", "tiny", "--micro_batch_size", "2", "--layers", "3",
                                                          "--eval", "--available_memory_proportion", "0.2", "0.3"])
    assert cfg.execution.micro_batch_size == 2 and cfg.model.layers == 3 and cfg.model.eval
    assert cfg.execution.available_memory_proportion == (0.2, 0.3)
    assert args.config == "tiny"


@pytest.mark.parametrize("kind", ["finetuning", "inference"])
def test_cli_help_lists_every_field(capsys, kind):
    # Field docs are free text (a "%" in one once broke argparse's help formatting).
    with pytest.raises(SystemExit) as e:
        parse_config(kind, "t", "tiny", ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    from app.args import TRAINING_ONLY

    # the decoding drivers list every field but the training-only ones (which they still accept)
    hidden = {f for f, ref in FIELDS.items() if ref.path[0] == "training" or f in TRAINING_ONLY}
    listed = set(FIELDS) - (hidden if kind == "inference" else set())
    missing = [f for f in listed if f"--{f}" not in out]
    assert not missing
    assert not [f for f in FIELDS if f not in listed and f"--{f} " in out]
    assert ("10% faster" in out) == (kind == "finetuning")  # a "%" in a doc (unroll_layers) once broke --help


def test_unwritable_paths_fail_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    import graphs.graphs

    def never(*a, **k):
        raise AssertionError("the model was built before the path was checked")

    monkeypatch.setattr(graphs.graphs.Graphs, "__init__", never)
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where a directory would have to be: unwritable even for root
    fails(capsys, run_finetuning.main, SMALL + ["--save", str(blocker / "ck")], f"--save {blocker / 'ck'} cannot be written")
    fails(capsys, run_finetuning.main, SMALL + ["--run_dir", str(blocker / "run")], "--run_dir")
    fails(capsys, run_validation.main, ["--config", "tiny", "--hf_model", "x", "--output", str(blocker / "r.json")],
          "--output")


def test_help_shows_the_presets_values_without_internal_names(capsys):
    with pytest.raises(SystemExit):
        run_finetuning.main(["--config", "xl_pod8", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "residual stream (hf: d_model). [xl_pod8: 2048]" in out  # hidden_size
    assert "(mesh axis 'tp'). [xl_pod8: 8]" in out  # tensor_parallel
    assert "CFG__" not in out and "(default: None)" not in out


# ------------------------------------------------------------------------------------- 5. resuming an own task
@pytest.mark.parametrize("given,resumes", [("train", True), (None, True), ("other/tokenizer", False)])
def test_tokenizer_train_on_a_resume_means_the_tokenizer_the_run_learnt(monkeypatch, caplog, given, resumes):
    """The argument logic of the long test below, in milliseconds (a checkpoint's meta faked): --tokenizer train
    on a resume is the tokenizer the run learnt (``resumed_fields`` drops the flag: it would learn another, whose
    ids are not the embedding's rows), named in the log; no flag is the same; another tokenizer is refused by the
    resume's check, naming the one it was trained with."""
    from types import SimpleNamespace

    from app.args import config_of
    from app.resume import resume_point
    from config import load_config
    from config.presets import to_dict
    from utils import checkpoint as ckpt
    from utils.errors import FlanT5Error

    learnt = "/runs/qa/tokenizer"
    saved = to_dict(load_config("finetuning", "tiny", {"tokenizer": learnt, "dataset": "qa.jsonl", "input_column":
                                                       "question", "target_column": "answer", "labels": "none"}))
    monkeypatch.setattr(ckpt, "resolve", lambda path: [("/runs/qa", 2)])
    monkeypatch.setattr(ckpt, "read_meta", lambda directory, step: {"step": 2, "config": saved})
    overrides = {"load": "/runs/qa", "save": "/runs/qa", "steps": 3, **({"tokenizer": given} if given else {})}
    with caplog.at_level("INFO", logger="flan_t5"):
        cfg = config_of("finetuning", SimpleNamespace(config="tiny"), overrides, resume=True)
    assert ("resuming with the tokenizer /runs/qa learnt, /runs/qa/tokenizer" in caplog.text) == (given == "train")
    if resumes:
        assert cfg.data.tokenizer == learnt and cfg.task.target_column == "answer" and cfg.training.steps == 3
        assert resume_point(cfg) == ("/runs/qa", 2)
    else:
        with pytest.raises(FlanT5Error, match="--tokenizer other/tokenizer \\(it was trained with --tokenizer "
                                              "/runs/qa/tokenizer\\)"):
            resume_point(cfg)
