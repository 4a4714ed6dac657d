"""Constrained decoding's cost, and what constraints do to a label task's scores.

    python3 benchmarks/constrained.py --json benchmarks/results/cpu/constrained.json         # both parts (CPU)
    python3 benchmarks/constrained.py --only serve --slots 16 --requests 64 --repeats 5       # the server's part

serve: the server's engine (serving/build.py's, every slot program compiled, in this process: no HTTP) over a
random-init checkpoint of ``--config``'s shape widened by ``--model_flags`` (default: width 256), with a Metaspace
BPE learnt here whose vocabulary holds JSON's characters. The same requests (``--requests`` prompts, greedy,
``--min_new``..``--max_new`` tokens each, all submitted at once) run all free, then with every second one held to a
JSON schema (decoder/grammar.py's xgrammar grammar, each constrained row asking the host for its allowed tokens at
every step), the two taking turns ``--repeats`` times on the same compiled programs after a round of each untimed
(the first calls of a kind pay for what the engine makes once). Reported: each request's
tokens/s (its tokens after the first over the time from its first to its last, the median of a kind), the free
requests' beside the constrained ones against the all-free run's (the goal: 0.9x at least), the constrained ones'
against the free ones' in the same run (0.5x at least); the host's callback seconds; a schema's compile time, the
tokenizer's pieces read once, then a schema's first compile (10 schemas, median and most) and from the cache; and
``--answers`` sampled answers to each of 10 JSON schemas (nested objects, arrays, enums, numbers, required fields),
a choice and a regular expression, each that its grammar ended checked (jsonschema, the set, the expression; the
goal: all of them) from a server of their own whose answers hold ``--answer_max_new`` tokens at most, those it cuts
counted apart (a random model's answers run long).

labels: the tiny preset trained ``--label_steps`` steps on the synthetic NLI task (three labels), then validated
three ways on ``--label_limit`` held-out rows: greedy, ``--constrain labels`` (answers restricted to the labels),
``--score labels`` (each example's labels ranked by their log-likelihood). Reported: each way's accuracy (the goal:
each at least greedy's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import string
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from app.bench import write_json  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"enum": ["red", "old", "small"]}}},
          "required": ["name", "age"]}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("serve", "labels"), default=None, help="one part (default: both)")
    p.add_argument("--config", default="tiny", help="the inference preset of the served model's shape")
    p.add_argument("--model_flags", default="--hidden_size 256 --d_ff 1024 --d_kv 64 --vocab_size 512 "
                                            "--tensor_parallel 1 --data_parallel 1",
                   help="config flags of the served model (default: width 256, a vocabulary for the learnt tokenizer, "
                        "one device: what a CPU serves on); its --tensor_parallel and --data_parallel the server's")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--min_new", type=int, default=16)
    p.add_argument("--max_new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--answers", type=int, default=20,
                   help="sampled answers to each of 10 JSON schemas, a choice and a regex, each checked (0: none)")
    p.add_argument("--label_steps", type=int, default=300, help="training steps of the label task's model")
    p.add_argument("--label_limit", type=int, default=300, help="held-out rows each validation scores")
    p.add_argument("--answer_max_new", type=int, default=256,
                   help="the most tokens of each checked answer (a server of its own over the same model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- serve


def texts(rng, n: int) -> list:
    """Prompts of the synthetic task's words and JSON."""
    from data.synthetic import vocabulary

    words = [w for w in vocabulary() if not w.startswith("<")]
    return [" ".join(rng.choice(words, int(rng.integers(6, 20)))) + ' {"name": "x", "age": 3}' for _ in range(n)]


