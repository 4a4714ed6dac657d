"""LoRA adapters served side by side over one base (decoder/adapters.py's stack, read by decoder/slot_programs.py's
programs), on random models of the tiny presets' shapes.

- Tokens: 8 requests of 4 adapters of different ranks, alphas and weights (column- and row-parallel, self and cross
  attention, feed-forward), and of the base, mixed at random in one batch: each request's greedy tokens equal those
  of its adapter merged into the base and decoded alone (modelling/lora.merged, decoder's greedy search), both
  families, tp 1 and 2, dp 1 and 2, float32; with int8 base weights, those of the adapter merged into the int8
  weights' float32 values (q * scale: what the int8 product computes); a causal model's prompt scores too.
- bfloat16: a request's tokens among the others equal its tokens served alone, and its first token's
  log-probability is the merged model's (float32) within bfloat16's rounding.
- A request held to a set of tokens (the host asked at each step, as structured outputs are) and reading an adapter:
  only those tokens, the same beside others as alone, its adapter's (the base's differ); the free rows beside it
  as with none held; both families.
- An adapter written into a slot after the programs are compiled is served at once, by the same programs (the write
  is one program whatever the slot), while a call that reads the stack is in flight; a slot emptied serves the base.
- Reading an adapter: a base of other weights is refused naming both fingerprints, a path with no checkpoint or with
  no adapters, a rank above the stack's, a weight the stack holds none of: each one line; every slot taken too.
"""

from __future__ import annotations

import functools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from config import load_config
from decoder.adapters import Adapter, AdapterError, AdapterStack, make_stack
from decoder.decoder import Decoder
from decoder.slot_programs import SlotPrograms
from modelling import continuous, lora, lora_stack, quant
from partitioning import sharding as S
from partitioning.base import fingerprint
from partitioning.placement import Placement
from tests.helpers import save_lora_checkpoint
from utils import checkpoint as ckpt

SLOTS, WIDTH, NEW, STEPS = 8, 16, 8, 4
TARGETS = {"t5": ("q", "v", "o", "cv", "wo"), "gptj": ("q", "v", "o", "fc_in", "fc_out")}
RANKS, ALPHAS = (2, 4, 3, 4), (8.0, 16.0, 4.0, 32.0)
CHOSEN = (0, 2, -1, 1, 3, 0, 2, 1)  # each request's adapter (-1: the base)
GREEDY = (0.0, 0, 0.0, 0, 0, -1)


def overrides(tp: int, dp: int, quantize: str = "none", precision: str = "float32") -> dict:
    return dict(eval=True, tensor_parallel=tp, data_parallel=dp, micro_batch_size=SLOTS // dp, output_length=NEW,
                quantize=quantize, precision=precision)


def random_adapters(family, specs, seed: int = 0) -> list:
    """4 adapters (numpy trees, as LoRA checkpoints hold them) of ranks RANKS of the family's TARGETS, B non-zero."""
    rng = np.random.default_rng(seed)
    out = []
    for r in RANKS:
        opts = type("O", (), {"lora_rank": r, "lora_targets": TARGETS[family.name]})()
        a = lora.adapter_specs(family, specs, opts)
        out.append(jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(np.float32), a,
                                is_leaf=lambda x: hasattr(x, "axes")))
    return out


@functools.lru_cache(maxsize=None)
def served(preset: str, tp: int, dp: int, quantize: str = "none", precision: str = "float32", integer: bool = True):
    """(decoder, base weights, adapters, compiled slot programs over a stack holding them in slots 0..3). ``integer``:
    int8 weights multiplied as a CPU does (modelling/quant.py's ``integer_dots``: the activations rounded to int8
    too), else as a GPU does (the weight converted: float32 decoding of its dequantized values, exactly)."""
    with mock.patch.object(quant, "integer_dots", lambda: integer):
        return _served(preset, tp, dp, quantize, precision)


