"""Placement: a model config resolved, once, into where its weights live: the model family and its options, the
mesh of dp x tp devices, the weights' specs, layouts and shardings (RTS or not, LoRA's adapters and frozen base),
and the programs that create and place them. What training (graphs/graphs.py's ``Graphs``) and decoding
(decoder/) both build on; it knows no optimizer and no batch.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from config.carry import shape_hint
from modelling import lora, registry
from modelling.family import cast_params, leaf_name
from modelling.params import ParamSpec, init_leaf, init_params, is_spec, zero_padded_vocab
from partitioning import sharding as S
from partitioning.tree import TreeStructure


class Placement:
    """A config's model on a mesh (see the module docstring). ``cfg`` stays for the drivers."""

    def __init__(self, cfg, mesh=None):
        self.cfg = cfg
        ex = cfg.execution
        self.dp, self.tp = ex.data_parallel, ex.tensor_parallel
        self.mesh = mesh if mesh is not None else S.make_mesh(self.dp, self.tp)
        self.family = registry.checked(cfg)
        self.opts = self.family.options_of(cfg)
        self.vocab_size = cfg.model.embedding.vocab_size
        self.model_config = cfg.model  # the model section: a pretrained model's shape is checked against it
        self.lora = lora.enabled(self.opts)
        base_specs = self.family.param_specs(cfg.model, self.tp)
        # the model's tree: its stacks and the weights the head phase reads (the trained tree, ``tree``, is the
        # adapters' under LoRA)
        self.model_tree = TreeStructure(tuple(s.name for s in self.family.stacks), self.family.head_paths(self.opts))
        if self.lora:
            # the trained weights are the adapters (modelling/lora.py); the base weights are frozen, stored in the
            # compute dtype in their RTS layout (``base_shardings``), and never get a gradient or optimizer state
            self.specs = lora.adapter_specs(self.family, base_specs, self.opts)
            self.tree = TreeStructure(tuple(s.name for s in self.family.stacks if s.name in self.specs))
            self.base_specs, self.base_layouts = base_specs, S.layouts(base_specs, self.mesh, ex.rts)
            self.base_shardings = S.storage_shardings(self.base_layouts, self.mesh)
        else:
            self.specs, self.tree = base_specs, self.model_tree
        self.layouts = S.layouts(self.specs, self.mesh, ex.rts)
        self.param_shardings = S.storage_shardings(self.layouts, self.mesh)
        self.replicated = NamedSharding(self.mesh, P())
        # rows [dp * rows per dp shard, length] (prompts, decoded tokens)
        self.row_sharding = NamedSharding(self.mesh, P(S.DP, None))
        self.seed = cfg.model.seed  # of the initial weights
        self.master_dtype = np.float32  # the weights' own dtype (Graphs: 16 bits under stochastic rounding)
        self.shape_hint = partial(shape_hint, cfg)  # how to run a checkpoint of another shape (utils/checkpoint.py)

    # ------------------------------------------------------------------ weights

    def to_master(self, params: dict) -> dict:
        """Weights (float32) in their master dtypes (the family's float32 weights, norms, tables and biases, stay
        float32)."""
        dt = self.master_dtype
        if dt == np.float32:
            return params
        keep = self.family.keeps_f32
        return jax.tree_util.tree_map_with_path(lambda path, x: x if keep(leaf_name(path)) else x.astype(dt), params)

    def init_params(self, seed: int | None = None) -> dict:
        """Random weights, created directly in their RTS layout (and master dtypes)."""
        key = jax.random.key(self.seed if seed is None else seed)
        fn = jax.jit(lambda k: self.to_master(zero_padded_vocab(init_params(self.specs, k), self.vocab_size)),
                     out_shardings=self.param_shardings)
        return fn(key)

    def shard_params(self, host_params: dict, memory_kind: str | None = None) -> dict:
        """Places host (numpy) weights in their RTS layout (in host memory with ``memory_kind="pinned_host"``), in
        their master dtypes (rounded to nearest, once, from float32)."""
        shardings = self.param_shardings if memory_kind is None else S.with_memory_kind(self.param_shardings,
                                                                                        memory_kind)
        host = self.to_master(jax.tree.map(lambda x: np.asarray(x, np.float32), host_params))
        return jax.tree.map(lambda x, s: S.put_global(np.asarray(x), s), host, shardings)

    def init_base(self, seed: int | None = None, memory_kind: str | None = None) -> dict:
        """LoRA: random base weights (the family's init, as ``init_params`` draws them without adapters), frozen
        (``frozen``) in their RTS layout; created one weight at a time into host memory with ``memory_kind``
        (the phased executor's: the whole base never passes through a device)."""
        if memory_kind is not None:
            return self.init_weights(self.base_specs, S.with_memory_kind(self.base_shardings, memory_kind),
                                     self.frozen_dtype, seed)
        key = jax.random.key(self.seed if seed is None else seed)
        fn = jax.jit(lambda k: self.frozen(zero_padded_vocab(init_params(self.base_specs, k), self.vocab_size)),
                     out_shardings=self.base_shardings)
        return fn(key)

    def init_weights(self, specs: dict, shardings: dict, dtype_of, seed: int | None = None) -> dict:
        """``init_params``' values for a spec tree, created one weight at a time (one compilation per distinct
        weight shape) straight into ``shardings`` (host memory, for the phased executor), each in
        ``dtype_of(name)``."""
        key = jax.random.key(self.seed if seed is None else seed)
        flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
        keys = jax.random.split(key, len(flat))
        programs, out = {}, []
        for (path, spec), k, sh in zip(flat, keys, jax.tree_util.tree_leaves(shardings)):
            top = path[0].key  # shared / lm_head(_bias) get their padded vocabulary zeroed, as in init_params
            padded = top in ("shared", "lm_head", "lm_head_bias")
            dt = dtype_of(leaf_name(path))
            sig = (spec.shape, spec.is_norm, top if padded else None, sh, np.dtype(dt))
            if sig not in programs:

                def make(k, std, spec=spec, top=top, padded=padded, dt=dt):
                    x = init_leaf(ParamSpec(spec.shape, spec.axes, None if spec.is_norm else 1.0, spec.dtype), k)
                    x = x if spec.is_norm else std * x
                    x = zero_padded_vocab({top: x}, self.vocab_size)[top] if padded else x
                    return x.astype(dt)

                programs[sig] = jax.jit(make, out_shardings=sh)
            out.append(programs[sig](k, jnp.float32(1.0 if spec.std is None else spec.std)))
        return jax.tree_util.tree_unflatten(jax.tree.structure(specs, is_leaf=is_spec), out)

    def frozen_dtype(self, name: str):
        """LoRA: the dtype a frozen base weight is kept in (the compute dtype; the family's float32 weights aside)."""
        return np.float32 if self.family.keeps_f32(name) else self.opts.compute_dtype

    def master_dtype_of(self, name: str):
        """The dtype a trained weight is kept in (``to_master``)."""
        return np.float32 if self.family.keeps_f32(name) else self.master_dtype

    def frozen(self, params: dict) -> dict:
        """LoRA: base weights as they are kept, frozen: in the compute dtype (the family's float32 weights aside)."""
        return cast_params(params, self.opts.compute_dtype, self.family.keeps_f32)

    def abstract_base(self, memory_kind: str | None = None) -> dict:
        """LoRA: ShapeDtypeStructs of the frozen base weights in their layout (in ``memory_kind``)."""
        shardings = self.base_shardings if memory_kind is None else S.with_memory_kind(self.base_shardings,
                                                                                       memory_kind)
        tree = jax.eval_shape(lambda k: self.frozen(init_params(self.base_specs, k)), jax.random.key(0))
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

    def shard_base(self, host_params: dict, memory_kind: str | None = None) -> dict:
        """LoRA: host (numpy) base weights placed frozen (``frozen``) in their RTS layout (in ``memory_kind``)."""
        shardings = self.base_shardings if memory_kind is None else S.with_memory_kind(self.base_shardings,
                                                                                       memory_kind)
        host = jax.tree_util.tree_map_with_path(
            lambda path, x: np.asarray(x, self.frozen_dtype(leaf_name(path))), host_params)
        return jax.tree.map(lambda x, s: S.put_global(x, s), host, shardings)

    def abstract_params(self) -> dict:
        """ShapeDtypeStructs of the weights (no allocation)."""
        return jax.eval_shape(self.init_params)

    def depths(self) -> dict:
        """{stack name: number of layers} of every stack of the model (an encoder and a decoder may differ)."""
        specs = self.base_specs if self.lora else self.specs
        return {s: jax.tree.leaves(specs[s]["layers"], is_leaf=is_spec)[0].shape[0] for s in self.model_tree.stacks}

    # ------------------------------------------------------------------ programs

    def phase(self, fn, in_specs, out_specs):
        """Compiles a per-device function under shard_map on this mesh."""
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))

    def compute_specs(self) -> dict:
        """tp-only specs of the weights (after the RTS gather), stacked as training holds them."""
        return jax.tree.map(lambda l: l.compute_spec, self.layouts, is_leaf=S.is_layout)