def tokenizer_texts(rng, n: int) -> list:
    """What the tokenizer learns from: prompts, and every printable ASCII character (a grammar whose text needs a
    character the vocabulary lacks can reach a point no token continues, where the row ends)."""
    return texts(rng, n) + ["".join(rng.permutation(list(string.printable.strip()))) for _ in range(n // 4)]


def served_model(a, tmp: str):
    """(config, ServeOptions) of a random-init checkpoint of the run's shape with a tokenizer learnt here (JSON's
    characters in its vocabulary), saved in ``tmp``, as run_server.py reads its flags."""
    from app.args import make_config, parse_args, server_flags
    from app.predict import decoding_config
    from app.runtime import start_devices
    from config.presets import to_dict
    from data.tokenizer import train_tokenizer
    from partitioning.placement import Placement
    from serving.engine import ServeOptions
    from utils import checkpoint as ckpt

    rng = np.random.default_rng(a.seed)
    tok_dir, ckpt_dir = os.path.join(tmp, "tokenizer"), os.path.join(tmp, "ckpt")
    model = shlex.split(a.model_flags)
    vocab = int(model[model.index("--vocab_size") + 1]) if "--vocab_size" in model else 512
    learnt = tokenizer_texts(rng, 400)
    train_tokenizer(lambda: [learnt], vocab, tok_dir)
    _, over = parse_args("inference", "constrained benchmark", a.config, ["--config", a.config] + model)
    cfg = make_config("inference", a.config, {**over, "tokenizer": tok_dir, "hf_model": None,
                                              "output_length": a.max_new}, fixed={"eval": True, "rts": False})
    start_devices(cfg)
    mgr = ckpt.manager(ckpt_dir)
    ckpt.save(mgr, 1, Placement(cfg).init_params(a.seed), None, {"step": 1, "seed": a.seed, "config": to_dict(cfg)})
    mgr.wait_until_finished()
    mgr.close()
    flags = ["--config", a.config, "--load", ckpt_dir, "--slots", str(a.slots), "--max_queue", str(a.requests),
             "--prompt_width", "64", "--output_length", str(a.max_new)]
    for flag in ("--tensor_parallel", "--data_parallel"):  # (the server's devices, as the model flags ask)
        if flag in model:
            flags += [flag, model[model.index(flag) + 1]]
    server, over = parse_args("inference", "constrained benchmark", a.config, flags, server_flags)
    cfg = decoding_config(server, over, "serve")
    return cfg, ServeOptions.of(server, cfg)


def compile_times(engine, repeats: int = 10) -> dict:
    """A schema's compile time: the tokenizer's pieces read once (the first grammar's), then ``repeats`` schemas of
    their own (their first compile) and one of them again (from the cache), in milliseconds."""
    from decoder.grammar import Grammars

    g = Grammars(engine.tokenizer, engine.grammars.vocab, engine.grammars.eos_id,
                 engine.grammars.optional_space)
    t0 = time.perf_counter()
    g.compiler()
    info = time.perf_counter() - t0
    first, cached = [], []
    for k in range(repeats):
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"], f"field{k}": {"type": "number"}}}
        t0 = time.perf_counter()
        g.compile("json_schema", schema, "bench")
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        g.compile("json_schema", schema, "bench")
        cached.append(time.perf_counter() - t0)
    ms = lambda xs: {"median": 1e3 * statistics.median(xs), "most": 1e3 * max(xs)}  # noqa: E731
    return {"tokenizer_pieces_ms": 1e3 * info, "first_compile_ms": ms(first), "cached_ms": ms(cached)}


def one_run(engine, listener: list, reqs: list, constrained: set, grammar) -> dict:
    """The requests submitted at once to the started ``engine`` (greedy; ``constrained``: the indices held to
    ``grammar``; ``listener``: where the engine's deliver finds this run's) -> the run's figures: the median of each
    kind's requests' tokens/s after their first token, the host's callbacks."""
    from serving.controls import Controls
    from serving.output import Output
    from serving.scheduler import Sequence

    done, left = threading.Event(), [len(reqs)]

    def deliver(events):
        left[0] -= sum(1 for _, ev in events if ev.finish_reason or ev.error)
        if left[0] <= 0:
            done.set()

    listener[0] = deliver
    asked0, seconds0 = engine.backend.masks.asked, engine.backend.masks.seconds
    seqs = [Sequence(engine.tokenize(p), n, 0.0, out=Output(0, None, stream=True),
                     controls=Controls(constraint=grammar) if i in constrained else Controls())
            for i, (p, n) in enumerate(reqs)]
    t0 = time.perf_counter()
    engine.submit(seqs)
    if not done.wait(3600):
        raise SystemExit("the engine did not finish the requests within an hour")
    wall = time.perf_counter() - t0
    failed = [s.aborted for s in seqs if s.aborted is not None]
    if failed:
        raise SystemExit(f"{len(failed)} requests failed, the first: {failed[0]}")
    rates = {"free": [], "constrained": []}
    for i, s in enumerate(seqs):
        if s.count > 1 and s.out.last > s.out.first:
            rates["constrained" if i in constrained else "free"].append((s.count - 1) / (s.out.last - s.out.first))
    return {"wall_s": wall, "tokens": sum(s.count for s in seqs),
            "median_tokens_per_s": {k: statistics.median(v) for k, v in rates.items() if v},
            "host_callbacks": engine.backend.masks.asked - asked0,
            "host_callback_s": engine.backend.masks.seconds - seconds0}


SCHEMAS = [  # ten schemas: nested objects, arrays, enums, numbers, required fields (strings and arrays bounded)
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "number", "minimum": 0, "maximum": 9}},
     "required": ["ok", "n"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "old", "small"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 5}},
                                             "required": ["q"]}}, "required": ["p"]},
    {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                        "maximum": 9}, "maxItems": 4}},
     "required": ["xs"]},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "size": {"type": "integer", "minimum": 0,
                                                                              "maximum": 3}},
     "required": ["kind", "size"]},
    {"type": "object", "properties": {"who": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["name", "age"]}, "ok": {"type": "boolean"}}, "required": ["who", "ok"]},
    {"type": "object", "properties": {"v": {"enum": [1, 2, 3]}, "w": {"type": "array", "items": {"type": "boolean"},
                                                                        "maxItems": 2}}, "required": ["v", "w"]},
]


