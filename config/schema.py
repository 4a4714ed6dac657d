"""The config's schema: typed nested dataclasses, one per section, each field declared with what it means (the
string under it, also its --help text) and what it accepts (``spec``), the properties derived from them, and
``Config.validate``, which checks every field against its declaration and the fields against each other.

Field names follow the original PopXL Flan-T5 application (``layers``, ``hidden_size``, ``micro_batch_size``, ...).
config/fields.py reads the declarations (flat flags, coercion); config/presets.py resolves the YAML presets;
config/carry.py says what a checkpoint carries.
"""

from __future__ import annotations

import math
import string
import typing
from dataclasses import dataclass, field
from typing import Optional

from config.fields import coerce, extend_section, get_path, leaf_fields, set_path, spec
from utils.errors import ConfigError

@dataclass
class Embedding:
    """Configuration of the token embedding."""

    vocab_size: int = spec(32128, minimum=1, shape=True)
    """Number of entries in the word vocabulary (padded up to a multiple of tensor_parallel inside the model)."""


@dataclass
class Attention:
    """Configuration of the attention layers. A model family adds its own fields here (T5's relative position
    buckets, a causal family's rotary embedding and key/value heads): modelling/family.py's ``Family.config_options``,
    added by ``add_options`` when modelling/registry.py lists the family."""

    heads: int = spec(64, minimum=1, shape=True)
    """Number of attention heads (must be divisible by tensor_parallel)."""

    d_kv: int = spec(64, minimum=1, shape=True)
    """Size of the q, k, v projection of each head."""


@dataclass
class ModelConfig:
    """Size and numerics of the model. A model family adds its own fields here (T5's feed-forward kind and tied
    head) and to ``attention`` (T5's relative position buckets, a causal family's rotary embedding): see
    ``Attention``."""

    family: str = spec("t5", shape=True)
    """Model family, one of modelling/registry.py's: t5 (T5 v1.0/v1.1, Flan-T5, mT5, UL2; an encoder-decoder), umt5
    (UMT5: T5 with a relative position table in every layer) or gptj (GPT-J; a causal LM). The family checks the
    fields only it knows (its variants, its shapes)."""

    layers: int = spec(24, minimum=1, shape=True)
    """Number of encoder blocks, and of decoder blocks unless decoder_layers says otherwise (hf: num_layers)."""

    decoder_layers: int = spec(0, minimum=0, shape=True)
    """Number of decoder blocks of an encoder-decoder when it differs from layers (hf: num_decoder_layers); 0: as
    many as layers."""

    hidden_size: int = spec(4096, minimum=1, shape=True)
    """Width of the residual stream (hf: d_model)."""

    d_ff: int = spec(10240, minimum=1, shape=True)
    """Inner width of the feed-forward blocks (must be divisible by tensor_parallel)."""

    sequence_length: int = spec(512, minimum=1)
    """Encoder length in tokens: prompts are padded or truncated to it."""

    decoder_sequence_length: int = spec(8, minimum=1, training=True)
    """Decoder length in tokens for training (the original padded targets to sequence_length; MNLI labels need 4)."""

    eval: bool = False
    """Build for inference or validation: no dropout, no optimizer."""

    dropout_prob: float = spec(0.0, bounds=(0.0, 1.0, True, False, "0.1"), training=True)
    """Dropout probability in training."""

    precision: str = spec("float32", choices=("float32", "bfloat16", "float16"))
    """Compute dtype: float32, bfloat16 or float16 (master weights, norms and softmax stay float32). float32's matrix
    products are full float32 on every device, as HF's are (JAX's default would use TF32 on a recent NVIDIA GPU);
    JAX_DEFAULT_MATMUL_PRECISION in the environment overrides that."""

    seed: int = 42
    """Seed of parameter initialisation, dropout and data shuffling."""

    eps: float = spec(1e-6, bounds=(0.0, 1.0, False, False, "1e-6"), shape=True)
    """Epsilon of the RMS norms (Flan-T5 checkpoints use 1e-6)."""

    scale_ff: int = spec(1, minimum=1)
    """Divide before the feed-forward down-projection and multiply back in float32 (float16 overflow guard)."""

    embedding: Embedding = field(default_factory=Embedding)
    attention: Attention = field(default_factory=Attention)

    @property
    def decoder_depth(self) -> int:
        """Number of decoder blocks of an encoder-decoder."""
        return self.decoder_layers or self.layers


