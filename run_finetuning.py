"""MNLI fine-tuning of Flan-T5 with TP x DP.

    python3 run_finetuning.py --config tiny --save ckpt/tiny          # offline, CPU
    python3 run_finetuning.py --config xxl_pod16 --save ckpt/xxl --wandb
    python3 run_finetuning.py --config tiny --save ckpt/tiny --load ckpt/tiny --steps 800   # resume
"""

from __future__ import annotations

import logging
import os
import sys
import time

from utils.cli import die, ensure_host_devices, ensure_pinned_host_memory, parse_config, setup_jax, setup_logging

logger = logging.getLogger("flan_t5")


def extra_flags(p):
    p.add_argument("--wandb", action="store_true", help="log to Weights & Biases")
    p.add_argument("--wandb-name", dest="wandb_name", default=None, help="W&B run name")
    p.add_argument("--plan", action="store_true",
                   help="print the memory plan of the run (device and host bytes at their peaks, from shapes; "
                        "nothing allocated) and exit")
    p.add_argument("--run_dir", default=None,
                   help="where metrics.jsonl and loss_curve.png go (default: the --save directory, else runs/CONFIG)")


def build_executor(cfg):
    """Graphs and the executor (fused, or phased when execution.phased)."""
    from graphs.executor import make_executor
    from graphs.graphs import Graphs

    executor = make_executor(Graphs(cfg))
    if executor.name == "phased":
        logger.info("phased execution: weights, optimizer state and activations in host memory")
    return executor


def build(cfg):
    """The executor, checked to fit this machine (graphs/plan.py), and the training data loader."""
    from data.mnli import TrainLoader, load_rows, load_tokenizer, tokenize_examples
    from graphs.plan import check_fits

    executor = build_executor(cfg)
    plan = check_fits(executor, cfg)
    logger.info("memory plan: %.2f GiB per device, %.2f GiB of host memory (before program temporaries; "
                "--plan counts them)", plan.device_peak / 2**30, plan.host_peak / 2**30)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if len(tokenizer) > cfg.model.embedding.vocab_size:
        die(f"tokenizer has {len(tokenizer)} tokens but vocab_size={cfg.model.embedding.vocab_size}: "
            "raise --vocab_size or use the tokenizer of this model")
    rows = load_rows(cfg.data.dataset, "train", seed=cfg.model.seed)
    examples = tokenize_examples(rows, tokenizer)
    logger.info("training on %d samples of %s (%s rows of %d/%d tokens)", len(rows), cfg.data.dataset,
                "packed" if cfg.data.packing else "padded", cfg.model.sequence_length, cfg.decoder_row_length)
    loader = TrainLoader(examples, cfg.training.global_batch_size, cfg.gradient_accumulation, cfg.model.seed,
                         sequence_length=cfg.model.sequence_length, target_length=cfg.model.decoder_sequence_length,
                         packing=cfg.data.packing, decoder_length=cfg.decoder_row_length)
    return executor, loader


def initial_state(cfg, executor, loader):
    """Train state from --load (resume), --hf_model (pretrained) or random init; returns (state, start step).

    Under phased execution the state lives in host memory, built without ever placing the
    whole model on a device.
    """
    from modelling.hf_mapping import load_hf_model
    from utils import checkpoint as ckpt

    if cfg.checkpoint.load:
        directory, step = ckpt.resolve(cfg.checkpoint.load)[-1]
        state, meta = executor.restore(directory, step, cfg.checkpoint.optim_state)
        loader.restore(meta)
        logger.info("resumed %s at step %d (data position %d)", directory, meta["step"], loader.position)
        return state, meta["step"]
    if cfg.data.hf_model:
        _, host = load_hf_model(cfg.data.hf_model, cfg.execution.tensor_parallel, expect=cfg.model)
        logger.info("initialised from %s", cfg.data.hf_model)
        return executor.init_state(host), 0
    return executor.init_state(), 0


def check_save_dir(cfg) -> None:
    """Refuses to write into a directory holding another run's checkpoints."""
    from utils import checkpoint as ckpt

    save = cfg.checkpoint.save
    if not save or not ckpt.saved_steps(save):
        return
    loading = cfg.checkpoint.load and os.path.abspath(ckpt.resolve(cfg.checkpoint.load)[-1][0]) == os.path.abspath(save)
    if not loading:
        die(f"{save} already holds checkpoints (steps {ckpt.saved_steps(save)}): pass --load {save} to resume, "
            "or choose a new --save directory")


