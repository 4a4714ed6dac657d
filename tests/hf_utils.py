"""Randomly initialised Hugging Face models (the T5 family, GPT-J; no download), their weights in our layout, the
batches and configs several test modules compare them on, and HF's greedy decoding beside ours.

Untied variants are untied for real: transformers >= 5 ties every T5-family head to the embedding whatever the
config says, while the real Flan-T5, mT5, UMT5 and UL2 checkpoints carry their own ``lm_head``. ``make_hf`` gives
those fixtures a head of their own, with values unlike the embedding's, so a head that read ``shared`` instead of
``lm_head`` fails every parity test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import MT5Config, MT5ForConditionalGeneration, UMT5Config, UMT5ForConditionalGeneration
from transformers import T5Config as HFT5Config
from transformers import T5ForConditionalGeneration

from modelling.hf_mapping import model_config_from_hf, params_from_hf_state_dict
from modelling.t5 import T5Options

SMALL = dict(vocab_size=100, d_model=48, d_ff=72, d_kv=8, num_heads=6, num_layers=2,
             relative_attention_num_buckets=8, relative_attention_max_distance=20)


# variant -> (HF config class, model class, config fields): the layouts of the family's real checkpoints
VARIANTS = {
    "1.1": (HFT5Config, T5ForConditionalGeneration, dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "1.0": (HFT5Config, T5ForConditionalGeneration, dict(feed_forward_proj="relu", tie_word_embeddings=True)),
    "ul2": (HFT5Config, T5ForConditionalGeneration, dict(feed_forward_proj="gated-silu", tie_word_embeddings=False)),
    "mt5": (MT5Config, MT5ForConditionalGeneration, dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "umt5": (UMT5Config, UMT5ForConditionalGeneration, dict(feed_forward_proj="gated-gelu",
                                                           tie_word_embeddings=False)),
}


def untie(hf) -> None:
    """Gives an HF model its own LM head, unlike its embedding (transformers >= 5 ties them on construction)."""
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.shared.weight) * hf.config.d_model ** -0.5)
    hf.config.tie_word_embeddings = False  # UMT5 reads it at run time (its output rescale)


def from_pretrained(model_cls, path):
    """model_cls.from_pretrained(path), with the checkpoint's own head where it has one (transformers >= 5 ties
    the head to the embedding on load, whatever config.json says)."""
    import os

    from safetensors.torch import load_file

    model = model_cls.from_pretrained(path).eval()
    sd = load_file(os.path.join(path, "model.safetensors"))
    if "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], sd["shared.weight"]):
        untie(model)
        with torch.no_grad():
            model.lm_head.weight.copy_(sd["lm_head.weight"])
    return model


def make_hf(version: str = "1.1", seed: int = 0, **overrides):
    """(hf_model, our ModelConfig, our params) for a random model of a VARIANTS layout."""
    config_cls, model_cls, fields = VARIANTS[version]
    kw = dict(SMALL, dropout_rate=0.0, **fields)
    kw.update(overrides)
    tied = kw["tie_word_embeddings"]
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**kw)).eval()
    if not tied:
        untie(hf)
        assert hf.lm_head.weight is not hf.shared.weight
    # our config from what a real checkpoint's config.json says (transformers >= 5 rewrites tie_word_embeddings)
    m = model_config_from_hf({**hf.config.to_dict(), "tie_word_embeddings": tied})
    params = jax.tree.map(jnp.asarray, params_from_hf_state_dict(hf.state_dict(), m))
    return hf, m, params


def options(m, **kw) -> T5Options:
    return T5Options(family=m.family, feed_forward_proj=m.feed_forward_proj, eps=m.eps,
                     relative_attention_num_buckets=m.attention.relative_attention_num_buckets,
                     relative_attention_max_distance=m.attention.relative_attention_max_distance,
                     vocab_size=m.embedding.vocab_size, hidden_size=m.hidden_size,
                     tie_word_embeddings=m.tie_word_embeddings, **kw)


def random_batch(vocab: int, b: int = 3, enc_len: int = 11, dec_len: int = 5, seed: int = 0) -> dict:
    """A batch with mixed encoder padding and -100 labels, as numpy int arrays."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab, (b, enc_len))
    mask = np.ones((b, enc_len), np.int64)
    for i in range(1, b):
        mask[i, enc_len - 2 * i - 2:] = 0
    ids[mask == 0] = 0
    labels = rng.integers(2, vocab, (b, dec_len))
    labels[0, dec_len - 2:] = -100
    dec = np.concatenate([np.zeros((b, 1), np.int64), np.where(labels == -100, 0, labels)[:, :-1]], axis=1)
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, labels=labels)