def _served(preset: str, tp: int, dp: int, quantize: str, precision: str):
    g = Decoder.of_config(load_config("inference", preset, overrides(tp, dp, quantize, precision)), eos=1, pad=0)
    base = Placement(g.cfg).init_params(3)
    adapters = random_adapters(g.family, g.specs)
    stack = AdapterStack(g, 5, 4, TARGETS[g.family.name], ("-", "base"))
    stack.place()
    for i, (tree, r, alpha) in enumerate(zip(adapters, RANKS, ALPHAS)):
        stack.install(Adapter(f"a{i}", "-", r, alpha, lora_stack.slot_values(stack.specs, tree, alpha, r)))
    sp = SlotPrograms(g, SLOTS, WIDTH, (SLOTS // dp,), NEW, STEPS, top=4, adapters=stack)
    sp.compile(base)
    return g, base, adapters, sp


def prompts(n: int = SLOTS, seed: int = 1) -> list:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(2, 100, rng.integers(3, WIDTH))] for _ in range(n)]


def serve(sp: SlotPrograms, ps: list, chosen, slots=None, logprobs: int = -1, controls=None) -> tuple:
    """Greedy tokens [len(ps), NEW] of prompts ``ps`` joining slots ``slots`` (default 0..) with adapters ``chosen``
    (and processors ``controls()``, called once the slots are reset (which closes the host's keys): each a joiner's
    RowControls fields or None), and their first tokens' log-probabilities."""
    slots = list(range(len(ps))) if slots is None else slots
    sp.reset()
    controls = [None] * len(ps) if controls is None else controls()
    sampling = GREEDY[:5] + (logprobs,)
    first, scored = sp.insert([(s, p, sampling, NEW, k, c) for s, p, c, k in zip(slots, ps, chosen, controls)])
    first, scored = SlotPrograms.fetch((first, scored))
    out = np.zeros((len(ps), NEW), np.int64)
    out[:, 0] = first
    for k in range(1, NEW, STEPS):
        tokens, _ = sp.advance(np.ones(SLOTS, bool), STEPS)
        out[:, k:k + STEPS] = SlotPrograms.fetch(tokens)[slots, : NEW - k]
    return out, scored.logprob


def merged(host_base: dict, tree: dict, i: int) -> dict:
    opts = type("O", (), {"lora_alpha": ALPHAS[i], "lora_rank": RANKS[i]})()
    return jax.tree.map(jnp.asarray, lora.merged(host_base, tree, opts))


def feats(ps: list) -> dict:
    ids, mask = np.zeros((len(ps), WIDTH), np.int32), np.zeros((len(ps), WIDTH), np.int32)
    for r, p in enumerate(ps):
        ids[r, :len(p)], mask[r, :len(p)] = p, 1
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("preset,tp,dp,quantize", [("tiny", 1, 1, "none"), ("tiny", 2, 1, "none"),
                                                   ("gptj_tiny", 1, 1, "none"), ("gptj_tiny", 2, 2, "none"),
                                                   ("tiny", 1, 2, "int8")])
def test_mixed_adapters_decode_as_each_adapter_merged_alone(preset, tp, dp, quantize, monkeypatch):
    # int8 as a GPU multiplies it (the weight converted), so that float32 decoding of the base's values q * scale with
    # the adapter merged is the exact reference (a CPU's integer products round the activations too: the next test)
    monkeypatch.setattr(quant, "integer_dots", lambda: False)
    g, base, adapters, sp = served(preset, tp, dp, quantize, integer=False)
    ps = prompts()
    got, _ = serve(sp, ps, CHOSEN)
    # the reference: float32 decoding of the base (an int8 base: its values q * scale) with the adapter merged
    ref = Decoder.of_config(load_config("inference", preset, overrides(tp, dp)), eos=1, pad=0)
    host = g.weights.host_tree(g.to_decoding(base)) if quantize == "int8" else jax.tree.map(np.asarray, base)
    differ = 0
    for c in sorted(set(CHOSEN)):
        want = ref.predict_tokens(jax.tree.map(jnp.asarray, host) if c < 0 else merged(host, adapters[c], c), feats(ps))
        rows = [r for r, x in enumerate(CHOSEN) if x == c]
        assert got[rows].tolist() == want[rows].tolist(), c
        if c >= 0:
            base_tokens = ref.predict_tokens(jax.tree.map(jnp.asarray, host), feats(ps))
            differ += sum(got[r].tolist() != base_tokens[r].tolist() for r in rows)
    assert differ >= 4  # (the adapters change the tokens: a request read with the wrong one would show)