def train(cfg, args, executor, loader, state, start_step: int) -> None:
    """The training loop: steps, logging, periodic checkpoints."""
    import jax
    from tqdm import tqdm

    from config.config import to_dict
    from utils import checkpoint as ckpt
    from utils.cli import is_main_process
    from data.packing import batch_stats
    from utils.tracking import Tracker

    primary = is_main_process()  # process 0 of a multi-process run writes the metrics and shows progress
    run_dir = args.run_dir or cfg.checkpoint.save or os.path.join("runs", args.config)
    tracker = Tracker(run_dir, to_dict(cfg), args.wandb, args.wandb_name, resume=start_step > 0, enabled=primary)
    mgr = ckpt.manager(cfg.checkpoint.save, cfg.checkpoint.to_keep) if cfg.checkpoint.save else None
    total, every = cfg.training.steps, cfg.checkpoint.steps
    samples = cfg.training.global_batch_size

    graphs = executor.g

    def save(step):
        meta = {"step": step, **loader.state(), "seed": cfg.model.seed, "config": to_dict(cfg)}
        # checkpoints hold the stacked layout whichever executor ran: either one resumes from them
        stacked = executor.to_checkpoint(state)
        ckpt.save(mgr, step, stacked.params, stacked.opt_state if cfg.checkpoint.optim_state else None, meta)

    bar = tqdm(range(start_step, total), initial=start_step, total=total, desc="fine-tuning", unit="step",
               disable=None if primary else True)
    t_last = time.perf_counter()
    for step in bar:
        host_batch = loader.next_batch()
        stats = batch_stats(host_batch)
        if step == start_step:
            logger.info("%d examples in the first batch of %d rows: %.1f per row, %.1f%% of the token slots used",
                        stats["examples"], samples, stats["examples"] / samples, 100 * stats["packing_efficiency"])
        batch = graphs.shard_batch(host_batch)
        rng = jax.random.key_data(jax.random.fold_in(jax.random.key(cfg.model.seed), step))
        state, metrics = executor.train_step(state, batch, rng)
        loss = float(metrics["loss"])
        now = time.perf_counter()
        lr = graphs.learning_rate(step)
        dt, t_last = now - t_last, now
        tracker.log(step + 1, {"loss": loss, "learning_rate": lr, "grad_norm": float(metrics["grad_norm"]),
                               "samples_per_s": samples / dt, "examples": stats["examples"],
                               "examples_per_s": stats["examples"] / dt,
                               "packing_efficiency": stats["packing_efficiency"]})
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", examples_s=f"{stats['examples'] / dt:.1f}")
        if mgr and every and (step + 1) % every == 0 and step + 1 < total:
            save(step + 1)
    if mgr:
        if start_step < total or not ckpt.saved_steps(cfg.checkpoint.save):
            save(total)
        mgr.wait_until_finished()
        logger.info("saved %s/%d", cfg.checkpoint.save, total)
    tracker.close()
    logger.info("metrics and loss curve in %s", run_dir)


def main(argv=None) -> None:
    setup_logging()
    cfg, args = parse_config("finetuning", __doc__.splitlines()[0], "tiny", argv, extra_flags)
    if cfg.model.eval:
        die("eval=true builds no optimizer: drop --eval to fine-tune, or use run_validation.py")
    ensure_host_devices(cfg.devices)
    ensure_pinned_host_memory(cfg.execution.phased)
    setup_jax()
    from data.mnli import DataError
    from graphs.sharding import DeviceCountError
    from config import ConfigError
    from modelling.hf_mapping import CheckpointError
    from utils.checkpoint import CheckpointNotFound

    from graphs.plan import PlanError, plan

    try:
        if args.plan:
            print(plan(build_executor(cfg), exact=True).format())
            return
        check_save_dir(cfg)
        executor, loader = build(cfg)
        state, start = initial_state(cfg, executor, loader)
        train(cfg, args, executor, loader, state, start)
    except (DataError, DeviceCountError, ConfigError, CheckpointError, CheckpointNotFound, PlanError) as e:
        die(str(e))


if __name__ == "__main__":
    main(sys.argv[1:])