@dataclass
class LearningRate:
    """The learning-rate schedule: linear warm-up, then constant."""

    maximum: float = spec(5e-6, flag="learning_rate", bounds=(0.0, 1.0, False, True, "1e-4"))
    """Peak learning rate."""

    warmup_steps: int = spec(10, minimum=0)
    """Steps of linear warm-up from 0 to the maximum."""


@dataclass
class Optimizer:
    """Optimizer and its hyper-parameters."""

    name: str = spec("adamw", flag="optimizer", choices=("adamw", "adafactor"))
    """adamw, or adafactor to save optimizer memory."""

    learning_rate: LearningRate = field(default_factory=LearningRate)

    beta1: Optional[float] = spec(None, bounds=(0.0, 1.0, True, False, "0.9"))
    """First-moment decay: Adam's beta1 (unset: 0.9); Adafactor keeps a first moment only when it is set
    (unset: none, T5X's default, which saves a weight-sized state)."""

    beta2: float = spec(0.999, bounds=(0.0, 1.0, True, False, "0.999"))
    """Adam beta2."""

    weight_decay: float = spec(0.01, bounds=(0.0, 1.0, True, True, "0.01"))
    """Decoupled weight decay (not applied to norms or biases)."""

    gradient_clipping: float = spec(1.0, bounds=(0.0, float("inf"), True, False, "1.0"))
    """Global-norm gradient clipping threshold; 0 disables it."""


@dataclass
class Training:
    """The training run."""

    steps: int = spec(500, minimum=0)
    """Number of optimizer steps."""

    global_batch_size: int = spec(128, minimum=1)
    """Samples that contribute to one optimizer step."""

    stochastic_rounding: bool = False
    """Keep the master weights in the compute dtype (bfloat16 or float16: half the bytes of float32) and round every
    optimizer update to it stochastically, so that updates smaller than the dtype's spacing still move the weights on
    average; the update itself and the optimizer state stay float32. Needs precision bfloat16 or float16."""

    optimizer: Optimizer = field(default_factory=Optimizer)

    eval_every: int = spec(0, minimum=0)
    """Every this many steps, decode eval_rows held-out examples (the task's held-out rows, else its validation split)
    and log the task's scores to metrics.jsonl, W&B and the loss plot; the best step is named at the end (0: never).
    The training's data order and exact resume are unchanged."""

    eval_rows: int = spec(256, minimum=1)
    """Examples decoded by each --eval_every evaluation (the first of the held-out set)."""


