"""One step under the JAX profiler (app/profile.py): the trace summarised into the device ops that took the time."""

import json


def test_profile_trace_summarises_the_device_ops(tmp_path, capsys):
    import jax
    import jax.numpy as jnp

    from app.profile import op_family, trace

    f = jax.jit(lambda a, b: jnp.tanh(a @ b).sum())
    a = jnp.ones((256, 256), jnp.float32)
    f(a, a).block_until_ready()
    s = trace(str(tmp_path), lambda: f(a, a).block_until_ready(), top=5)
    assert s["busy_us"] > 0 and 0 < len(s["top"]) <= 5
    assert abs(sum(s["families"].values()) - s["busy_us"]) < 1e-6 * s["busy_us"] + 1e-9
    assert json.loads((tmp_path / "summary.json").read_text())["busy_us"] == s["busy_us"]
    assert "profiled step" in capsys.readouterr().out
    # the CPU trace's device ops are XLA's (the matmul among them), not Python's dispatch events
    assert s["families"].get("matmul", 0) > 0, s
    assert not any("Pjit" in r["name"] or "Argument" in r["name"] for r in s["top"]), s["top"]
    assert op_family("nvjet_sm90_tst_128x160") == "matmul" and op_family("all-reduce.3") == "collective"
    assert op_family("ynn_fusion.11") == "matmul"
    assert op_family("loop_add_fusion") == "elementwise/other fusion"
