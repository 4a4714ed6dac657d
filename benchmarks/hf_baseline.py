"""The two benchmark workloads in Hugging Face transformers + PyTorch, at the same shapes.

    python3 benchmarks/hf_baseline.py train --config small --sequence_length 128 --global_batch_size 8 \
        --micro_batch_size 8 --precision float32 --json runs/hf_train.json
    python3 benchmarks/hf_baseline.py generate --config small --sequence_length 128 --micro_batch_size 8 \
        --precision float32 --output_length 8 --json runs/hf_generate.json

Random init from the preset's shape (no download). float32 on CPU, the preset's precision
(bf16) on GPU. Training: AdamW with gradient accumulation over the same micro-batches
as ours; generation: greedy, exactly output_length tokens (EOS suppressed, as ours runs
every step in the benchmark).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from utils.cli import die, entry, parse_config  # noqa: E402


def extra_flags(p):
    p.add_argument("--json", default=None)
    p.add_argument("--warmup_iterations", type=int, default=2)
    p.add_argument("--iterations", type=int, default=5, help="timed steps / batches")


def hf_model(cfg):
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    from modelling.hf_mapping import hf_config_dict

    torch.manual_seed(cfg.model.seed)
    kw = hf_config_dict(cfg.model)
    kw.pop("architectures"), kw.pop("model_type")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):  # initialised where it runs: an XL model is slow to initialise on the host
        model = T5ForConditionalGeneration(T5Config(**kw))
    dtype = torch.float32 if dev == "cpu" else {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        cfg.model.precision, torch.float32)
    return model.to(dev, dtype), dev, dtype


def train(cfg, args) -> dict:
    import torch

    from data.generated import generated_batch
    from utils.bench import median

    model, dev, _ = hf_model(cfg)
    model.train()
    o = cfg.training.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.learning_rate.maximum, betas=(0.9 if o.beta1 is None else o.beta1, o.beta2),
                            weight_decay=o.weight_decay)
    batch = {k: torch.tensor(v, dtype=torch.long, device=dev) for k, v in generated_batch(cfg).items()
             if k != "decoder_attention_mask"}
    times, losses = [], []
    for step in range(args.warmup_iterations + args.iterations):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(batch["labels"].shape[0]):  # gradient accumulation over micro-batches
            out = model(**{k: v[i] for k, v in batch.items()})
            (out.loss / batch["labels"].shape[0]).backward()
            total += out.loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.gradient_clipping)
        opt.step()
        if dev == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup_iterations:
            times.append(time.perf_counter() - t0)
        losses.append(total / batch["labels"].shape[0])
    step_s = median(times)
    samples = cfg.training.global_batch_size
    return {"framework": "transformers+torch", "device": dev, "median_step_s": step_s,
            "samples_per_s": samples / step_s, "losses": losses, "global_batch_size": samples}


def generate(cfg, args) -> dict:
    import torch

    from data.generated import generated_batch
    from utils.bench import median

    model, dev, _ = hf_model(cfg)
    model.eval()
    n = cfg.inference.output_length
    b = cfg.execution.micro_batch_size * cfg.execution.data_parallel
    data = generated_batch(cfg)
    L = cfg.model.sequence_length
    ids = torch.tensor(data["input_ids"].reshape(-1, L)[:b], dtype=torch.long, device=dev)
    mask = torch.tensor(data["attention_mask"].reshape(-1, L)[:b], dtype=torch.long, device=dev)
    def timed(tokens):
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1,
                             max_new_tokens=tokens, min_new_tokens=tokens, decoder_start_token_id=0, eos_token_id=1,
                             pad_token_id=0)
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    times, first = [], []
    with torch.no_grad():
        for it in range(args.warmup_iterations + args.iterations):
            t1, _ = timed(1)
            t, out = timed(n)
            if it >= args.warmup_iterations:
                times.append(t)
                first.append(t1)
    t, t1 = median(times), median(first)
    generated = out.shape[0] * (out.shape[1] - 1)
    return {"framework": "transformers+torch", "device": dev, "generate_s": t, "first_token_s": t1,
            "decode_token_latency_s": (t - t1) / (n - 1) if n > 1 else t,
            "generated_tokens_per_s": generated / t, "samples_per_s": b / t, "batch_size": b}


@entry
def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("train", "generate"):
        die("first argument must be 'train' or 'generate'")
    kind = "finetuning" if argv[0] == "train" else "inference"
    cfg, args = parse_config(kind, "HF baseline", "small", argv[1:], extra_flags)
    report = (train if argv[0] == "train" else generate)(cfg, args)
    report["config"] = args.config
    import torch

    cuda = torch.cuda.is_available()
    report["device_kind"] = torch.cuda.get_device_name() if cuda else "cpu"
    report["peak_device_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
    from utils.bench import write_json

    write_json(args.json, report)
    print({k: v for k, v in report.items() if k != "losses"})
    return report


if __name__ == "__main__":
    main()
