"""Scores of decoded outputs against their references, as a task asks: accuracy with per-class counts and the
confusion matrix (a label set), exact match, ROUGE-1/2/L (the rouge-score package: F1, with its Porter stemmer, as
Hugging Face's run_summarization reports it), BLEU and chrF (sacrebleu's corpus scores). The libraries are called,
never rewritten; exact match compares whitespace-normalised strings. A report keeps every prediction beside its
reference and its input."""

from __future__ import annotations

UNKNOWN = "unknown"  # a generated text that names no label of the set (counted as wrong)


def clean(text: str) -> str:
    """A generated text without the special tokens a decoder may leave, whitespace normalised."""
    return " ".join(text.replace("</s>", " ").replace("<pad>", " ").split())


def label_of(text: str, labels: tuple) -> str:
    """The label a generated text names, or 'unknown'."""
    s = clean(text)
    return s if s in labels else UNKNOWN


def accuracy(references: list, generated: list, labels: tuple) -> dict:
    """Accuracy, per-class counts and the confusion matrix (rows: true class; columns: predicted class, then
    'unknown') of generated texts against label indices ``references``; 'predictions' holds the named labels."""
    names = list(labels) + [UNKNOWN]
    confusion = [[0] * len(names) for _ in labels]
    predictions = []
    for y, text in zip(references, generated):
        pred = label_of(text, labels)
        confusion[y][names.index(pred)] += 1
        predictions.append(pred)
    n = len(references)
    correct = sum(confusion[i][i] for i in range(len(labels)))
    per_class = {c: {"support": sum(confusion[i]), "correct": confusion[i][i],
                     "accuracy": confusion[i][i] / sum(confusion[i]) if sum(confusion[i]) else None}
                 for i, c in enumerate(labels)}
    return {"accuracy": correct / n if n else 0.0, "samples": n, "correct": correct,
            "unknown": sum(r[-1] for r in confusion), "per_class": per_class,
            "confusion_matrix": {"rows": list(labels), "columns": names, "counts": confusion},
            "predictions": predictions, "generated": list(generated)}


def exact_match(references: list, generated: list) -> float:
    """The share of outputs equal to their reference (whitespace normalised)."""
    return sum(clean(g) == clean(r) for r, g in zip(references, generated)) / max(len(references), 1)


def rouge(references: list, generated: list) -> dict:
    """Mean ROUGE-1, ROUGE-2 and ROUGE-L F1 (rouge-score, Porter stemmer)."""
    from rouge_score import rouge_scorer

    kinds = ("rouge1", "rouge2", "rougeL")
    scorer = rouge_scorer.RougeScorer(list(kinds), use_stemmer=True)
    totals = dict.fromkeys(kinds, 0.0)
    for r, g in zip(references, generated):
        scores = scorer.score(clean(r), clean(g))
        for k in kinds:
            totals[k] += scores[k].fmeasure
    return {k: v / max(len(references), 1) for k, v in totals.items()}


def bleu(references: list, generated: list) -> float:
    """sacrebleu's corpus BLEU (0-100) with its default 13a tokenisation."""
    import sacrebleu

    return sacrebleu.corpus_bleu([clean(g) for g in generated], [[clean(r) for r in references]]).score


def chrf(references: list, generated: list) -> float:
    """sacrebleu's corpus chrF (0-100)."""
    import sacrebleu

    return sacrebleu.corpus_chrf([clean(g) for g in generated], [[clean(r) for r in references]]).score


def score(task, examples: list, generated: list) -> dict:
    """The report of a task's decoded outputs (data.tasks.Task, Examples with their references): every metric the
    task names (``scores``: {name: value}, and the accuracy report's own keys for a label set), and every input,
    reference and output."""
    refs = [e.target for e in examples]
    report = {"task": task.name, "metrics": list(task.metrics), "samples": len(examples)}
    scores = {}
    for name in task.metrics:
        if name == "accuracy":
            acc = accuracy([e.label for e in examples], generated, task.labels)
            report.update(acc)
            scores["accuracy"] = acc["accuracy"]
        elif name == "exact_match":
            scores["exact_match"] = exact_match(refs, generated)
        elif name == "rouge":
            scores.update(rouge(refs, generated))
        elif name == "bleu":
            scores["bleu"] = bleu(refs, generated)
        elif name == "chrf":
            scores["chrf"] = chrf(refs, generated)
    report.update(scores=scores, inputs=[e.input for e in examples], references=refs, generated=list(generated))
    return report


def headline(scores: dict) -> str:
    """``accuracy 93.10%, exact_match 41.20%, rouge1 0.812 ...``: the scores of a report in one line."""
    parts = []
    for k, v in scores.items():
        parts.append(f"{k} {v:.2%}" if k in ("accuracy", "exact_match") else f"{k} {v:.3f}" if k.startswith("rouge")
                     else f"{k} {v:.2f}")
    return ", ".join(parts)


def primary(task) -> str:
    """The score that names a task's best step (its first metric's; ROUGE by ROUGE-L)."""
    first = task.metrics[0]
    return "rougeL" if first == "rouge" else first