def test_with_a_cpus_integer_products_each_row_decodes_as_it_does_beside_its_own_adapter_alone():
    """int8 weights multiplied in integers (a CPU's: each row's activations rounded to its own grid), adapters mixed:
    every request's tokens are those it gets in a batch where every row reads its adapter, and its adapter changes
    them (a row rounded on another row's grid, or read with another's adapter, would show)."""
    g, base, adapters, sp = served("tiny", 1, 2, "int8")
    ps = prompts()
    got, _ = serve(sp, ps, CHOSEN)
    alone = {c: serve(sp, ps, [c] * len(ps))[0] for c in sorted(set(CHOSEN))}
    for r, c in enumerate(CHOSEN):
        assert got[r].tolist() == alone[c][r].tolist(), (r, c)
    assert sum(got[r].tolist() != alone[-1][r].tolist() for r, c in enumerate(CHOSEN) if c >= 0) >= 4


def test_a_causal_model_s_prompt_scores_are_its_adapter_s():
    """GPT-J's prompt log-probabilities (echo with logprobs) through the stack: each prompt's equal its adapter
    merged (modelling/continuous.py's score_prompts on the merged weights), or the base's."""
    g, base, adapters, sp = served("gptj_tiny", 2, 2, "none")
    ps = prompts(4, seed=3)
    chosen = [1, -1, 3, 0]
    scored = SlotPrograms.fetch(sp.score(ps, chosen))
    host = jax.tree.map(np.asarray, base)
    f = feats(ps)
    ids, mask = g.family.layout_prompts(f["input_ids"], f["attention_mask"])
    for r, c in enumerate(chosen):
        w = jax.tree.map(jnp.asarray, host) if c < 0 else merged(host, adapters[c], c)
        one = Decoder.of_config(load_config("inference", "gptj_tiny", overrides(1, 1)), eos=1, pad=0)
        want = continuous.score_prompts(one.family, one.family.decoding_params(w, one.opts), one.opts,
                                        jnp.asarray(ids[r:r + 1]), jnp.asarray(mask[r:r + 1]), 4)
        n = len(ps[r])
        np.testing.assert_allclose(scored.logprob[r, : n - 1], np.asarray(want.logprob)[0, -(n - 1):], atol=1e-4)


def test_bfloat16_requests_read_their_adapter_among_others_as_alone():
    """In bfloat16 (where merged and unmerged weights round differently, so a random model's near-tied tokens may
    go either way) a request's tokens among others equal its tokens served alone, and its first token's
    log-probability is its adapter's merged model's (float32) within bfloat16's rounding: 0.1 on average over the
    requests, 0.3 at most."""
    g, base, adapters, sp = served("tiny", 1, 1, "none", "bfloat16")
    ps = prompts(seed=5)
    together, logprob = serve(sp, ps, CHOSEN, logprobs=0)
    for r, c in enumerate(CHOSEN):
        alone, _ = serve(sp, [ps[r]], [c], slots=[(3 * r + 1) % SLOTS])
        assert alone[0].tolist() == together[r].tolist(), r
    host = jax.tree.map(np.asarray, base)
    ref = Decoder.of_config(load_config("inference", "tiny", overrides(1, 1)), eos=1, pad=0)
    fam, opts = ref.family, ref.opts
    f = feats(ps)
    start = jax.jit(lambda w: jax.nn.log_softmax(fam.decode_start(fam.decoding_params(w, opts), f["input_ids"],
                                                                  f["attention_mask"], opts, 2)[0], axis=-1))
    diffs = np.zeros(SLOTS)
    for c in sorted(set(CHOSEN)):
        want = np.asarray(start(jax.tree.map(jnp.asarray, host) if c < 0 else merged(host, adapters[c], c)))
        for r in (r for r, x in enumerate(CHOSEN) if x == c):
            diffs[r] = abs(logprob[r] - want[r, together[r, 0]])
    # measured: 0.045 on average, 0.23 at most (the adapters' scaling dropped: 0.72 and 1.56); logits spread over ~5
    assert diffs.mean() < 0.1 and diffs.max() < 0.3, diffs


