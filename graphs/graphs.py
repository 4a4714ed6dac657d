"""The Graphs builder: a config resolved, once, into what the engine runs on: the model family and its options, the
mesh, weight layouts and shardings, the updater (optimizer, clipping, stochastic rounding), the step options, and
the decoding programs.

The executors (graphs/fused.py, graphs/phased.py) read these objects, never the config itself:
``graphs.executor.make_executor(graphs)`` picks the fused executor (every phase in one compiled step) or the
phased one (weights, optimizer state and activations in host memory, one phase program at a time).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from config.carry import shape_hint
from graphs import optim
from graphs import sharding as S
from graphs.streaming import PromptStream
from graphs.tree import TreeStructure
from modelling import decoding, lora, quant, registry
from modelling.family import cast_params, leaf_name
from modelling.params import ParamSpec, init_leaf, init_params, is_spec, zero_padded_vocab
from modelling.rows import pack_prompts
from utils.errors import ConfigError

HOST = "pinned_host"  # (graphs/host_state.py's: the memory streamed weights wait in)


@dataclass(frozen=True)
class StepOptions:
    """What a training step needs of the config beside the model and the updater."""

    seed: int  # of the initial weights and of every step's key (graphs/state.step_key)
    loss_scale: float  # the static loss scale, or the first one under dynamic scaling
    update_in_backward: bool  # phased: each layer updated right after its backward, clipped with the previous norm
    compute_copy: bool  # phased: forward and backward read a compute-dtype copy of the weights kept in host memory
    batch: tuple  # (gradient accumulation, rows per micro-batch) of a global batch
    batch_lengths: tuple  # ((batch key, row length), ...) as the loader builds a batch


class Graphs:
    """A config resolved into the engine's objects (see the module docstring). ``cfg`` stays for the drivers."""

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
        # batches are [gradient_accumulation, data_parallel * micro_batch_size, length]
        self.batch_sharding = NamedSharding(self.mesh, P(None, S.DP, None))
        # inference rows [dp * micro_batch_size, length]
        self.row_sharding = NamedSharding(self.mesh, P(S.DP, None))
        training = not cfg.model.eval
        self.updater = optim.Updater.of_config(cfg.training, self.family.decays) if training else None
        # 16-bit master weights under stochastic rounding (every update rounded stochastically), else float32
        self.master_dtype = self.opts.compute_dtype if training and cfg.training.stochastic_rounding else np.float32
        ga = max(cfg.gradient_accumulation, 1)
        self.steps = StepOptions(cfg.model.seed, cfg.initial_loss_scale, ex.update_in_backward and training,
                                 ex.compute_copy and training,
                                 (ga, cfg.training.global_batch_size // ga),
                                 tuple(self.family.batch_lengths(cfg).items()))
        self.phased = ex.phased
        # decoding's weights: int8 matmul weights when an eval config asks (modelling/quant.py); training never
        self.quantize = cfg.inference.quantize if cfg.model.eval else "none"
        # ... and the stacks that read the prompt alone (T5's encoder) streamed from host memory a layer at a time
        # (graphs/streaming.py) when an eval config asks
        self.prompt_stacks = tuple(s.name for s in self.family.stacks[:-1]) \
            if cfg.model.eval and cfg.inference.stream_encoder else ()
        if cfg.model.eval and cfg.inference.stream_encoder and not self.prompt_stacks:
            raise ConfigError(f"--stream_encoder streams an encoder's layers, and the {self.family.name} family has "
                              "no encoder (every layer decodes token by token): drop --stream_encoder (--quantize "
                              "int8 halves its weights' bytes)")
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
        key = jax.random.key(self.steps.seed if seed is None else seed)
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
        key = jax.random.key(self.steps.seed if seed is None else seed)
        fn = jax.jit(lambda k: self.frozen(zero_padded_vocab(init_params(self.base_specs, k), self.vocab_size)),
                     out_shardings=self.base_shardings)
        return fn(key)

    def init_weights(self, specs: dict, shardings: dict, dtype_of, seed: int | None = None) -> dict:
        """``init_params``' values for a spec tree, created one weight at a time (one compilation per distinct
        weight shape) straight into ``shardings`` (host memory, for the phased executor), each in
        ``dtype_of(name)``."""
        key = jax.random.key(self.steps.seed if seed is None else seed)
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

    def opt_state_shardings(self, params, param_shardings=None) -> dict:
        """Shardings of the optimizer state ({group: state}): a leaf shaped like a weight follows that
        weight; any other leaf (step counts, Adafactor's factored moments) is replicated."""
        param_shardings = self.param_shardings if param_shardings is None else param_shardings
        abstract = jax.eval_shape(partial(self.updater.init_state, tree=self.tree), params)
        pg, sg = self.tree.split_groups(params), self.tree.split_groups(param_shardings)
        default = NamedSharding(self.mesh, P(), memory_kind=jax.tree.leaves(param_shardings)[0].memory_kind)
        return {name: S.follow_params(state, pg[name], sg[name], default) for name, state in abstract.items()}

    # ------------------------------------------------------------------ batches and step inputs

    def shard_batch(self, batch: dict) -> dict:
        """Host batch {key: [GA, dp*mb, len]} -> device arrays split over dp.

        With several processes each one reads the same global batch (same seed and
        position) and places only the rows of its own devices.
        """
        return {k: S.put_global(v, self.batch_sharding) for k, v in batch.items() if k in self.family.batch_keys}

    def abstract_batch(self) -> dict:
        """ShapeDtypeStructs of one global batch as the loader builds it (packed rows carry positions)."""
        shape = self.steps.batch
        return {k: jax.ShapeDtypeStruct(shape + (n,), jnp.int32, sharding=self.batch_sharding)
                for k, n in self.steps.batch_lengths}

    def loss_scale_input(self, loss_scale: float | None = None) -> jax.Array:
        """A step's loss scale as the step programs take it: a float32 scalar replicated over the mesh (an input, so
        that a new scale compiles nothing); the config's static scale when None."""
        value = self.steps.loss_scale if loss_scale is None else loss_scale
        return jax.device_put(jnp.asarray(value, jnp.float32), self.replicated)

    def clip_norm_input(self, clip_norm: float | None) -> jax.Array | None:
        """The norm a step clips with in place of its own: under ``execution.update_in_backward`` the previous
        step's (None or 0: no clipping), as a replicated float32 scalar; otherwise None (the step's own norm)."""
        if not self.steps.update_in_backward:
            return None
        return jax.device_put(jnp.asarray(clip_norm or 0.0, jnp.float32), self.replicated)

    def learning_rate(self, step: int) -> float:
        return self.updater.learning_rate(step)

    # ------------------------------------------------------------------ programs

    def phase(self, fn, in_specs, out_specs):
        """Compiles a per-device function under shard_map on this mesh."""
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))

    def compute_specs(self) -> dict:
        """tp-only specs of the weights (after the RTS gather), stacked as training holds them."""
        return jax.tree.map(lambda l: l.compute_spec, self.layouts, is_leaf=S.is_layout)

    # ------------------------------------------------------------------ decoding's layout of the weights
    #
    # Decoding reads its weights in a layout of its own: every weight whole on the devices of its tp group (no RTS),
    # in the compute dtype (the family's float32 weights kept float32), int8 where ``quantize`` says
    # (modelling/quant.py), and the layers of the stack that decodes token by token (the family's last) as one tree
    # per layer: the decode step reads them one by one, and a program that sliced them out of a stacked array would
    # copy them all (XXL: 5.8 GiB of int8 decoder weights, 11.5 GiB of bfloat16) before its loop.

    def decode_specs(self) -> dict:
        """The specs of decoding's weights: a weight kept as int8 has an ``Int8`` of its values' specs and its
        scale's (its output axes'); the decode stack's layers one tree per layer."""
        return self._decoding(lambda spec, lay, path: lay.compute_spec,
                              lambda spec, lay, n_in, path: P(*_scale_axes(spec, lay.tp_spec, n_in)),
                              lambda p: P(*tuple(p)[1:]))

    def decode_shardings(self, memory_kind: str | None = None) -> dict:
        """Shardings of decoding's weights (``decode_specs``), on the devices or in ``memory_kind``; a streamed
        stack's layers (``prompt_stacks``) in host memory."""
        tree = jax.tree.map(lambda p: NamedSharding(self.mesh, p, memory_kind=memory_kind), self.decode_specs())
        for s in self.prompt_stacks:
            tree[s] = {**tree[s], "layers": jax.tree.map(lambda sh: sh.with_memory_kind(HOST), tree[s]["layers"])}
        return tree

    def resident(self, tree: dict) -> dict:
        """A tree like decoding's weights without the streamed stacks' layers (what the decoding program reads)."""
        return {**tree, **{s: {**tree[s], "layers": ()} for s in self.prompt_stacks}}

    def abstract_decode_params(self) -> dict:
        """ShapeDtypeStructs of decoding's weights (app/weights.py places them), with their shardings."""
        def dtype(path):
            return np.float32 if self.family.keeps_f32(path[-1]) else self.opts.compute_dtype

        def values(spec, lay, path):
            int8 = self._int8_inputs(spec, path) is not None
            return jax.ShapeDtypeStruct(spec.shape, np.int8 if int8 else dtype(path))

        shapes = self._decoding(values, lambda spec, lay, n_in, path: jax.ShapeDtypeStruct(
            _scale_axes(spec, spec.shape, n_in), np.float32), lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype))
        return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes,
                            self.decode_shardings())

    def is_decoding_layout(self, params: dict) -> bool:
        """Whether a weight tree is in decoding's layout already (``abstract_decode_params``: its make, dtypes and
        shardings), else it is converted (``to_decoding``)."""
        targets = self.abstract_decode_params()
        if jax.tree.structure(params) != jax.tree.structure(targets):
            return False
        return all(isinstance(x, jax.Array) and x.dtype == t.dtype and x.sharding.is_equivalent_to(t.sharding, x.ndim)
                   for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(targets)))

    def to_decoding(self, params: dict) -> dict:
        """Weights on the devices in training's layout (any dtypes) -> decoding's (``decode_shardings``), in one
        program: the whole model and its new copy on the devices at once (app/weights.py's ``place`` converts from
        host memory a weight at a time)."""
        targets = self.abstract_decode_params()

        def convert(x, t):
            return quant.quantize(x, t.n_in, t.lead, t.dtype) if quant.is_int8(t) else x.astype(t.dtype)

        def fn(p):
            for s in self.prompt_stacks:
                layers = p[s]["layers"]
                p = {**p, s: {**p[s], "layers": [jax.tree.map(lambda w: w[i], layers)
                                                   for i in range(len(targets[s]["layers"]))]}}
            return jax.tree.map(convert, p, targets)

        return jax.jit(fn, out_shardings=jax.tree.map(lambda t: t.sharding, targets))(params)

    def _decoding(self, plain, scale, row) -> dict:
        """``decoding_tree`` with the streamed stacks' stacked leaves split into one tree per layer (``row(leaf)``: a
        stacked leaf's per-layer one): the stream loads them one by one from host memory."""
        tree = self.decoding_tree(plain, scale)
        for stack in self.prompt_stacks:
            n = jax.tree.leaves(self.specs[stack]["layers"], is_leaf=is_spec)[0].shape[0]
            one = jax.tree.map(row, tree[stack]["layers"])
            tree = {**tree, stack: {**tree[stack], "layers": [one] * n}}
        return tree

    def _int8_inputs(self, spec, path: tuple):
        """How many input dims the weight at ``path`` has if decoding keeps it as int8, else None."""
        if self.quantize != "int8" or not quant.quantizes(self.family, path):
            return None
        return quant.input_dims(spec.axes)

    def _map_weights(self, fn) -> dict:
        """fn(spec, layout, path) for every weight, as a tree like the weights'."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(self.specs, is_leaf=is_spec)
        lays = jax.tree.leaves(self.layouts, is_leaf=S.is_layout)
        out = [fn(spec, lay, tuple(str(getattr(k, "key", k)) for k in path)) for (path, spec), lay in zip(flat, lays)]
        return jax.tree_util.tree_unflatten(treedef, out)

    def decoding_tree(self, plain, scale) -> dict:
        """A tree like decoding's weights: ``plain(spec, layout, path)`` for a weight kept as it is; for one kept as
        int8 an ``Int8`` of ``plain``'s value for its values and ``scale(spec, layout, n_in, path)`` for its
        scale."""
        def build(spec, lay, path):
            n_in = self._int8_inputs(spec, path)
            if n_in is None:
                return plain(spec, lay, path)
            return quant.Int8(plain(spec, lay, path), scale(spec, lay, n_in, path), self.opts.compute_dtype,
                              _n_out(spec, n_in))

        return self._map_weights(build)

    def decode_phase(self, options: decoding.Options, eos_id: int = 1, pad_id: int = 0, seed: int = 0):
        """The search ``options`` names (greedy, beam search, sampling: modelling/decoding.py): (weights in
        decoding's layout, ids [B, k], mask [B, k]) -> tokens [B, max_new_tokens]. Sampling draws from ``seed``, each
        row by its global index, so the outputs are the same at any dp x tp. Programs: the search (one per prompt
        width k), and where prompts are packed (``pack``) the encoder over them apart (one per packed shape)."""
        opts, family = self.opts, self.family

        def search(p, ids, mask, key_data, encoded=None):
            offset = jax.lax.axis_index(S.DP) * ids.shape[0]
            return decoding.decode(family, p, ids, mask, opts, options, S.TP, eos_id, pad_id,
                                   jax.random.wrap_key_data(key_data), offset, encoded)

        specs = (self.resident(self.decode_specs()), P(S.DP, None), P(S.DP, None), P())
        key = jax.device_put(jax.random.key_data(jax.random.key(seed)), self.replicated)
        # the search from the prompt stacks' output (streamed, or read packed): a program apart from the encoder's, so
        # that a new packed shape compiles the encoder alone, never the search's loop
        from_encoded = self.phase(search, specs + (P(S.DP, None, None),), P(S.DP, None))
        if not self.prompt_stacks:
            program = self.phase(search, specs, P(S.DP, None))
            encode = self._packed_encoder(specs[0]) if family.packs_prompts else None

            def run(p, ids, mask):
                """ids/mask [B, k]: on the devices, or numpy (then packed where that saves rows: ``pack``)."""
                p = p if self.is_decoding_layout(p) else self.to_decoding(p)  # (a test's weights: each call)
                if isinstance(ids, np.ndarray):
                    pk = self.pack(ids, mask) if encode is not None else None
                    ids, mask = S.put_global(ids, self.row_sharding), S.put_global(mask, self.row_sharding)
                    if pk is not None:
                        return from_encoded(p, ids, mask, key, encode(p, *pk))
                return program(p, ids, mask, key)

            return run
        stream = PromptStream(self)

        def streamed(p, ids, mask):  # the encoder a layer at a time from host memory, then the decoding program
            p = p if self.is_decoding_layout(p) else self.to_decoding(p)
            if isinstance(ids, np.ndarray):  # (placed as the batch's rows: each process holds its own)
                ids, mask = S.put_global(ids, self.row_sharding), S.put_global(mask, self.row_sharding)
            return from_encoded(self.resident(p), ids, mask, key, stream(p, ids, mask))

        return streamed

    def pack(self, ids: np.ndarray, mask: np.ndarray):
        """Prompts ids/mask [B, k] (numpy) packed for the encoder (modelling/rows.py's ``pack_prompts``), each
        data-parallel group's rows apart, into rows k, 2k or 4k wide, whichever reads the fewest weighted
        positions: a position costs the layer's matmuls, and a row's attention grows with its width (prompts of
        65 to 119 tokens in rows of 128 pair with none: 8 rows; in rows of 256, 3). -> (ids, segments, positions,
        where) on the devices, or None where packing would not save a tenth of the encoder's work. A group's packed
        rows are a multiple of an eighth of its rows, rounded up: at most 7 shapes (encoder programs) a width."""
        m = self.cfg.model
        inner = m.attention.heads * m.attention.d_kv
        matmuls = 4 * m.hidden_size * inner + (3 if m.feed_forward_proj.startswith("gated") else 2) * \
            m.hidden_size * m.d_ff
        per_key = 2 * inner  # a position's scores and context against each key of its row

        def cost(rows, width):
            return rows * width * (matmuls + per_key * width)

        k = ids.shape[1]
        best, best_cost = None, 0.9 * cost(ids.shape[0], k)
        for width in (k, 2 * k, 4 * k):
            packed = pack_prompts(ids, mask, groups=self.dp, width=width, multiple=-(-ids.shape[0] // self.dp // 8))
            if packed is not None and cost(packed[0].shape[0], width) < best_cost:
                best, best_cost = packed, cost(packed[0].shape[0], width)
        return None if best is None else tuple(S.put_global(x, self.row_sharding) for x in best)

    def _packed_encoder(self, weight_specs):
        """The encoder over prompts packed by ``pack``: (weights, packed ids, segments, positions [dp * P, W], where
        [B, k]) -> its output at each prompt position, float32 [B, k, d] (zeros at padding), as the search reads it."""
        family, opts = self.family, self.opts

        def encode(p, ids, segments, positions, where):
            enc = family.encode_packed(family.decoding_params(p, opts), ids, segments, positions, opts, S.TP)
            flat = enc.reshape(-1, enc.shape[-1])
            flat = jnp.concatenate([flat, jnp.zeros((1, flat.shape[-1]), flat.dtype)])  # (padding reads zeros)
            return flat[where]

        rows = P(S.DP, None)
        return self.phase(encode, (weight_specs, rows, rows, rows, rows), P(S.DP, None, None))

    def generate_phase(self, max_new_tokens: int, eos_id: int = 1, cached: bool = True, pad_id: int = 0):
        """Greedy decoding: (gathered weights, ids [B, k], mask [B, k]) -> tokens [B, max_new_tokens].

        Rows split over dp, weights over tp; ``cached=False`` runs the uncached reference.
        """
        opts, family = self.opts, self.family
        search = decoding.greedy if cached else decoding.greedy_uncached
        return self.phase(lambda p, ids, mask: search(family, p, ids, mask, opts, max_new_tokens, S.TP, eos_id=eos_id,
                                                      pad_id=pad_id),
                          (self.compute_specs(), P(S.DP, None), P(S.DP, None)), P(S.DP, None))


def _lead(spec) -> int:
    """1 for a stacked layer weight (its leading ``layers`` axis), else 0."""
    return int(spec.axes[0] == "layers")


def _n_out(spec, n_in: int) -> int:
    return len(spec.shape) - _lead(spec) - n_in


def _scale_axes(spec, per_dim: tuple, n_in: int) -> tuple:
    """``per_dim`` (a weight's shape, or its per-dim mesh axes) without the weight's input dims: its scale's."""
    lead = _lead(spec)
    return tuple(per_dim[:lead]) + tuple(per_dim[lead + n_in:])
