"""The decoder: decoding as an engine of its own, built from what decoding needs (the model's shape and its place on
dp x tp devices, the inference options, the tokenizer's end-of-text and padding ids), never from the optimizer or
the training data. It owns the weights' decoding layout, the searches' programs (greedy, beam search, sampling:
modelling/decoding.py) and the prompts' reading (packed for an encoder, or streamed from host memory), and it
decodes batches of prompts for validation, inference, --eval_every and export's comparison. The server's slots
(decoder/slot_programs.py), the weights' loading (decoder/weights.py), the streamed encoder (decoder/streaming.py) and
decoding's memory plan (decoder/plan.py) are built on it.

    decoder = Decoder.of_config(cfg, tokenizer)     # a decoding config (app/predict.py's decoding_config)
    params = decoder.load_params(directory, step)
    texts = decoder.predict(params, features)

Every program scans the layers (the weights stacked, the KV cache a leaf of every layer), so a program's size and
compile time do not grow with the model's depth. Decoding compiles one search program per prompt width (a multiple
of 8) and, where an encoder's prompts are packed, one encoder program per packed shape.

Decoding's layout of the weights: every weight whole on the devices of its tp group (no RTS), in the compute dtype
(the family's float32 weights kept float32), int8 where ``inference.quantize`` says (modelling/quant.py), stacked
by layer as a checkpoint holds them; a streamed stack's layers (``inference.stream_encoder``) one tree per layer in
host memory, loaded a layer at a time; on a CPU, a decoder of at most ``UNROLL_LAYERS`` layers one tree per layer on
the devices (``unrolled_decoder``), its steps running the layers one after the other.
"""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from data.tokenizer import pad_id
from decoder.streaming import PromptStream
from decoder.weights import Weights
from modelling import decoding, quant
from modelling.params import is_spec
from modelling.rows import pack_prompts
from partitioning import sharding as S
from partitioning.placement import Placement
from partitioning.sharding import HOST  # (the memory a streamed stack's layers wait in)
from utils.errors import ConfigError


# The deepest decoder whose steps run its layers one after the other on a CPU (base's 12): each layer's weights and
# caches read in place, where a scan over the stacked layers has XLA:CPU copy each layer's slice of them first (a
# third of a float32 step at the small shape); a program's compile time grows with the layers it runs so
UNROLL_LAYERS = 12


def unrolled_decoder(family, platform: str, layers: int) -> bool:
    """Whether decoding's layout holds the decoder one tree per layer, its steps running the layers one after the
    other: on a CPU, for a family whose steps can (``Family.unrolls_decoding``), at most ``UNROLL_LAYERS`` deep.
    Elsewhere the steps scan the stacked layers (a GPU reads a layer's slice inside its GEMMs)."""
    return platform == "cpu" and family.unrolls_decoding and layers <= UNROLL_LAYERS


def decoding_config(cfg):
    """A config's twin for decoding its weights: eval mode (no dropout), no RTS, the fused layout, and no adapters
    (a LoRA checkpoint's are merged into the weights decoded); a decoding config comes back as it is."""
    if cfg.model.eval and not cfg.execution.rts and not cfg.execution.phased and not cfg.lora.rank:
        return cfg
    ecfg = copy.deepcopy(cfg)
    ecfg.model.eval, ecfg.execution.rts, ecfg.execution.phased = True, False, False
    ecfg.lora.rank = 0
    return ecfg.validate()


def length_buckets(lengths: np.ndarray, batch_size: int) -> list:
    """Index batches (sorted by length, so padding is small); the last may be short."""
    order = np.argsort(lengths, kind="stable")
    return [order[i: i + batch_size] for i in range(0, len(order), batch_size)]