@pytest.mark.parametrize("preset", ["tiny", "gptj_tiny"])
def test_a_request_held_to_allowed_tokens_reads_its_adapter_beside_others_as_alone(preset):
    """A request that names an adapter and holds its answer to a set of tokens (the host asked at each step:
    decoder/grammar.py's ``Allowed``, as ``allowed_token_ids`` and the structured outputs reach it) writes only those
    tokens, and the same tokens beside other adapters' and free requests as alone; its adapter still counts (the
    same request over the base differs), and the free requests beside it decode as they do with none held."""
    from decoder.grammar import Allowed

    g, base, adapters, sp = served(preset, 1, 1, "none")
    ps = prompts(seed=11)
    allowed = list(range(20, 52))
    held = {1: CHOSEN[1], 3: CHOSEN[3], 4: CHOSEN[4]}  # rows held (adapters 2, 1, 3)

    def controls(rows):
        return [(0.0, 0.0, 1.0, 0.0, False, sp.masks.open(Allowed(allowed, sp.masks.words)), ()) if r in held else None
                for r in rows]

    try:
        together, _ = serve(sp, ps, CHOSEN, controls=lambda: controls(range(SLOTS)))
        free, _ = serve(sp, ps, CHOSEN)
        for r, c in held.items():
            assert set(together[r].tolist()) <= set(allowed), (r, together[r])
            assert not set(free[r].tolist()) <= set(allowed)  # (held, the request writes otherwise)
            alone, _ = serve(sp, [ps[r]], [c], slots=[(3 * r + 2) % SLOTS], controls=lambda: controls([r]))
            assert alone[0].tolist() == together[r].tolist(), r
            on_base, _ = serve(sp, [ps[r]], [-1], controls=lambda: controls([r]))
            assert on_base[0].tolist() != together[r].tolist(), r
        others = [r for r in range(SLOTS) if r not in held]
        assert together[others].tolist() == free[others].tolist()
    finally:
        sp.masks.clear()


def test_an_adapter_written_after_compiling_is_served_by_the_same_programs_and_an_emptied_slot_serves_the_base():
    g, base, adapters, sp = served("gptj_tiny", 1, 1, "none")
    stack = sp.adapters
    programs = (dict(sp._insert), dict(sp._advance), sp._score)
    ps = prompts(4, seed=7)
    host = jax.tree.map(np.asarray, base)
    ref = Decoder.of_config(load_config("inference", "gptj_tiny", overrides(1, 1)), eos=1, pad=0)
    want = {c: ref.predict_tokens(jax.tree.map(jnp.asarray, host) if c < 0 else merged(host, adapters[c], c),
                                  feats(ps)) for c in (-1, 1, 2)}
    try:
        # adapter 2 into the free slot 4, while an advance that reads the stack is dispatched and not yet read
        sp.reset()
        sp.insert([(0, ps[0], GREEDY, NEW, None, 1)])
        pending, _ = sp.advance(np.ones(SLOTS, bool), STEPS)
        slot = stack.install(Adapter("again", "-", RANKS[2], ALPHAS[2],
                                     lora_stack.slot_values(stack.specs, adapters[2], ALPHAS[2], RANKS[2])))
        assert slot == 4
        SlotPrograms.fetch(pending)
        got, _ = serve(sp, ps, [4, 1, 4, -1])
        assert got[[0, 2]].tolist() == want[2][[0, 2]].tolist() and got[1].tolist() == want[1][1].tolist()
        assert got[3].tolist() == want[-1][3].tolist()
        stack.remove(1)  # emptied: a row that still names it reads zeros, the base
        got, _ = serve(sp, ps, [1, 1, 4, 4])
        assert got[:2].tolist() == want[-1][:2].tolist() and got[2:].tolist() == want[2][2:].tolist()
        assert stack._write._cache_size() == 1  # one write program, whatever the slot, filled or emptied
        assert (dict(sp._insert), dict(sp._advance), sp._score) == programs  # the slot programs, as compiled
    finally:  # (the module's cached stack as it was: adapter 1 in slot 1, slot 4 free)
        stack.remove(4)
        stack.install(Adapter("a1", "-", RANKS[1], ALPHAS[1],
                              lora_stack.slot_values(stack.specs, adapters[1], ALPHAS[1], RANKS[1])))


# --------------------------------------------------------------------------- reading adapters from checkpoints


