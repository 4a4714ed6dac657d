"""The LoRA adapters a server serves side by side over one base, unmerged (modelling/lora_stack.py's stack), on its
devices: which slot holds which adapter, an adapter read from its LoRA checkpoint and checked against the served base
and the stack, written into a free slot or a slot emptied, each by one compiled program whatever the slot (the stack's
shapes never change, so the slot programs are never compiled again).

    stack = make_stack(decoder, (("sql", "ckpt/sql_lora"),), 8, 0, (), (fingerprint, "ckpt/base"))
    slot = stack.install(stack.read("chat", "ckpt/chat_lora"))     # later (between the slot programs' calls)
    stack.remove(slot)

An adapter is refused (``FlanT5Error``, one line naming it and the fix) when its checkpoint is missing or holds no
adapters, when it was trained on other weights than the served base (their fingerprints, partitioning/base.py, differ:
both named), when its rank is above the stack's (``--max_lora_rank``), when it adapts a weight the stack holds none
of (``--lora_target_modules``), or when every slot is taken (``--max_loras``).

The stack lives in the compute dtype (the scale float32) in training's adapter layouts: under tensor parallelism a
column-parallel weight's A whole and B split like its output, a row-parallel weight's A split like its input and B
whole, so each device holds its share, as it holds the base's.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from config.carry import saved_value
from modelling import lora, lora_stack
from modelling.params import is_spec
from partitioning import sharding as S
from partitioning.base import describe_base
from utils import checkpoint as ckpt
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")
DEFAULT_RANK = 16  # --max_lora_rank where no start-up adapter says (vLLM's default)
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # a PEFT adapter directory's files


class AdapterError(FlanT5Error):
    """An adapter the server cannot serve (its checkpoint, its base, its rank, its weights, no free slot)."""


@dataclass
class Adapter:
    """An adapter read and checked, its slot's values on the host (``lora_stack.slot_values``)."""

    name: str
    path: str
    rank: int
    alpha: float
    values: dict


def stack_targets(family, given: tuple, adapters: list) -> tuple:
    """The weights a server's stack holds adapters of: ``given`` (--lora_target_modules), else those the start-up
    adapters adapt (their checkpoints' targets: ``adapters`` [(its config's lora_targets, ...)]), else the family's
    default (PEFT's)."""
    if given:
        return tuple(given)
    found = sorted({t for targets in adapters for t in (targets or family.lora_targets)})
    return tuple(found) or tuple(family.lora_targets)


def is_peft(path: str) -> bool:
    """Whether ``path`` is an adapter directory in Hugging Face PEFT's format (its adapter_config.json)."""
    return os.path.isfile(os.path.join(path, PEFT_CONFIG))


def peft_keys(path: str) -> list:
    """The tensor names of a PEFT directory's adapter_model.safetensors, read from its header alone."""
    from safetensors import safe_open

    with safe_open(os.path.join(path, PEFT_WEIGHTS), framework="numpy") as f:
        return list(f.keys())


def saved_lora(path: str, decoder=None) -> tuple:
    """(the weights a LoRA checkpoint's adapters adapt as its config names them, () for its family's default; its
    rank), from its metadata alone; ((), 0) for a path that is no LoRA checkpoint (``AdapterStack.read`` says why).
    A PEFT directory's: its adapter_config.json's rank, and ``decoder``'s names of the weights its tensors adapt."""
    if is_peft(path):
        try:
            with open(os.path.join(path, PEFT_CONFIG)) as f:
                rank = int(json.load(f).get("r") or 0)
            names = lora.peft_targets(decoder.family, decoder.specs, decoder.cfg.model, peft_keys(path))
            return names, rank
        except (OSError, ValueError, TypeError, FlanT5Error):
            return (), 0
    try:
        directory, step = ckpt.resolve(path)[-1]
        saved = ckpt.read_meta(directory, step)
    except FlanT5Error:
        return (), 0
    if not saved.get("lora_base"):
        return (), 0
    config = saved.get("config") or {}
    return tuple(saved_value(config, "lora_targets") or ()), int(saved_value(config, "lora_rank") or 0)


def stack_of(decoder, loras: tuple, slots: int, rank: int, targets: tuple, base: tuple = ("-", "-")) -> "AdapterStack":
    """The stack of a server, nothing placed (``make_stack``'s, and what the memory plan counts): ``slots`` of rank
    ``rank`` (0: the largest of the ``loras`` adapters' [(name, path)], read from their metadata, else
    ``DEFAULT_RANK``) of the weights ``targets`` ((): ``stack_targets``)."""
    saved = [saved_lora(path, decoder) for _, path in loras]
    rank = rank or max([r for _, r in saved] + [0]) or DEFAULT_RANK
    return AdapterStack(decoder, slots, rank, stack_targets(decoder.family, targets, [t for t, _ in saved]), base)