@dataclass
class Execution:
    """How the model is executed on the devices."""

    micro_batch_size: int = spec(1, minimum=1)
    """Samples per device in one gradient-accumulation step."""

    data_parallel: int = spec(1, minimum=1)
    """Number of data-parallel replicas (mesh axis 'dp')."""

    tensor_parallel: int = spec(1, minimum=1)
    """Number of devices a layer is split over (mesh axis 'tp')."""

    device_iterations: int = spec(1, minimum=1, ipu=True)
    """IPU-only (steps per host call of the original's device loop); kept so the original's configs load. Must be 1:
    any other value is refused, not ignored."""

    io_tiles: int = spec(1, ipu=True)
    """IPU-only; kept so the original's configs load. No effect here."""

    available_memory_proportion: tuple = spec((0.28,), ipu=True)
    """IPU-only; kept so the original's configs load. No effect here."""

    loss_scaling: Optional[float] = spec(None, bounds=(0.0, float("inf"), False, False, "32768"), training=True)
    """Loss scale: the loss is multiplied by it and the gradients divided by it, so that small gradients survive
    float16. Static, or with dynamic_loss_scaling the starting scale. Unset: 1 (no scaling), or 2**15 where dynamic
    scaling starts."""

    dynamic_loss_scaling: Optional[bool] = None
    """Adjust the loss scale during the run: a step whose gradients overflow (inf or nan) is skipped (weights and
    optimizer state untouched) and the scale halved; after loss_scale_window good steps in a row it is doubled.
    Unset: on for float16, off for float32 and bfloat16 (whose range is float32's)."""

    loss_scale_window: int = spec(1000, minimum=1, training=True)
    """Dynamic loss scaling: good steps in a row after which the scale is doubled."""

    max_skipped_steps: int = spec(16, minimum=1, training=True)
    """Dynamic loss scaling: steps skipped for overflow in a row after which the run stops as diverged (a run whose
    every step overflows is broken, not unlucky); without dynamic scaling the first non-finite step stops it."""

    attention_serialisation: int = spec(1, minimum=1)
    """Split the attention queries into this many chunks, each rematerialised on its own."""

    recompute: bool = spec(True, training=True)
    """Rematerialise each block's activations in the backward pass."""

    remat_policy: str = spec("full", choices=("full", "save_dots"), training=True)
    """With recompute: full (a layer's backward recomputes its forward from the layer's input: least memory) or
    save_dots (the matmul outputs are kept, the cheap elementwise work and attention recomputed: more memory,
    less recomputation). The phased executor always recomputes fully."""

    attention_impl: str = spec("auto", choices=("auto", "xla", "cudnn"))
    """Self-attention kernel: xla (einsums + softmax), cudnn (fused flash attention via
    jax.nn.dot_product_attention; GPU, bfloat16/float16, no dropout), or auto (cudnn where it
    applies, else xla)."""

    unroll_layers: bool = spec(False, training=True)
    """Trace each layer of a stack on its own instead of scanning over the stacked weights: a larger
    program and a longer compile; on CPU about 10% faster training at small shapes without recompute."""

    rts: bool = spec(True, training=True)
    """Replicated tensor sharding: store weights, gradients and optimizer state sharded over their replica group."""

    phased: bool = spec(False, training=True)
    """Phased execution: weights and optimizer state live on the host, streamed in one layer at a time."""

    compute_copy: bool = spec(True, training=True)
    """Phased execution with float32 master weights and a 16-bit compute dtype: keep each weight's compute-dtype
    copy in host memory beside its master, written by each update, and have the forward and the backward read it
    (2 bytes a weight where the master takes 4: a third less over the host link a step, for 2 bytes a weight more of
    host memory). false: they read the float32 masters and cast them on the device. No effect on what is computed."""

    update_in_backward: bool = False
    """Phased execution: update each layer right after its backward (its gradient is complete then, and its
    weights are already on the device), so the layers' gradients never go to host memory (a model's worth of them
    in the compute dtype). Gradient clipping then uses the previous step's global norm (the first step is not
    clipped), in the fused executor too, so that both still agree. Not with dynamic loss scaling: a step that
    overflows could no longer be skipped whole."""

    @property
    def rows_per_micro_batch(self) -> int:
        """Rows of one micro-batch over all replicas: micro_batch_size * data_parallel (a training micro-batch, a
        batch of validation's prompts, the serving slots' default)."""
        return self.micro_batch_size * self.data_parallel


@dataclass
class Checkpoint:
    """Loading and saving of checkpoints."""

    load: Optional[str] = None
    """Checkpoint directory (or glob, for validation) to load."""

    save: Optional[str] = spec(None, training=True)
    """Directory to save checkpoints to."""

    steps: Optional[int] = spec(None, flag="checkpoint_steps", minimum=0, training=True)
    """Save a checkpoint every this many steps (0: only at the end; unset: every tenth of the run when --save is
    given). An interrupted run (Ctrl-C, SIGTERM) also saves the step it finished, and with eval_every an evaluated
    step that is the best so far is saved too."""

    to_keep: int = spec(4, minimum=0, training=True)
    """Number of this run's checkpoints to keep: older steps are deleted once a newer one is complete (0: keep
    all), except the best --eval_every step's. Only this project's step folders are ever deleted; other folders in
    the directory are left alone."""

    optim_state: bool = spec(True, training=True)
    """Include the optimizer state in checkpoints."""


