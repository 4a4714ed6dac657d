"""Generated token batches for benchmarks and tests (no download, no tokenizer).

Length modes for the prompts:
- ``uniform``: prompt lengths uniform in [L/2, L] (rows mostly full; what the original's
  benchmarks measured);
- ``short``: uniform in [2, L/2] (tests: several examples to a packed row);
- ``summaries``: dialogue-summarisation-like: prompts of about 150 tokens and targets of about 30 (log-normal,
  as SAMSum's dialogues of ~94 words and summaries of ~20 words in T5 tokens; up to the row lengths), the
  long-target workload of a summarisation task;
- ``mnli``: lengths drawn to match MultiNLI's statistics. The MultiNLI paper (Williams et al.,
  2018) reports a mean premise of 22.3 words and a mean hypothesis of 11.4; word counts are drawn
  log-normally around those means (a long right tail), turned into T5 tokens at 1.3 tokens per
  word (SentencePiece on English prose; an assumption, not a measurement of MNLI), plus the 8
  tokens of the prompt template (``mnli hypothesis: ... premise: ...``) and EOS. The mean is
  about 52 tokens, the 99th percentile about 140, the longest a few hundred. Targets are 2 to 4
  tokens (a class name and EOS).

Batches are padded (one example per row) or packed, as ``data.packing`` says, in the family's row format.
"""

from __future__ import annotations

import numpy as np

from data.packing import Examples, Packer
from data.packing import lengths as lengths_of
from modelling import registry
from modelling.rows import RowShape

MNLI_PREMISE_WORDS, MNLI_HYPOTHESIS_WORDS = 22.3, 11.4  # means reported by the MultiNLI paper
PREMISE_SIGMA, HYPOTHESIS_SIGMA = 0.6, 0.45  # spread of log word counts: a long tail to a few hundred tokens
TOKENS_PER_WORD = 1.3
TEMPLATE_TOKENS = 8  # "mnli hypothesis:" and "premise:" in T5 tokens, and EOS


def _lognormal(rng, mean: float, sigma: float, n: int) -> np.ndarray:
    """Log-normal draws with the given mean (not median)."""
    return rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, n)


def mnli_like_lengths(rng: np.random.Generator, n: int) -> tuple:
    """(prompt token lengths, target token lengths) of n MNLI-like examples (see the module docstring)."""
    words = _lognormal(rng, MNLI_PREMISE_WORDS, PREMISE_SIGMA, n) + _lognormal(rng, MNLI_HYPOTHESIS_WORDS,
                                                                               HYPOTHESIS_SIGMA, n)
    prompts = np.maximum(np.rint(TOKENS_PER_WORD * words), 2).astype(np.int64) + TEMPLATE_TOKENS
    return prompts, rng.integers(2, 5, n)


def summary_like_lengths(rng: np.random.Generator, n: int, sequence_length: int, target_length: int) -> tuple:
    """(prompt token lengths, target token lengths) of n dialogue-summarisation-like examples (module docstring)."""
    enc = np.clip(np.rint(_lognormal(rng, 150.0, 0.5, n)), 8, sequence_length).astype(np.int64)
    return enc, np.clip(np.rint(_lognormal(rng, 30.0, 0.5, n)), 2, target_length).astype(np.int64)


def generated_examples(rng: np.random.Generator, n: int, vocab_size: int, lengths: str, sequence_length: int,
                       target_length: int) -> Examples:
    """n examples of random tokens (ids >= 3), each prompt and target ending in EOS (1)."""
    if lengths == "mnli":
        enc, tgt = mnli_like_lengths(rng, n)
    elif lengths == "summaries":
        enc, tgt = summary_like_lengths(rng, n, sequence_length, target_length)
    elif lengths in ("uniform", "short"):
        half = max(sequence_length // 2, 2)
        enc = rng.integers(half, sequence_length + 1, n) if lengths == "uniform" else rng.integers(2, half + 1, n)
        tgt = rng.integers(1, target_length + 1, n)
    else:
        raise ValueError(f"lengths={lengths!r}: use 'uniform', 'short', 'mnli' or 'summaries'")
    inputs = [np.append(rng.integers(3, vocab_size, k - 1), 1).astype(np.int32) for k in enc]
    targets = [np.append(rng.integers(3, vocab_size, k - 1), 1).astype(np.int32) for k in tgt]
    return Examples(inputs, targets)


def generated_batch(cfg, seed: int = 0, encoder_length: int | None = None, decoder_length: int | None = None,
                    lengths: str = "uniform", packing: bool | None = None) -> dict:
    """One global batch {key: int32 [gradient_accumulation, dp * micro_batch_size, length]}.

    Rows as the training data has them, in the family's row format (modelling/rows.py): padded (one example per
    row), or packed (``packing``, default ``cfg.data.packing``: as many examples as fit the rows).
    """
    rng = np.random.default_rng(seed)
    ga = max(cfg.gradient_accumulation, 1)
    rows = ga * cfg.execution.rows_per_micro_batch
    L = encoder_length or cfg.model.sequence_length
    T = decoder_length or cfg.model.decoder_sequence_length
    V = cfg.model.embedding.vocab_size
    packing = cfg.data.packing if packing is None else packing
    fmt = registry.of_config(cfg).rows
    shape = RowShape(L, T, decoder_length or cfg.decoder_row_length, packing, False, cfg.data.loss_tokens)
    if not packing:
        batch = fmt.padded(generated_examples(rng, rows, V, lengths, fmt.input_room(shape), T), range(rows), shape)
    else:
        shortest = {"mnli": TEMPLATE_TOKENS + 2, "short": 2, "summaries": 8}.get(lengths, max(L // 2, 1))
        ex = generated_examples(rng, rows * max(L // shortest, 1) + 64, V, lengths, fmt.input_room(shape), T)
        n = np.arange(len(ex))
        a, b = fmt.sizes(lengths_of(ex.inputs, n), lengths_of(ex.targets, n), shape)
        filled, _ = Packer.of_sizes(lambda i: (int(a[i]), int(b[i])), fmt.capacity(shape)).fill(
            rows, [], iter(range(len(ex))))
        batch = fmt.packed(ex, filled, shape)
    return {k: v.reshape(ga, rows // ga, -1) for k, v in batch.items()}


def generated_prompts(cfg) -> tuple:
    """The decoding benchmarks' prompts, the same for every engine compared (ours, HF ``generate``, CTranslate2):
    (ids, mask) int32 [micro-batch rows, sequence_length] numpy, one prompt per row (``uniform`` lengths, seed 0), as
    the family decodes them (``layout_prompts``: right-padded, or right-aligned for a causal LM)."""
    b = cfg.execution.rows_per_micro_batch
    data = generated_batch(cfg, seed=0, packing=False)
    L = cfg.model.sequence_length
    ids, mask = data["input_ids"].reshape(-1, L)[:b], data["attention_mask"].reshape(-1, L)[:b]
    return registry.of_config(cfg).layout_prompts(ids, mask)
