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
    p.add_argument("--run_dir", default=None,
                   help="where metrics.jsonl and loss_curve.png go (default: the --save directory, else runs/CONFIG)")


def build(cfg):
    """Graphs (with the phased executor when execution.phased), tokenizer and the training data loader."""
    from data.mnli import TrainLoader, load_rows, load_tokenizer, tokenize_training
    from graphs.graphs import Graphs

    graphs = Graphs(cfg)
    if cfg.execution.phased:
        from graphs.phased import PhasedExecutor

        graphs.phased = PhasedExecutor(graphs)
        logger.info("phased execution: weights, optimizer state and activations in host memory")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if len(tokenizer) > cfg.model.embedding.vocab_size:
        die(f"tokenizer has {len(tokenizer)} tokens but vocab_size={cfg.model.embedding.vocab_size}: "
            "raise --vocab_size or use the tokenizer of this model")
    rows = load_rows(cfg.data.dataset, "train", seed=cfg.model.seed)
    feats = tokenize_training(rows, tokenizer, cfg.model.sequence_length, cfg.model.decoder_sequence_length)
    logger.info("training on %d samples of %s", len(rows), cfg.data.dataset)
    loader = TrainLoader(feats, cfg.training.global_batch_size, cfg.gradient_accumulation, cfg.model.seed)
    return graphs, loader


def initial_state(cfg, graphs, loader):
    """Train state from --load (resume), --hf_model (pretrained) or random init; returns (state, start step).

    Under phased execution the state is a PhasedState in host memory, built without
    ever placing the whole model on a device.
    """
    from modelling.hf_mapping import load_hf_model
    from utils import checkpoint as ckpt

    phased = getattr(graphs, "phased", None)
    memory = "pinned_host" if phased else None
    if cfg.checkpoint.load:
        import jax
        import jax.numpy as jnp

        from graphs.graphs import TrainState
        from graphs.sharding import with_memory_kind

        directory, step = ckpt.resolve(cfg.checkpoint.load)[-1]
        # restore targets from shapes alone: no random weights or optimizer state are materialised
        abstract = jax.eval_shape(graphs.init_params)
        place = (lambda s: with_memory_kind(s, memory)) if memory else (lambda s: s)  # noqa: E731
        opt_target = None
        if cfg.checkpoint.optim_state:
            opt_target = ckpt.abstract_like(jax.eval_shape(graphs.optimizer.init, abstract),
                                            place(graphs.opt_state_shardings(abstract)))
        params, opt_state, meta = ckpt.load(directory, step,
                                            ckpt.abstract_like(abstract, place(graphs.param_shardings)), opt_target)
        loader.position = meta["data_position"]
        logger.info("resumed %s at step %d (data position %d)", directory, meta["step"], loader.position)
        if phased:
            if opt_state is None:
                state = phased.init_state(params)
                state.step = meta["step"]
                return state, meta["step"]
            return phased.from_train_state(TrainState(meta["step"], params, opt_state)), meta["step"]
        if opt_state is None:  # saved without optimizer state: start it afresh
            opt_state = graphs.init_state(params).opt_state
        state = TrainState(jax.device_put(jnp.asarray(meta["step"], jnp.int32), graphs.replicated), params, opt_state)
        return state, meta["step"]
    if cfg.data.hf_model:
        _, host = load_hf_model(cfg.data.hf_model, cfg.execution.tensor_parallel, expect=cfg.model)
        logger.info("initialised from %s", cfg.data.hf_model)
        params = graphs.shard_params(host, memory)
        return (phased.init_state(params) if phased else graphs.init_state(params)), 0
    if phased:
        return phased.init_state(phased.init_params()), 0
    return graphs.init_state(graphs.init_params()), 0


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


def train(cfg, args, graphs, loader, state, start_step: int) -> None:
    """The training loop: steps, logging, periodic checkpoints."""
    import jax
    from tqdm import tqdm

    from config.config import to_dict
    from utils import checkpoint as ckpt
    from utils.cli import is_main_process
    from utils.tracking import Tracker

    primary = is_main_process()  # process 0 of a multi-process run writes the metrics and shows progress
    run_dir = args.run_dir or cfg.checkpoint.save or os.path.join("runs", args.config)
    tracker = Tracker(run_dir, to_dict(cfg), args.wandb, args.wandb_name, resume=start_step > 0, enabled=primary)
    mgr = ckpt.manager(cfg.checkpoint.save, cfg.checkpoint.to_keep) if cfg.checkpoint.save else None
    total, every = cfg.training.steps, cfg.checkpoint.steps
    samples = cfg.training.global_batch_size

    executor = getattr(graphs, "phased", None) or graphs

    def save(step):
        meta = {"step": step, "data_position": loader.position, "seed": cfg.model.seed, "config": to_dict(cfg)}
        # checkpoints hold the stacked layout whichever executor ran: either one resumes from them
        stacked = executor.to_train_state(state) if executor is not graphs else state
        ckpt.save(mgr, step, stacked.params, stacked.opt_state if cfg.checkpoint.optim_state else None, meta)

    bar = tqdm(range(start_step, total), initial=start_step, total=total, desc="fine-tuning", unit="step",
               disable=None if primary else True)
    t_last = time.perf_counter()
    for step in bar:
        batch = graphs.shard_batch(loader.next_batch())
        rng = jax.random.key_data(jax.random.fold_in(jax.random.key(cfg.model.seed), step))
        state, metrics = executor.train_step(state, batch, rng)
        loss = float(metrics["loss"])
        now = time.perf_counter()
        lr = graphs.learning_rate(step)
        rate = samples / (now - t_last)
        t_last = now
        tracker.log(step + 1, {"loss": loss, "learning_rate": lr, "grad_norm": float(metrics["grad_norm"]),
                               "samples_per_s": rate})
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", samples_s=f"{rate:.1f}")
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

    try:
        check_save_dir(cfg)
        graphs, loader = build(cfg)
        state, start = initial_state(cfg, graphs, loader)
        train(cfg, args, graphs, loader, state, start)
    except (DataError, DeviceCountError, ConfigError, CheckpointError, CheckpointNotFound) as e:
        die(str(e))


if __name__ == "__main__":
    main(sys.argv[1:])