@dataclass
class Data:
    """Where the data and the tokenizer come from."""

    dataset: str = spec("glue/mnli", travels=True)
    """Where the rows come from: a local jsonl/json/csv/tsv/parquet file, a directory of split files
    (train.jsonl, validation.jsonl ...), a directory written by datasets' save_to_disk, a Hugging Face hub data set
    name (with hub_config; glue/mnli is MNLI's), or one this project generates offline: synthetic (NLI),
    synthetic-mnli (the same with MultiNLI-like lengths), synthetic-headlines (free text)."""

    hub_config: Optional[str] = spec(None, travels=True)
    """The configuration of a hub data set (datasets.load_dataset(dataset, hub_config)), e.g. mnli of nyu-mll/glue."""

    train_split: str = spec("train", training=True, travels=True)
    """Split used by training."""

    holdout: int = spec(0, minimum=0, training=True, travels=True)
    """Rows of the training split held out of training (the last ones of a fixed shuffle of the seed): --eval_every
    and validation of the run's checkpoints score them unless told otherwise (0: none; the task's split is
    scored)."""

    tokenizer: str = spec("google/flan-t5-xxl", travels=True)
    """Hugging Face tokenizer name or directory, 'synthetic' for the offline word-level tokenizer, or 'train' to
    learn one from the training data (offline, seconds; saved with the run, and used by validation)."""

    hf_model: Optional[str] = None
    """Hugging Face model name or directory to initialise the weights from (random init if unset)."""

    split: str = spec("validation_mismatched", travels=True)
    """Split used by validation (and by the evaluations during training, eval_every, when nothing is held out)."""

    packing: bool = spec(True, training=True)
    """Pack several training examples into each row of sequence_length tokens (segment ids and per-segment
    positions keep them apart); false pads every example to its own row, as the original. global_batch_size
    then counts rows, not examples."""

    causal_packing: str = spec("segments", choices=("segments", "concat"), training=True)
    """GPT-J with packing: segments (each example keeps its own attention and rotary positions, which restart
    at 0: the loss equals the unpacked one) or concat (the original's: examples concatenated and cut into rows
    of sequence_length, attending across example boundaries, as Hugging Face's run_clm)."""

    loss_tokens: str = spec("target", choices=("all", "target"), training=True)
    """A causal LM (GPT-J): the tokens the loss counts: target (the target and its end-of-text after 'target:')
    or all (every next token, the prompt's too: the original's, which its MNLI presets keep)."""

    packed_decoder_length: int = spec(0, minimum=0, training=True)
    """Decoder length of a packed row, shared by the targets of all its examples (0: sequence_length // 8,
    at least decoder_sequence_length). Each target is first cut to decoder_sequence_length, as unpacked."""

    cache_dir: Optional[str] = None
    """Where data read and tokenized once is kept for every later run, resume and validation (unset:
    $FLAN_T5_CACHE, else ~/.cache/flan_t5)."""

    num_proc: int = spec(0, minimum=0)
    """Worker processes that read and tokenize a large source (0: as many as the cores; a small source is read by
    the run itself)."""


@dataclass
class Task:
    """What the model learns: how a row of the data becomes an input and a target, and how decoded outputs are
    scored. The defaults are MNLI's (the original's task); a task of your own sets these (a task: section of a
    preset, or the flags)."""

    name: str = spec("mnli", flag="task_name")
    """The task's name, in reports and metrics."""

    input_template: str = "mnli hypothesis: {hypothesis} premise: {premise}"
    """The input: a template over the row's columns ({column} fields, Python's format syntax)."""

    input_column: Optional[str] = None
    """The input: one column as it is, in place of input_template."""

    target_column: str = "label"
    """The column that holds the target: free text, or with labels a label."""

    labels: Optional[tuple] = spec(("entailment", "neutral", "contradiction"), items=str)
    """The label set: the target column holds a label (its index, 0 the first word, or the word itself; -1 marks an
    unlabelled row, which is dropped) and the model learns to write its word. none: the target column is free
    text."""

    metrics: tuple = spec((), items=str, choices=("accuracy", "exact_match", "rouge", "bleu", "chrf"))
    """How decoded outputs are scored: accuracy (a label set; with per-class counts), exact_match, rouge
    (ROUGE-1/2/L F1 of the rouge-score package), bleu, chrf (sacrebleu); several at once. Unset: accuracy with
    labels, else exact_match and rouge."""


MIXTURE_KEYS = ("name", "dataset", "hub_config", "train_split", "split", "holdout", "input_template", "input_column",
                "target_column", "labels", "metrics")


@dataclass
class Mixture:
    """Several tasks trained at once (T5's mixtures): each with its own data, template, target, labels and metrics,
    mixed by rates. Empty: the run has one task (the task: section and the data: section's dataset)."""

    tasks: tuple = spec((), flag="mixture", items=dict, travels=True)
    """The mixture's tasks: each a preset's name (its task: section and its dataset, hub_config, train_split, split
    and holdout) or a mapping of those keys (on the command line in YAML's flow style, e.g. "{name: qa, dataset:
    qa.jsonl, input_column: question, target_column: answer, labels: none}"); none: no mixture."""

    rates: tuple = spec((), flag="mixture_rates", travels=True)
    """Each task's rate, in the order of the tasks: its share of the training examples is its rate over their sum
    (unset: examples-proportional, each task's rate its number of training examples, at most mixture_cap)."""

    cap: int = spec(0, flag="mixture_cap", minimum=0, travels=True)
    """Examples-proportional mixing: a task's rate is the smaller of its training examples and this (T5's K; 0: no
    cap)."""


