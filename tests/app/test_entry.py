"""Every driver's entry (app/entry.py): each driver runs under the entry wrapper and every expected error derives
from the error base; a bad config is one line and a non-zero exit; a device out of memory is one line with the
bytes and the knobs; a signal at start-up or during validation exits cleanly (130, no traceback, no segmentation
fault, an earlier report intact)."""

import os
import signal
import time

import pytest

import run_finetuning
import run_validation
from app.args import parse_config
from tests.helpers import SMALL, fails, start, train
from utils import checkpoint as ckpt


@pytest.mark.parametrize("argv,message", [
    (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag"),
    (["--config", "nope"], "unknown preset 'nope'"),
    (["--tensor_parallel", "3"], "heads=4 is not divisible by tensor_parallel=3"),
])
def test_cli_errors_exit_nonzero_with_one_line(capsys, argv, message):
    from app.entry import entry

    with pytest.raises(SystemExit) as e:
        entry(lambda a: parse_config("finetuning", "t", "tiny", a))(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_every_driver_shares_the_entry_wrapper_and_the_error_base():
    import finetuning
    import inference
    from benchmarks import hf_baseline
    from config import ConfigError
    from data.sources import DataError
    from graphs.plan import PlanError
    from modelling.hf_mapping import CheckpointError
    from partitioning.sharding import DeviceCountError
    from utils.errors import FlanT5Error

    for module in (run_finetuning, run_validation, finetuning, inference, hf_baseline):
        assert module.main.__wrapped__  # utils.cli.entry
    for cls in (ConfigError, DataError, PlanError, DeviceCountError, CheckpointError, ckpt.CheckpointNotFound,
                ckpt.CheckpointShapeError):
        assert issubclass(cls, FlanT5Error)


def test_a_device_out_of_memory_is_one_line_with_the_bytes_and_the_knobs(capsys):
    """A real XLA out-of-memory error (4 TiB asked of this CPU) under the drivers' entry wrapper."""
    import jax.numpy as jnp

    from app.entry import entry

    @entry
    def main(argv):
        jnp.zeros((2 ** 40,), jnp.float32).block_until_ready()

    line = fails(capsys, main, [], "a device ran out of memory allocating 4096.0 GiB", code=4)
    assert "--micro_batch_size" in line and "--phased true" in line and "--plan" in line


@pytest.mark.slow
@pytest.mark.parametrize("when", ["start-up", "validation"])
def test_a_signal_at_start_up_or_during_validation_exits_cleanly(tmp_path, when):
    """No segmentation fault, no traceback, exit 130; an earlier report stays intact."""
    save = str(tmp_path / "ck")
    train(save, 1)
    earlier = os.path.join(save, "validation_step1.json")
    with open(earlier, "w") as f:
        f.write('{"earlier": true}')
    if when == "start-up":
        proc = start(["run_finetuning.py"] + SMALL + ["--steps", "50", "--save", str(tmp_path / "new")])
        time.sleep(1.5)
    else:
        # the whole synthetic split one prompt at a time: decoding lasts long past the signal
        proc = start(["run_validation.py", "--load", save, "--micro_batch_size", "1"])
        deadline, buf = time.time() + 240, ""
        while "model shape from the checkpoint" not in buf and time.time() < deadline and proc.poll() is None:
            buf += os.read(proc.stderr.fileno(), 4096).decode(errors="replace")
        time.sleep(4)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Segmentation fault" not in err and "Traceback" not in err and "Exception ignored" not in err
    assert "SIGINT: stopped" in err
    assert open(earlier).read() == '{"earlier": true}'
    assert not [f for f in os.listdir(save) if ".tmp" in f]
