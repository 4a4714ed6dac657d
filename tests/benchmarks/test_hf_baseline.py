"""The Hugging Face baseline (benchmarks/hf_baseline.py) under torch.compile trains like eager."""

import numpy as np
import pytest


@pytest.mark.slow
def test_hf_baseline_under_torch_compile_trains_like_eager(tmp_path):
    """The compiled baseline (torch.compile, fused AdamW) computes the same losses as eager on the same data. The
    test compiles with the aot_eager backend: the same Dynamo capture and AOT autograd graphs as inductor, without
    generating C++ kernels (minutes of a CPU for each shape); the benchmarks run inductor. Rows padded to one
    length: one shape, one compilation."""
    from benchmarks import hf_baseline

    argv = ["train", "--config", "tiny", "--global_batch_size", "4", "--micro_batch_size", "2", "--sequence_length",
            "32", "--iterations", "1", "--warmup_iterations", "1", "--lengths", "mnli", "--padding", "max_length"]
    eager = hf_baseline.main(argv + ["--json", str(tmp_path / "e.json")])
    compiled = hf_baseline.main(argv + ["--compile", "--compile_backend", "aot_eager", "--json", str(tmp_path / "c.json")])
    assert compiled["compiled"] and compiled["optimizer"] == "AdamW (fused)" and not eager["compiled"]
    assert compiled["compile_backend"] == "aot_eager"
    assert compiled["padding"] == "max_length" and compiled["precision_policy"] == "float32"
    np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=1e-4)