def answers(engine, listener: list, per: int, max_new: int) -> dict:
    """``per`` sampled answers (temperature 1, each its own seed) to each of ``SCHEMAS``, a choice and a regular
    expression: how many ended by their grammar ("stop") and how many of those validate (jsonschema), are one of
    the choices, match the expression; those max_new cut are counted apart ("length": a grammar not yet ended)."""
    import jsonschema

    from serving.controls import Controls
    from serving.output import Output
    from serving.scheduler import Sequence

    kinds = [("json_schema", s) for s in SCHEMAS] + [("choice", ["red", "old", "small"]),
                                                     ("regex", "[a-c]{2,4}-[0-9]{2}")]
    out = {}
    for k, (kind, spec) in enumerate(kinds):
        grammar = engine.grammars.compile(kind, spec, "bench")
        texts, why, done = [""] * per, [None] * per, threading.Event()

        def deliver(events, texts=texts, why=why, done=done):
            for _, ev in events:
                texts[ev.index] += ev.text
                why[ev.index] = ev.finish_reason or why[ev.index]
            if all(w is not None for w in why):
                done.set()

        listener[0] = deliver
        prompt = engine.tokenize(f"answer {k} :")
        engine.submit([Sequence(prompt, max_new, 1.0, seed=1000 * k + i, out=Output(i, None),
                                controls=Controls(constraint=grammar)) for i in range(per)])
        if not done.wait(3600):
            raise SystemExit("the answers did not end within an hour")
        ended = [t for t, w in zip(texts, why) if w == "stop"]
        ok = 0
        for t in ended:
            try:
                if kind == "json_schema":
                    jsonschema.validate(json.loads(t, strict=False), spec)
                    ok += 1
                else:
                    ok += bool(t in spec if kind == "choice" else re.fullmatch(spec, t))
            except (ValueError, jsonschema.ValidationError):
                pass
        out[f"{kind} {k}"] = {"answers": per, "ended": len(ended), "valid_of_ended": ok}
    valid = sum(v["valid_of_ended"] for v in out.values())
    ended = sum(v["ended"] for v in out.values())
    return {"per_grammar": out, "ended": ended, "valid": valid, "valid_share_of_ended": valid / max(ended, 1)}


def answered(a, tmp: str) -> dict:
    """``answers`` from an engine of its own over the same model, ``--answer_max_new`` tokens each at most (a random
    model's answers run long: whitespace between JSON's marks, strings)."""
    from serving.build import build_engine

    b = argparse.Namespace(**{**vars(a), "max_new": a.answer_max_new})
    cfg, options = served_model(b, os.path.join(tmp, "answers"))
    engine = build_engine(cfg, options)
    listener = [None]
    engine.start(lambda events: listener[0](events))
    try:
        return {"max_new": a.answer_max_new, **answers(engine, listener, a.answers, a.answer_max_new)}
    finally:
        engine.stop()


