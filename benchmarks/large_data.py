"""Data at the size of real instruction-tuning corpora (issue 37): a generated own task of millions of JSONL rows,
trained on the tiny shape, at each row count twice (a fresh data cache, then the cache the first run built):

- the peak resident memory of the training process (VmHWM, sampled while it runs; the separate process that reads
  and tokenizes a large source reported beside it), which must not grow with the rows (each row count's first run
  compiles too: a fresh compilation cache each, so that first runs are compared with first runs);
- the first run's reading (JSON -> Arrow -> checked texts) and tokenizing throughput, in rows per second;
- the second run's time from its start to its first step (no reading, no tokenizing: the cache is mapped).

    python3 benchmarks/large_data.py --rows 1000000 10000000 --json benchmarks/results/cpu/large_data.json

The rows are the synthetic NLI task's (premise, hypothesis, label: its words, so the offline word-level tokenizer
reads them) under an own template; the files and caches go to --work (reused files, fresh caches).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.bench import ROOT, descendants, write_json  # noqa: E402
from app.entry import entry  # noqa: E402

TASK = ["--task_name", "own_nli", "--input_template", "premise: {premise} hypothesis: {hypothesis}",
        "--target_column", "label", "--labels", "entailment", "neutral", "contradiction", "--tokenizer", "synthetic"]


def write_rows(path: str, n: int) -> None:
    """n rows of the synthetic NLI task as JSON lines (distinct seeds per 100,000 rows), unless the file exists."""
    from data.synthetic import generate_split

    if os.path.exists(path) and sum(1 for _ in open(path, "rb")) == n:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for k, start in enumerate(range(0, n, 100_000)):
            rows = generate_split("train", min(100_000, n - start), seed=1000 + k)
            f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


def tokenizer_rate(path: str, n: int = 200_000) -> float:
    """Rows per second of the tokenizer's own batch encoding (HF tokenizers, Rust, all cores) on the first n rows'
    prompts, in this process: the ceiling of the tokenizing map (which adds reading, the family's format and the
    writing of the ids)."""
    from data.tokenizer import load_tokenizer

    with open(path) as f:
        rows = [json.loads(next(f)) for _ in range(n)]
    texts = [f"premise: {r['premise']} hypothesis: {r['hypothesis']}" for r in rows]
    backend = load_tokenizer("synthetic").backend_tokenizer
    t0 = time.perf_counter()
    ids = [e.ids for e in backend.encode_batch_fast(texts)]
    return len(ids) / (time.perf_counter() - t0)


def _status(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                    if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}
    except (OSError, ValueError):
        return {}


def run(argv: list, env: dict, metrics: str, log: str) -> dict:
    """One training run (a subprocess, its output to ``log``) -> its peak RSS (and its helpers'), the seconds to its
    first step and in all."""
    t0 = time.perf_counter()
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "run_finetuning.py"] + argv, cwd=ROOT, env=env, stdout=out, stderr=out)
    peak, helpers, helpers_anon, first, anon = 0, {}, {}, None, 0
    while proc.poll() is None:
        st = _status(proc.pid)
        peak, anon = max(peak, st.get("VmHWM", 0)), max(anon, st.get("RssAnon", 0))
        for d in descendants(proc.pid):
            sd = _status(d)
            helpers[d] = max(helpers.get(d, 0), sd.get("VmHWM", 0))
            helpers_anon[d] = max(helpers_anon.get(d, 0), sd.get("RssAnon", 0))
        if first is None and os.path.exists(metrics) and os.path.getsize(metrics):
            first = time.perf_counter() - t0
        time.sleep(0.05)
    out.close()
    if proc.returncode:
        sys.exit(f"run_finetuning.py {' '.join(argv)} failed (exit {proc.returncode}): see {log}")
    return {"peak_rss_bytes": peak, "peak_anon_rss_bytes": anon,
            "helper_peak_rss_bytes": max(helpers.values(), default=0),  # its mapped file pages: page cache
            "helper_peak_anon_rss_bytes": max(helpers_anon.values(), default=0),
            "seconds_to_first_step": first, "seconds": time.perf_counter() - t0}


def measure(n: int, args, env: dict) -> dict:
    path = os.path.join(args.work, f"own_{n}.jsonl")
    write_rows(path, n)
    cache, compiled = os.path.join(args.work, f"cache_{n}"), os.path.join(args.work, f"jax_cache_{n}")
    for d in (cache, compiled):  # each row count's first run reads, tokenizes and compiles
        shutil.rmtree(d, ignore_errors=True)
    env = {**env, "FLAN_T5_CACHE": cache, "JAX_COMPILATION_CACHE_DIR": compiled}
    out = {"rows": n, "file_bytes": os.path.getsize(path), "tokenizer_batch_rows_per_s": tokenizer_rate(path)}
    for which in ("first", "second"):
        run_dir = os.path.join(args.work, f"run_{n}_{which}")
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = ["--config", "tiny", "--dataset", path, *TASK, "--steps", str(args.steps), "--run_dir", run_dir,
                "--log_every", str(args.steps)]
        out[which] = run(argv, env, os.path.join(run_dir, "metrics.jsonl"), f"{run_dir}.log")
    texts = json.load(open(glob.glob(os.path.join(cache, "texts", "*", "meta.json"))[0]))
    tokens = json.load(open(glob.glob(os.path.join(cache, "tokens", "*", "meta.json"))[0]))
    out["read_seconds"], out["tokenize_seconds"] = texts["seconds"], tokens["seconds"]
    out["read_rows_per_s"] = texts["rows"] / texts["seconds"]
    out["tokenize_rows_per_s"] = tokens["rows_per_s"]
    out["cache_bytes"] = sum(os.path.getsize(f) for f in glob.glob(os.path.join(cache, "*", "*", "*")))
    print(f"{n} rows: peak RSS {out['first']['peak_rss_bytes'] / 2**30:.2f} GiB (first run), "
          f"{out['second']['peak_rss_bytes'] / 2**30:.2f} GiB (second); read {out['read_rows_per_s']:.0f} rows/s, "
          f"tokenized {out['tokenize_rows_per_s']:.0f} rows/s (the tokenizer alone: "
          f"{out['tokenizer_batch_rows_per_s']:.0f}); second run's first step after "
          f"{out['second']['seconds_to_first_step']:.1f} s", flush=True)
    return out


@entry
def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--work", default="/tmp/flan_t5_large_data")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    report = {"benchmark": "large_data", "cores": os.cpu_count(), "steps": args.steps,
              "load_average_at_start": os.getloadavg(), "runs": [measure(n, args, dict(os.environ))
                                                                 for n in args.rows]}
    report["load_average_at_end"] = os.getloadavg()
    for which in ("first", "second"):  # the same run of each row count, against each other
        peaks = [r[which]["peak_rss_bytes"] for r in report["runs"]]
        report[f"peak_rss_spread_{which}"] = max(peaks) / min(peaks) - 1
        print(f"peak RSS of the training process, {which} runs: {min(peaks) / 2**30:.2f}-{max(peaks) / 2**30:.2f} "
              f"GiB ({report[f'peak_rss_spread_{which}']:.1%} apart)")
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
