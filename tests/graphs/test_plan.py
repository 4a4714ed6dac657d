"""The memory plan of training (graphs/plan.py): from shapes alone, equal to what a run allocates, and refusing runs
that will not fit with a one-line message. Decoding's plan is tests/decoder/test_plan.py's.

Tolerance: the plan's device and host peaks within 10% of the bytes measured during a real step
(device: live arrays at each phase's start + XLA's temporaries, as utils/bench and PhaseMemory
count them; host: live arrays in host memory at each phase's start)."""

import gc

import jax
import pytest

from config import load_config
from data.generated import generated_batch
from graphs.executor import make_executor
from graphs.graphs import Graphs
from graphs.phase_ops import DeviceOps, PhaseMemory
from graphs.plan import PlanError, plan
from modelling.params import count_params
from partitioning.memory import live_device_bytes
from partitioning.plan import GIB

pytestmark = pytest.mark.slow  # every test here compiles a step or plans a large model


def _host_bytes():
    """Bytes of the distinct buffers in host memory (an array built from single-device arrays shares
    their buffers: each is counted once)."""
    seen = {}
    for x in jax.live_arrays():
        if not x.is_deleted() and x.sharding.memory_kind == "pinned_host":
            for s in x.addressable_shards:
                seen[(s.device, s.data.unsafe_buffer_pointer())] = s.data.nbytes
    return sum(seen.values())


def _planned_without_allocating(ex, **kw):
    """plan(ex) and check it left no new array alive. The arrays alive before are held while it runs, so
    an earlier test's garbage collected meanwhile neither hides a new array nor counts as one."""
    before = jax.live_arrays()
    known = {id(x) for x in before}
    p = plan(ex, **kw)
    new = [x for x in jax.live_arrays() if id(x) not in known]
    assert not new, [(x.shape, x.dtype) for x in new]  # planned from shapes: nothing was allocated
    del before
    return p


def _kept_alive_bytes() -> int:
    """Device bytes that earlier tests of this worker keep alive (caches, garbage not yet collected): not a step's,
    so they are measured before it and taken off."""
    gc.collect()
    return max(live_device_bytes().values() or [0])


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_phased_plan_equals_what_a_step_allocates(optimizer):
    cfg = load_config("finetuning", "tiny", dict(
        data_parallel=1, tensor_parallel=2, global_batch_size=8, micro_batch_size=4, sequence_length=64,
        hidden_size=256, d_ff=512, heads=4, d_kv=64, layers=2, vocab_size=4096, phased=True, optimizer=optimizer))
    ex = make_executor(Graphs(cfg))
    p = _planned_without_allocating(ex, exact=True)

    host_peak = [0]

    class Measure(PhaseMemory):
        def record(self, name, program, args):
            super().record(name, program, args)
            host_peak[0] = max(host_peak[0], _host_bytes())

    before = _kept_alive_bytes()
    state = ex.init_state()
    memory = Measure()
    ex.with_ops(DeviceOps(memory=memory)).train_step(state, ex.g.shard_batch(generated_batch(cfg, seed=0,
                                                                                              lengths="short")))
    measured = memory.peak - before
    assert abs(p.device_peak - measured) <= 0.1 * measured, (p.format(), memory.by_phase, before)
    assert abs(p.host_peak - host_peak[0]) <= 0.1 * host_peak[0], (p.format(), host_peak[0] / GIB)


def test_fused_plan_equals_the_compiled_step():
    cfg = load_config("finetuning", "tiny", dict(global_batch_size=8, micro_batch_size=2, sequence_length=32))
    ex = make_executor(Graphs(cfg))
    p = plan(ex, exact=True)
    from partitioning.memory import program_bytes

    before = _kept_alive_bytes()
    state = ex.init_state()
    batch = ex.g.shard_batch(generated_batch(cfg, seed=0))
    rng = jax.random.key_data(jax.random.key(0))
    analysis = ex.train_step_program(state).lower(state, batch, rng, jax.numpy.float32(1)).compile().memory_analysis()
    measured = program_bytes(analysis, max(live_device_bytes().values()) - before)
    assert abs(p.device_peak - measured) <= 0.1 * measured, (p.format(), measured)


