"""Model families: what the engine, the data and the drivers need to know about a model, as one interface.

A family is one module of ``modelling/`` (``t5``, ``gptj``) holding a subclass of ``Family`` and listed
in modelling/registry.py. Nothing outside ``modelling/`` asks which family a run has: it asks the family.
The family answers for

- its kind: ``causal`` (one causal stack, prompt and target in one sequence: GPT-J) or an
  encoder-decoder (T5), and whether decoding left-pads its prompts;
- its parameters: ``param_specs`` with logical axes (partitioning/sharding.py maps them to mesh axes, so a
  family needs no sharding code), ``keeps_f32``, ``decays``, ``is_dense``, ``head_paths``;
- its stacks as data (``Stack``) and the per-device bodies of a training step (``embeddings``,
  ``context``, ``block``, ``stack_output``, ``head_loss``) that graphs/phases.py composes for both
  executors, and the batch it reads (``batch_keys``, ``batch_lengths``) and how its training rows are laid out
  (``rows``: modelling/rows.py);
- its text format: how an input and a target become token ids (``encode_inputs``, ``encode_targets``,
  ``prompt``);
- decoding: ``decode_start`` and ``decode_step`` over a KV cache, which modelling/decoding.py's searches
  (greedy, beam search, sampling) drive without knowing the model;
- its own config fields (``config_options``: T5's relative position buckets, a causal LM's rotary embedding; the
  registry adds them to the config, so config/schema.py holds only what every family shares) and the typed options
  its functions read (``options``: a ``ModelOptions`` with them);
- its config checks (``validate_config``), FLOPs per sample and its Hugging Face mapping (``hf``: one
  ``HFMapping`` object).

The parameter tree of every family has the same top level: ``shared`` (the token embedding), the
head weights, and one subtree per stack holding ``layers`` (stacked on a leading axis) and the
stack's own small weights. partitioning/tree.py owns that structure.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from config.fields import get_path
from config.schema import FIELDS
from modelling.quant import is_int8
from modelling.rows import RowFormat
from utils.errors import CheckpointError, ConfigError

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass(frozen=True)
class Stack:
    """One stack of layers, as the engine sees it."""

    name: str  # key of the stack in the parameter tree
    ids: str  # batch key of the stack's token ids
    meta: tuple  # batch keys its attention context reads (segment ids, positions)
    embed_stream: int  # dropout stream of its embedding
    layers_stream: int  # dropout stream of its layers (then folded with the layer index)
    buffer: str  # name of its activation buffer in the phased executor
    context: tuple = ()  # its own non-layer weights that the attention context reads (T5: relpos)
    cross: bool = False  # its layers attend to the previous stack's output (T5's decoder)
    output: Optional[str] = None  # its final-norm weight, whose output the next stack reads (T5's encoder)
    output_stream: int = 0  # dropout stream of that output


# --------------------------------------------------------------------------- the Hugging Face mapping


def attention_tokens(hf_inputs: dict) -> int:
    """The tokens of an HF training batch that are not padding (its attention mask's): what a step reads."""
    return int(hf_inputs["attention_mask"].sum())


def _unmapped(what: str) -> Callable:
    """A mapping function a family leaves unset: asked, it says in one line that there is no HF model to ``what``."""
    def unmapped(*args, **kwargs):
        raise CheckpointError(f"this model family has no Hugging Face model to {what}: train it from a random init "
                              "(no --hf_model) and keep its checkpoints in this project's format")

    return unmapped


@dataclass(frozen=True, eq=False)
class HFMapping:
    """A family's Hugging Face mapping, one object (``Family.hf``), next to the layers it maps: the config.json and
    the state dict both ways, and what the tests and the benchmarks need to set HF's model beside ours (its training
    batch, ``generate``'s arguments and output). What a family leaves unset, asked, says in one line that it has no
    HF model for it."""

    model_types: tuple = ()
    """The ``model_type`` values of the HF config.json files it reads (the registry's HF model types)."""

    model_config: Callable = _unmapped("read a config.json of")
    """(hf: config.json as a dict) -> our ModelConfig."""

    config_dict: Callable = _unmapped("write a config.json for")
    """(m: ModelConfig) -> the HF config.json (dict, ``architectures`` first)."""

    params: Callable = _unmapped("load weights from")
    """(sd, m, tensor_parallel=1, dtype=None) -> our tree from an HF state dict (numpy arrays or torch tensors):
    float32, or with ``dtype`` the weights the family does not keep float32 in it, each cast as it is read
    (hf_weights.kept_as)."""

    state_dict: Callable = _unmapped("export weights to")
    """(params, m) -> an HF state dict (numpy float32) of our tree; padded vocabulary stripped."""

    layer_keys: Callable = _unmapped("name the layer weights of (PEFT's format)")
    """(stack, i, m) -> {our weight name: HF state-dict key} of layer ``i`` of stack ``stack`` (modelling/lora.py names
    PEFT's adapters by them)."""

    train_inputs: Callable = _unmapped("train beside")
    """(rows, trim=False) -> padded training rows of ours (one example a row: {batch key: int [n, len]}) as HF's model
    takes them in training ({input_ids, attention_mask, labels, ...}); ``trim``: cut to the longest row (HF's
    collators' default padding). A kind's base gives it (modelling/causal.py, modelling/t5.py)."""

    nonpad_tokens: Callable = attention_tokens
    """(hf_inputs) -> the tokens of an HF training batch that are not padding (what a step reads and predicts)."""

    new_tokens: Callable = _unmapped("generate with")
    """(out [b, n], prompt_width) -> the new tokens of HF ``generate``'s output for prompts ``prompt_width`` wide: a
    causal LM's output continues its prompt; an encoder-decoder's starts with the decoder's start token."""

    generate_kwargs: dict = field(default_factory=dict)
    """What HF ``generate`` needs beside the ids to decode as the family's ``decode_start`` does."""


# --------------------------------------------------------------------------- the model's options


@dataclass(frozen=True)
class ModelOptions:
    """The config fields the model functions read, under the config's flag names (frozen, hashable: static under
    jit): every field of the config's ``model`` and ``lora`` sections, and the execution fields that shape a layer's
    program. A family reads its own options from a subclass of this (``Family.options``) that adds the fields it
    declares (``Family.config_options``); tests/modelling/test_family.py holds each family's to the config's fields."""

    family: str = "t5"
    layers: int = 24
    decoder_layers: int = 0
    hidden_size: int = 4096
    d_ff: int = 10240
    sequence_length: int = 512
    decoder_sequence_length: int = 8
    eval: bool = False
    dropout_prob: float = 0.0
    precision: str = "float32"
    seed: int = 42
    eps: float = 1e-6
    scale_ff: int = 1
    vocab_size: int = 32128
    heads: int = 64
    d_kv: int = 64
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple = ()
    # execution
    attention_serialisation: int = 1
    recompute: bool = True
    remat_policy: str = "full"
    unroll_layers: bool = False
    attention_impl: str = "auto"

    @property
    def compute_dtype(self):
        return DTYPES[self.precision]

    @classmethod
    def from_config(cls, cfg) -> "ModelOptions":
        """The options of a config: its fields, with no dropout when built for evaluation and the attention
        kernel resolved for this backend."""
        values = {f.name: get_path(cfg, FIELDS[f.name].path) for f in dataclasses.fields(cls)}
        if values["eval"]:
            values["dropout_prob"] = 0.0
        values["attention_impl"] = resolve_attention_impl(values["attention_impl"], values["precision"],
                                                          values["dropout_prob"])
        return cls(**values)


# The execution fields the model functions read; they also read every field of the config's ``model`` and ``lora``
# sections.
EXECUTION_FIELDS = ("attention_serialisation", "recompute", "remat_policy", "unroll_layers", "attention_impl")


def resolve_attention_impl(requested: str, precision: str, dropout_prob: float) -> str:
    """'auto' -> 'cudnn' on a GPU in bfloat16/float16 without dropout, else 'xla'; an explicit
    'cudnn' where it cannot run is a ConfigError naming the fix."""
    usable = jax.default_backend() == "gpu" and precision in ("bfloat16", "float16")
    if requested == "cudnn":
        if not usable:
            raise ConfigError(f"attention_impl=cudnn needs a GPU and precision bfloat16 or float16 (backend "
                              f"{jax.default_backend()}, precision {precision}): pass --attention_impl auto or xla")
        if dropout_prob > 0:
            raise ConfigError(f"attention_impl=cudnn has no attention dropout (dropout_prob={dropout_prob}): "
                              "pass --attention_impl xla, or --dropout_prob 0")
        return "cudnn"
    if requested == "auto":
        return "cudnn" if usable and dropout_prob == 0 else "xla"
    return "xla"


# --------------------------------------------------------------------------- helpers of every family


def leaf_name(path) -> str:
    """The last key of a tree path (the weight's own name)."""
    return str(getattr(path[-1], "key", path[-1]))


def cast_params(params: dict, dtype, keeps_f32) -> dict:
    """Casts the weights to the compute dtype, except those ``keeps_f32(name)`` keeps float32 (norms...) and int8
    ones (modelling/quant.py: read in the compute dtype inside their matmuls)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if is_int8(x) or keeps_f32(leaf_name(p)) else x.astype(dtype), params, is_leaf=is_int8)


def left_align(ids: np.ndarray, mask: np.ndarray) -> tuple:
    """Right-padded prompt rows -> left-padded ones (each row's tokens moved to its end), for decoding a causal
    LM, whose generated tokens follow the prompt's last token. ids, mask [b, n] -> (ids, mask) [b, n]."""
    n = mask.shape[1]
    shift = n - (mask > 0).sum(1)
    cols = (np.arange(n)[None, :] - shift[:, None]) % n
    return np.take_along_axis(ids, cols, 1), np.take_along_axis(mask, cols, 1)


def rng(key, *data):
    """A key folded with streams (and a layer index); None stays None (no dropout)."""
    if key is None:
        return None
    for d in data:
        key = jax.random.fold_in(key, d)
    return key


# --------------------------------------------------------------------------- the interface


class Family(abc.ABC):
    """A model family as everything outside ``modelling/`` sees it (see the module docstring). Its questions come in
    five groups; what every family of a kind answers alike has its default here or in the kind's base
    (modelling/causal.py's ``CausalLM``; T5 is the encoder-decoder), so a family module writes only what differs.

    what it is       name, stacks, shape_fields, rows (its training rows), batch_keys, batch_lengths,
                     validate_config, forward_flops, decode_step_flops; its own config fields (config_options) and
                     the options its functions read (options: a ModelOptions with them)
    its weights      param_specs, keeps_f32, decays, is_dense, head_paths, lora_targets, residual_outputs
    its bodies       embeddings, context, block, stack_output, head_loss (graphs/phases.py composes them for
                     both executors); optional: forward, the reference composition the parity tests read
    its text         prompt, encode_inputs, encode_targets, layout_prompts
    its decoding     decoding_params, decode_start, decode_step, reorder_beams; optional:
                     decode_uncached, the reference the tests hold the cached decoding to; decode_start_packed,
                     cache_positions and first_token_column, serving's slots
    Hugging Face     hf, its ``HFMapping`` (model types, config.json and state dict both ways, layer keys, HF's
                     training batch and ``generate`` beside ours); a family without an HF model says so, one line,
                     when asked for one
    """

    name: str  # its ``model.family`` value
    hf: HFMapping = HFMapping()  # its Hugging Face mapping (none by default)
    causal: bool  # one causal stack: a prompt and its target are one sequence (else an encoder-decoder)
    left_pad_prompts: bool = False  # decoding continues each prompt from its last token: prompts right-aligned
    scores_prompts: bool = False  # ``prompt_logits`` gives its prompt's own log-probabilities (a causal LM's)
    decoder_start: int = 0  # the token an encoder-decoder's decoder reads first (what its processors see before the
    # new tokens, as HF's decoder_input_ids; a causal LM's decoder reads its prompt)
    stacks: tuple  # its Stacks, in forward order
    head_stream: int  # the dropout stream of the head
    batch_keys: tuple  # the keys of a training batch it reads
    rows: RowFormat  # how its training rows are laid out (modelling/rows.py): the data path calls it
    shape_fields: tuple  # the config's model-shape flags (config.MODEL_SHAPE) it reads: what a checkpoint carries
    lora_targets: tuple = ()  # the layer weights that get adapters by default (PEFT's default for the model type)
    residual_outputs: tuple = ()  # the layer weights whose output is the residual stream (row-parallel under tp)
    config_options: tuple = ()  # its own config fields: frozen dataclasses of ``spec`` fields, each naming the config
    # section it joins (``section``: "model.attention"); config/schema.py's add_options adds them (registry.py)
    options: type = ModelOptions  # what its model functions read: ModelOptions and its config_options' fields

    @property
    def continues_prompt(self) -> bool:
        """Whether its output continues its prompt's text (a causal LM's: its first new token follows the prompt's
        last, so its text is read after the prompt's, a leading space kept); an encoder-decoder's answer is a text
        of its own."""
        return self.causal

    def options_of(self, cfg) -> ModelOptions:
        """The options its model functions read, of a config (``options.from_config``)."""
        return self.options.from_config(cfg)

    # ------------------------------------------------------------------ what it is

    @abc.abstractmethod
    def batch_lengths(self, cfg) -> dict:
        """{batch key: row length} of a training batch as the loader builds it."""

    def validate_config(self, cfg) -> None:
        """ConfigError (naming the field and the fix) for what only this family knows to be wrong."""

    @abc.abstractmethod
    def forward_flops(self, m, encoder_length: int, decoder_length: int) -> int:
        """Matmul FLOPs (2 per multiply-add) of one sample's forward pass."""

    @abc.abstractmethod
    def decode_step_flops(self, m) -> int:
        """Matmul FLOPs of one row's decoding step (one new token, its cache holding the rest): every weight that
        multiplies the token once, the LM head, and the token's self-attention scores and context over itself; those
        over the cache (and T5's cross-attention's over the prompt), which grow with their lengths, are not counted
        (at width 256 and a 48-token prompt, T5's cross-attention adds about 3%)."""

    # ------------------------------------------------------------------ its weights

    @abc.abstractmethod
    def param_specs(self, m, tensor_parallel: int = 1) -> dict:
        """The spec tree of a model config section (modelling/params.py's ParamSpecs), vocab padded for tp."""

    @abc.abstractmethod
    def keeps_f32(self, name: str) -> bool:
        """Whether a weight stays float32 in the compute copy (norms, tables)."""

    def decays(self, name: str) -> bool:
        """Whether weight decay applies to a weight: every weight the compute dtype changes."""
        return not self.keeps_f32(name)

    def is_dense(self, name: str) -> bool:
        """Whether a layer weight is a matmul weight (its gradient accumulates inside the weight-gradient GEMM)."""
        return not self.keeps_f32(name)

    @abc.abstractmethod
    def head_paths(self, opts) -> tuple:
        """The tree paths of the weights the head phase reads."""

    def compute_params(self, params: dict, opts) -> dict:
        """The weights in the compute dtype (this family's float32 weights kept)."""
        return cast_params(params, opts.compute_dtype, self.keeps_f32)

    # ------------------------------------------------------------------ its bodies (graphs/phases.py)

    @abc.abstractmethod
    def embeddings(self, shared, ids, opts, tp_axis, rng=None):
        """shared [Vl, d], ids int [b, l] -> float32 [b, l, d], identical over tp."""

    @abc.abstractmethod
    def context(self, stack: Stack, ctx_w: dict, meta: dict, length: int, opts) -> tuple:
        """(self-attention context, cross-attention context or None) of a micro-batch."""

    @abc.abstractmethod
    def block(self, stack: Stack, p, x, self_ctx, cross_ctx, enc, opts, tp_axis, rng=None):
        """One layer of a stack: x float32 [b, l, d] -> float32 [b, l, d]."""

    def stack_output(self, stack: Stack, w, x, opts, rng=None):
        """A stack's output norm, for a stack whose output the next one reads."""
        raise NotImplementedError(f"the {self.name} stack {stack.name} has no output norm")

    @abc.abstractmethod
    def head_loss(self, head_p, x, labels, opts, tp_axis, rng=None):
        """Final norm + LM head + vocab-sharded cross entropy, summed over the tokens (labels -100 ignored)."""

    def forward(self, params: dict, batch: dict, opts, tp_axis=None, rng=None):
        """The whole model on a batch -> float32 logits [b, l, Vl] (this device's vocab slice): the reference
        composition the parity tests hold a family to (nothing in a run reads it)."""
        raise NotImplementedError(f"the {self.name} family has no reference forward")

    # ------------------------------------------------------------------ its text

    def prompt(self, text: str) -> str:
        """The text the model reads for an input (a causal LM: followed by ``target:``, which it continues)."""
        return text

    @abc.abstractmethod
    def encode_inputs(self, tokenizer, texts: list) -> list:
        """Token ids of inputs (already ``prompt``-ed), as the model reads them."""

    @abc.abstractmethod
    def encode_targets(self, tokenizer, texts: list) -> list:
        """Token ids of targets, each ending where decoding stops (the end-of-text token)."""

    def layout_prompts(self, ids: np.ndarray, mask: np.ndarray) -> tuple:
        """Right-padded prompt rows (ids, mask [b, n], numpy) as decoding reads them: as they are, or right-aligned
        (``left_align``) where decoding continues each prompt from its last token (``left_pad_prompts``)."""
        return left_align(ids, mask) if self.left_pad_prompts else (ids, mask)

    # ------------------------------------------------------------------ its decoding (modelling/decoding.py)

    def decoding_params(self, params: dict, opts):
        """What ``decode_start`` and ``decode_step`` read, prepared once outside the decoding loop: the compute copy
        (every stack's layers stay stacked: the steps scan over them)."""
        return self.compute_params(params, opts)

    @abc.abstractmethod
    def decode_start(self, params, input_ids, attention_mask, opts, max_new_tokens: int, tp_axis=None) -> tuple:
        """Reads the prompts (the encoder, or a causal LM's prefill) -> (logits [b, Vl] of the first new token,
        cache: a tree whose every leaf has the batch as its leading axis, a leaf of every layer [b, layers, ...]).
        ``params``: ``decoding_params``'."""

    packs_prompts: bool = False  # its encoder reads prompts packed several to a row (``encode_packed``)
    # its decoding steps also take the last stack one tree per layer (a list), running the layers one after the other
    # (decoder/decoder.py's ``unrolled_decoder``: on a CPU), its cache then one tree per layer too
    unrolls_decoding: bool = False

    def encode_packed(self, params, ids, segments, positions, opts, tp_axis=None):
        """The prompt stacks' output for prompts packed several to a row (modelling/rows.py's ``pack_prompts``):
        ids/segments/positions [P, W] -> float32 [P, W, d]; ``params``: ``decoding_params``' compute copy. A family
        that packs no prompts (``packs_prompts`` False) has none."""
        raise NotImplementedError(f"the {self.name} family reads no packed prompts")

    def decode_start_encoded(self, params, encoded, attention_mask, opts, max_new_tokens: int, tp_axis=None) -> tuple:
        """``decode_start`` from the output of the stacks that read the prompt and nothing else (T5's encoder; read
        a layer at a time from host memory by decoder/streaming.py), float32 [b, k, d] -> (logits, cache). A family
        whose every stack decodes token by token (a causal LM) has none."""
        raise NotImplementedError(f"the {self.name} family has no stack that reads the prompt alone (an encoder)")

    @abc.abstractmethod
    def decode_step(self, params, token, i, cache, opts, tp_axis=None) -> tuple:
        """New token ``i`` (0-based) int [b] -> (logits [b, Vl] of the next, cache). ``i``: one index for the whole
        batch, or int [b], one per row (serving's slots, each at its own position)."""

    def decode_uncached(self, params, input_ids, attention_mask, tokens, opts, tp_axis=None):
        """The reference: logits [b, Vl] after the prompts and the tokens generated so far (int [b, n]), by running
        the whole model again (modelling/decoding.py's ``greedy_uncached``, which the tests hold the cached decoding
        to; nothing in a run reads it)."""
        raise NotImplementedError(f"the {self.name} family has no uncached reference decoding")

    def prompt_logits(self, w, input_ids, attention_mask, opts, tp_axis=None):
        """Logits [b, k, Vl] at each prompt position (ids/mask [b, k] laid out for decoding; w:
        ``decoding_params``) of the token after it: a causal LM's score of its own prompt (``scores_prompts``). An
        encoder-decoder reads its prompt with the encoder, which predicts no token of it: none."""
        raise NotImplementedError(f"the {self.name} family reads its prompt with an encoder: it gives no "
                                  "log-probabilities of the prompt's tokens")

    def decode_start_packed(self, params, ids, segments, positions, where, lengths, opts, max_new_tokens: int,
                            tp_axis=None) -> tuple:
        """``decode_start`` of prompts packed several to a row, as serving's inserts read them: ids/segments/positions
        [R, W] (modelling/rows.py's packed rows: segment ids from 1, positions restarting at 0 in each prompt),
        ``where`` int [J, W] each prompt's positions in the rows flattened (R * W past its ``lengths`` [J]) -> (logits
        [J, Vl] of each prompt's first new token, the cache of J rows with room for prompts W wide), every row
        decoding at its own position (``decode_step`` with ``i`` int [J]) from ``first_token_column``."""
        raise NotImplementedError(f"the {self.name} family has no cache for serving slots (decode_start_packed)")

    def cache_positions(self, cache):
        """The axis of each of the cache's leaves along which a decoding step writes and reads its positions (-1: a
        leaf it only reads whole, as T5's cross-attention keys), a tree of the cache's make: serving's slots attend
        over a prefix of those positions only (``cache_span``). None: the family's steps always read all of it."""
        return None

    def first_token_column(self, prompt_length: int) -> int:
        """The cache column (along ``cache_positions``) that a row's first new token is written at when it is fed
        back, new token i at that + i, for a row whose prompt of ``prompt_length`` tokens ``decode_start_packed``
        read."""
        raise NotImplementedError(f"the {self.name} family has no cache for serving slots")

    def reorder_beams(self, cache, rows: jax.Array):
        """Beam search's cache after a step: row ``rows[j]`` of ``cache`` becomes row j, where ``rows`` only moves a
        row within its prompt's block of beams (a beam's parent is a beam of the same prompt). Every leaf by default;
        a family whose cache holds parts that are equal for all beams of a prompt (T5's cross-attention keys) leaves
        those where they are."""
        return jax.tree.map(lambda x: jnp.take(x, rows, axis=0), cache)

    def __repr__(self) -> str:
        return f"<family {self.name}>"
