"""The offline synthetic NLI set (data/synthetic.py): its labels follow from its content."""

from data import synthetic


def test_synthetic_labels_follow_from_content():
    for r in synthetic.generate_split("train", 300):
        p, h = r["premise"].split(), r["hypothesis"].split()
        has_time = any(w in synthetic.TIMES for w in h)
        changed = any(w not in p for w in h if w not in synthetic.TIMES)
        assert r["label"] == (2 if changed else 1 if has_time else 0), r
    assert synthetic.generate_split("train", 5) == synthetic.generate_split("train", 5)
    assert synthetic.generate_split("validation", 5) != synthetic.generate_split("train", 5)