@pytest.fixture(scope="module")
def lora_checkpoints(tmp_path_factory):
    """A tiny GPT-J base's fingerprint and LoRA checkpoints over it: q and v of rank 4 and 8; o of rank 2; and one of
    rank 4 over another base."""
    d = tmp_path_factory.mktemp("loras")
    cfg = load_config("inference", "gptj_tiny", overrides(1, 1))
    g = Decoder.of_config(cfg, eos=1, pad=0)
    digest = fingerprint(Placement(g.cfg).init_params(3))

    def saved(name, rank, alpha, targets=("q", "v"), base_digest=digest):
        return save_lora_checkpoint("gptj_tiny", str(d / name), "ckpt/base", base_digest, rank, alpha, targets,
                                    scale=1.0)

    paths = {"r4": saved("r4", 4, 8.0), "r8": saved("r8", 8, 16.0), "o": saved("o", 2, 4.0, ("o",)),
             "other": saved("other", 4, 8.0, base_digest="0123456789abcdef")}
    return g, digest, paths, str(d)


def test_start_up_adapters_fill_the_first_slots_with_their_rank_alpha_and_weights(lora_checkpoints):
    """``make_stack``: the stack's rank the largest adapter's (none given), its weights theirs; each adapter in the
    next slot, A and B as saved and padded, its scale alpha / r."""
    g, digest, paths, _ = lora_checkpoints
    stack = make_stack(g, (("four", paths["r4"]), ("eight", paths["r8"])), 3, 0, (), (digest, "base"))
    assert stack.rank == 8 and stack.targets == ("q", "v")
    assert [a.name if a else None for a in stack.held] == ["four", "eight", None]
    assert np.asarray(stack.arrays[lora_stack.SCALE]).tolist() == [2.0, 2.0, 0.0]
    saved, _, _ = ckpt.load(*ckpt.resolve(paths["r4"])[-1], None)
    a = np.asarray(stack.arrays["decoder"]["layers"]["q" + lora.A])
    np.testing.assert_array_equal(a[..., 0, :4], np.asarray(saved["decoder"]["layers"]["q" + lora.A]))
    assert not a[..., 0, 4:].any() and not a[..., 2, :].any()


@pytest.mark.parametrize("case,message", [
    ("other", "adapter x ({other}) was trained on the weights of ckpt/base/1 (fingerprint 0123456789abcdef), not on "
              "the base served, base (fingerprint {digest}): serve it over the base it was trained on"),
    ("missing", "adapter x: no checkpoint at {root}/missing"),
    ("full", "adapter x: {root}/full holds no LoRA adapters"),
    ("r8", "adapter x ({r8}): its rank is 8, above the server's --max_lora_rank 4: restart it with --max_lora_rank 8"),
    ("o", "adapter x ({o}): it adapts decoder o, which the server's adapter stack holds no adapters of (it holds q, "
          "v): restart it with --lora_target_modules"),
])
def test_an_adapter_the_stack_cannot_serve_is_one_line(lora_checkpoints, case, message):
    g, digest, paths, root = lora_checkpoints
    if case == "full" and not os.path.isdir(os.path.join(root, "full")):
        from tests.helpers import save_random_checkpoint

        save_random_checkpoint("gptj_tiny", os.path.join(root, "full"))
    stack = AdapterStack(g, 2, 4, ("q", "v"), (digest, "base"))
    path = paths.get(case, os.path.join(root, case))
    with pytest.raises(AdapterError) as e:
        stack.read("x", path)
    want = message.format(root=root, digest=digest, **paths)
    assert str(e.value).startswith(want) and "\n" not in str(e.value), str(e.value)


