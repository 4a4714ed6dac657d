"""Tasks generated offline: a synthetic NLI task in the MNLI schema (``synthetic``, ``synthetic-mnli``) and a
free-text one (``synthetic-headlines``), and the NLI task's word-level tokenizer.

Headlines (``text`` -> ``summary``): a sentence about a subject, with fillers, a time and a second clause about
another subject ("indeed the old dog sleeps in the park tonight while the red cat eats in the house ."), and its
headline: the first subject, its verb and its place ("dog sleeps in park"). The target is free text of several
tokens, scored by exact match and ROUGE; a model that learnt nothing gets neither (chance is well below 1%).

Premise: "the {adj} {noun} {verb} in the {place} ." Hypotheses:
- entailment: a consistent subset of the premise ("the {noun} {verb} .");
- contradiction: like entailment but one of adj / verb / place replaced by another value;
- neutral: consistent, plus a time ("... tonight .") that the premise does not mention.
The label follows from comparing the two sentences word by word.

With ``lengths="mnli"`` (dataset ``synthetic-mnli``) the word counts follow MultiNLI's (a
mean premise of 22.3 words and hypothesis of 11.4, log-normal, data/generated.py): the premise
gains clauses about other subjects ("... and the old dog sleeps in the house"), the hypothesis
leading filler words ("indeed", "well", ...) that carry no content; the label still follows
from the clause about the hypothesis's subject.
"""

from __future__ import annotations

import numpy as np

from data.generated import HYPOTHESIS_SIGMA, MNLI_HYPOTHESIS_WORDS, MNLI_PREMISE_WORDS, PREMISE_SIGMA, _lognormal

NOUNS = ["cat", "dog", "bird", "horse", "child", "woman", "man", "teacher", "farmer", "doctor"]
ADJS = ["red", "blue", "green", "small", "big", "old", "young", "happy"]
VERBS = ["runs", "sleeps", "eats", "sings", "reads", "swims", "walks", "jumps"]
PLACES = ["park", "kitchen", "garden", "school", "river", "city", "forest", "house"]
TIMES = ["today", "tonight", "yesterday", "tomorrow"]
LABELS = ["entailment", "neutral", "contradiction"]
SPECIALS = ["<pad>", "</s>", "<unk>"]
WORDS = ["the", "a", "in", "at", ".", "mnli", "hypothesis:", "premise:"]
FILLERS = ["indeed", "well", "so", "really", "actually", "surely", "clearly", "perhaps", "also", "now"]
LENGTHS = ("short", "mnli")

SPLIT_SIZES = {"train": 20000, "validation": 1000, "validation_matched": 1000, "validation_mismatched": 1000,
               "test": 1000}
SPLIT_SEEDS = {"train": 0, "validation": 1, "validation_matched": 1, "validation_mismatched": 2, "test": 3}


def vocabulary() -> list:
    """Every token of the synthetic task; ids are positions (pad 0, eos 1, unk 2 as in T5; "target:" last: the
    causal-LM prompt's, appended so earlier ids never move)."""
    return SPECIALS + WORDS + LABELS + NOUNS + ADJS + VERBS + PLACES + TIMES + ["and"] + FILLERS + ["target:"]


def _other(rng, options, value):
    return options[(options.index(value) + rng.integers(1, len(options))) % len(options)]


def _mnli_words(rng: np.random.Generator) -> tuple:
    """Word counts (premise, hypothesis) drawn as MultiNLI's (data/generated.py)."""
    return (int(_lognormal(rng, MNLI_PREMISE_WORDS, PREMISE_SIGMA, 1)[0]),
            int(_lognormal(rng, MNLI_HYPOTHESIS_WORDS, HYPOTHESIS_SIGMA, 1)[0]))


def _lengthen(rng, premise: str, hypothesis: str, noun: str) -> tuple:
    """MultiNLI-like lengths: clauses about other subjects after the premise, fillers before the hypothesis."""
    p_words, h_words = _mnli_words(rng)
    clauses = []
    while len(premise.split()) + 8 * (len(clauses) + 1) <= p_words + 4:  # the nearest count of 8-word clauses
        other = _other(rng, NOUNS, noun)
        a, v, pl = (o[rng.integers(len(o))] for o in (ADJS, VERBS, PLACES))
        clauses.append(f"and the {a} {other} {v} in the {pl}")
    if clauses:
        premise = premise[:-2] + " " + " ".join(clauses) + " ."
    fill = max(h_words - len(hypothesis.split()), 0)
    if fill:
        hypothesis = " ".join(FILLERS[i] for i in rng.integers(len(FILLERS), size=fill)) + " " + hypothesis
    return premise, hypothesis


