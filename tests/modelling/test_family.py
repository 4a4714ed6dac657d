"""A third family in one module (modelling/family.py, modelling/causal.py): tests/toy_family.py defines a
LLaMA-style decoder (RMSNorm, SwiGLU, rotate-half rotary, 2 key/value heads for 4 query heads) on
modelling/causal.py's base, this test registers it (the one line a new family adds to modelling/registry.py, README
"Model families"), and the unchanged engine and drivers train it, checkpoint it, resume it exactly and greedy-decode
it, at tp 1 and 2. Its numbers are transformers' LlamaForCausalLM's."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import run_finetuning
import run_validation
from config.schema import ModelConfig
from modelling import decoding, registry
from modelling.hf_mapping import hf_config_dict, hf_state_dict_from_params
from tests.helpers import assert_trained_alike, params_at
from tests.toy_family import ToyLlama
from utils.errors import CheckpointError

SHAPE = ["--family", "toy_llama", "--layers", "2", "--hidden_size", "32", "--d_ff", "64", "--heads", "4",
         "--kv_heads", "2", "--d_kv", "8", "--vocab_size", "128", "--sequence_length", "48",
         "--global_batch_size", "8", "--micro_batch_size", "4", "--learning_rate", "3e-3", "--warmup_steps", "0"]


def hf_llama(vocab: int = 96, seed: int = 0):
    """A random LlamaForCausalLM of the toy's shape (float32): 2 layers, 4 query heads over 2 key/value heads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=128, bos_token_id=1, eos_token_id=1, pad_token_id=0,
                         tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def toy():
    family = ToyLlama()
    registry.add(family)  # what the one line a new family adds to modelling/registry.py does
    yield family
    del registry.FAMILIES[family.name]


def _opts(m: ModelConfig):
    from config.schema import Config

    cfg = Config(model=m)
    cfg.model.eval = True
    return ToyLlama.options.from_config(cfg)


@pytest.mark.slow
def test_the_toy_family_is_transformers_llama(toy):
    """Forward logits of a padded batch and greedy decoding with the KV cache (left-padded prompts, grouped
    key/value heads, rotate-half positions counted over real tokens) equal LlamaForCausalLM's (float32)."""
    hf = hf_llama()
    m = toy.hf.model_config(hf.config.to_dict())
    params = jax.tree.map(jnp.asarray, toy.hf.params(hf.state_dict(), m))
    opts = _opts(m)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 96, (3, 9)).astype(np.int32)
    mask = (np.arange(9)[None] < np.array([9, 6, 4])[:, None]).astype(np.int32)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask),
             "positions": jnp.broadcast_to(jnp.arange(9), (3, 9))}
    ours = np.asarray(toy.forward(params, batch, opts))[..., :96]
    valid = mask > 0
    assert np.max(np.abs(ours[valid] - ref[valid])) < 1e-5 * np.max(np.abs(ref))
    left, lmask = toy.layout_prompts(ids * mask, mask)
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor(left), attention_mask=torch.tensor(lmask), max_new_tokens=6,
                           min_new_tokens=6, do_sample=False, pad_token_id=0)[:, 9:].numpy()
    got = decoding.greedy(toy, params, jnp.asarray(left), jnp.asarray(lmask), opts, 6,
                          eos_id=-1)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.slow
def test_the_toy_family_trains_resumes_and_decodes_through_the_drivers(toy, tmp_path, capsys):
    """run_finetuning.py and run_validation.py, unchanged, with --family toy_llama: two steps at tp 1 equal two at
    tp 2; a run of 4 steps (saved at 2 and 4) resumed from its step 2 ends where it ended; validation greedy-decodes
    the checkpoint at tp 2 and at tp 1 to the same outputs."""
    one, two, resumed = (str(tmp_path / n) for n in ("tp1", "tp2", "resumed"))
    base = ["--config", "tiny", *SHAPE, "--data_parallel", "1"]
    run_finetuning.main(base + ["--tensor_parallel", "1", "--steps", "2", "--save", one])
    run_finetuning.main(base + ["--tensor_parallel", "2", "--steps", "4", "--checkpoint_steps", "2", "--save", two])
    run_finetuning.main(base + ["--tensor_parallel", "2", "--steps", "4", "--load", f"{two}/2", "--save", resumed])
    for a, b in zip(jax.tree.leaves(params_at(one, 2)[1]), jax.tree.leaves(params_at(two, 2)[1])):
        assert_trained_alike(a, b, lr=3e-3, steps=2)  # tp 2 trains as one device does (tests/helpers.py)
    for a, b in zip(jax.tree.leaves(params_at(two, 4)[1]), jax.tree.leaves(params_at(resumed, 4)[1])):
        np.testing.assert_array_equal(a, b)  # resumed exactly
    capsys.readouterr()
    reports = {}
    for tp in (2, 1):
        out = str(tmp_path / f"val_tp{tp}.json")
        run_validation.main(["--load", resumed, "--limit", "12", "--tensor_parallel", str(tp), "--output", out])
        reports[tp] = json.load(open(out))
    assert "accuracy" in capsys.readouterr().out
    assert reports[1]["generated"] == reports[2]["generated"] and any(reports[1]["generated"])
    assert reports[1]["samples"] == 12 and os.path.isdir(os.path.join(resumed, "4"))


def test_what_a_family_leaves_out_of_its_hf_mapping_is_one_line_when_asked(toy):
    """The toy maps LlamaForCausalLM's config and weights one way only: an export asks for what it left unset, and
    gets the CheckpointError (one line, exit 2 from a driver) that names what cannot be done, not a TypeError."""
    m = ModelConfig(family=toy.name)
    with pytest.raises(CheckpointError, match="no Hugging Face model to write a config.json for"):
        hf_config_dict(m)
    with pytest.raises(CheckpointError, match="no Hugging Face model to export weights to"):
        hf_state_dict_from_params({}, m)
    assert registry.hf_model_types()["llama"] == toy.name  # what it did set reaches the registry
