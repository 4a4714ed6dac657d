"""The figures (benchmarks/figures.py) are drawn from the committed results."""

import os


def test_figures_are_drawn_from_the_committed_results(tmp_path):
    from benchmarks import figures

    made = figures.main(["all", "--out_dir", str(tmp_path)])
    assert [os.path.basename(p) for p in made] == ["quickstart_loss_curve.png", "phased_memory.png", "throughput.png",
                                                      "precision.png"]
    assert all(os.path.getsize(p) > 10000 for p in made)