def make_example(rng: np.random.Generator, lengths: str = "short") -> dict:
    noun, adj, verb, place = (o[rng.integers(len(o))] for o in (NOUNS, ADJS, VERBS, PLACES))
    premise = f"the {adj} {noun} {verb} in the {place} ."
    label = int(rng.integers(3))
    h_adj, h_verb, h_place = adj, verb, place
    keep_adj, keep_place = bool(rng.integers(2)), bool(rng.integers(2))
    time = None
    if label == 2:  # contradiction: one detail changed
        which = int(rng.integers(3))
        if which == 0:
            h_adj, keep_adj = _other(rng, ADJS, adj), True
        elif which == 1:
            h_verb = _other(rng, VERBS, verb)
        else:
            h_place, keep_place = _other(rng, PLACES, place), True
    elif label == 1:  # neutral: a fact the premise does not state
        time = TIMES[rng.integers(len(TIMES))]
    words = ["the"] + ([h_adj] if keep_adj else []) + [noun, h_verb]
    words += (["in", "the", h_place] if keep_place else []) + ([time] if time else []) + ["."]
    hypothesis = " ".join(words)
    if lengths == "mnli":
        premise, hypothesis = _lengthen(rng, premise, hypothesis, noun)
    return {"premise": premise, "hypothesis": hypothesis, "label": label}


def generate_split(split: str, size: int | None = None, seed: int = 0, lengths: str = "short") -> list:
    """Rows {premise, hypothesis, label} of a split; deterministic from (split, seed, lengths)."""
    if lengths not in LENGTHS:
        raise ValueError(f"lengths={lengths!r}: use one of {LENGTHS}")
    n = size if size is not None else SPLIT_SIZES.get(split, 1000)
    key = [seed, SPLIT_SEEDS.get(split, 9)] + ([1] if lengths == "mnli" else [])
    rng = np.random.default_rng(key)
    return [make_example(rng, lengths) for _ in range(n)]


def make_tokenizer():
    """A word-level tokenizer over vocabulary(), as a transformers tokenizer (no files needed).

    Appends </s> to every sequence, as the T5 tokenizer does.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


# --------------------------------------------------------------------------- the free-text task


def make_headline(rng: np.random.Generator) -> dict:
    """One row {text, summary} of the headlines task (see the module docstring)."""
    noun, other = (NOUNS[i] for i in rng.choice(len(NOUNS), 2, replace=False))
    adj, adj2 = (ADJS[i] for i in rng.integers(len(ADJS), size=2))
    verb, verb2 = (VERBS[i] for i in rng.integers(len(VERBS), size=2))
    place, place2 = (PLACES[i] for i in rng.integers(len(PLACES), size=2))
    lead = " ".join(FILLERS[i] for i in rng.integers(len(FILLERS), size=int(rng.integers(3))))
    time = f" {TIMES[rng.integers(len(TIMES))]}" if rng.integers(2) else ""
    second = f" while the {adj2} {other} {verb2} in the {place2}" if rng.integers(2) else ""
    text = f"{lead} the {adj} {noun} {verb} in the {place}{time}{second} .".strip()
    return {"text": text, "summary": f"{noun} {verb} in {place}"}


def generate_headlines(split: str, size: int | None = None, seed: int = 0) -> list:
    n = size if size is not None else SPLIT_SIZES.get(split, 1000)
    rng = np.random.default_rng([seed, SPLIT_SEEDS.get(split, 9), 7])
    return [make_headline(rng) for _ in range(n)]


# name -> (split, seed) -> rows: the data sets this project generates (data/sources.py reads them by name)
GENERATED = {
    "synthetic": lambda split, seed: generate_split(split, seed=seed, lengths="short"),
    "synthetic-mnli": lambda split, seed: generate_split(split, seed=seed, lengths="mnli"),
    "synthetic-headlines": lambda split, seed: generate_headlines(split, seed=seed),
}


def generate(name: str, split: str, seed: int = 0) -> list:
    """The rows of ``split`` of a generated data set."""
    return GENERATED[name](split, seed)
