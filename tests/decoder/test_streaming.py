"""The encoder streamed from host memory while decoding (decoder/streaming.py, --stream_encoder): equal to the encoder
resident on the devices, token for token, for every search, at tp 1 and 2, with int8 weights or without; its layers
wait in host memory; a family with no encoder refuses it in one line."""

import jax
import numpy as np
import pytest
from hypothesis import given, strategies as st

from config import load_config
from data.generated import generated_batch
from decoder.decoder import Decoder
from decoder.streaming import CHUNK_ROWS, chunk_rows
from modelling.decoding import Options
from modelling.params import is_spec
from partitioning import sharding as S
from utils.errors import ConfigError


@given(st.integers(1, 200), st.integers(1, 16))
def test_a_layer_reads_the_largest_whole_share_of_rows_at_most_its_chunk(rows, most):
    c = chunk_rows(rows, most)
    assert rows % c == 0 and 1 <= c <= most
    assert not any(rows % d == 0 for d in range(c + 1, min(rows, most) + 1))


def _tokens(tp: int, quantize: str, stream: bool, options: Options, rows: int = 16):
    cfg = load_config("inference", "tiny", dict(eval=True, data_parallel=1, tensor_parallel=tp, micro_batch_size=rows,
                                                quantize=quantize, stream_encoder=stream, sequence_length=32))
    g = Decoder.of_config(cfg)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda s: (s.std or 0.0) * rng.standard_normal(s.shape).astype(np.float32)
                        + (0.0 if s.std else 1.0), g.specs, is_leaf=is_spec)
    params = g.weights.place(host)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(params["encoder"]["layers"])}
    assert kinds == ({"pinned_host"} if stream else {"device"}), kinds  # where the encoder's layers wait
    assert {x.sharding.memory_kind for x in jax.tree.leaves(params["decoder"])} == {"device"}
    data = generated_batch(cfg, seed=0, packing=False)
    ids, mask = data["input_ids"].reshape(-1, 32)[:rows], data["attention_mask"].reshape(-1, 32)[:rows]
    ids, mask = S.put_global(ids, g.row_sharding), S.put_global(mask, g.row_sharding)
    return np.asarray(g.search(options, seed=3)(params, ids, mask))


@pytest.mark.parametrize("tp,quantize,options", [
    (2, "none", Options(6)),  # greedy; 16 rows through each layer in 2 chunks of CHUNK_ROWS
    (1, "int8", Options(6, num_beams=3)),  # beam search reads the streamed encoder's output too
    (2, "int8", Options(6, do_sample=True, top_k=5)),
])
@pytest.mark.slow
def test_a_streamed_encoder_decodes_the_same_tokens_as_a_resident_one(tp, quantize, options):
    assert 16 // chunk_rows(16) > 1 and CHUNK_ROWS < 16  # (the layer program reads the rows in pieces)
    resident = _tokens(tp, quantize, False, options)
    streamed = _tokens(tp, quantize, True, options)
    np.testing.assert_array_equal(streamed, resident)
    assert len(np.unique(resident)) > 3  # (a real decoding: not one token over and over)


def test_a_family_without_an_encoder_refuses_to_stream_one():
    with pytest.raises(ConfigError, match="no encoder.*drop --stream_encoder"):
        Decoder.of_config(load_config("inference", "gptj_tiny", dict(eval=True, stream_encoder=True, tensor_parallel=1)))
