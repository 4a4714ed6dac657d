"""What a phased step moves over the host link (graphs/transfers.py), held to the floor of its state layout.

The count comes from the schedule's own loads and stores. The plan runs the schedule on placeholders (shapes
alone, nothing compiled), so every layout is counted here for free; one real step per family shows the real
schedule moves exactly what the plan counts, and that the compute copies it reads are the masters' current values.
The floor is computed apart, from the weights' shapes (``PhasedExecutor.transfer_floor``), and checked by hand for
one layout: what a step moves is what the layout must move, within 1%.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from config import load_config
from data.generated import generated_batch
from graphs.graphs import Graphs
from graphs.phased import PhasedExecutor
from graphs.transfers import link_seconds
from modelling.params import count_params, is_spec


T5 = dict(global_batch_size=8, micro_batch_size=4, sequence_length=16, layers=2, warmup_steps=0,
          data_parallel=1, tensor_parallel=1, phased=True)
GPTJ = dict(T5, layers=2)

LAYOUTS = {  # name: overrides of the tiny preset
    "bf16 adamw": dict(precision="bfloat16"),
    "bf16 adafactor": dict(precision="bfloat16", optimizer="adafactor"),
    "bf16 adamw in backward": dict(precision="bfloat16", update_in_backward=True),
    "bf16 adafactor in backward": dict(precision="bfloat16", optimizer="adafactor", update_in_backward=True),
    "bf16 no copy": dict(precision="bfloat16", compute_copy=False),
    "float32": dict(precision="float32"),
    "stochastic rounding": dict(precision="bfloat16", stochastic_rounding=True),
    "lora adamw": dict(precision="bfloat16", lora_rank=4),
    "lora adafactor in backward": dict(precision="bfloat16", lora_rank=4, optimizer="adafactor",
                                       update_in_backward=True),
    "dp2 tp2 rts": dict(precision="bfloat16", data_parallel=2, tensor_parallel=2, micro_batch_size=2),
}


def _executor(preset: str, **overrides) -> PhasedExecutor:
    base = T5 if preset == "tiny" else GPTJ
    return PhasedExecutor(Graphs(load_config("finetuning", preset, {**base, **overrides})))


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "gptj_tiny"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_step_moves_the_floor_of_its_layout(preset, layout):
    ex = _executor(preset, **LAYOUTS[layout])
    counted, floor = ex.plan().transfers, ex.transfer_floor()
    for d in ("load", "store"):
        assert counted[f"{d}_bytes"] == pytest.approx(floor[f"{d}_bytes"], rel=0.01), (d, counted, floor)
    for what, f in floor["items"].items():  # and so does each kind of what moves
        for d in ("load", "store"):
            assert counted["by_what"].get(what, {}).get(d, 0) == pytest.approx(f[d], rel=0.01), (what, d, counted)


def test_the_floor_by_hand_and_what_the_compute_copy_saves():
    """float32 at dp = tp = 1 (nothing sharded, nothing cast): the optimizer reads and writes every master (4 bytes
    a weight) once, the forward and the backward read every layer weight and the other weights once more. In
    bfloat16 with the compute copy, the forward and the backward read 2 bytes of each matrix instead of 4 and the
    update writes the copy (2 bytes); nothing else changes."""
    ex = _executor("tiny", precision="float32")
    specs = ex.g.specs
    n = count_params(specs)
    n_layers = sum(count_params(specs[s]["layers"]) for s in ex.tree.stacks)
    moved = ex.plan().transfers["by_what"]
    assert moved["master weights"] == {"load": 4 * n, "store": 4 * n}
    assert moved["weights"]["load"] == 4 * (2 * n_layers + (n - n_layers))
    assert "compute copy" not in moved
    bf16, old = _executor("tiny", precision="bfloat16"), _executor("tiny", precision="bfloat16", compute_copy=False)
    new_moved, old_moved = bf16.plan().transfers, old.plan().transfers
    norms = sum(int(np.prod(s.shape)) for p, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
                if ex.g.family.keeps_f32(str(p[-1].key)))
    assert new_moved["by_what"]["weights"]["load"] == pytest.approx(old_moved["by_what"]["weights"]["load"] / 2,
                                                                     abs=4 * 3 * norms)  # norms stay float32
    assert new_moved["by_what"]["compute copy"]["store"] == pytest.approx(2 * (n - norms), rel=1e-6)
    # nothing else changes: the loads shrink by what the forward and the backward save, the stores grow by the copy
    saved = old_moved["by_what"]["weights"]["load"] - new_moved["by_what"]["weights"]["load"]
    assert old_moved["load_bytes"] - new_moved["load_bytes"] == saved > 0
    assert new_moved["store_bytes"] - old_moved["store_bytes"] == new_moved["by_what"]["compute copy"]["store"]
    assert link_seconds(new_moved["load_bytes"], new_moved["store_bytes"], 1.0) < link_seconds(
        old_moved["load_bytes"], old_moved["store_bytes"], 1.0)


class _Watched:
    """DeviceOps' load, watched: how many programs dispatched before each load had not finished."""

    def __init__(self, ops):
        self.ops, self.outputs, self.unfinished = ops, [], []
        load, run = ops.load, ops.run

        def watched_load(*a, **kw):
            out = load(*a, **kw)  # (it waits for the last program first)
            self.unfinished.append(sum(not x.is_ready() for x in self.outputs))
            return out

        def watched_run(*a, **kw):
            out = run(*a, **kw)
            self.outputs.append(ops.pending)
            return out

        ops.load, ops.run = watched_load, watched_run


