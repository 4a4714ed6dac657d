"""The benchmark suite (benchmarks/suite.py) cannot rot between GPU sessions: its --smoke run executes every
part at tiny shapes on CPU and each part writes its JSON with the keys the summary reads; a budget too small
for a part skips it (recorded, not cut off); the README's table is generated from the results."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ["xxl_1gpu", "ul2_1gpu", "xl_mfu", "vs_hf", "xl_phased", "decode", "gptj_6B"]


def suite(*args, timeout=900):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the drivers simulate their own devices
    p = subprocess.run([sys.executable, "benchmarks/suite.py", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def test_smoke_runs_every_part_and_writes_its_json(tmp_path):
    out = tmp_path / "suite"
    suite("--smoke", "--out", str(out))
    for name in PARTS:
        r = json.load(open(out / f"{name}.json"))
        assert r["status"] == "ok", (name, {k: v.get("log_tail") for k, v in r["runs"].items()})
        assert r["env"]["device_kind"] and r["env"]["jax"] and r["env"]["torch"] and r["env"]["transformers"]
        assert all(v["command"].startswith("python3 ") for v in r["runs"].values())
        assert r["figures"] and "error" not in r["figures"], r["figures"]
    figs = {name: json.load(open(out / f"{name}.json"))["figures"] for name in PARTS}
    x = figs["xxl_1gpu"]["rows16"]
    assert x["median_step_s"] > 0 and x["plan_host_bytes"] > 0 and x["host_peak_rss_bytes"] > 0
    assert x["phase_timing"]["compute_s"] > 0 and x["transfer_wait_s"] >= 0
    assert figs["ul2_1gpu"]["in_backward"]["losses_decrease"] is not None
    assert figs["ul2_1gpu"]["stored_over_in_backward_step_s"] > 0
    assert figs["xl_mfu"]["best"] in ("mb4", "mb8") and figs["xl_mfu"]["profile"]["families"]
    assert any(n["ratios"] for n in figs["vs_hf"].values())
    assert figs["xl_phased"]["phased_over_fused_samples_per_s"] > 0
    assert figs["decode"]["base"]["decode_tokens_per_s"]["ratio"] > 0
    assert figs["gptj_6B"]["gptj_1gpu"]["median_step_s"] > 0 and figs["gptj_6B"]["vs_hf"]["ratios"]
    assert (out / "throughput.png").stat().st_size > 1000  # the figure, drawn from the suite's own results
    summary = open(out / "summary.md").read()
    assert all(f"| {name} | ok |" in summary for name in PARTS)

    # the README's table, regenerated from these results between its markers
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- suite:begin -->\nold\n<!-- suite:end -->\nrest\n")
    suite("--summarize", str(out), "--readme", str(readme))
    text = readme.read_text()
    assert "old" not in text and "| gptj_6B | ok |" in text and text.startswith("intro") and text.endswith("rest\n")


def test_a_part_the_budget_cannot_hold_is_skipped_and_recorded(tmp_path):
    out = tmp_path / "suite"
    suite("--smoke", "--out", str(out), "--only", "decode", "--budget", "1")
    r = json.load(open(out / "decode.json"))
    assert r["status"] == "skipped" and "left" in r["reason"] and r["runs"] == {}
    assert "| decode | skipped" in open(out / "summary.md").read()