def test_xxl_plan_on_one_device_from_shapes_alone():
    """Flan-T5-XXL at dp = tp = 1, phased: computed on this CPU without allocating anything. Its host
    figures are the model's own counts; with AdamW it needs more host memory than a 125 GiB box has,
    with Adafactor (factored second moments, no first moment) it fits one."""
    base = dict(data_parallel=1, tensor_parallel=1, phased=True, packing=False, micro_batch_size=8)
    cfg = load_config("finetuning", "xxl_pod16", base)
    p = _planned_without_allocating(make_executor(Graphs(cfg)), exact=False)
    n = count_params(Graphs(cfg).specs)
    assert 11.0e9 < n < 11.3e9
    assert p.host_items["master weights"] == pytest.approx(4 * n, rel=1e-3)
    assert p.host_items["optimizer state"] == pytest.approx(8 * n, rel=1e-3)  # AdamW: two float32 moments
    # the encoder's activation rows alone: 25 rows of [128, 512, 4096] float32 (1 GiB each)
    assert p.host_items["activations"] >= 25 * GIB
    box = dict(device_limit=80 * GIB, host_limit=125 * GIB, cfg=cfg)
    with pytest.raises(PlanError, match=r"host memory .* try --optimizer adafactor"):
        p.check(**box)
    cfg = load_config("finetuning", "xxl_pod16", dict(base, optimizer="adafactor"))
    p = plan(make_executor(Graphs(cfg)), exact=False)
    assert p.host_items["optimizer state"] < 0.01 * p.host_items["master weights"]  # factored, per layer
    p.check(**box)  # fits
    assert 2 * GIB < p.device_peak < 40 * GIB, p.format()
    assert 60 * GIB < p.host_peak < 100 * GIB, p.format()
    # the xxl_1gpu preset (16 packed rows a step, micro-batch 8) fits the same box
    one_box = load_config("finetuning", "xxl_1gpu")
    plan(make_executor(Graphs(one_box)), exact=False).check(device_limit=80 * GIB, host_limit=125 * GIB, cfg=one_box)


def test_ul2_and_xxl_fit_one_box_and_stochastic_rounding_halves_the_host_weights():
    """ul2_1gpu (Flan-UL2, 20B: phased, Adafactor, bfloat16 master weights with stochastic rounding, layers updated
    in the backward) and xxl_1gpu plan within 75 GiB of device and 110 GiB of host memory, from shapes alone.
    Stochastic rounding halves the weights' host bytes (norms and tables stay float32); updating each layer in the
    backward keeps no layer gradients in host memory. UL2 with float32 weights and the gradients stored peaks at the
    very limit of what one H100 box can pin (~110 GiB), over it with any headroom (105 GiB); updated in the
    backward it fits with room."""
    plans = {}

    def planned(name, **kw):  # (a flag equal to the preset's own gives the same config: planned once)
        cfg = load_config("finetuning", name, kw)
        if repr(cfg) not in plans:
            plans[repr(cfg)] = plan(make_executor(Graphs(cfg)), exact=False)
        return cfg, plans[repr(cfg)]

    for name in ("ul2_1gpu", "xxl_1gpu"):
        cfg, p = planned(name)
        p.check(device_limit=75 * GIB, host_limit=110 * GIB, cfg=cfg)
        sr, f32 = planned(name, stochastic_rounding=True)[1], planned(name, stochastic_rounding=False)[1]
        assert sr.host_items["master weights"] == pytest.approx(f32.host_items["master weights"] / 2, rel=1e-3)
        assert sr.device_peak < f32.device_peak
        stored = planned(name, update_in_backward=False)[1]
        in_bwd = planned(name, update_in_backward=True)[1]
        assert "weight gradients" not in in_bwd.host_items
        assert in_bwd.host_peak < stored.host_peak - 0.8 * stored.host_items["weight gradients"]
    ul2 = Graphs(load_config("finetuning", "ul2_1gpu"))
    assert 19.0e9 < count_params(ul2.specs) < 20.5e9
    cfg, p = planned("ul2_1gpu", stochastic_rounding=False, update_in_backward=False)
    with pytest.raises(PlanError, match="host memory"):
        p.check(device_limit=75 * GIB, host_limit=105 * GIB, cfg=cfg)
    cfg, p = planned("ul2_1gpu", stochastic_rounding=False)  # float32 masters and their bfloat16 compute copies
    with pytest.raises(PlanError, match="--compute_copy false"):
        p.check(device_limit=75 * GIB, host_limit=90 * GIB, cfg=cfg)
    cfg, p = planned("ul2_1gpu", stochastic_rounding=False, compute_copy=False)
    p.check(device_limit=75 * GIB, host_limit=90 * GIB, cfg=cfg)