@pytest.mark.slow
@pytest.mark.parametrize("preset,overrides", [
    ("tiny", dict(precision="bfloat16", data_parallel=2, tensor_parallel=2, micro_batch_size=2)),
    ("gptj_tiny", dict(precision="bfloat16", optimizer="adafactor", update_in_backward=True)),
])
def test_a_real_step_moves_what_the_plan_counts_and_reads_current_copies(preset, overrides):
    """Two real steps: each moves exactly the bytes the plan counted, and after them every compute copy holds its
    master's value in the compute dtype (the update writes the copy it reads next). And the host never ran more than
    one program ahead: JAX dispatches asynchronously, and a schedule that loaded layer after layer without waiting
    would hold many layers on the device while the first computes (on a GPU the allocator's peak was 3-4x the plan's
    two layers); every load waited until each program dispatched before it had run."""
    ex = _executor(preset, **overrides)
    watched = _Watched(ex.ops)
    counted = ex.plan().transfers
    state = ex.init_state()
    batch = ex.g.shard_batch(generated_batch(ex.g.cfg, seed=0))
    for _ in range(2):
        state, metrics = ex.train_step(state, batch)
        real = ex.ops.moved.summary()
        assert (real["load_bytes"], real["store_bytes"]) == (counted["load_bytes"], counted["store_bytes"])
        assert real["by_phase"] == counted["by_phase"]
    assert np.isfinite(float(metrics["loss"]))
    assert len(watched.unfinished) > 20 and len(watched.outputs) > 10
    assert max(watched.unfinished) == 0, watched.unfinished
    dt = ex.g.opts.compute_dtype
    checked = 0
    for masters, copies in [(state.rest, state.copy_rest)] + [
            (m, c) for s in ex.tree.stacks for m, c in zip(state.layers[s], state.copy_layers[s])]:
        for m, c in zip(jax.tree.leaves(masters), jax.tree.leaves(jax.tree.map(
                lambda m_, c_: m_ if c_ is None else c_, masters, copies))):
            np.testing.assert_array_equal(np.asarray(c), np.asarray(jnp.asarray(m).astype(c.dtype)))
            checked += c.dtype == dt
    assert checked > 0


@pytest.mark.parametrize("load,store,want", [(3e9, 1e9, 3.0), (1e9, 3e9, 3.0), (2e9, 2e9, 2.0), (0, 5e8, 0.5),
                                             (0, 0, 0.0)])
def test_a_full_duplex_link_waits_for_the_larger_direction(load, store, want):
    """Guards ``max`` in ``link_seconds`` (loads and stores cross the link at once: their sum reported a link-bound
    step 1.3-2x too long), and the bandwidth in GB/s: 3 GB each way at 1 GB/s is 3 s, at 52 GB/s 3/52 s."""
    assert link_seconds(load, store, 1.0) == pytest.approx(want)
    assert link_seconds(load, store, 52.0) == pytest.approx(want / 52)
