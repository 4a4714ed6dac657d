"""MNLI fine-tuning of Flan-T5 or GPT-J with TP x DP.

    python3 run_finetuning.py --config tiny --save ckpt/tiny          # offline, CPU
    python3 run_finetuning.py --config gptj_tiny --save ckpt/gptj      # GPT-J, offline, CPU
    python3 run_finetuning.py --config xxl_pod16 --save ckpt/xxl --wandb
    python3 run_finetuning.py --config tiny --save ckpt/tiny --load ckpt/tiny --steps 1200   # resume
    python3 run_finetuning.py --config xxl_pod16 --data_parallel 1 --tensor_parallel 1 --phased true --plan

Ctrl-C or SIGTERM finish the current step, save it (with --save) and exit 130 / 143; a
non-finite loss or gradient norm stops the run (exit 3) and keeps the last good checkpoint. Under dynamic
loss scaling (float16's default) a step whose gradients overflow is skipped and the scale halved; only
--max_skipped_steps such steps in a row stop the run.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below (seconds: JAX's) is one line too, not a traceback
    from app.entry import exit_on_signals

    exit_on_signals()

import logging
import os
import sys

from app.args import command_line, config_of, ensure_writable
from app.entry import entry
from app.runtime import start_devices
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


def extra_flags(p):
    p.add_argument("--wandb", action="store_true", help="log to Weights & Biases (WANDB_MODE=offline works without a login)")
    p.add_argument("--wandb-name", dest="wandb_name", default=None, help="W&B run name")
    p.add_argument("--plan", action="store_true",
                   help="print the memory plan of the run (device and host bytes at their peaks, from shapes; "
                        "nothing allocated) and exit")
    p.add_argument("--run_dir", default=None,
                   help="where metrics.jsonl and loss_curve.png go: the --save directory if given, else a fresh "
                        "runs/PRESET-DATE-TIME")
    p.add_argument("--init_from", default=None, metavar="CKPT",
                   help="start a new run from a checkpoint's weights (step 0, fresh optimizer state and learning-rate "
                        "schedule, any dataset), unlike --load, which resumes a run where it stopped")
    p.add_argument("--lora_random_base", action="store_true",
                   help="with --lora_rank and no --hf_model or --init_from: adapters on the seed's random weights "
                        "(for tests and benchmarks: a random base learns little through its adapters)")
    p.add_argument("--discard_later_steps", action="store_true",
                   help="with --load DIR/STEP --save DIR: continue from STEP on a new branch, deleting DIR's later "
                        "steps (without it, such a rollback stops before any work)")
    p.add_argument("--log_every", type=int, default=None, metavar="N",
                   help="when the output is not a terminal (a cluster job's log), a progress line every N steps "
                        "(default: a twentieth of the run, and at least once a minute)")


def build_executor(cfg):
    """Graphs and the executor (fused, or phased when execution.phased)."""
    from graphs.executor import make_executor
    from graphs.graphs import Graphs

    executor = make_executor(Graphs(cfg))
    if executor.name == "phased":
        logger.info("phased execution: weights, optimizer state and activations in host memory")
    return executor


def check_args(cfg, args) -> None:
    """Fails before any work: a run that trains nothing, LoRA adapters on a random base (unless asked), paths that
    cannot be written, a W&B run that cannot start."""
    if cfg.model.eval:
        raise FlanT5Error("eval=true builds no optimizer: drop --eval to fine-tune, or use run_validation.py")
    if cfg.lora.rank and not (cfg.checkpoint.load or args.init_from or cfg.data.hf_model or args.lora_random_base
                              or args.plan):
        raise FlanT5Error(f"--lora_rank {cfg.lora.rank} trains adapters on a frozen base, and this run's base would "
                          "be a random init (no --hf_model, --init_from or --load): start from trained weights with "
                          "--hf_model NAME_OR_DIR or --init_from CKPT (a fine-tuned checkpoint, e.g. the quickstart's "
                          "ckpt/tiny), or pass --lora_random_base to adapt random weights anyway (tests, benchmarks)")
    if cfg.checkpoint.save:
        ensure_writable(cfg.checkpoint.save, "--save")
    if args.run_dir:
        ensure_writable(args.run_dir, "--run_dir")
    if args.wandb:
        from app.tracking import check_wandb

        check_wandb()


@entry
def main(argv=None) -> None:
    args, overrides = command_line("finetuning", __doc__, argv, extra_flags)
    cfg = config_of("finetuning", args, overrides, resume=True)
    from app.args import local_paths_absolute
    from app.resume import base_tokenizer

    local_paths_absolute(cfg)
    base_tokenizer(cfg, args.init_from, "tokenizer" in overrides)
    check_args(cfg, args)
    start_devices(cfg, pinned=True)
    if args.plan:
        from graphs.plan import plan

        print(plan(build_executor(cfg), exact=True).format())
        return
    if cfg.training.steps == 0:
        raise FlanT5Error("--steps 0: nothing to train (and nothing is written): pass --steps 1 or more")
    from app import resume
    from app.rundir import check_free, check_metrics_owner, fresh_run_dir
    from app.runtime import agree, is_main_process

    point, warm = resume.resume_point(cfg), resume.init_point(cfg, args.init_from)
    if point and not cfg.checkpoint.save:
        logger.warning("resuming %s/%d without --save: nothing of this run will be saved; pass --save %s to go on "
                       "saving where it stopped", *point, point[0])
    # a fresh directory is chosen (and made) by process 0 alone; every process of the run uses the same
    args.run_dir = args.run_dir or cfg.checkpoint.save or agree("run_dir", lambda: fresh_run_dir("runs", args.config))
    # every check that can refuse the run reads only: a refused run leaves its directories as they were
    for d in dict.fromkeys([cfg.checkpoint.save, args.run_dir]):
        if d and is_main_process():  # process 0 owns the run's directories (and holds their locks)
            check_free(d)
    later = resume.check_save_dir(cfg, point, args.discard_later_steps)
    check_metrics_owner(args.run_dir, bool(point) and os.path.abspath(point[0]) == os.path.abspath(args.run_dir))
    locks = resume.own_directories([cfg.checkpoint.save, args.run_dir])  # held for the run's life
    try:
        resume.discard_steps(cfg.checkpoint.save, later, point)
        train(cfg, args, point, warm)
    finally:
        for lock in locks:
            lock.release()


def train(cfg, args, point, warm) -> None:
    """Builds the run (executor checked to fit, data, state) and trains it."""
    from app.resume import initial_state
    from app.train_data import training_data
    from app.trainer import Trainer, run_name
    from graphs.loss_scale import LossScale
    from graphs.plan import check_fits
    from partitioning.plan import human_bytes
    from utils import checkpoint as ckpt

    if cfg.training.eval_every:  # what it would score exists and is not the training rows (before reading any)
        from app.train_data import run_tasks
        from data.mixture import check_evaluation

        check_evaluation(run_tasks(cfg))
    executor = build_executor(cfg)
    for source in (point, warm):  # a checkpoint of another model shape fails here, before the data is read
        if source:
            ckpt.check_shapes(*source, executor.g.abstract_params(), executor.g.shape_hint)
    loader = training_data(cfg, executor.g.family, args.run_dir)
    plan = check_fits(executor, cfg)
    logger.info("memory plan: %s per device, %s of host memory (before program temporaries; --plan counts them)",
                human_bytes(plan.device_peak), human_bytes(plan.host_peak))
    scaler = LossScale.of_config(cfg)
    state, start = initial_state(cfg, executor, loader, point, warm, scaler)
    tracking = {"wandb": args.wandb, "wandb_name": args.wandb_name, "log_every": args.log_every,
                "name": run_name(args.config, args.run_dir)}
    Trainer(cfg, executor, loader, start, scaler, args.run_dir, tracking).run(state)


if __name__ == "__main__":
    main(sys.argv[1:])