def test_the_lora_presets_fit_a_24_gb_gpu_with_64_gb_of_host_memory():
    """xxl_lora_1gpu and ul2_lora_1gpu (phased: the frozen bfloat16 base in host memory, streamed in a layer at a
    time) and gptj_lora_1gpu (fused: the base on the device) plan within one 24 GB GPU (22 GiB) and 64 GB of host
    memory (59 GiB), from shapes alone. The frozen base is in bfloat16 (2 bytes a weight), the adapters and their
    AdamW moments are under 1% of it. XLA:CPU has no bfloat16 GEMM and counts every frozen weight of the fused step
    converted to float32 for it (a GPU does not): the fused preset's device peak is its frozen base plus the step
    temporaries of the float32 run, which bound the bfloat16 run's."""
    gpu, host = 22 * GIB, 59 * GIB
    for name, billions in (("xxl_lora_1gpu", 11.1), ("ul2_lora_1gpu", 19.5)):
        cfg = load_config("finetuning", name)
        g = Graphs(cfg)
        p = plan(make_executor(g), exact=False)
        p.check(device_limit=gpu, host_limit=host, cfg=cfg)
        n = count_params(g.base_specs)
        assert n > billions * 1e9 and p.host_items["frozen base weights"] == pytest.approx(2 * n, rel=0.01)
        assert p.host_items["master weights"] < 0.01 * p.host_items["frozen base weights"]
        assert "weight gradients" not in p.host_items or p.host_items["weight gradients"] < 0.01 * 2 * n
    cfg = load_config("finetuning", "gptj_lora_1gpu")
    frozen = plan(make_executor(Graphs(cfg)), exact=False).device_items["frozen base weights"]
    f32 = plan(make_executor(Graphs(load_config("finetuning", "gptj_lora_1gpu", dict(precision="float32")))),
               exact=False)
    temporaries = f32.device_peak - f32.device_items["frozen base weights"]
    assert frozen == pytest.approx(f32.device_items["frozen base weights"] / 2, rel=0.01)
    assert frozen + temporaries < gpu, (frozen / GIB, temporaries / GIB)


def test_a_task_with_longer_targets_is_planned_with_its_longer_decoder():
    """Summaries' targets (decoder rows of 64 tokens, packed into 128) against labels' (8, packed into 16): the plan
    reads the decoder length from the config, so the batch, the activations and the device peak grow with it
    (measured: 10.7 MiB against 4.0 MiB at this tiny shape)."""
    def planned(decoder, packed):
        cfg = load_config("finetuning", "tiny", dict(data_parallel=1, tensor_parallel=1, global_batch_size=8,
                                                     micro_batch_size=4, sequence_length=64, phased=True,
                                                     decoder_sequence_length=decoder, packed_decoder_length=packed))
        return plan(make_executor(Graphs(cfg)), exact=True)

    short, long = planned(8, 16), planned(64, 128)
    for item in ("batch", "activations"):
        assert long.device_items[item] > short.device_items[item] * 1.5, (short.format(), long.format())
    assert long.device_peak > 2 * short.device_peak


def test_a_phased_plan_says_what_it_under_counts_on_a_gpu_by_the_factors_measured_there():
    """Where a phased plan prints, it says the factors one H100 measured (the allocator's peak over the exact device
    plan, the RSS over the host plan, the step over its floor), each the figure the run's JSON holds (the one
    source docs/results.md's xxl-1gpu table reads); a fused plan does not say it."""
    import json
    import os
    import re

    from graphs.plan import TrainingPlan
    from tests.helpers import ROOT

    rows16 = json.load(open(os.path.join(ROOT, "benchmarks", "results", "h100", "fifteen", "2_xxl_pool110_workstation",
                                         "f15_xxl_1gpu.json")))["figures"]["rows16"]
    want = [f"{rows16[k]:.2f}x" for k in ("device_over_plan", "host_rss_over_plan", "over_bound")]
    printed = TrainingPlan("phased", 1, "a", {"x": 1}, 2, "b", {"y": 2}, True).format()
    (line,) = [x for x in printed.splitlines() if "under-counts" in x]
    assert re.findall(r"\d+\.\d+x", line) == want, (line, want)
    assert "results.md#xxl-1gpu" in line
    assert "under-counts" not in TrainingPlan("fused", 1, "a", {"x": 1}, 2, "b", {"y": 2}, True).format()