@dataclass
class Lora:
    """Low-rank adapters (LoRA, as Hugging Face PEFT defines them): the base weights frozen in the compute dtype, and
    for each adapted weight W [in, out] two small trained matrices A [in, rank] and B [rank, out], the layer computing
    x W + (alpha / rank) (dropout(x) A) B. Only the adapters get gradients, optimizer state and checkpoints."""

    rank: int = spec(0, flag="lora_rank", minimum=0, shape=True)
    """The adapters' rank (0: no adapters: every weight is fine-tuned)."""

    alpha: float = spec(16.0, flag="lora_alpha", bounds=(0.0, 1e6, False, True, "16"), shape=True)
    """The adapters' scaling is alpha / rank (PEFT's lora_alpha)."""

    dropout: float = spec(0.0, flag="lora_dropout", bounds=(0.0, 1.0, True, False, "0.05"), training=True)
    """Dropout on the adapters' input (PEFT's lora_dropout)."""

    targets: tuple = spec((), flag="lora_targets", items=str, shape=True)
    """The layer weights that get adapters, by the parameter tree's names (T5: q, k, v, o, the decoder's cross
    attention cq, ck, cv, co, the feed-forward wi_0, wi_1 or wi, wo; GPT-J: q, k, v, o, fc_in, fc_out). Unset: the
    family's attention projections."""


@dataclass
class Inference:
    """Decoding: greedy (the original's), beam search or sampling, each as Hugging Face generate defines it."""

    output_length: int = spec(5, minimum=1, travels=True)
    """Maximum number of tokens to generate (HF: max_new_tokens); a sequence stops earlier at its end-of-text."""

    num_beams: int = spec(1, minimum=1)
    """Beam search with this many beams (1: greedy, or sampling)."""

    length_penalty: float = spec(1.0, bounds=(-10.0, 10.0, True, True, "1.0"))
    """Beam search: a finished sequence's score is its log-probability divided by its length to this power (> 0
    favours longer sequences)."""

    early_stopping: str = spec("false", choices=("true", "false", "never"))
    """Beam search: true (stop once num_beams sequences are finished), false (stop once no running beam can be
    better, by HF's heuristic) or never (run until no better sequence is possible)."""

    do_sample: bool = False
    """Sample each token from the model's distribution (after temperature, top_k, top_p) instead of taking the
    most likely."""

    temperature: float = spec(1.0, bounds=(0.0, 100.0, False, True, "0.7"))
    """Sampling: the logits are divided by it (< 1: sharper, > 1: flatter)."""

    top_k: int = spec(50, minimum=0)
    """Sampling: only the k most likely tokens (0: all), as HF's default of 50."""

    top_p: float = spec(1.0, bounds=(0.0, 1.0, False, True, "0.9"))
    """Sampling: only the most likely tokens whose probabilities sum to top_p (nucleus sampling; 1: all)."""

    sampling_seed: int = 0
    """Sampling: the seed of the draws (the same seed, the same outputs, at any dp x tp)."""

    quantize: str = spec("none", choices=("none", "int8"))
    """Decoding's weights: none (as trained, in the compute dtype) or int8 (every matmul weight and the LM head as
    int8 with a float32 scale per output channel, absmax, converted inside the matmul: half the device bytes of
    bfloat16 weights; modelling/quant.py). The evaluations during training decode as trained unless this is set."""

    stream_encoder: bool = False
    """Encoder-decoder models: the encoder's layers stay in host memory and are streamed to the device one at a
    time for each batch of prompts (as phased training streams them), the decoder and the KV cache resident: a
    device then holds the decoder's weights and one encoder layer. For models whose weights, with the KV cache, do
    not fit a device (Flan-UL2 on 24 GB: --plan says)."""

    repetition_penalty: float = spec(1.0, bounds=(0.0, 100.0, False, True, "1.2"))
    """HF's repetition penalty: each token the decoder has read (a causal LM's prompt and its output, an
    encoder-decoder's output) has its score divided by it where positive, multiplied where negative (1: off)."""

    no_repeat_ngram_size: int = spec(0, minimum=0)
    """HF's no_repeat_ngram_size: no n-gram of this size occurs twice in what the decoder has read (0: off)."""

    bad_words: tuple = spec((), items=str)
    """Words never written (HF's bad_words_ids: each word's tokens, alone and after a space, banned as a
    sequence)."""

    constrain: str = spec("none", choices=("none", "labels"))
    """labels: a label task's answers restricted to its label set (a token trie: HF's prefix_allowed_tokens_fn),
    greedy, sampling or beam search."""

    score: str = spec("none", choices=("none", "labels"))
    """labels (validation): also rank each example's labels by their log-likelihood and score the most likely
    (rank classification, as SeqIO and T5X score a label task), beside the decoded answers' scores."""

    regex: Optional[str] = None
    """A regular expression every answer matches (a grammar: xgrammar), greedy or sampling."""

    json_schema: Optional[str] = None
    """A JSON schema file every answer is valid JSON against (a grammar: xgrammar), greedy or sampling."""


