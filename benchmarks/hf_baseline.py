"""The two benchmark workloads in Hugging Face transformers + PyTorch, at the same shapes (T5 or GPT-J: the
preset's family).

    python3 benchmarks/hf_baseline.py train --config small --sequence_length 128 --global_batch_size 8 \
        --micro_batch_size 8 --precision float32 --json runs/hf_train.json
    python3 benchmarks/hf_baseline.py train --config base --compile ...      # torch.compile + fused AdamW
    python3 benchmarks/hf_baseline.py generate --config small --sequence_length 128 --micro_batch_size 8 \
        --precision float32 --output_length 8 --json runs/hf_generate.json

Random init from the preset's shape (no download). Precision policy: float32 on CPU; on a GPU
the preset's precision for everything ("pure" bf16: weights, gradients and AdamW state, as
model.to(torch.bfloat16) gives). Training: AdamW with gradient accumulation over the same
micro-batches as ours, the loss read once a step; ``--compile`` runs the model under
torch.compile (inductor) with the fused AdamW kernel (what a PyTorch user tuning for speed
runs), else eager with PyTorch's default AdamW. The generated data has the benchmark's length
mode (``--lengths``: mnli or uniform), one example per row as HF pipelines batch it, padded
to the longest row of each micro-batch (``--padding longest``, DataCollatorForSeq2Seq's
default) or to the full length (``max_length``). Generation: greedy, exactly output_length
tokens (EOS suppressed, as ours runs every step in the benchmark), eager.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.args import parse_config  # noqa: E402
from app.entry import die, entry  # noqa: E402
from modelling import registry  # noqa: E402
from app.hf_generate import hf_decoding  # noqa: E402


def extra_flags(p):
    p.add_argument("--json", default=None)
    p.add_argument("--compile", action="store_true", help="training: torch.compile the model, fused AdamW")
    p.add_argument("--compile_backend", default="inductor",
                   help="torch.compile's backend (inductor, the default and what the benchmarks report; aot_eager "
                        "traces and differentiates the same graph without generating kernels: the tests' check)")
    p.add_argument("--lengths", choices=("mnli", "uniform", "summaries"), default="uniform",
                   help="prompt lengths of the generated data (as finetuning.py's --lengths)")
    p.add_argument("--padding", choices=("longest", "max_length"), default="longest",
                   help="training rows padded to the longest of each micro-batch (HF's collator default) or to "
                        "sequence_length")
    p.add_argument("--warmup_iterations", type=int, default=2)
    p.add_argument("--iterations", type=int, default=5, help="timed steps / batches")
    p.add_argument("--worker", action="store_true", help="after the warm-up, measure --iterations steps / batches at "
                   "each 'measure' line of stdin (benchmarks/compare.py alternates engines this way)")


def hf_model(cfg):
    """The HF model of the preset's family (T5ForConditionalGeneration or GPTJForCausalLM), randomly initialised."""
    import torch
    import transformers

    from modelling.hf_mapping import hf_config_dict

    torch.manual_seed(cfg.model.seed)
    kw = hf_config_dict(cfg.model)
    arch = kw.pop("architectures")[0]
    config_cls = transformers.AutoConfig.for_model(kw.pop("model_type")).__class__
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):  # initialised where it runs: an XL model is slow to initialise on the host
        model = getattr(transformers, arch)(config_cls(**kw))
    dtype = torch.float32 if dev == "cpu" else {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
        cfg.model.precision, torch.float32)
    return model.to(dev, dtype), dev, dtype


def micro_batches(cfg, args, dev, seed: int) -> list:
    """One global batch as HF training sees it: [{key: tensor [mb, len]}] per micro-batch, one example per row."""
    import numpy as np
    import torch

    from data.generated import generated_batch

    host = generated_batch(cfg, seed=seed, lengths=args.lengths, packing=False)
    family = registry.of_config(cfg)
    out = []
    for i in range(host["labels"].shape[0]):
        # HF's own batch of our padded rows (the family says which); "longest": the collator's default padding
        mb = family.hf.train_inputs({k: v[i] for k, v in host.items()}, trim=args.padding == "longest")
        out.append({k: torch.tensor(np.ascontiguousarray(v), dtype=torch.long, device=dev) for k, v in mb.items()})
    return out


