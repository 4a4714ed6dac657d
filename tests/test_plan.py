"""The memory plan (graphs/plan.py): from shapes alone, equal to what a run allocates, and refusing runs
that will not fit with a one-line message.

Tolerance: the plan's device and host peaks within 10% of the bytes measured during a real step
(device: live arrays at each phase's start + XLA's temporaries, as utils/bench and PhaseMemory
count them; host: live arrays in host memory at each phase's start).
"""

import gc

import jax
import numpy as np
import pytest

from config import load_config
from data.generated import generated_batch
from graphs.executor import make_executor
from decoder.engine import Decoder
from graphs.graphs import Graphs
from graphs.phase_ops import DeviceOps, PhaseMemory
from graphs.memory import live_device_bytes
from graphs.plan import GIB, PlanError, plan
from modelling.params import count_params

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
    from graphs.memory import program_bytes

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


# --------------------------------------------------------------------------- decoding's plan (decoder/plan.py)


def _decode_graphs(preset, **kw):
    from graphs import sharding as S

    over = dict(eval=True, lora_rank=0, phased=False, rts=False, micro_batch_size=32, output_length=128,
                data_parallel=1, tensor_parallel=1, **kw)
    return Decoder.of_config(load_config("finetuning", preset, over), mesh=S.make_mesh(1, 1))


@pytest.mark.parametrize("preset,fits,short", [
    # XXL: int8 weights alone (its bfloat16 weights with the cache do not fit)
    ("xxl_lora_1gpu", dict(quantize="int8"), dict()),
    # UL2: int8 weights and the encoder streamed from host memory (int8 alone does not fit)
    ("ul2_lora_1gpu", dict(quantize="int8", stream_encoder=True), dict(quantize="int8")),
])
def test_the_24_gb_lora_presets_decode_within_22_gib(preset, fits, short):
    """What the workstation presets train in, they validate and serve in: 32 rows of sequence_length (512) prompts
    and 128 new tokens within 22 GiB of device memory and 59 GiB of host memory (the frozen base held there while
    the adapters are merged into it), from shapes (the largest activations estimated; --plan_exact counts XLA's
    temporaries on the machine itself). Measured: XXL 18.3 GiB, UL2 20.6 GiB device, 44.5 GiB host."""
    from decoder.plan import decode_plan

    g = _decode_graphs(preset, **fits)
    base = g.weights.lora_graphs({"config": {"lora": {"rank": 16, "alpha": 32}}})  # (the presets' adapters)
    base_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(base.abstract_base()))
    p = decode_plan(g, 32, g.cfg.model.sequence_length, 128, lora_base_bytes=base_bytes)
    assert g.cfg.model.sequence_length == 512 and p.device_items["KV cache"] > 0
    assert p.device_peak < 22 * GIB and p.host_peak < 59 * GIB, (p.device_peak / GIB, p.host_peak / GIB)
    assert p.host_items["LoRA base (while merging)"] == base_bytes > 20 * GIB  # the bfloat16 base: 20.7 / 36.5 GiB
    worse = decode_plan(_decode_graphs(preset, **short), 32, 512, 128)
    assert worse.device_peak > 22 * GIB, worse.device_peak / GIB  # the option is what makes it fit


def test_ul2_lora_1gpu_is_served_with_int8_weights_within_22_gib_at_8_slots():
    """The server keeps every weight on the device (no streamed encoder): UL2's int8 weights and the KV cache of 8
    slots of 512-token prompts and 128 new tokens within 22 GiB (measured from shapes: 21.0 GiB), 16 slots not."""
    from decoder.plan import decode_plan

    assert decode_plan(_decode_graphs("ul2_lora_1gpu", quantize="int8"), 8, 512, 128).device_peak < 22 * GIB
    assert decode_plan(_decode_graphs("ul2_lora_1gpu", quantize="int8"), 16, 512, 128).device_peak > 22 * GIB


@pytest.mark.parametrize("flags", [dict(quantize="int8", tensor_parallel=2), dict(quantize="int8", stream_encoder=True),
                                   dict(family_preset="gptj_tiny")])