@dataclass
class Config:
    """The whole configuration of a run: the model, training, execution, checkpoints, data and decoding."""

    model: ModelConfig = field(default_factory=ModelConfig)
    training: Training = field(default_factory=Training)
    execution: Execution = field(default_factory=Execution)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    data: Data = field(default_factory=Data)
    task: Task = field(default_factory=Task)
    mixture: Mixture = field(default_factory=Mixture)
    lora: Lora = field(default_factory=Lora)
    inference: Inference = field(default_factory=Inference)

    @property
    def gradient_accumulation(self) -> int:
        """Micro-batches accumulated per optimizer step on each replica."""
        return self.training.global_batch_size // self.execution.rows_per_micro_batch

    @property
    def decoder_row_length(self) -> int:
        """Decoder tokens of a training row: decoder_sequence_length, or with packing the packed row's."""
        m = self.model
        if not self.data.packing:
            return m.decoder_sequence_length
        return self.data.packed_decoder_length or max(m.decoder_sequence_length, m.sequence_length // 8)

    @property
    def dynamic_loss_scaling(self) -> bool:
        """Whether the loss scale is dynamic: execution.dynamic_loss_scaling, unset meaning float16 only."""
        d = self.execution.dynamic_loss_scaling
        return self.model.precision == "float16" if d is None else d

    @property
    def initial_loss_scale(self) -> float:
        """The loss scale of the first step: execution.loss_scaling, unset meaning 2**15 under dynamic scaling
        (where float16 gradients of a few hundred tokens have room both ways) and 1 otherwise."""
        s = self.execution.loss_scaling
        return s if s is not None else (2.0 ** 15 if self.dynamic_loss_scaling else 1.0)

    @property
    def devices(self) -> int:
        """Number of devices the run needs (the original's ``ipus``)."""
        return self.execution.data_parallel * self.execution.tensor_parallel

    def validate(self) -> "Config":
        """Checks every field against what its declaration says (``spec``) and the fields against each other;
        raises ConfigError naming the field and the fix. What only a model family knows (its shapes and variants)
        is checked by the family (modelling/family.py), when the config is resolved into a run."""
        _check_types(self)
        _check_fields(self)
        _check_parallelism(self)
        _check_lengths(self)
        _check_training(self)
        _check_task(self.task)
        _check_mixture(self.mixture)
        _check_constraints(self.inference)
        return self


T5Config = Config  # the name of the root config before the model families (kept for code that imports it)


def _check_fields(cfg: Config) -> None:
    """Each field against its own declaration: the least value of an int, the choices of a str, a float finite
    and within its bounds."""
    for ref in FIELDS.values():
        value, meta = get_path(cfg, ref.path), ref.meta
        if value is None:
            continue
        if "minimum" in meta and value < meta["minimum"]:
            if meta["minimum"] == 0:
                raise ConfigError(f"{ref.flag}={value} must not be negative: pass --{ref.flag} 0 or more")
            raise ConfigError(f"{ref.flag}={value} must be at least {meta['minimum']}: pass --{ref.flag} with a "
                              f"value of {meta['minimum']} or more")
        for item in (value if isinstance(value, tuple) else (value,)) if meta.get("choices") else ():
            if item not in meta["choices"]:
                raise ConfigError(f"{ref.flag}={item!r} is not one of {', '.join(meta['choices'])}: pass "
                                  f"--{ref.flag} with {'some' if isinstance(value, tuple) else 'one'} of them")
        if "bounds" in meta:
            _check_bounds(ref.flag, value, *meta["bounds"])


def _check_bounds(flag: str, value: float, lo: float, hi: float, lo_in: bool, hi_in: bool, example: str) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"{flag}={value} is not a finite number: pass e.g. --{flag} {example}")
    if not ((value >= lo if lo_in else value > lo) and (value <= hi if hi_in else value < hi)):
        interval = f"{'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"
        raise ConfigError(f"{flag}={value:g} is outside {interval}: pass e.g. --{flag} {example}")