def test_every_slot_taken_is_one_line(lora_checkpoints):
    g, digest, paths, _ = lora_checkpoints
    stack = make_stack(g, (("a", paths["r4"]),), 1, 4, (), (digest, "base"))
    with pytest.raises(AdapterError, match=r"adapter b: every one of the server's --max_loras 1 slots holds an adapter "
                                           r"\(a\): unload one first, or start the server with --max_loras 2 or "
                                           r"more$"):
        stack.install(stack.read("b", paths["r4"]))
    stack.remove(0)
    assert stack.install(stack.read("b", paths["r4"])) == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_the_plan_counts_the_stack_beside_the_weights_and_prints_each_adapter_s_slot(tp):
    """decoder/plan.py with a stack: a device holds the stack's every A and B (a column-parallel weight's B and a
    row-parallel one's A split over tp, the rest whole) and the scales, in the compute dtype (float32 scales), beside
    the weights; one line says the stack, one each adapter's slot, one the free slots."""
    from decoder.plan import decode_plan

    g = Decoder.of_config(load_config("inference", "tiny", overrides(tp, 1, precision="bfloat16")), eos=1, pad=0)
    stack = AdapterStack(g, 3, 8, ("q", "o"), ("-", "-"))
    m = g.cfg.model
    d, inner, layers = m.hidden_size, m.attention.heads * m.attention.d_kv, m.layers + (m.decoder_layers or m.layers)
    per_slot = layers * 8 * (d + inner // tp + inner // tp + d) * 2  # q: A whole, B split; o: A split, B whole
    assert stack.nbytes == 3 * per_slot + 3 * 4
    plan = decode_plan(g, 4, 16, 8, stack=stack, loras=(("sql", "ckpt/sql"),))
    without = decode_plan(g, 4, 16, 8)
    assert plan.device_items["LoRA adapter stack"] == stack.nbytes
    assert plan.device_peak == without.device_peak + stack.nbytes
    lines = "\n".join(plan.notes)
    assert "LoRA adapter stack: 3 slots of rank 8 for o, q:" in lines
    assert "slot 0: adapter sql (ckpt/sql)" in lines and "slots 1..2: free" in lines


@pytest.mark.parametrize("source", ["checkpoint", "checkpoint int8", "hf"])
def test_the_served_base_s_fingerprint_is_the_one_a_lora_run_over_it_records(source, tmp_path):
    """``load_params(base=True)``'s fingerprint of a base (a checkpoint, its int8 decoding read from host memory, an
    HF model directory) equals what a LoRA run over that base records (partitioning/base.py's ``device_base`` in the
    run's frozen layout): adapters trained on it are served over it."""
    from app.hf_generate import hf_model_of
    from partitioning.base import device_base
    from tests.helpers import params_at, save_random_checkpoint

    directory = str(tmp_path / "base")
    save_random_checkpoint("gptj_tiny", directory)
    quantize = "int8" if source.endswith("int8") else "none"
    cfg = load_config("inference", "gptj_tiny", {**overrides(1, 1, quantize), "micro_batch_size": 2})
    g = Decoder.of_config(cfg, eos=1, pad=0)
    if source == "hf":
        hf_model_of(cfg, g.family, params_at(directory, 1)[1]).save_pretrained(str(tmp_path / "hf"))
        where, args = {"hf_model": str(tmp_path / "hf")}, (None, None, str(tmp_path / "hf"))
    else:
        where, args = {"init_from": [directory, 1]}, (directory, 1)
    _, digest = g.load_params(*args, base=True)
    lcfg = load_config("finetuning", "gptj_tiny", {"lora_rank": 4, "precision": "bfloat16", "data_parallel": 1,
                                                   "tensor_parallel": 1})
    assert digest == fingerprint(device_base(Placement(lcfg), where))


# --------------------------------------------------------------------------- adapters in PEFT's format


def lora_opts(rank: int, alpha: float):
    """The LoRA options modelling/lora.py's PEFT config reads."""
    return type("O", (), {"lora_rank": rank, "lora_alpha": alpha, "lora_dropout": 0.0})()


def write_peft(directory, g, tree, rank: int, alpha: float, **config) -> str:
    """Adapters ``tree`` in PEFT's format (``run_export.py --peft``'s files) in ``directory``, its config updated by
    ``config`` -> the directory."""
    import json

    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    opts = lora_opts(rank, alpha)
    save_file(lora.peft_state_dict(g.family, tree, g.cfg.model), os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({**lora.peft_config(g.family, tree, g.cfg.model, opts, "base"), **config}, f)
    return str(directory)


@pytest.mark.parametrize("preset", ["tiny", "gptj_tiny"])
def test_a_peft_directory_is_served_as_the_adapters_it_holds(preset, tmp_path):
    """An adapter in PEFT's format (modelling/lora.py's ``peft_state_dict`` and ``peft_config``: the names and
    torch layouts PEFT saves) read into a slot holds exactly the values of the adapters it was written from, its rank
    and alpha; rsLoRA's scale alpha / sqrt(r) is served as alpha * sqrt(r) / r."""
    g, base, adapters, sp = served(preset, 1, 1, "none")
    stack = sp.adapters
    for i in (1, 2):
        got = stack.read("p", write_peft(tmp_path / f"a{i}", g, adapters[i], RANKS[i], ALPHAS[i]))
        want = lora_stack.slot_values(stack.specs, adapters[i], ALPHAS[i], RANKS[i])
        jax.tree.map(np.testing.assert_array_equal, got.values, want)
        assert (got.rank, got.alpha) == (RANKS[i], ALPHAS[i])
    rs = stack.read("rs", write_peft(tmp_path / "rs", g, adapters[1], RANKS[1], ALPHAS[1], use_rslora=True))
    assert rs.alpha == pytest.approx(ALPHAS[1] * RANKS[1] ** 0.5)


@pytest.mark.slow
def test_a_directory_peft_itself_saved_is_served_as_its_adapters(tmp_path):
    """PEFT's own ``save_pretrained`` of an HF T5 wrapped with LoraConfig (the adapter's values ours, copied in):
    read into a slot, the same values as the adapters themselves (PEFT's key names and layouts, as it writes them)."""
    import copy

    peft = pytest.importorskip("peft", reason="PEFT's own files (requirements-dev)")
    import torch

    from app.hf_generate import hf_model_of

    g, base, adapters, sp = served("tiny", 1, 1, "none")
    tree = adapters[3]
    hf = hf_model_of(g.cfg, g.family, jax.tree.map(np.asarray, base))
    config = lora.peft_config(g.family, tree, g.cfg.model, lora_opts(RANKS[3], ALPHAS[3]), "base")
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
        r=RANKS[3], lora_alpha=ALPHAS[3], lora_dropout=0.0, target_modules=config["target_modules"],
        task_type="SEQ_2_SEQ_LM"))
    named = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in lora.peft_state_dict(g.family, tree, g.cfg.model).items():
            named[key.replace(".weight", ".default.weight")].copy_(torch.tensor(value))
    model.save_pretrained(str(tmp_path / "peft"))
    got = sp.adapters.read("peft", str(tmp_path / "peft"))
    jax.tree.map(np.testing.assert_array_equal, got.values,
                 lora_stack.slot_values(sp.adapters.specs, tree, ALPHAS[3], RANKS[3]))


