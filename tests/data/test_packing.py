"""Sequence packing: row layout, segment isolation, packed == unpacked loss and gradients (fused and
phased, one device and dp=tp=2), resumable packed loading, and greedy decoding of a packed-trained model.

Tolerance of packed vs unpacked: loss sum, token count and every weight gradient within 1e-5
relative (max |a - b| / max |b|); the two batches sum the same terms in another order.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from config import load_config
from data.loader import TrainLoader
from data.packing import Examples, FileRagged, Packer
from modelling.rows import batch_stats, pack_rows, pad_rows
from graphs.fused import FusedExecutor
from graphs.graphs import Graphs
from graphs.phased import PhasedExecutor
from modelling import registry, t5
from modelling.rows import RowShape
from tests.helpers import leaves, max_rel
from utils.errors import FlanT5Error


def _examples(prompt_lengths, target_lengths, seed=0, vocab=128):
    rng = np.random.default_rng(seed)
    inputs = [np.append(rng.integers(3, vocab, n - 1), 1).astype(np.int32) for n in prompt_lengths]
    targets = [np.append(rng.integers(3, vocab, n - 1), 1).astype(np.int32) for n in target_lengths]
    return Examples(inputs, targets)


def test_packed_row_layout_is_exact():
    ex = Examples([np.array([7, 8, 1]), np.array([9, 1]), np.array([5, 6, 4, 1])],
                  [np.array([11, 1]), np.array([12, 13, 1]), np.array([14, 1])])
    b = pack_rows(ex, [[0, 1], [2]], sequence_length=6, target_length=4, decoder_length=6)
    np.testing.assert_array_equal(b["input_ids"], [[7, 8, 1, 9, 1, 0], [5, 6, 4, 1, 0, 0]])
    np.testing.assert_array_equal(b["attention_mask"], [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
    # every segment's decoder input starts with the start token (0) and is its target shifted right
    np.testing.assert_array_equal(b["decoder_input_ids"], [[0, 11, 0, 12, 13, 0], [0, 14, 0, 0, 0, 0]])
    np.testing.assert_array_equal(b["labels"], [[11, 1, 12, 13, 1, -100], [14, 1, -100, -100, -100, -100]])
    np.testing.assert_array_equal(b["decoder_attention_mask"], [[1, 1, 2, 2, 2, 0], [1, 1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(b["decoder_positions"], [[0, 1, 0, 1, 2, 0], [0, 1, 0, 0, 0, 0]])
    s = batch_stats(b)
    assert s["examples"] == 3 and s["encoder_tokens"] == 9 and s["decoder_tokens"] == 7
    with pytest.raises(ValueError, match="overflows"):
        pack_rows(ex, [[0, 1, 2]], 6, 4, 6)


@pytest.mark.parametrize("in_memory", [True, False], ids=["offsets-in-memory", "offsets-read"])
def test_a_file_ragged_reads_each_sequence_and_its_length(tmp_path, monkeypatch, in_memory):
    """The token cache's files read back as written: with the offsets in memory (fewer than 2^19 sequences) and
    read by offset (more), the same sequences and lengths, any order of indices; an index out of range is refused
    and a cache cut short named."""
    if not in_memory:
        monkeypatch.setattr(FileRagged, "OFFSETS_IN_MEMORY", 3)
    seqs = [np.arange(n, dtype=np.uint16) + 7 * n for n in (3, 0, 5, 1, 9, 2)]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in seqs])]).astype(np.int64)
    np.concatenate(seqs).tofile(tmp_path / "t.bin")
    offsets.tofile(tmp_path / "t.off")
    r = FileRagged(str(tmp_path / "t.bin"), str(tmp_path / "t.off"), np.uint16, len(seqs))
    assert (r.offs is not None) is in_memory and len(r) == 6
    for i, x in enumerate(seqs):
        np.testing.assert_array_equal(r[i], x)
    idx = np.array([[4, 0], [1, 5]])
    np.testing.assert_array_equal(r.lengths(idx), [9, 3, 0, 2])
    np.testing.assert_array_equal(r.lengths(np.arange(6)), [len(x) for x in seqs])
    for bad in (-1, 6):  # no wrapping around and no reading past the end
        with pytest.raises(IndexError):
            r[bad]
        with pytest.raises(IndexError):
            r.lengths([0, bad])
    if in_memory:  # a cache cut short is named, with the fix
        offsets[:-2].tofile(tmp_path / "t.off")
        with pytest.raises(FlanT5Error, match=r"t.off holds 4 sequences' offsets, not 6: .* delete its folder"):
            FileRagged(str(tmp_path / "t.bin"), str(tmp_path / "t.off"), np.uint16, len(seqs))


def test_packer_fills_rows_and_holds_over_what_does_not_fit():
    lengths, targets = np.array([5, 5, 5, 9, 2, 6, 3]), np.full(7, 2)
    p = Packer(lengths, targets, sequence_length=10, target_length=2, decoder_length=8, max_misses=2)
    rows, held = p.fill(2, [], iter(range(7)))
    assert rows == [[0, 1], [2, 4, 6]] and held == [3, 5]  # 9 and 6 fit no row; two misses end the batch
    rows, held = p.fill(2, held, iter([]))
    assert rows == [[3], [5]] and held == []  # held-over examples open the next batch
    # MNLI-like lengths fill a 512-token row to more than 90%
    from data.generated import mnli_like_lengths

    enc, tgt = mnli_like_lengths(np.random.default_rng(0), 4000)
    assert 45 < enc.mean() < 60 and enc.max() > 200  # the means of MultiNLI and a long tail
    p = Packer(enc, tgt, 512, 8, 64)
    rows, _ = p.fill(32, [], iter(range(4000)))
    fill = sum(enc[i] for r in rows for i in r) / (32 * 512)
    assert fill > 0.9, fill


def _pair(cfg_kw, ex, packed_rows, micro_unpacked, micro_packed, T=4, D=12):
    """(unpacked config, unpacked batch, packed config, packed batch) of the same examples (targets of at most T
    tokens, packed decoder rows of D)."""
    n, L = len(ex), 32
    base = dict(sequence_length=L, decoder_sequence_length=T, packed_decoder_length=D, warmup_steps=0, **cfg_kw)
    dp = cfg_kw["data_parallel"]
    cu = load_config("finetuning", "tiny", dict(base, packing=False, global_batch_size=n, micro_batch_size=micro_unpacked))
    cp = load_config("finetuning", "tiny", dict(base, global_batch_size=len(packed_rows), micro_batch_size=micro_packed))
    bu = pad_rows(ex, range(n), L, T)
    bp = pack_rows(ex, packed_rows, L, T, D)
    shape = lambda b, c: {k: v.reshape(c.gradient_accumulation, dp * c.execution.micro_batch_size, -1)  # noqa: E731
                          for k, v in b.items()}
    return cu, shape(bu, cu), cp, shape(bp, cp)


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp,targets", [(1, 1, "summaries"), (2, 2, "labels")])
def test_packed_batch_gives_the_unpacked_loss_and_gradients(dp, tp, targets):
    """8 examples: one longer than half a row (20 of 32 tokens), and a row holding a single example; their targets
    a label's few tokens (MNLI), or summaries' tens (decoder rows of 24, packed three to a row of 48)."""
    lengths, T, D = (([3, 2, 4, 2, 3, 1, 2, 4], 4, 12) if targets == "labels" else
                     ([14, 6, 18, 3, 11, 9, 12, 17], 24, 48))
    ex = _examples([20, 5, 9, 3, 30, 7, 6, 11], lengths)
    rows = [[0, 1, 3], [4], [2, 5, 6], [7]]
    cu, bu, cp, bp = _pair(dict(data_parallel=dp, tensor_parallel=tp), ex, rows, 4 // dp, 2 // dp, T, D)
    # the same token count
    assert int(np.sum(bu["labels"] != -100)) == int(np.sum(bp["labels"] != -100)) == sum(lengths)
    assert batch_stats(bp)["examples"] == 8 and bp["input_ids"].shape[:2] == (2, 2)
    host = jax.tree.map(np.asarray, Graphs(cu).init_params())
    rng = jax.random.key_data(jax.random.key(0))

    def fused(cfg, batch):
        f = FusedExecutor(Graphs(cfg))
        loss, grads = f.loss_and_grads(f.init_state(host), f.g.shard_batch(batch), rng)
        return float(loss), leaves(grads)

    def phased(cfg, batch):
        g = Graphs(cfg)
        ph = PhasedExecutor(g)
        loss, grads = ph.loss_and_grads(ph.init_state(host), g.shard_batch(batch), rng)
        return float(loss), leaves(grads)

    for run in (fused, phased):
        (lu, gu), (lp, gp) = run(cu, bu), run(cp, bp)
        # the loss is the token sum over the token count, which is the same for both: so are the sums
        assert abs(lp - lu) <= 1e-5 * abs(lu), run.__name__
        for a, b in zip(gp, gu):
            assert a.shape == b.shape and max_rel(a, b) < 1e-5, run.__name__


def _tiny_opts(**kw):
    cfg = load_config("finetuning", "tiny", dict(sequence_length=32, data_parallel=1, tensor_parallel=1,
                                                 micro_batch_size=2, global_batch_size=2, **kw))
    return cfg, t5.T5Options.from_config(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "cudnn"])
def test_no_token_attends_across_a_segment(monkeypatch, impl):
    """Perturbing one segment's encoder and decoder tokens leaves every other segment's logits unchanged
    (through the einsum path, and through jax.nn.dot_product_attention run by XLA on this CPU)."""
    if impl == "cudnn":
        real = jax.nn.dot_product_attention
        monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **k: real(*a, **{**k, "implementation": "xla"}))
    cfg, opts = _tiny_opts()
    opts = dataclasses.replace(opts, attention_impl=impl)
    params = Graphs(cfg).init_params()
    ex = _examples([9, 6, 12], [3, 2, 3])
    b = pack_rows(ex, [[0, 1, 2]], 32, 4, 12)
    b2 = {k: v.copy() for k, v in b.items()}
    seg = 2
    b2["input_ids"][b["attention_mask"] == seg] = 77
    b2["decoder_input_ids"][(b["decoder_attention_mask"] == seg) & (b["decoder_positions"] > 0)] = 55
    out = np.asarray(t5.forward(params, jax.tree.map(jnp.asarray, b), opts))
    out2 = np.asarray(t5.forward(params, jax.tree.map(jnp.asarray, b2), opts))
    other = (b["decoder_attention_mask"][0] > 0) & (b["decoder_attention_mask"][0] != seg)
    np.testing.assert_allclose(out2[0, other], out[0, other], rtol=1e-6, atol=1e-6)
    mine = b["decoder_attention_mask"][0] == seg
    assert np.max(np.abs(out2[0, mine] - out[0, mine])) > 1e-3  # the perturbed segment itself did change


def test_packed_loader_is_deterministic_and_resumes_exactly():
    rng = np.random.default_rng(1)
    ex = _examples(rng.integers(3, 30, 200), rng.integers(1, 4, 200))
    kw = dict(fmt=registry.get("t5").rows, shape=RowShape(32, 4, 12, packing=True))
    a = TrainLoader(ex, 8, 2, seed=5, **kw)
    batches, states = [], []
    for _ in range(12):  # about 20 examples a batch: the stream crosses an epoch boundary
        states.append(a.state())
        batches.append(a.next_batch())
    held = [k for k, s in enumerate(states) if s["data_pending"]]
    assert held  # some batches held examples over; resuming from such a state gives exactly the next batches
    for k in (held[0], 7):
        b = TrainLoader(ex, 8, 2, seed=5, **kw)
        b.restore(states[k])
        for want in batches[k:k + 3]:
            got = b.next_batch()
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
    stats = [batch_stats(x)["examples"] for x in batches]
    assert min(stats) > 8  # several examples to a row


@pytest.mark.slow
def test_greedy_decoding_of_a_packed_trained_model_matches_hf(tmp_path):
    """A model fine-tuned with packed rows, exported to Hugging Face: HF generate and our cached
    greedy decoding give the same tokens on validation prompts (tied head: transformers 5 ties it)."""
    import torch
    from transformers import T5Config as HFConfig, T5ForConditionalGeneration

    import run_finetuning
    from data.tokenizer import load_tokenizer
    from modelling.hf_mapping import hf_config_dict, hf_state_dict_from_params
    from tests.helpers import SMALL, params_at
    from tests.hf_utils import hf_greedy, sharded_greedy
    from tests.mnli import load_rows, tokenize_inputs

    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + ["--steps", "3", "--learning_rate", "3e-3", "--save", save,
                                 "--tie_word_embeddings", "true", "--sequence_length", "32"])
    meta, params = params_at(save, 3)
    cfg = load_config("finetuning", "tiny", {"tie_word_embeddings": True, "sequence_length": 32})
    m = cfg.model
    kw = hf_config_dict(m)
    kw.pop("architectures"), kw.pop("model_type")
    hf = T5ForConditionalGeneration(HFConfig(**kw)).eval()
    missing = hf.load_state_dict({k: torch.tensor(v) for k, v in hf_state_dict_from_params(params, m).items()},
                                 strict=False)
    assert not [k for k in missing.missing_keys if "lm_head" not in k], missing
    rows = load_rows("synthetic", "validation_mismatched")[:6]
    feats = tokenize_inputs(rows, load_tokenizer("synthetic"), 32, registry.get("t5"))
    ref = hf_greedy(hf, feats, 4)
    ours = sharded_greedy(m, jax.tree.map(jnp.asarray, params), feats, 4, tp=2)
    np.testing.assert_array_equal(ours, ref)