def _check_parallelism(cfg: Config) -> None:
    """Shapes that must divide over the devices and the batch over its micro-batches."""
    m, a, ex = cfg.model, cfg.model.attention, cfg.execution
    tp = ex.tensor_parallel
    for name, value in (("heads", a.heads), ("d_ff", m.d_ff)):
        if value % tp:
            raise ConfigError(f"{name}={value} is not divisible by tensor_parallel={tp}: choose --tensor_parallel "
                              f"among the divisors of {value}")
    denom = ex.rows_per_micro_batch
    if not m.eval and cfg.training.global_batch_size % denom:
        raise ConfigError(f"global_batch_size={cfg.training.global_batch_size} is not divisible by data_parallel * "
                          f"micro_batch_size = {ex.data_parallel} * {ex.micro_batch_size}: set --global_batch_size to "
                          f"a multiple of {denom}")
    if m.sequence_length % ex.attention_serialisation:
        raise ConfigError(f"sequence_length={m.sequence_length} is not divisible by attention_serialisation="
                          f"{ex.attention_serialisation}: choose --attention_serialisation among its divisors")
    if ex.device_iterations != 1:
        raise ConfigError(f"device_iterations={ex.device_iterations}: this backend runs one optimizer step per call "
                          "from the host (the IPU's device loop has no counterpart here): pass --device_iterations 1")


def _check_constraints(i: Inference) -> None:
    """The answers' constraints: one at a time; a grammar (regex, json_schema) follows one sequence a row (its
    matcher on the host), so not beam search's."""
    given = [f"--{f} {v}" for f, v in (("constrain", i.constrain if i.constrain != "none" else None),
                                      ("regex", i.regex), ("json_schema", i.json_schema)) if v is not None]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)}: an answer takes one constraint: pass one of them")
    if (i.regex is not None or i.json_schema is not None) and i.num_beams > 1:
        raise ConfigError(f"{given[0]} constrains greedy decoding or sampling (each row's grammar follows one "
                          "sequence), not beam search: drop --num_beams (or use --constrain labels, which beams "
                          "follow)")


def _check_lengths(cfg: Config) -> None:
    m, p = cfg.model, cfg.data.packed_decoder_length
    if p and p < m.decoder_sequence_length:
        raise ConfigError(f"packed_decoder_length={p} is shorter than decoder_sequence_length="
                          f"{m.decoder_sequence_length}: one target would not fit a row; pass --packed_decoder_length "
                          f"{m.decoder_sequence_length} or more (or 0 for sequence_length // 8)")


def _check_training(cfg: Config) -> None:
    """The training options that exclude each other."""
    m, tr, ex = cfg.model, cfg.training, cfg.execution
    if m.eval:
        return
    if tr.stochastic_rounding and m.precision == "float32":
        raise ConfigError("stochastic_rounding=true rounds float32 updates to 16-bit master weights, but precision "
                          "is float32: pass --precision bfloat16 (or float16), or --stochastic_rounding false")
    if ex.update_in_backward and cfg.dynamic_loss_scaling:
        raise ConfigError("update_in_backward=true updates each layer before the step's overflow is known, so "
                          "dynamic loss scaling could not skip a step whole: pass --precision bfloat16, or "
                          "--dynamic_loss_scaling false with a static --loss_scaling, or --update_in_backward false")


def template_fields(template: str) -> list:
    """The columns a template reads ({column} fields), in order; ConfigError for a template Python cannot read."""
    try:
        fields_ = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ConfigError(f"input_template {template!r} is not a template ({e}): write the columns as {{column}}, "
                          "and a literal brace as {{ or }}") from None
    bad = [f for f in fields_ if not f or not f.replace("_", "a").replace("-", "a").replace(" ", "a").isalnum()]
    if bad:
        raise ConfigError(f"input_template {template!r} has a field {bad[0]!r} that is not a column name: write "
                          "{column}")
    return fields_


def _check_task(t: "Task") -> None:
    if t.input_column is None:
        if not template_fields(t.input_template):
            raise ConfigError(f"input_template {t.input_template!r} reads no column: write the columns as {{column}} "
                              "(e.g. --input_template 'summarize: {text}'), or pass --input_column")
    if t.labels is not None and (len(t.labels) < 2 or len(set(t.labels)) != len(t.labels) or not all(t.labels)):
        raise ConfigError(f"labels={list(t.labels)}: a label set needs two or more distinct, non-empty words: pass "
                          "e.g. --labels positive negative (or --labels none for free-text targets)")
    if "accuracy" in t.metrics and t.labels is None:
        raise ConfigError("metrics accuracy needs a label set (--labels WORD WORD ...): for free text pass --metrics "
                          "exact_match rouge bleu chrf")


