"""The encoder streamed from host memory while decoding (``--stream_encoder``), as phased training streams layers.

An encoder-decoder reads its prompts once, through the encoder, and then decodes token by token through the
decoder alone; the encoder's weights sit idle on the device for the whole decoding. With ``inference.
stream_encoder`` they stay in host memory (decoding's layout, ``Decoder.decode_shardings``: one tree per layer, in
``pinned_host``) and each batch of prompts reads them a layer at a time: layer i+1 is copied to the device while
layer i runs, so the device holds two encoder layers, the decoder, the KV cache and the encoder's activations
[rows, prompt, d] (float32) for this batch. The rows pass through a layer a few at a time (``CHUNK_ROWS``), which
bounds the layer's temporaries (the feed-forward's [rows x prompt, d_ff] and the attention's [rows, heads, prompt,
prompt] scores) whatever the batch.

The programs are the families' own phase bodies, those the phased executor composes for training
(``Family.embeddings``, ``context``, ``block``, ``stack_output``), so the encoder computes what it computes inside
the decoding program: tests/decoder/test_streaming.py holds the two equal token for token.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from partitioning import sharding as S

CHUNK_ROWS = 8  # rows through a layer at once (a device's share of the batch, in pieces of at most this many)


def chunk_rows(rows: int, most: int = CHUNK_ROWS) -> int:
    """The largest divisor of ``rows`` (a device's rows) that is at most ``most``: the rows a layer reads at once."""
    return max(d for d in range(1, min(rows, most) + 1) if rows % d == 0)


class PromptStream:
    """The prompt stack (T5's encoder) of a Decoder with ``prompt_stacks``: weights in decoding's layout (its layers
    in host memory) and prompts ids/mask [B, k] on the devices -> the stack's output float32 [B, k, d]."""

    def __init__(self, decoder):
        g = self.g = decoder
        if len(g.prompt_stacks) != 1 or g.family.stacks[0].name != g.prompt_stacks[0]:
            raise NotImplementedError("streaming reads one prompt stack, the family's first")
        family, opts, stack = g.family, g.opts, g.family.stacks[0]
        self.stack = stack
        specs = g.decode_specs()[stack.name]
        row_specs = specs["layers"][0]
        self.ctx_names = tuple(stack.context)
        ctx_specs = {k: specs[k] for k in self.ctx_names if k in specs}
        x_spec, rows_spec = P(S.DP, None, None), P(S.DP, None)
        self.device_rows = jax.tree.map(lambda sh: NamedSharding(sh.mesh, sh.spec),  # (the devices' own memory)
                                        g.decode_shardings()[stack.name]["layers"][0])

        def embed(shared, ids):
            return family.embeddings(shared, ids, opts, S.TP)

        def layer(p, ctx_w, mask, x):  # a device's rows a chunk at a time: [b, k, d] -> [b, k, d]
            b, k = mask.shape
            c = chunk_rows(b)

            def one(args):
                xc, mc = args
                self_ctx, cross_ctx = family.context(stack, ctx_w, {"attention_mask": mc}, k, opts)
                return family.block(stack, p, xc, self_ctx, cross_ctx, None, opts, S.TP)

            out = lax.map(one, (x.reshape(b // c, c, k, -1), mask.reshape(b // c, c, k)))
            return out.reshape(x.shape)

        def output(w, x):
            return family.stack_output(stack, w, x, opts)

        self.embed = g.phase(embed, (g.decode_specs()["shared"], rows_spec), x_spec)
        self.layer = jax.jit(jax.shard_map(layer, mesh=g.mesh, in_specs=(row_specs, ctx_specs, rows_spec, x_spec),
                                           out_specs=x_spec, check_vma=False), donate_argnums=3)
        self.output = g.phase(output, (specs[stack.output], x_spec), x_spec) if stack.output else None

    def load(self, row):
        """One layer's weights, from host memory to the devices (asynchronous: it overlaps the running layer)."""
        return jax.device_put(row, self.device_rows)

    def __call__(self, params: dict, ids, mask):
        """The prompt stack's output for prompts ids/mask [B, k]: each layer loaded while the previous one runs."""
        sub = params[self.stack.name]
        rows = sub["layers"]
        ctx_w = {k: sub[k] for k in self.ctx_names if k in sub}
        x = self.embed(params["shared"], ids)
        nxt = self.load(rows[0])
        for i in range(len(rows)):
            cur, nxt = nxt, (self.load(rows[i + 1]) if i + 1 < len(rows) else None)
            x = self.layer(cur, ctx_w, mask, x)
            del cur
        return self.output(sub[self.stack.output], x) if self.output else x