def hf_outputs(hf, batch: dict):
    """HF loss, logits and per-parameter gradients (our names are mapped by the caller)."""
    hf.zero_grad()
    t = {k: torch.tensor(v) for k, v in batch.items()}
    out = hf(**t)
    out.loss.backward()
    grads = {k: p.grad.detach().numpy().copy() for k, p in hf.named_parameters() if p.grad is not None}
    return out.loss.item(), out.logits.detach().numpy(), grads


# --------------------------------------------------------------------------- T5 v1.1 and GPT-J fixtures

T5_ENC, T5_DEC = 11, 5  # encoder and decoder lengths of the T5 test batches


def t5_with_norms_off_one(version: str, seed: int = 5, **overrides):
    """(hf_model, our ModelConfig) of ``make_hf``, its norms moved away from 1 (so each norm's own gradient is
    checked)."""
    hf, m, _ = make_hf(version, seed=seed, **overrides)
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if key.endswith("layer_norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return hf, m


def t5_training_config(m, **overrides):
    """The tiny preset's config with model ``m``'s shape, 4 rows of T5_ENC/T5_DEC tokens, float32, one device."""
    from config import load_config
    from config.carry import model_shape
    from config.schema import T5Config

    base = dict(model_shape(T5Config(model=m)), sequence_length=T5_ENC, decoder_sequence_length=T5_DEC,
                packing=False, global_batch_size=4, micro_batch_size=2, data_parallel=1, tensor_parallel=1,
                warmup_steps=0, dropout_prob=0.0, precision="float32")
    base.update(overrides)
    return load_config("finetuning", "tiny", base)


def t5_batch(vocab: int) -> dict:
    """4 rows of ``random_batch`` with every decoder position attended."""
    b = random_batch(vocab, 4, T5_ENC, T5_DEC, seed=1)
    b["decoder_attention_mask"] = np.ones_like(b["decoder_input_ids"])
    return b


GPTJ_KW = dict(vocab_size=98, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_inner=96,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=1)
GPTJ_LENGTH = 12  # sequence length of the GPT-J test batches


def gptj_hf():
    """A random HF GPT-J whose biases and norms are not at their init (so each is checked)."""
    from transformers import GPTJConfig, GPTJForCausalLM

    torch.manual_seed(0)
    hf = GPTJForCausalLM(GPTJConfig(**GPTJ_KW)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf


def gptj_config(hf, **overrides):
    """The gptj_tiny preset's config with an HF GPT-J's shape, 4 rows of GPTJ_LENGTH tokens, one device."""
    from config import load_config
    from modelling import gptj

    m = gptj.config_from_hf(hf.config.to_dict())
    base = dict(layers=m.layers, hidden_size=m.hidden_size, d_ff=m.d_ff, heads=m.attention.heads,
                d_kv=m.attention.d_kv, rotary_dim=m.attention.rotary_dim, vocab_size=m.embedding.vocab_size,
                eps=m.eps, sequence_length=GPTJ_LENGTH, global_batch_size=4, micro_batch_size=2, data_parallel=1,
                tensor_parallel=1, packing=False, warmup_steps=0, learning_rate=1e-3, recompute=True)
    base.update(overrides)
    return load_config("finetuning", "gptj_tiny", base)


def gptj_batch(seed: int = 0, rows: int = 4, vocab: int = 98) -> dict:
    """Right-padded causal rows of different lengths: ids, mask, positions, next-token labels (-100 on padding)."""
    from data.packing import Examples
    from modelling.rows import causal_rows

    rng = np.random.default_rng(seed)
    L = GPTJ_LENGTH
    lengths = [L, L - 3, L - 5, 5][:rows]
    ex = Examples([rng.integers(2, vocab, n - 2) for n in lengths], [rng.integers(2, vocab, 2) for _ in lengths])
    return causal_rows(ex, [[i] for i in range(rows)], L)


# --------------------------------------------------------------------------- greedy decoding, HF's and ours


def hf_greedy(hf, batch: dict, n: int, eos: int = 1) -> np.ndarray:
    """HF ``generate``'s greedy tokens of a T5 model [rows, n] (padded with 0 after every row is done)."""
    out = hf.generate(input_ids=torch.tensor(batch["input_ids"]), attention_mask=torch.tensor(batch["attention_mask"]),
                      do_sample=False, num_beams=1, max_new_tokens=n, decoder_start_token_id=0, eos_token_id=eos,
                      pad_token_id=0).numpy()[:, 1:]
    return np.pad(out, ((0, 0), (0, n - out.shape[1])))  # HF stops when all rows are done


def sharded_greedy(m, params, batch: dict, n: int, tp: int, eos: int = 1, cached: bool = True) -> np.ndarray:
    """Our greedy decoding of a T5 model ``m`` [rows, n] over ``tp`` devices (the decoding graphs' program)."""
    from config.schema import T5Config
    from decoder.decoder import Decoder

    cfg = T5Config(model=m)
    cfg.model.eval = True
    cfg.execution.tensor_parallel, cfg.execution.rts = tp, False
    g = Decoder.of_config(cfg.validate(), eos=eos)
    run = g.greedy_program(n, cached=cached)
    host = jax.tree.map(np.asarray, params)
    return np.asarray(run(g.place.shard_params(host), jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])))


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (a scale-aware error that does not blow up near zeros)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# --------------------------------------------------------------------------- the searches' parity fixture