def make_stack(decoder, loras: tuple, slots: int, rank: int, targets: tuple, base: tuple) -> "AdapterStack":
    """The stack of a server (``stack_of``) with the adapters ``loras`` [(name, path)] read and written into its
    first slots. AdapterError (one line) for the first one refused."""
    stack = stack_of(decoder, loras, slots, rank, targets, base)
    read = [stack.read(name, path) for name, path in loras]  # (every one checked before any is placed)
    stack.place()
    for adapter in read:
        stack.install(adapter)
    return stack


class AdapterStack:
    """``slots`` adapters of rank at most ``rank`` of the weights ``targets`` over the decoder's base, whose
    fingerprint and description ``base`` gives (see the module docstring)."""

    def __init__(self, decoder, slots: int, rank: int, targets: tuple, base: tuple):
        if slots < 1 or rank < 1:
            raise AdapterError(f"--max_loras {slots} and --max_lora_rank {rank} must be at least 1")
        self.g, self.slots, self.rank = decoder, slots, rank
        self.fingerprint, self.base_name = base
        self.specs = lora_stack.specs(decoder.family, decoder.specs, tuple(targets), slots, rank)
        self.targets = lora_stack.targets_of(self.specs)
        lays = S.layouts(self.specs, decoder.mesh, rts=False)
        self.decode_specs = jax.tree.map(lambda lay: lay.compute_spec, lays, is_leaf=S.is_layout)
        self.shardings = jax.tree.map(lambda p: NamedSharding(decoder.mesh, p), self.decode_specs)
        dtype = decoder.opts.compute_dtype
        self.abstract = jax.tree.map(
            lambda sp, sh: jax.ShapeDtypeStruct(sp.shape, np.float32 if sp.axes == (lora_stack.SLOTS,) else dtype,
                                                sharding=sh), self.specs, self.shardings, is_leaf=is_spec)
        self.arrays = None
        self.held: list = [None] * slots  # each slot's adapter (None: free)
        self._write = jax.jit(lora_stack.put, donate_argnums=0, out_shardings=self.shardings)

    # ------------------------------------------------------------------ sizes (the memory plan)

    @property
    def nbytes(self) -> int:
        """A device's bytes of the whole stack."""
        return sum(S.shard_bytes(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(self.abstract))

    @property
    def slot_bytes(self) -> int:
        """A device's bytes of one slot (one adapter of the stack's rank)."""
        return self.nbytes // self.slots

    # ------------------------------------------------------------------ on the devices

    def place(self) -> dict:
        """Every slot empty (zeros), on the devices -> the stack's arrays (kept in ``arrays``)."""
        self.arrays = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), self.abstract),
                              out_shardings=self.shardings)()
        self.held = [None] * self.slots
        return self.arrays

    def install(self, adapter: Adapter) -> int:
        """``adapter`` written into the first free slot (its arrays donated: written in place) -> the slot.
        AdapterError when every slot is taken. Called where no slot program runs at the same time (the server's
        decoding thread, between its calls)."""
        free = [s for s, held in enumerate(self.held) if held is None]
        if not free:
            raise AdapterError(f"adapter {adapter.name}: every one of the server's --max_loras {self.slots} slots "
                               f"holds an adapter ({', '.join(a.name for a in self.held)}): unload one first, or start "
                               f"the server with --max_loras {self.slots + 1} or more")
        slot = free[0]
        self.arrays = self._write(self.arrays, jnp.int32(slot), self._placed(adapter.values))
        self.held[slot] = adapter
        logger.info("LoRA adapter %s (%s, rank %d, alpha %g) in slot %d", adapter.name, adapter.path, adapter.rank,
                    adapter.alpha, slot)
        return slot

    def remove(self, slot: int) -> None:
        """Slot ``slot`` emptied (zeros) and free again."""
        self.arrays = self._write(self.arrays, jnp.int32(slot), self._placed(self._empty_slot()))
        logger.info("LoRA adapter %s out of slot %d", self.held[slot].name, slot)
        self.held[slot] = None

    def _empty_slot(self) -> dict:
        """One slot's values, all zeros (numpy)."""
        def one(path, sp):
            key = str(getattr(path[-1], "key", ""))
            if sp.axes == (lora_stack.SLOTS,):
                return np.float32(0.0)
            return np.zeros(sp.shape[:-2] + sp.shape[-1:] if key.endswith(lora.A) else sp.shape[:1] + sp.shape[2:],
                            np.float32)

        return jax.tree_util.tree_map_with_path(one, self.specs, is_leaf=is_spec)

    def _placed(self, values: dict) -> dict:
        """A slot's host values on the devices, each in its leaf's layout less the slot axis."""
        def put(x, sh, spec):
            axes = list(sh.spec) + [None] * (len(spec.shape) - len(sh.spec))
            if spec.axes == (lora_stack.SLOTS,):
                axes = []
            elif spec.axes[-2] == lora_stack.SLOTS:  # A [layers, in..., slots, rank]
                axes = axes[:-2] + axes[-1:]
            else:  # B [layers, slots, rank, out...]
                axes = axes[:1] + axes[2:]
            return S.put_global(np.asarray(x, np.float32), NamedSharding(sh.mesh, jax.sharding.PartitionSpec(*axes)))

        return jax.tree.map(put, values, self.shardings, self.specs, is_leaf=lambda x: is_spec(x) or np.isscalar(x)
                            or isinstance(x, np.ndarray))

    # ------------------------------------------------------------------ reading an adapter (the host's work)

    def read(self, name: str, path: str) -> Adapter:
        """The adapters of the LoRA checkpoint at ``path`` (a --save directory of ``run_finetuning.py --lora_rank N``,
        or a step of it), or of a PEFT adapter directory (``read_peft``), checked against the served base and the
        stack, as one slot's values on the host. AdapterError (one line) where it cannot be served."""
        if is_peft(path):
            return self.read_peft(name, path)
        try:
            directory, step = ckpt.resolve(path)[-1]
            saved = ckpt.read_meta(directory, step)
        except FlanT5Error as e:
            raise AdapterError(f"adapter {name}: {e}") from None
        if not saved.get("lora_base"):
            raise AdapterError(f"adapter {name}: {path} holds no LoRA adapters (a --save directory of "
                               "run_finetuning.py --lora_rank N holds them; a full checkpoint is a model of its own: "
                               "serve it with --load)")
        record = saved["lora_base"]
        if record["fingerprint"] != self.fingerprint:
            raise AdapterError(f"adapter {name} ({path}) was trained on {describe_base(record['source'])} (fingerprint "
                               f"{record['fingerprint']}), not on the base served, {self.base_name} (fingerprint "
                               f"{self.fingerprint}): serve it over the base it was trained on")
        lg = self.g.weights.lora_graphs(saved)
        adapters, _, _ = ckpt.load(directory, step, ckpt.abstract_like(lg.abstract_params(), lg.param_shardings),
                                   hint=lg.shape_hint)
        r, alpha = lg.opts.lora_rank, lg.opts.lora_alpha
        try:
            values = lora_stack.slot_values(self.specs, jax.tree.map(np.asarray, adapters), alpha, r)
        except FlanT5Error as e:
            raise AdapterError(f"adapter {name} ({path}): {e}") from None
        return Adapter(name, path, r, alpha, values)

    def read_peft(self, name: str, path: str) -> Adapter:
        """A Hugging Face PEFT adapter directory (adapter_config.json and adapter_model.safetensors, as PEFT's
        ``save_pretrained`` and ``run_export.py --peft`` write them) as one slot's values. PEFT records no fingerprint
        of its base: what is checked is that every tensor adapts a weight of the served base, at its shape (an adapter
        of another architecture or size is refused), and the base it names is logged beside the served one. Refused:
        what the stack cannot compute (DoRA, a rank or alpha a module of its own, biases, fan_in_fan_out, modules saved
        whole). rsLoRA's scale (alpha / sqrt(r)) is served as its alpha."""
        try:
            with open(os.path.join(path, PEFT_CONFIG)) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise AdapterError(f"adapter {name}: {path}/{PEFT_CONFIG} cannot be read: {e}") from None
        unsupported = [why for why, bad in (
            ("its peft_type is not LORA", str(config.get("peft_type", "LORA")).upper() != "LORA"),
            ("it is DoRA (use_dora)", bool(config.get("use_dora"))),
            ("modules have ranks or alphas of their own (rank_pattern, alpha_pattern)",
             bool(config.get("rank_pattern")) or bool(config.get("alpha_pattern"))),
            ("it trains biases (bias)", config.get("bias", "none") != "none"),
            ("its weights are stored transposed (fan_in_fan_out)", bool(config.get("fan_in_fan_out"))),
            ("it saves whole modules (modules_to_save)", bool(config.get("modules_to_save"))),
        ) if bad]
        if unsupported:
            raise AdapterError(f"adapter {name} ({path}): the server serves plain LoRA adapters, and "
                               f"{'; '.join(unsupported)}")
        weights = os.path.join(path, PEFT_WEIGHTS)
        if not os.path.isfile(weights):
            raise AdapterError(f"adapter {name}: {path} has no {PEFT_WEIGHTS} (save the adapter with PEFT's "
                               "save_pretrained(..., safe_serialization=True))")
        from safetensors.numpy import load_file

        r = int(config.get("r") or 0)
        alpha = float(config.get("lora_alpha") or r)
        if config.get("use_rslora"):
            alpha *= math.sqrt(r)  # (its scale alpha / sqrt(r), as alpha' / r)
        g = self.g
        try:
            tree = lora.from_peft(g.family, g.specs, g.cfg.model, load_file(weights), r)
            values = lora_stack.slot_values(self.specs, tree, alpha, r)
        except FlanT5Error as e:
            raise AdapterError(f"adapter {name} ({path}): {e}") from None
        logger.info("LoRA adapter %s: PEFT's format, trained on %s (no fingerprint to check; every tensor fits the "
                    "served base, %s)", name, config.get("base_model_name_or_path") or "a base it does not name",
                    self.base_name)
        return Adapter(name, path, r, alpha, values)
