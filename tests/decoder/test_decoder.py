"""The decoder (decoder/decoder.py) decoding batches of prompts: batches that do not divide the split score every
sample once, each as it decodes alone; prompts packed for the encoder (modelling/rows.py's ``pack_prompts``,
``Decoder.pack``): every prompt token read once, in its own segment with its own positions, each data-parallel group
apart, and packed prompts decoding the tokens padded ones do, for every search, at dp x tp; on a CPU a shallow T5
decoder held one tree per layer (``unrolled_decoder``: by platform, family and depth) decoding the scanned one's
tokens, for every search, at dp x tp, with int8 weights or without."""

import logging

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from config import load_config
from decoder.decoder import Decoder
from modelling.decoding import Options
from modelling.params import is_spec
from modelling.rows import pack_prompts
from partitioning import sharding as S


@pytest.mark.slow
def test_batches_that_do_not_divide_the_split_score_every_sample_once(tmp_path):
    from config import load_config
    from data.tokenizer import load_tokenizer
    from decoder.decoder import Decoder
    from tests.mnli import load_rows, tokenize_inputs

    cfg = load_config("inference", "tiny", {"micro_batch_size": 4, "tensor_parallel": 2, "rts": False})
    tok = load_tokenizer("synthetic")
    v = Decoder.of_config(cfg, tok)
    params = v.place.init_params()
    rows = load_rows("synthetic", "validation")[:7]  # 7 = 4 + 3: the last batch is short
    feats = tokenize_inputs(rows, tok, cfg.model.sequence_length, v.family)
    texts = v.predict(params, feats)
    assert len(texts) == 7 and all(t is not None for t in texts)
    for i in range(7):  # each row alone gives the same text
        alone = {k: x[i: i + 1] for k, x in feats.items()}
        assert v.predict(params, alone) == [texts[i]]


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([1, 2, 4]), st.integers(4, 24), st.sampled_from([1, 2]), st.sampled_from([1, 2, 3]))
def test_every_prompt_token_is_read_once_in_a_segment_of_its_own(data, groups, k, widen, multiple):
    per = data.draw(st.integers(1, 7))
    lengths = data.draw(st.lists(st.integers(1, k), min_size=groups * per, max_size=groups * per))
    b, width = len(lengths), k * widen
    mask = (np.arange(k)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    ids = (np.arange(b * k).reshape(b, k) + 1) * mask  # every token its own id
    out = pack_prompts(ids, mask, groups=groups, width=width, multiple=multiple)
    if out is None:  # nothing saved: a group needs as many rows as it has prompts (rounded up to the multiple)
        return
    fewest = max(-(-sum(lengths[g * per: (g + 1) * per]) // width) for g in range(groups))  # no packing does better
    pids, segs, pos, where = out
    p = pids.shape[0] // groups
    assert p < per and pids.shape == segs.shape == pos.shape == (groups * p, width) and where.shape == (b, k)
    assert p % multiple == 0 and p >= fewest  # (few shapes: each one a program compiled)
    for r in range(b):
        g, n = r // per, lengths[r]
        flat = where[r, :n]
        assert (where[r, n:] == p * width).all()  # padding reads the zero row
        assert ((flat >= 0) & (flat < p * width)).all()  # within its group's rows
        rows, cols = g * p + flat // width, flat % width
        np.testing.assert_array_equal(pids[rows, cols], ids[r, :n])  # its tokens, in order
        np.testing.assert_array_equal(pos[rows, cols], np.arange(n))  # positions restart
        assert len(set(rows)) == 1 and (segs[rows, cols] == segs[rows[0], cols[0]]).all() and segs[rows[0], cols[0]] > 0
        others = (segs[rows[0]] == segs[rows[0], cols[0]]).sum()
        assert others == n  # no other prompt in its segment
    assert (pids != 0).sum() == sum(lengths)  # every token once, nothing else


def _decode(dp, tp, options, lengths, packed: bool, quantize="none", unrolled=None):
    k = 32
    cfg = load_config("inference", "tiny", dict(eval=True, data_parallel=dp, tensor_parallel=tp,
                                                micro_batch_size=len(lengths) // dp, quantize=quantize,
                                                sequence_length=k))
    g = Decoder.of_config(cfg)
    assert unrolled is None or bool(g.unrolled_stacks) == unrolled
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda s: (s.std or 0.0) * rng.standard_normal(s.shape).astype(np.float32)
                        + (0.0 if s.std else 1.0), g.specs, is_leaf=is_spec)
    params = g.weights.place(host)
    mask = (np.arange(k)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    ids = rng.integers(2, 128, mask.shape).astype(np.int32) * mask
    if packed:
        assert g.pack(ids, mask) is not None  # (the batch does pack)
    run = g.search(options, seed=2)
    if packed:
        return np.asarray(run(params, ids, mask))  # numpy: the program packs them
    return np.asarray(run(params, S.put_global(ids, g.row_sharding), S.put_global(mask, g.row_sharding)))


@pytest.mark.parametrize("dp,tp,options,quantize", [
    (1, 1, Options(6), "none"),
    (2, 2, Options(6, num_beams=3), "int8"),
    (2, 1, Options(6, do_sample=True, top_k=4), "none"),
])
@pytest.mark.slow
def test_packed_prompts_decode_the_tokens_padded_ones_do(dp, tp, options, quantize):
    lengths = [30, 5, 26, 3, 20, 9, 7, 11] * dp  # short prompts beside long ones: fewer rows packed
    assert _decode(dp, tp, options, lengths, True, quantize).tolist() == \
        _decode(dp, tp, options, lengths, False, quantize).tolist()


def test_the_packing_width_is_the_cheapest():
    """Prompts that pair with none in rows of their own width (all longer than half of it) pack into wider rows, the
    width of the fewest weighted positions of k, 3k/2, 2k and 4k: MultiNLI-like lengths in 8 rows of 128 become 4
    of 192 (as many positions as 3 of 256, a quarter fewer attention pairs); prompts all of one length are not
    packed."""
    g = Decoder.of_config(load_config("inference", "small", dict(eval=True, data_parallel=1, tensor_parallel=1,
                                                      micro_batch_size=8, sequence_length=128)),
               mesh=S.make_mesh(1, 1))
    lengths = np.array([119, 105, 97, 81, 84, 66, 68, 65])
    mask = (np.arange(128)[None] < lengths[:, None]).astype(np.int32)
    assert pack_prompts(mask, mask, width=128) is None
    ids, segs, pos, where = g.pack(mask, mask)
    assert ids.shape == (4, 192)
    costs = {w: g.packed_cost(pack_prompts(mask, mask, width=w)[0].shape[0], w) for w in (192, 256, 512)}
    assert costs[192] == min(costs.values()) < costs[256]
    assert pack_prompts(mask, mask, width=256)[0].shape[0] == 3  # (the width before: as many positions, 4 x 192)
    full = np.ones((8, 128), np.int32)
    assert g.pack(full, full) is None


def test_a_new_packed_shape_compiles_the_encoder_alone(caplog):
    """Batches whose prompts pack into different numbers of rows are different programs: the encoder over the packed
    rows is compiled for each, the search (the decoding loop: seconds to compile) once per prompt width."""
    cfg = load_config("inference", "tiny", dict(eval=True, data_parallel=1, tensor_parallel=1, micro_batch_size=8,
                                                sequence_length=32))
    g = Decoder.of_config(cfg)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda s: (s.std or 0.0) * rng.standard_normal(s.shape).astype(np.float32)
                        + (0.0 if s.std else 1.0), g.specs, is_leaf=is_spec)
    params, run = g.weights.place(host), g.search(Options(3))
    shapes = []
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING, logger="jax"):
            for lengths in ([30, 5, 26, 3, 20, 9, 7, 11], [4] * 6 + [30] * 2, [30] * 6 + [2] * 2, [3] * 8):
                mask = (np.arange(32)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
                ids = rng.integers(2, 128, mask.shape).astype(np.int32) * mask
                shapes.append(g.pack(ids, mask)[0].shape)
                run(params, ids, mask)
    finally:
        jax.config.update("jax_log_compiles", False)
    assert len(set(shapes)) == 4  # (four packed shapes: (4, 32), (3, 32), (6, 32), (1, 32))
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Finished XLA compilation")]
    assert sum("jit(encode)" in m for m in compiled) == 4
    assert sum("jit(search)" in m for m in compiled) == 1


@pytest.mark.parametrize("dp", [1, 2])
def test_a_group_s_packed_rows_are_a_multiple_of_an_eighth_of_its_rows(dp):
    """16 rows a group: packed into an even number of rows (where first-fit needs an odd one, one row of nothing
    after them)."""
    b, k = 16 * dp, 32
    g = Decoder.of_config(load_config("inference", "tiny", dict(eval=True, data_parallel=dp, tensor_parallel=1,
                                                     micro_batch_size=16, sequence_length=k)))
    rng, odd = np.random.default_rng(0), 0
    for _ in range(20):
        lengths = rng.integers(1, k + 1, b)
        mask = (np.arange(k)[None] < lengths[:, None]).astype(np.int32)
        packed = g.pack(mask, mask)
        if packed is None:
            continue
        rows, width = packed[0].shape
        first_fit = pack_prompts(mask, mask, groups=dp, width=width)[0].shape[0] // dp
        assert rows // dp == first_fit + first_fit % 2  # (rounded up to the next even number, no further)
        odd += first_fit % 2  # (where rounding did work)
    assert odd > 0


def test_a_shallow_t5_decoder_is_held_one_tree_per_layer_on_a_cpu_alone():
    """The choice: a CPU, a family whose steps take one tree per layer (T5's), at most UNROLL_LAYERS deep; a GPU or
    a TPU scans (it reads a layer's slice inside its GEMMs), as does GPT-J, and a deeper decoder (compile time)."""
    from decoder import decoder as engine
    from modelling import registry

    t5, gptj = registry.get("t5"), registry.get("gptj")
    assert engine.unrolled_decoder(t5, "cpu", engine.UNROLL_LAYERS) and engine.unrolled_decoder(t5, "cpu", 1)
    assert not engine.unrolled_decoder(t5, "cpu", engine.UNROLL_LAYERS + 1)
    assert not engine.unrolled_decoder(t5, "gpu", 2) and not engine.unrolled_decoder(t5, "tpu", 2)
    assert not engine.unrolled_decoder(gptj, "cpu", 2) and engine.UNROLL_LAYERS == 12  # (base's decoder)
    g = Decoder.of_config(load_config("inference", "tiny", dict(eval=True, tensor_parallel=1, data_parallel=1)))
    shapes = g.abstract_decode_params()
    assert g.unrolled_stacks == ("decoder",) and isinstance(shapes["decoder"]["layers"], list)
    assert len(shapes["decoder"]["layers"]) == g.cfg.model.layers and isinstance(shapes["encoder"]["layers"], dict)
    deep = Decoder.of_config(load_config("inference", "tiny", dict(eval=True, tensor_parallel=1, data_parallel=1,
                                                                   layers=13)))
    assert deep.unrolled_stacks == () and isinstance(deep.abstract_decode_params()["decoder"]["layers"], dict)


@pytest.mark.parametrize("dp,tp,options,quantize", [
    (1, 1, Options(6), "none"),
    (1, 2, Options(6, num_beams=3), "int8"),
    (2, 1, Options(6, do_sample=True, top_k=4), "none"),
])
@pytest.mark.slow
def test_the_decoder_held_one_tree_per_layer_decodes_the_scanned_tokens(dp, tp, options, quantize, monkeypatch):
    """The same weights decoded by the decoder's layers one after the other (each layer's weights and caches its
    own arrays) and scanned over the stacked layers: the same tokens, every search, packed prompts and padded."""
    from decoder import decoder as engine

    lengths = [30, 5, 26, 3] * dp
    unrolled = [_decode(dp, tp, options, lengths, packed, quantize, unrolled=True) for packed in (True, False)]
    monkeypatch.setattr(engine, "unrolled_decoder", lambda *a: False)
    scanned = [_decode(dp, tp, options, lengths, packed, quantize, unrolled=False) for packed in (True, False)]
    assert [x.tolist() for x in unrolled] == [x.tolist() for x in scanned]
    assert len(set(unrolled[0].ravel().tolist())) > 3  # tokens that tell the layers apart
