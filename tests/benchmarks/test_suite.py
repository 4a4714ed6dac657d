"""The benchmark suite (benchmarks/suite.py) cannot rot between GPU sessions: its --smoke run executes every
part at tiny shapes on CPU and each part writes its JSON with the keys the summary reads; a budget too small
for a part skips it (recorded, not cut off); the README's table is generated from the results."""

import json
import os
import subprocess
import sys

import pytest

from tests.env import child_env
from tests.helpers import ROOT

PARTS = ["xxl_1gpu", "ul2_1gpu", "xl_mfu", "vs_hf", "xl_phased", "decode", "summaries", "beams", "gptj_6B",
         "plan_check", "workstation", "serve", "serve_xl"]


def suite(*args, timeout=900):
    env = child_env()  # the drivers simulate their own devices
    p = subprocess.run([sys.executable, "benchmarks/suite.py", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


FIFTEEN = ["f15_xxl_1gpu", "f15_workstation", "f15_xl_mfu", "f15_decode", "f15_int8_fusion"]


@pytest.mark.slow
def test_the_fifteen_minute_plan_s_smoke_run_writes_each_part_s_figures(tmp_path):
    """`bash benchmarks/lent_gpu.sh fifteen`'s parts at tiny shapes on CPU (CI runs this one: a GPU session must
    never find the plan broken): each part's JSON with its figures, read from its runs' own reports."""
    out = tmp_path / "suite"
    suite("--smoke", "--out", str(out), "--only", "fifteen")
    f15 = {name: json.load(open(out / f"{name}.json")) for name in FIFTEEN}
    assert all(r["status"] == "ok" and r["figures"] and "error" not in r["figures"] for r in f15.values()), \
        {n: r["status"] for n, r in f15.items()}
    a = f15["f15_xxl_1gpu"]["figures"]["rows16"]
    ra = f15["f15_xxl_1gpu"]["runs"]["rows16"]["report"]
    assert a["over_bound"] == pytest.approx(ra["median_step_s"] / max(ra["phase_timing"]["compute_s"],
                                                                       ra["link_floor_step_s"]))
    assert a["host_rss_over_plan"] == pytest.approx(ra["host_peak_rss_bytes"] / ra["plan_host_bytes"])
    b = f15["f15_workstation"]["figures"]
    assert b["quantize"] == "int8" and b["validation"]["quantization"] == "int8" and b["validation"]["samples"] > 0
    d = f15["f15_decode"]["figures"]
    rd = f15["f15_decode"]["runs"]
    assert d["int8_over_ours_tokens_per_s"] == pytest.approx(
        rd["int8"]["report"]["generated_tokens_per_s"]
        / rd["base"]["report"]["runs"]["ours_g"][0]["generated_tokens_per_s"])
    assert 0 < d["weight_bytes"]["int8"] < d["weight_bytes"]["ours"]
    h = f15["f15_int8_fusion"]["figures"]
    assert h["backend"] == "cpu" and h["quantized_weights"] > 0 and h["temp_bytes_int8"] > 0
    # (XLA:CPU converts each int8 weight into a buffer before its GEMM: the check finds them)
    assert h["weights_materialised"] is True and len(h["materialised"]) > 0
    summary = open(out / "summary.md").read()
    assert all(f"| {name} | ok | smoke (tiny shapes on CPU" in summary for name in FIFTEEN)


DECODING = ["dec_startup", "dec_serve", "dec_f32"]


@pytest.mark.slow
def test_the_decoding_plan_s_smoke_run_writes_each_part_s_figures(tmp_path):
    """`bash benchmarks/lent_gpu.sh decoding`'s parts at tiny shapes on CPU: servers started cold and warm (the warm
    start reading the compilation cache the cold one filled: it compiles nothing new, as many programs), the server
    against static batching and HF, the float32 server's tokens against both."""
    out = tmp_path / "suite"
    suite("--smoke", "--out", str(out), "--only", "decoding")
    dec = {name: json.load(open(out / f"{name}.json")) for name in DECODING}
    assert all(r["status"] == "ok" and r["figures"] and "error" not in r["figures"] for r in dec.values()), \
        {n: r["status"] for n, r in dec.items()}
    for model in ("t5_tiny", "gptj_tiny"):
        m = dec["dec_startup"]["figures"][model]
        assert 0 < m["warm_s"] and 0 < m["cold_s"] and m["programs"] >= 2, m
    f32 = dec["dec_f32"]["figures"]
    (model,) = f32
    assert set(f32[model]["same_tokens"]) == {"static", "hf"} and f32[model]["ratios"]
    summary = open(out / "summary.md").read()
    assert all(f"| {name} | ok | smoke (tiny shapes on CPU" in summary for name in DECODING)


@pytest.mark.slow
def test_smoke_runs_every_part_and_writes_its_json(tmp_path):
    """Every other part of the suite at tiny shapes on CPU (a long test: make test-all)."""
    out = tmp_path / "suite"
    suite("--smoke", "--out", str(out), "--only", ",".join(PARTS))
    for name in PARTS:
        r = json.load(open(out / f"{name}.json"))
        assert r["status"] == "ok", (name, {k: v.get("log_tail") for k, v in r["runs"].items()})
        assert r["env"]["device_kind"] and r["env"]["jax"] and r["env"]["torch"] and r["env"]["transformers"]
        assert all(v["command"].startswith("python3 ") for v in r["runs"].values())
        assert r["figures"] and "error" not in r["figures"], r["figures"]
    parts = {name: json.load(open(out / f"{name}.json")) for name in PARTS}
    figs = {name: r["figures"] for name, r in parts.items()}

    def raw(part, run):
        return parts[part]["runs"][run]["report"]

    x = figs["xxl_1gpu"]["rows16"]
    assert x["median_step_s"] == raw("xxl_1gpu", "rows16")["median_step_s"] > 0
    assert x["plan_host_bytes"] > 0 and x["host_peak_rss_bytes"] > 0
    assert figs["xxl_1gpu"]["lora_over_full_step_s"] == pytest.approx(
        raw("xxl_1gpu", "lora16")["median_step_s"] / raw("xxl_1gpu", "rows16")["median_step_s"])
    assert raw("xxl_1gpu", "lora16")["parameters"] < raw("xxl_1gpu", "rows16")["parameters"] / 10  # the adapters
    t = raw("xxl_1gpu", "rows16")["phase_timing"]
    assert t["compute_s"] > 0 and x["transfer_wait_s"] == max(x["median_step_s"] - t["compute_s"], 0.0)
    for run in ("in_backward", "gradients_stored"):  # the figure says what the run's own losses say
        losses = raw("ul2_1gpu", run)["losses"]
        assert len(losses) > 1 and figs["ul2_1gpu"][run]["losses_decrease"] is (losses[-1] < losses[0])
    assert figs["ul2_1gpu"]["stored_over_in_backward_step_s"] == pytest.approx(
        raw("ul2_1gpu", "gradients_stored")["median_step_s"] / raw("ul2_1gpu", "in_backward")["median_step_s"])
    best = figs["xl_mfu"]["best"]
    assert best == max(("mb4", "mb8"), key=lambda n: raw("xl_mfu", n)["samples_per_s"])
    assert figs["xl_mfu"]["profile"]["families"]
    for run, f in figs["vs_hf"].items():  # each ratio is ours over the peer, from the run's own figures
        training = raw("vs_hf", run)["training"]
        assert f["ratios"] and all(v == pytest.approx(training[k.split(" / ")[0]]["examples_per_s"]
                                                      / training[k.split(" / ")[1]]["examples_per_s"])
                                   for k, v in f["ratios"].items())
    assert figs["xl_phased"]["phased_over_fused_samples_per_s"] == pytest.approx(
        raw("xl_phased", "phased")["samples_per_s"] / raw("xl_phased", "fused")["samples_per_s"])
    for part in ("decode", "beams"):
        d = raw(part, "base")["decode_tokens_per_s"]
        assert figs[part]["base"]["decode_tokens_per_s"]["ratio"] == pytest.approx(d["ours"] / d["hf"])
    assert raw("beams", "base")["args"]["decode_flags"] == "--num_beams 4"
    assert "ours packed / ours unpacked" in figs["summaries"]["base"]["ratios"]
    assert figs["gptj_6B"]["gptj_1gpu"]["median_step_s"] == raw("gptj_6B", "gptj_1gpu")["median_step_s"] > 0
    assert figs["gptj_6B"]["vs_hf"]["ratios"]
    # the host link: what a step moved (the schedule's count) is its layout's floor, and the step is set against
    # the larger of its compute and that floor
    assert x["load_bytes"] == x["floor_load_bytes"] > 0 and x["store_bytes"] == x["floor_store_bytes"] > 0
    assert x["over_bound"] == pytest.approx(x["median_step_s"] / max(t["compute_s"], x["link_floor_step_s"]))
    for name, f in figs["plan_check"].items():
        r = raw("plan_check", name)
        assert r["plan_device_bytes_exact"] > 0 and f["device_over_plan"] == pytest.approx(
            (r["peak_device_bytes"] or r["device_bytes_estimate"]) / r["plan_device_bytes_exact"])
    w = figs["workstation"]["xxl_lora_1gpu"]
    assert w["status"] == w["train_status"] == w["validate_status"] == "ok" and len(w["step_s"]) == 3
    assert w["train_peak_rss_bytes"] > 0 and w["host_cap"]["gib"] == 60 and w["device_cap"]["gib"] == 22
    # serve_xl's smoke command is serve's: run once, the other part reusing it
    assert sorted(bool(parts[n]["runs"]["serve"].get("reused")) for n in ("serve", "serve_xl")) == [False, True]
    served = raw("serve", "serve")["models"]["tiny"]  # the server against static batching, from its own figures
    assert figs["serve"]["tiny"]["ratios"]["server_8step / static tokens_per_s"] == pytest.approx(
        served["server_8step"]["tokens_per_s"] / served["static"]["tokens_per_s"])
    assert served["static"]["same_tokens_as_server"] == 1.0  # greedy through the server: static batching's tokens
    assert (out / "throughput.png").stat().st_size > 1000  # the figure, drawn from the suite's own results
    summary = open(out / "summary.md").read()
    assert all(f"| {name} | ok | smoke (tiny shapes on CPU" in summary for name in PARTS)
    assert summary.startswith("SMOKE RUN")  # a reader of summary.md alone cannot take these for real figures
    assert f"({raw('xxl_1gpu', 'rows16')['global_batch_size']} rows)" in summary  # the rows it ran, not 16

    # the README's table, regenerated from these results between its markers
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- suite:begin -->\nold\n<!-- suite:end -->\nrest\n")
    suite("--summarize", str(out), "--readme", str(readme))
    text = readme.read_text()
    assert "old" not in text and "| gptj_6B | ok |" in text and text.startswith("intro") and text.endswith("rest\n")
    assert "SMOKE RUN" in text


@pytest.mark.slow
def test_a_part_the_budget_cannot_hold_is_skipped_and_recorded(tmp_path):
    out = tmp_path / "suite"
    suite("--smoke", "--out", str(out), "--only", "decode", "--budget", "1")
    r = json.load(open(out / "decode.json"))
    assert r["status"] == "skipped" and "left" in r["reason"] and r["runs"] == {}
    assert "| decode | skipped" in open(out / "summary.md").read()


def test_a_command_two_parts_run_runs_once_even_when_they_run_at_once(monkeypatch, tmp_path):
    """run_one's reuse (serve_xl's smoke run is serve's; --jobs 2 runs them at once): a part that asks for a command
    another part is still running waits for it and reuses its result; a failed run is forgotten (the part waiting on
    it runs its own, as does a later one); another command runs apart."""
    import threading
    import time
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import suite as S
    monkeypatch.setattr(S, "_DONE", {})
    started, waiting, release = [], [], threading.Event()
    status = {"ok": "ok", "bad": "failed", "other": "ok"}

    class Counted(S.Future):
        def result(self, timeout=None):
            waiting.append(threading.current_thread().name)
            return super().result(timeout)

    timeouts = {}

    def fake(run, out_dir, part, timeout):
        started.append((run.cmd[0], part))
        timeouts[part] = timeout
        assert release.wait(30)
        return {"status": status[run.cmd[0]], "part": part}

    monkeypatch.setattr(S, "Future", Counted)
    monkeypatch.setattr(S, "_run_process", fake)
    out = {}

    def go(part, cmd):
        out[part] = S.run_one(S.Run("r", [cmd]), str(tmp_path), part, 10)

    threads = [threading.Thread(target=go, args=(p, c), name=p) for p, c in
               (("a", "ok"), ("b", "ok"), ("c", "bad"), ("d", "bad"), ("e", "other"))]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while (len(started) < 3 or len(waiting) < 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        # one run of each command under way, and the two other parts waiting on theirs
        assert len(started) == 3 and len(waiting) == 2, (started, waiting)
        time.sleep(0.3)
    finally:
        release.set()
        for t in threads:
            t.join()
    ran = next(p for c, p in started if c == "ok")  # a or b, whichever asked first
    other = "b" if ran == "a" else "a"
    assert sorted(c for c, _ in started) == ["bad", "bad", "ok", "other"]  # the failed command ran again
    assert out[other] == {"status": "ok", "part": ran, "reused": True} and "reused" not in out[ran]
    assert out["c"] == {"status": "failed", "part": "c"} and out["d"] == {"status": "failed", "part": "d"}
    assert out["e"] == {"status": "ok", "part": "e"}
    rerun = next(p for c, p in started[3:] if c == "bad")  # the part that waited on the failed run of "bad"
    assert timeouts[rerun] < 10 - 0.3 and all(timeouts[p] > 9 for c, p in started[:3])  # its wait counted
    go("f", "bad")  # later: a failed command runs again, one that ran ok is reused
    go("g", "ok")
    assert out["f"] == {"status": "failed", "part": "f"} and out["g"] == {"status": "ok", "part": ran, "reused": True}
    assert len(started) == 5
    # a part whose seconds all went on the wait: timed out, not run with time it no longer has
    monkeypatch.setattr(S, "_DONE", {})
    slow = threading.Thread(target=lambda: S.run_one(S.Run("r", ["bad"]), str(tmp_path), "h", 10))
    release.clear()
    slow.start()
    while len(started) < 6:
        time.sleep(0.01)
    late_out = {}
    late = threading.Thread(target=lambda: late_out.update(r=S.run_one(S.Run("r", ["bad"]), str(tmp_path), "i",
                                                                        0.2)))
    late.start()
    time.sleep(0.4)
    release.set()
    slow.join()
    late.join()
    assert late_out["r"]["status"] == "timed_out" and len(started) == 6