def run_serve(a) -> dict:
    from serving.build import build_engine

    with tempfile.TemporaryDirectory() as tmp:
        cfg, options = served_model(a, tmp)
        t0 = time.perf_counter()
        engine = build_engine(cfg, options)
        built = time.perf_counter() - t0
        engine.backend.compile_constrained().join()  # (the constrained programs, which build_engine starts apart)
        rng = np.random.default_rng(a.seed + 1)
        lengths = rng.integers(a.min_new, a.max_new + 1, a.requests)
        reqs = [(p, int(n)) for p, n in zip(texts(rng, a.requests), lengths)]
        grammar = engine.grammars.compile("json_schema", SCHEMA, "bench")
        half = set(range(0, a.requests, 2))
        runs = {"free": [], "half": []}
        listener = [None]
        engine.start(lambda events: listener[0](events))  # (an engine starts once: each run its own listener)
        try:
            for kind in ("free", "half"):  # (untimed)
                one_run(engine, listener, reqs, half if kind == "half" else set(), grammar)
            for r in range(a.repeats):  # the two take turns (the order turned each round)
                for kind in (("free", "half") if r % 2 == 0 else ("half", "free")):
                    runs[kind].append(one_run(engine, listener, reqs, half if kind == "half" else set(), grammar))
        finally:
            engine.stop()
        valid = answered(a, tmp) if a.answers else None
        med = lambda xs: statistics.median(xs)  # noqa: E731
        free_alone = med([x["median_tokens_per_s"]["free"] for x in runs["free"]])
        free_beside = med([x["median_tokens_per_s"]["free"] for x in runs["half"]])
        constrained = med([x["median_tokens_per_s"]["constrained"] for x in runs["half"]])
        return {"model_flags": a.model_flags, "slots": a.slots, "requests": a.requests, "engine_built_s": built,
                "runs": runs, "compile": compile_times(engine), "answers": valid,
                "free_tokens_per_s_all_free": free_alone, "free_tokens_per_s_half_constrained": free_beside,
                "constrained_tokens_per_s": constrained,
                "ratios": {"free beside constrained / all free": free_beside / free_alone,
                           "constrained / free (same run)": constrained / free_beside}}


# --------------------------------------------------------------------------- labels


def run_labels(a) -> dict:
    """The label task's model trained, then validated three ways, each driver in a process of its own (as a user
    runs them: app/bench.py's ``run_child``)."""
    from app.bench import run_child

    with tempfile.TemporaryDirectory() as tmp:
        save = os.path.join(tmp, "ckpt")
        t0 = time.perf_counter()
        log = os.path.join(tmp, "train.log")
        devices = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +  # (the tiny preset's dp 2 x tp 2)
                                               " --xla_force_host_platform_device_count=4").strip()}
        code, _ = run_child(["run_finetuning.py", "--config", "tiny", "--steps", str(a.label_steps), "--save", save],
                            log, env=devices)
        if code != 0:
            raise SystemExit(f"training the label task's model failed: {open(log).read()[-2000:]}")
        out = {"steps": a.label_steps, "train_s": time.perf_counter() - t0, "limit": a.label_limit}
        for name, flags in (("greedy", []), ("constrained", ["--constrain", "labels"]),
                            ("ranked", ["--score", "labels"])):
            path, log = os.path.join(tmp, f"{name}.json"), os.path.join(tmp, f"{name}.log")
            t0 = time.perf_counter()
            code, _ = run_child(["run_validation.py", "--load", save, "--limit", str(a.label_limit), "--output", path,
                                 *flags], log, env=devices)
            if code != 0:
                raise SystemExit(f"validation ({name}) failed: {open(log).read()[-2000:]}")
            r = json.load(open(path))
            out[name] = {"accuracy": (r["ranked"] if name == "ranked" else r)["scores"]["accuracy"],
                         "seconds": time.perf_counter() - t0}
        out["ratios"] = {f"{k} / greedy accuracy": out[k]["accuracy"] / max(out["greedy"]["accuracy"], 1e-9)
                         for k in ("constrained", "ranked")}
        return out


def main(argv=None) -> dict:
    own = list(sys.argv[1:] if argv is None else argv)
    a = parse(own)
    report = {"command": "python3 benchmarks/constrained.py " + shlex.join(own),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count()}
    if a.only in (None, "serve"):
        report["serve"] = run_serve(a)
        print("serve: " + json.dumps({k: report["serve"][k] for k in ("ratios", "compile")}) + "; answers: "
              + json.dumps({k: v for k, v in (report["serve"]["answers"] or {}).items() if k != "per_grammar"}),
              flush=True)
        write_json(a.json, report)
    if a.only in (None, "labels"):
        report["labels"] = run_labels(a)
        print("labels: " + json.dumps({k: v for k, v in report["labels"].items()}), flush=True)
        write_json(a.json, report)
    return report


if __name__ == "__main__":
    main()