def batch_rows(feats: dict, idx, batch_size: int) -> tuple:
    """(ids, mask) [batch_size, n] of rows ``idx`` of feats, right-padded to their longest prompt rounded up to a
    multiple of 8, the last batch filled by repeating its last row."""
    n = int(-(-int(feats["attention_mask"][idx].sum(1).max()) // 8) * 8)
    width = feats["input_ids"].shape[1]
    rows = np.concatenate([idx, np.repeat(idx[-1:], batch_size - len(idx))])
    ids, mask = feats["input_ids"][rows, :n], feats["attention_mask"][rows, :n]
    if n > width:  # the feats' width: pad it to the multiple of 8
        ids, mask = (np.pad(x, ((0, 0), (0, n - width))) for x in (ids, mask))
    return ids, mask


class Decoder:
    """Decoding of one model on one mesh (see the module docstring): ``place`` an eval Placement (no RTS, no
    adapters), ``inference`` the config's inference section, ``eos_id``/``pad_id`` the tokenizer's, ``rows`` the rows
    of a batch (micro_batch_size x data_parallel), ``tokenizer`` what ``predict`` decodes texts with."""

    def __init__(self, place: Placement, inference, eos_id: int = 1, pad_id: int = 0, rows: int = 1,
                 tokenizer=None):
        if place.cfg.execution.rts or place.lora:
            raise ValueError("a Decoder needs an eval placement without RTS or adapters: build it with "
                             "Decoder.of_config")
        self.place, self.cfg, self.inference = place, place.cfg, inference
        self.family, self.opts, self.mesh = place.family, place.opts, place.mesh
        self.dp, self.tp, self.vocab_size = place.dp, place.tp, place.vocab_size
        self.specs, self.layouts = place.specs, place.layouts
        self.row_sharding, self.replicated, self.phase = place.row_sharding, place.replicated, place.phase
        self.eos_id, self.pad_id, self.batch_size, self.tokenizer = eos_id, pad_id, rows, tokenizer
        # the ids a search may choose: the tokenizer's (the embedding's rows past its vocabulary never: issue 69)
        self.n_tokens = min(len(tokenizer), self.vocab_size) if tokenizer is not None else self.vocab_size
        self.options = dataclasses.replace(decoding.Options.of_config(inference), vocab=self.n_tokens)
        # decoding's weights: int8 matmul weights when asked (modelling/quant.py)
        self.quantize = inference.quantize
        # ... and the stacks that read the prompt alone (T5's encoder) streamed from host memory a layer at a time
        # (decoder/streaming.py) when asked
        self.prompt_stacks = tuple(s.name for s in self.family.stacks[:-1]) if inference.stream_encoder else ()
        if inference.stream_encoder and not self.prompt_stacks:
            raise ConfigError(f"--stream_encoder streams an encoder's layers, and the {self.family.name} family has "
                              "no encoder (every layer decodes token by token): drop --stream_encoder (--quantize "
                              "int8 halves its weights' bytes)")
        # ... and on a CPU a shallow decoder one tree per layer on the devices (``unrolled_decoder``)
        last = self.family.stacks[-1].name
        depth = jax.tree.leaves(self.specs[last]["layers"], is_leaf=is_spec)[0].shape[0]
        platform = self.mesh.devices.flat[0].platform
        self.unrolled_stacks = (last,) if unrolled_decoder(self.family, platform, depth) else ()
        self._weights = self._abstract = None
        self._searches: dict = {}  # Options -> its search (``predict``'s, one a set of options asked)
        self._rank = None

    @property
    def layered_stacks(self) -> tuple:
        """The stacks whose layers decoding's layout holds one tree per layer: streamed, and unrolled."""
        return self.prompt_stacks + self.unrolled_stacks

    @classmethod
    def of_config(cls, cfg, tokenizer=None, mesh=None, eos: int | None = None, pad: int | None = None) -> "Decoder":
        """The decoder of a config's model (a decoding config, or a training run's: its eval twin,
        ``decoding_config``) on ``mesh`` (default: the config's dp x tp), its inference options, and the tokenizer's
        ids (none: end-of-text 1, padding 0; ``eos``, ``pad``: others, eos -1 for none)."""
        ecfg = decoding_config(cfg)
        if eos is None:
            eos = 1 if tokenizer is None else tokenizer.eos_token_id
        if pad is None:
            pad = 0 if tokenizer is None else pad_id(tokenizer)
        return cls(Placement(ecfg, mesh), ecfg.inference, eos, pad, ecfg.execution.rows_per_micro_batch, tokenizer)

    # ------------------------------------------------------------------ the weights

    @property
    def weights(self):
        """Where the weights decoded come from and how they are placed (decoder/weights.py)."""
        if self._weights is None:
            self._weights = Weights(self)
        return self._weights

    def load_params(self, directory=None, step=None, hf_model=None, base: bool = False):
        """The weights decoded, on the devices (decoder/weights.py): an HF model's, a checkpoint's, or a LoRA
        checkpoint's adapters merged into the base they were trained on; int8 with --quantize int8. ``base``: the
        base of adapters served unmerged: -> (weights, their fingerprint)."""
        return self.weights.load(directory, step, hf_model, base)

    # ------------------------------------------------------------------ decoding's layout of the weights

    def decode_specs(self) -> dict:
        """The specs of decoding's weights: a weight kept as int8 has an ``Int8`` of its values' specs and its
        scale's (its output axes'); a streamed stack's layers one tree per layer."""
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
        """ShapeDtypeStructs of decoding's weights (decoder/weights.py places them), with their shardings (made once:
        ``is_decoding_layout`` reads them at every batch)."""
        if self._abstract is None:
            self._abstract = self._abstract_decode_params()
        return self._abstract

    def _abstract_decode_params(self) -> dict:
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
        program: the whole model and its new copy on the devices at once (decoder/weights.py's ``place`` converts from
        host memory a weight at a time)."""
        targets = self.abstract_decode_params()

        def convert(x, t):
            return quant.quantize(x, t.n_in, t.lead, t.dtype) if quant.is_int8(t) else x.astype(t.dtype)

        def fn(p):
            for s in self.layered_stacks:
                layers = p[s]["layers"]
                p = {**p, s: {**p[s], "layers": [jax.tree.map(lambda w: w[i], layers)
                                                   for i in range(len(targets[s]["layers"]))]}}
            return jax.tree.map(convert, p, targets)

        return jax.jit(fn, out_shardings=jax.tree.map(lambda t: t.sharding, targets))(params)

    def _decoding(self, plain, scale, row) -> dict:
        """``decoding_tree`` with the streamed and unrolled stacks' stacked leaves split into one tree per layer
        (``row(leaf)``: a stacked leaf's per-layer one): the stream loads them one by one from host memory, an
        unrolled decoder reads each in place."""
        tree = self.decoding_tree(plain, scale)
        for stack in self.layered_stacks:
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

    # ------------------------------------------------------------------ the searches' programs

    def search(self, options: decoding.Options | None = None, seed: int | None = None):
        """The search ``options`` names (greedy, beam search, sampling: modelling/decoding.py): (weights in
        decoding's layout, ids [B, k], mask [B, k]) -> tokens [B, max_new_tokens]. Sampling draws from ``seed``, each
        row by its global index, so the outputs are the same at any dp x tp. Programs: the search (one per prompt
        width k), and where prompts are packed (``pack``) the encoder over them apart (one per packed shape).
        ``options`` and ``seed``: the inference section's by default."""
        opts, family, eos_id, pad_id = self.opts, self.family, self.eos_id, self.pad_id
        options = self.options if options is None else options
        seed = self.inference.sampling_seed if seed is None else seed

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
        data-parallel group's rows apart, into rows k, 3k/2, 2k or 4k wide, whichever reads the fewest weighted
        positions: a position costs the layer's matmuls, and a row's attention grows with its width (prompts of
        65 to 119 tokens in rows of 128 pair with none: 8 rows; in rows of 256, 3; in rows of 192, 4: as many
        positions, a quarter fewer attention pairs, the one chosen). -> (ids, segments, positions,
        where) on the devices, or None where packing would not save a tenth of the encoder's work. A group's packed
        rows are a multiple of an eighth of its rows, rounded up: at most 7 shapes (encoder programs) a width."""
        cost = self.packed_cost
        k = ids.shape[1]
        best, best_cost = None, 0.9 * cost(ids.shape[0], k)
        for width in (k, 3 * k // 2, 2 * k, 4 * k):
            packed = pack_prompts(ids, mask, groups=self.dp, width=width, multiple=-(-ids.shape[0] // self.dp // 8))
            if packed is not None and cost(packed[0].shape[0], width) < best_cost:
                best, best_cost = packed, cost(packed[0].shape[0], width)
        return None if best is None else tuple(S.put_global(x, self.row_sharding) for x in best)

    def packed_cost(self, rows: int, width: int) -> int:
        """The encoder's multiply-adds a layer over ``rows`` rows ``width`` wide (``pack``'s measure): each position's
        matmuls, and its scores and context against each key of its row."""
        m = self.cfg.model
        inner = m.attention.heads * m.attention.d_kv
        matmuls = 4 * m.hidden_size * inner + (3 if m.feed_forward_proj.startswith("gated") else 2) * \
            m.hidden_size * m.d_ff
        return rows * width * (matmuls + 2 * inner * width)

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

    def greedy_program(self, max_new_tokens: int, cached: bool = True):
        """Greedy decoding of weights in training's layout (the tests' reference): (weights, ids [B, k], mask [B, k])
        -> tokens [B, max_new_tokens]. Rows split over dp, weights over tp; ``cached=False`` runs the uncached
        reference (the whole model again for every token)."""
        opts, family, eos_id, pad_id = self.opts, self.family, self.eos_id, self.pad_id
        search = decoding.greedy if cached else decoding.greedy_uncached
        return self.phase(lambda p, ids, mask: search(family, p, ids, mask, opts, max_new_tokens, S.TP, eos_id=eos_id,
                                                      pad_id=pad_id),
                          (self.place.compute_specs(), P(S.DP, None), P(S.DP, None)), P(S.DP, None))

    # ------------------------------------------------------------------ batches of prompts

    def predict(self, params, feats: dict, progress: str = "validating", options=None) -> list:
        """Generated texts for every row of feats (input_ids/attention_mask [n, len]), in row order; ``options``:
        the search's (``self.options`` by default: a task's processors, app/predict.py's ``decoding_options``)."""
        lengths = feats["attention_mask"].sum(1)
        out = [None] * len(lengths)
        for idx in tqdm(length_buckets(lengths, self.batch_size), desc=progress, unit="batch",
                        disable=None if jax.process_index() == 0 else True):  # (process 0 shows the progress)
            for i, text in zip(idx, self.predict_batch(params, feats, idx, options=options)):
                out[i] = text
        return out

    def predict_batch(self, params, feats: dict, idx, tokens: bool = False, options=None) -> list:
        """Generated texts of rows ``idx`` of feats (at most one batch), padded to their longest prompt (a multiple
        of 8: few compilations; no prompt is ever cut); ``tokens``: their token ids [len(idx), output_length]."""
        options = self.options if options is None else options
        if options not in self._searches:
            self._searches[options] = self.search(options)
        ids, mask = batch_rows(feats, idx, self.batch_size)
        ids, mask = self.family.layout_prompts(ids, mask)  # (numpy: the program places them, packed or not)
        out = S.fetch(self._searches[options](params, ids, mask))[: len(idx)]
        return out if tokens else self.tokenizer.batch_decode(out, skip_special_tokens=True)

    def rank(self, params, feats: dict, labels: list, progress: str = "ranking") -> np.ndarray:
        """Rank classification (``decoding.label_scores``): each row's log-likelihood of each label (token id lists,
        each ending with its end-of-text token) -> float32 [n, len(labels)], in row order."""
        if self.prompt_stacks:
            raise ConfigError("--score labels reads the encoder resident on the devices: drop --stream_encoder")
        width = max(len(x) for x in labels)
        table = np.full((len(labels), width), -1, np.int32)
        for r, x in enumerate(labels):
            table[r, :len(x)] = x
        if self._rank is None:
            family, opts, pad = self.family, self.opts, self.pad_id
            self._rank = self.phase(lambda p, ids, mask, lab: decoding.label_scores(family, p, ids, mask, opts, lab,
                                                                                    S.TP, pad),
                                    (self.decode_specs(), P(S.DP, None), P(S.DP, None), P()), P(S.DP, None))
        p = params if self.is_decoding_layout(params) else self.to_decoding(params)
        lengths = feats["attention_mask"].sum(1)
        out = np.zeros((len(lengths), len(labels)), np.float32)
        for idx in tqdm(length_buckets(lengths, self.batch_size), desc=progress, unit="batch",
                        disable=None if jax.process_index() == 0 else True):
            ids, mask = self.family.layout_prompts(*batch_rows(feats, idx, self.batch_size))
            ids, mask = S.put_global(ids, self.row_sharding), S.put_global(mask, self.row_sharding)
            out[idx] = S.fetch(self._rank(p, ids, mask, jax.device_put(table, self.replicated)))[: len(idx)]
        return out

    def predict_tokens(self, params, feats: dict) -> np.ndarray:
        """Token ids [n, output_length] of every row of feats, in row order, batch after batch."""
        idx = np.arange(len(feats["input_ids"]))
        return np.concatenate([self.predict_batch(params, feats, idx[i: i + self.batch_size], tokens=True)
                               for i in range(0, len(idx), self.batch_size)])


def _lead(spec) -> int:
    """1 for a stacked layer weight (its leading ``layers`` axis), else 0."""
    return int(spec.axes[0] == "layers")


def _n_out(spec, n_in: int) -> int:
    return len(spec.shape) - _lead(spec) - n_in


def _scale_axes(spec, per_dim: tuple, n_in: int) -> tuple:
    """``per_dim`` (a weight's shape, or its per-dim mesh axes) without the weight's input dims: its scale's."""
    lead = _lead(spec)
    return tuple(per_dim[:lead]) + tuple(per_dim[lead + n_in:])
