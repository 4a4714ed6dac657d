"""HF -> ours -> HF round trip: identical tensors and identical HF logits; bad checkpoints fail clearly."""

import os

import numpy as np
import pytest
import torch
from transformers import T5ForConditionalGeneration

from modelling.hf_mapping import CheckpointError, load_hf_model, resolve_hf_dir, save_hf_model
from tests.hf_utils import from_pretrained, make_hf, random_batch


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_round_trip_gives_identical_tensors_and_logits(tmp_path, version):
    hf, m, params = make_hf(version, seed=3)
    src = tmp_path / "src"
    hf.save_pretrained(src)  # safetensors, read back without torch
    m2, imported = load_hf_model(str(src))
    assert (m2.layers, m2.hidden_size, m2.tie_word_embeddings) == (m.layers, m.hidden_size, m.tie_word_embeddings)

    out = tmp_path / "out"
    save_hf_model(imported, m2, str(out))
    back = from_pretrained(T5ForConditionalGeneration, out)
    ref_sd, new_sd = hf.state_dict(), back.state_dict()
    assert set(ref_sd) == set(new_sd)
    for k in ref_sd:
        assert torch.equal(ref_sd[k], new_sd[k]), k

    b = {k: torch.tensor(v) for k, v in random_batch(m.embedding.vocab_size).items() if k != "labels"}
    with torch.no_grad():
        assert torch.equal(hf(**b).logits, back(**b).logits)


def test_a_16_bit_load_reads_each_tensor_into_the_frozen_dtype(tmp_path):
    """load_hf_model(dtype=bfloat16) (LoRA's frozen base): the weights a family does not keep in float32 arrive in
    bfloat16, each equal to the float32 load rounded to nearest; norms and position tables stay float32 and exact. The
    directory is read a tensor at a time (a mapping that reads on lookup), sharded files included."""
    import jax
    import ml_dtypes

    from modelling.family import leaf_name
    from modelling.hf_mapping import read_safetensors_dir
    from modelling.t5 import keeps_f32

    hf, m, _ = make_hf("1.1", seed=4)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")  # several files
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    sd = read_safetensors_dir(str(tmp_path))
    assert "shared.weight" in sd and "nope" not in sd and len(sd) == len(list(sd))
    _, f32 = load_hf_model(str(tmp_path), tensor_parallel=2)
    _, b16 = load_hf_model(str(tmp_path), tensor_parallel=2, dtype=ml_dtypes.bfloat16)
    kinds = set()
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(f32), jax.tree.leaves(b16)):
        kept = keeps_f32(leaf_name(path))
        kinds.add(kept)
        assert b.dtype == (np.float32 if kept else ml_dtypes.bfloat16), path
        np.testing.assert_array_equal(b, a if kept else a.astype(ml_dtypes.bfloat16))
    assert kinds == {True, False}


def test_vocab_padding_for_tensor_parallel_is_stripped_on_export(tmp_path):
    hf, m, _ = make_hf("1.1", vocab_size=99)
    hf.save_pretrained(tmp_path / "src")
    m2, params = load_hf_model(str(tmp_path / "src"), tensor_parallel=4)
    assert params["shared"].shape[0] == 100 and params["lm_head"].shape[1] == 100
    assert not np.any(params["shared"][99:])
    save_hf_model(params, m2, str(tmp_path / "out"))
    back = T5ForConditionalGeneration.from_pretrained(tmp_path / "out")
    assert torch.equal(back.shared.weight, hf.shared.weight)


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_hf_dir(str(tmp_path / "nope"))


def test_corrupt_safetensors_is_a_clear_error(tmp_path):
    hf, _, _ = make_hf("1.1")
    hf.save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: os.path.getsize(f) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_hf_model(str(tmp_path))


def test_hub_name_without_network_says_how_to_pass_a_directory(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="--hf_model DIR"):
        resolve_hf_dir("google/flan-t5-this-does-not-exist")