N = 7  # new tokens


def search_models(name: str) -> tuple:
    """The searches' parity fixture of a family ("t5", "gptj"): (its name, an HF model, our ModelConfig, our params,
    4 prompts ids/mask of mixed lengths as the family decodes them)."""
    from transformers import GPTJConfig, GPTJForCausalLM

    from modelling import gptj, registry

    if name == "t5":
        hf, m, params = make_hf("1.1", seed=3)
        with torch.no_grad():
            hf.shared.weight.mul_(0.05)  # a smaller embedding: the random model does not echo its start token
        from modelling.hf_mapping import params_from_hf_state_dict

        params = params_from_hf_state_dict(hf.state_dict(), m)
    else:
        torch.manual_seed(3)
        hf = GPTJForCausalLM(GPTJConfig(vocab_size=96, n_positions=64, n_embd=48, n_layer=2, n_head=4, rotary_dim=8,
                                        n_inner=96, bos_token_id=1, eos_token_id=1, tie_word_embeddings=False)).eval()
        m = gptj.config_from_hf(hf.config.to_dict())
        params = gptj.params_from_hf(hf.state_dict(), m)
    batch = random_batch(m.embedding.vocab_size, 4, 9, 2, seed=4)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ids, mask = registry.get(name).layout_prompts(ids, mask)
    return name, hf, m, jax.tree.map(np.asarray, params), ids, mask


def ours(m, params, ids, mask, options, tp: int = 1, dp: int = 1, eos: int = 1, seed: int = 0):
    """Our search ``options`` names (modelling/decoding.py's Options) over tp x dp devices -> tokens [b, N]."""
    from config.schema import Config
    from decoder.decoder import Decoder

    cfg = Config(model=m)
    cfg.model.eval = True
    cfg.execution.tensor_parallel, cfg.execution.data_parallel, cfg.execution.rts = tp, dp, False
    g = Decoder.of_config(cfg.validate(), eos=eos, pad=0)
    run = g.search(options, seed)
    return np.asarray(run(g.place.shard_params(params), jnp.asarray(ids), jnp.asarray(mask)))


def hf_tokens(name, hf, ids, mask, eos: int = 1, **kw):
    """HF generate's N new tokens with ``kw``, padded with 0 after the first end-of-text token."""
    extra = {"decoder_start_token_id": 0} if name == "t5" else {}
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=N,
                          eos_token_id=eos, pad_token_id=0, **kw, **extra).numpy()
    out = out[:, ids.shape[1]:] if name == "gptj" else out[:, 1:]
    out = np.pad(out, ((0, 0), (0, N - out.shape[1])))
    ended = np.cumsum(out == eos, axis=1) - (out == eos) > 0  # after the first EOS: padding (HF may fill with EOS)
    return np.where(ended, 0, out)
