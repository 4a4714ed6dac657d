"""Decoding's memory plan (decoder/plan.py): it counts what decoding places (the weights' bytes on each device, the
cache, the activations), the server's plan counts its slots' cache, the 24 GB LoRA presets decode within 22 GiB,
UL2's LoRA preset is served with int8 weights at 8 slots within 22 GiB, and the server prints its plan and refuses a
streamed encoder."""

import jax
import numpy as np
import pytest

from config import load_config
from decoder.decoder import Decoder
from partitioning.plan import GIB

pytestmark = pytest.mark.slow  # every test here compiles a step or plans a large model


# --------------------------------------------------------------------------- decoding's plan (decoder/plan.py)
def _decode_graphs(preset, **kw):
    from partitioning import sharding as S

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
    slots of 512-token prompts and 128 new tokens within 22 GiB (from shapes: 20.9 GiB, docs/results.md's
    plan-serve-ul2-lora-1gpu-quantize-int8-device), 16 slots not."""
    from decoder.plan import decode_plan

    assert decode_plan(_decode_graphs("ul2_lora_1gpu", quantize="int8"), 8, 512, 128).device_peak < 22 * GIB
    assert decode_plan(_decode_graphs("ul2_lora_1gpu", quantize="int8"), 16, 512, 128).device_peak > 22 * GIB


@pytest.mark.parametrize("flags", [dict(quantize="int8", tensor_parallel=2), dict(quantize="int8", stream_encoder=True),
                                   dict(family_preset="gptj_tiny")])
def test_the_decode_plan_counts_what_decoding_places(flags):
    """The plan's weights are the bytes Weights.place puts on a device (and, streamed, in host memory); its KV
    cache the bytes of the cache decoding makes (the family's decode_start under shard_map, on a device)."""
    from jax.sharding import PartitionSpec as P

    from decoder.plan import cache_bytes, decode_plan
    from modelling.params import is_spec
    from partitioning import sharding as S

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
    the cache the slots hold (decoder/slot_programs.py's, each device's piece), for both families."""
    from app.predict import decoding_plan
    from decoder.plan import cache_bytes, format_plan
    from decoder.slot_programs import SlotPrograms
    from partitioning.plan import human_bytes

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