def test_the_decode_plan_counts_what_decoding_places(flags):
    """The plan's weights are the bytes Weights.place puts on a device (and, streamed, in host memory); its KV
    cache the bytes of the cache decoding makes (the family's decode_start under shard_map, on a device)."""
    from jax.sharding import PartitionSpec as P

    from graphs import sharding as S
    from decoder.plan import cache_bytes, decode_plan
    from modelling.params import is_spec

    flags = dict(flags)
    preset = flags.pop("family_preset", "tiny")
    cfg = load_config("inference", preset, dict(eval=True, data_parallel=1, micro_batch_size=4, **flags))
    g = Decoder.of_config(cfg)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda s: (s.std or 1.0) * rng.standard_normal(s.shape).astype(np.float32), g.specs,
                        is_leaf=is_spec)
    params = g.weights.place(host)
    p = decode_plan(g, 4, 16, 6)
    on_device = [x for x in jax.tree.leaves(params) if x.sharding.memory_kind != "pinned_host"]
    assert p.device_items["weights"] == max(S.per_device_bytes(on_device).values())
    if g.prompt_stacks:
        host_bytes = sum(sh.data.nbytes for x in jax.tree.leaves(params) if x.sharding.memory_kind == "pinned_host"
                         for sh in x.addressable_shards)  # (each device's copy of a replicated weight: a buffer)
        assert p.host_items["streamed encoder layers"] == host_bytes > 0
    if g.prompt_stacks:  # (the cache decoding makes from a streamed encoder's output has the same shapes)
        g = Decoder.of_config(load_config("inference", preset, dict(eval=True, data_parallel=1, micro_batch_size=4,
                                                         **{**flags, "stream_encoder": False})))
    fam, opts = g.family, g.opts

    def cache(prm, i, m):  # each device's cache, stacked on a new leading axis
        return jax.tree.map(lambda x: x[None], fam.decode_start(fam.decoding_params(prm, opts), i, m, opts, 6, S.TP)[1])

    ids = jax.ShapeDtypeStruct((4, 16), np.int32, sharding=g.row_sharding)
    out = jax.eval_shape(jax.shard_map(cache, mesh=g.mesh, in_specs=(g.decode_specs(), P(S.DP, None), P(S.DP, None)),
                                       out_specs=P((S.DP, S.TP)), check_vma=False), g.abstract_decode_params(), ids, ids)
    one_device = sum(int(np.prod(x.shape[1:])) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(out))
    assert cache_bytes(g, 4, 16, 6) == one_device > 0 and p.device_items.get("KV cache", one_device) == one_device
    assert p.device_peak == p.device_items["weights"] + max(
        sum(v for k, v in p.device_items.items() if k != "weights"), 0)


@pytest.mark.parametrize("preset", ["tiny", "gptj_tiny"])
def test_the_server_s_plan_counts_the_slots_cache(preset):
    """run_server.py --plan: the KV cache of --slots rows of the widest prompt width and output_length new tokens is
    the cache the slots hold (decoder/slots.py's, each device's piece), for both families."""
    from app.predict import decoding_plan
    from decoder.plan import cache_bytes, format_plan
    from graphs.plan import human_bytes
    from decoder.slots import SlotPrograms

    cfg = load_config("inference", preset, dict(eval=True, data_parallel=2, tensor_parallel=2, output_length=12))
    g = Decoder.of_config(cfg)
    slots = SlotPrograms(g, 4, 16, (1, 2), cfg.inference.output_length, 4)
    slots.params = g.abstract_decode_params()
    cache = slots._empty_cache()
    one_device = sum(s.data.nbytes for x in jax.tree.leaves(cache) for s in x.addressable_shards
                     if s.device == jax.devices()[0])
    assert cache_bytes(g, 4, 16, cfg.inference.output_length) == one_device > 0
    assert cache_bytes(g, 4, 8, cfg.inference.output_length) < one_device  # the width counted
    # the plan counts it whichever phase is the peak, and prints it
    plan = decoding_plan(cfg, 4, prompt_length=16)
    assert f"KV cache {human_bytes(one_device)}" in format_plan(plan)


def test_the_server_prints_its_plan_and_refuses_a_streamed_encoder(tmp_path, capsys):
    """run_server.py --plan prints serving's plan for --slots and exits without loading anything; --stream_encoder
    (which the server cannot serve: its slots read prompts with weights on the devices) is one line, exit 2."""
    import run_server
    from transformers import T5Config, T5ForConditionalGeneration

    hf = str(tmp_path / "hf")
    T5ForConditionalGeneration(T5Config(vocab_size=128, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16,
                                        decoder_start_token_id=0)).save_pretrained(hf)
    run_server.main(["--hf_model", hf, "--slots", "6", "--prompt_width", "16", "--plan", "--data_parallel", "1",
                     "--tensor_parallel", "1"])
    out = capsys.readouterr().out
    assert "KV cache" in out and "weights" in out
    assert "6 rows, prompts of 16 tokens" in out  # --slots rows of the prompt width the server takes
    with pytest.raises(SystemExit) as e:
        run_server.main(["--hf_model", hf, "--stream_encoder", "--plan", "--data_parallel", "1",
                         "--tensor_parallel", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "the server keeps every weight on the devices" in err[-1] and not any("Traceback" in x for x in err)