def _check_mixture(mx: "Mixture") -> None:
    """Each mixture task a whole task (config/presets.py resolves preset names into mappings), named once, and the
    rates one per task."""
    names = []
    for entry in mx.tasks:
        if not isinstance(entry, dict):
            raise ConfigError(f"mixture task {entry!r} is not a preset of config/finetuning.yml: name one (e.g. "
                              "tiny_headlines) or give a mapping {name: ..., dataset: ..., ...}")
        unknown = sorted(set(entry) - set(MIXTURE_KEYS))
        if unknown:
            raise ConfigError(f"mixture task {entry.get('name', '?')!r} has unknown key(s) {', '.join(unknown)}: "
                              f"known keys are {', '.join(MIXTURE_KEYS)}")
        if not entry.get("name") or not entry.get("dataset"):
            raise ConfigError(f"mixture task {entry!r} needs a name and a dataset: give both (e.g. {{name: qa, "
                              "dataset: qa.jsonl, ...}})")
        names.append(entry["name"])
        try:
            _check_task(Task(**{k: entry[k] for k in ("name", "input_template", "input_column", "target_column",
                                                      "labels", "metrics")}))
            _check_fields_of(Task, entry)
        except ConfigError as e:
            raise ConfigError(f"mixture task {entry['name']!r}: {e}") from None
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"mixture task name(s) {', '.join(dup)} appear more than once: give each task its own name "
                          "(they name its scores and reports)")
    if mx.rates and (len(mx.rates) != len(mx.tasks) or min(mx.rates) < 0 or not sum(mx.rates) > 0):
        raise ConfigError(f"mixture_rates {list(mx.rates)}: give one rate (>= 0, not all 0) for each of the "
                          f"{len(mx.tasks)} mixture tasks, in their order, or none for examples-proportional mixing")


def _check_fields_of(cls, entry: dict) -> None:
    """The choices a mixture task's values must take (its metrics)."""
    for name in ("metrics",):
        ref = FIELDS[name]
        for item in entry.get(name) or ():
            if item not in ref.meta["choices"]:
                raise ConfigError(f"metrics={item!r} is not one of {', '.join(ref.meta['choices'])}")


def ipu_only_notices(cfg: Config) -> list:
    """One line for each IPU-only field set to other than its default (it has no effect here)."""
    return [f"{r.flag}={get_path(cfg, r.path)} had meaning only on IPUs: it has no effect here (kept so the "
            "original's configs load)" for r in FIELDS.values()
            if r.meta.get("ipu") and r.flag != "device_iterations" and get_path(cfg, r.path) != r.default]


# --------------------------------------------------------------------------- the flat fields

FIELDS: dict = {}  # {flag: FieldRef} of every leaf field, the families' own included once added
MODEL_SHAPE: list = []  # the fields that make a model's shape (and numerics): a checkpoint or an HF config.json carries
TASK_FIELDS: list = []  # the fields of the task a checkpoint was trained on: its task section, its data and tokenizer,
# its output length


def _derive() -> None:
    """FIELDS, MODEL_SHAPE and TASK_FIELDS from the config's declarations, in place (their importers see them)."""
    FIELDS.clear()
    FIELDS.update({r.flag: r for r in leaf_fields(Config)})
    MODEL_SHAPE[:] = [flag for flag, ref in FIELDS.items() if ref.meta.get("shape")]
    TASK_FIELDS[:] = [flag for flag, ref in FIELDS.items() if ref.path[0] == "task" or ref.meta.get("travels")]


_ADDED: list = []  # the declarations add_options has taken


def families_added() -> bool:
    """Whether any model family's own fields joined the config (modelling/registry.py adds them on import)."""
    return bool(_ADDED)


def add_options(declared) -> list:
    """A model family's own config fields: the fields of dataclass ``declared`` join the section its ``section``
    names ("model.attention"), as flags, preset keys and --help text like every other field (modelling/registry.py
    adds every family's ``config_options``). An option two families declare alike is one field. -> the flags added."""
    section = Config
    for name in declared.section.split("."):
        section = typing.get_type_hints(section)[name]
    added = extend_section(section, declared)
    _ADDED.append(declared)
    if added:
        _derive()
    return added


_derive()


def _check_types(cfg) -> None:
    for ref in FIELDS.values():
        value = get_path(cfg, ref.path)
        coerced = coerce(ref, value)
        if coerced != value or type(coerced) is not type(value):
            set_path(cfg, ref.path, coerced)