def train(cfg, args) -> tuple:
    """(what runs, measure: ``args.iterations`` more steps -> their median's figures), warmed up already."""
    import torch

    from app.bench import median

    model, dev, dtype = hf_model(cfg)
    model.train()
    o = cfg.training.optimizer
    kw = dict(lr=o.learning_rate.maximum, betas=(0.9 if o.beta1 is None else o.beta1, o.beta2),
              weight_decay=o.weight_decay)
    optimizer = "AdamW"
    if args.compile:
        try:
            opt = torch.optim.AdamW(model.parameters(), fused=True, **kw)
            optimizer = "AdamW (fused)"
        except (RuntimeError, TypeError):  # no fused kernel for this device or dtype
            opt = torch.optim.AdamW(model.parameters(), **kw)
        run = torch.compile(model, backend=args.compile_backend)
    else:
        opt = torch.optim.AdamW(model.parameters(), **kw)
        run = model
    batches = [micro_batches(cfg, args, dev, seed) for seed in (0, 1)]  # alternated, as ours
    losses = []

    def step(batch) -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=dev)
        for mb in batch:  # gradient accumulation over micro-batches
            loss = run(**mb).loss
            (loss / len(batch)).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.gradient_clipping)
        opt.step()
        losses.append(float(total) / len(batch))  # one host read a step
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for i in range(args.warmup_iterations):
        step(batches[i % 2])
    samples = cfg.training.global_batch_size
    family = registry.of_config(cfg)
    tokens = sum(family.hf.nonpad_tokens({k: v.cpu().numpy() for k, v in mb.items()}) for b in batches for mb in b) / 2
    header = {"framework": "transformers+torch" + (" (torch.compile)" if args.compile else " (eager)"), "device": dev,
              "compiled": args.compile, "compile_backend": args.compile_backend if args.compile else None,
              "optimizer": optimizer, "precision_policy": str(dtype).replace("torch.", ""),
              "lengths": args.lengths, "padding": args.padding, "global_batch_size": samples}

    def measure() -> dict:
        step_s = median([step(batches[i % 2]) for i in range(args.iterations)])
        return {"median_step_s": step_s, "samples_per_s": samples / step_s, "examples_per_s": samples / step_s,
                "nonpad_tokens_per_s": tokens / step_s, "losses": list(losses)}

    return header, measure


def generate(cfg, args) -> tuple:
    """(what runs, measure: ``args.iterations`` batches -> their medians' figures), warmed up already."""
    import torch

    from app.bench import decode_figures, decode_rounds
    from data.generated import generated_prompts

    model, dev, _ = hf_model(cfg)
    model.eval()
    n = cfg.inference.output_length
    family = registry.of_config(cfg)
    extra = family.hf.generate_kwargs
    ids, mask = generated_prompts(cfg)
    ids = torch.tensor(ids, dtype=torch.long, device=dev)
    mask = torch.tensor(mask, dtype=torch.long, device=dev)

    def timed(tokens):
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                             eos_token_id=1, pad_token_id=0, **hf_decoding(cfg.inference), **extra)
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    def rounds(count: int) -> tuple:
        with torch.no_grad():
            return decode_rounds(timed, n, count)

    rounds(args.warmup_iterations)
    b = ids.shape[0]

    def measure() -> dict:
        times, first, out = rounds(args.iterations)
        return {**decode_figures(times, first, b, n),
                "tokens": family.hf.new_tokens(out.cpu().numpy(), ids.shape[1]).tolist()}

    return {"framework": "transformers+torch", "device": dev, "batch_size": b}, measure


@entry
def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("train", "generate"):
        die("first argument must be 'train' or 'generate'")
    kind = "finetuning" if argv[0] == "train" else "inference"
    cfg, args = parse_config(kind, "HF baseline", "small", argv[1:], extra_flags)
    header, measure = (train if argv[0] == "train" else generate)(cfg, args)
    import torch

    cuda = torch.cuda.is_available()
    header = {**header, "config": args.config, "device_kind": torch.cuda.get_device_name() if cuda else "cpu"}
    if args.worker:  # measured on demand, alternated with other engines (benchmarks/compare.py: app/alternate.py)
        from app.alternate import serve

        serve(measure, header)
        return header
    report = {**header, **measure(), "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None}
    from app.bench import write_json

    write_json(args.json, report)
    print({k: v for k, v in report.items() if k != "losses"})
    return report


if __name__ == "__main__":
    main()