def test_a_server_s_stack_takes_a_peft_adapter_s_rank_and_weights_at_start_up(tmp_path):
    g, base, adapters, sp = served("tiny", 1, 1, "none")
    one = {"encoder": {"layers": {k: v for k, v in adapters[2]["encoder"]["layers"].items() if k.startswith("q_")}}}
    path = write_peft(tmp_path / "p", g, one, RANKS[2], ALPHAS[2])
    stack = make_stack(g, (("p", path),), 2, 0, (), ("-", "base"))
    assert stack.rank == RANKS[2] and stack.targets == ("q",)
    assert [a.name if a else None for a in stack.held] == ["p", None]


@pytest.mark.parametrize("change,message", [
    ({"use_dora": True}, "it is DoRA"),
    ({"rank_pattern": {"q": 8}}, "ranks or alphas of their own"),
    ({"bias": "all"}, "it trains biases"),
    ({"r": 2}, r"is \(4, \d+\), where this model.s \w+ weight \w+ at rank 2 takes \(2, \d+\)"),
])
def test_a_peft_adapter_the_stack_cannot_serve_is_one_line_naming_why(tmp_path, change, message):
    g, base, adapters, sp = served("tiny", 1, 1, "none")
    path = write_peft(tmp_path / "p", g, adapters[1], RANKS[1], ALPHAS[1], **change)
    with pytest.raises(AdapterError, match=message) as e:
        sp.adapters.read("p", path)
    assert "\n" not in str(e.value) and "adapter p" in str(e.value)


def test_a_peft_tensor_of_a_weight_the_base_lacks_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    g, base, adapters, sp = served("tiny", 1, 1, "none")
    path = write_peft(tmp_path / "p", g, adapters[0], RANKS[0], ALPHAS[0])
    state = load_file(os.path.join(path, "adapter_model.safetensors"))
    key = next(iter(state))
    state[key.replace("block.0.", "block.9.")] = state.pop(key)
    save_file(state, os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"block\.9\..* adapts no weight of this model"):
        sp.adapters.read("p", path)
