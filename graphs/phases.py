"""The phase library: the per-device bodies of a training step, shared by both executors.

A body runs on one device (inside ``shard_map``, tensor parallelism through ``tp_axis``) on
one micro-batch, with its weights already all-gathered (RTS) and cast to the compute dtype:

    embeddings       token ids -> residual stream                    (model: t5.embeddings)
    biases           a stack's attention biases from relpos and the micro-batch's segments
    block            one encoder or decoder layer, forward            (model: t5.t5_block)
    block_backward   one layer's backward, recomputing its forward from the layer's input
    encoder_head     the encoder's final norm                         (model: t5.encoder_head)
    head_loss        final norm + LM head + vocab-sharded cross entropy, summed over tokens
    update_group     the optimizer update of one weight group         (graphs/optim.py)

Executors are schedules over these bodies:
- fused (graphs/fused.py): ``loss`` composes the bodies into the loss of one micro-batch and
  differentiates it; with recomputation every layer's backward is ``block_backward`` (the
  forward keeps only each layer's input), so both executors run the same layer backward;
- phased (graphs/phased.py): each body is a program of its own over all micro-batches, with its
  weights streamed in from host memory (graphs/phase_programs.py).

The two stacks differ only in what ``Stack`` says, so both executors loop over ``STACKS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from modelling import layers as L
from modelling import t5


@dataclass(frozen=True)
class Stack:
    """What distinguishes the encoder from the decoder in a training step."""

    name: str  # key of the stack in the parameter tree
    decoder: bool  # self-attention is causal and a cross-attention reads the encoder output
    ids: str  # batch key of the stack's token ids
    embed_stream: int  # dropout stream of its embedding (modelling/t5.py)
    layers_stream: int  # dropout stream of its layers (then folded with the layer index)
    meta: tuple  # batch keys its attention biases read (segment ids and, for packed rows, positions)


ENCODER = Stack("encoder", False, "input_ids", t5.ENC_EMBED, t5.ENC_LAYERS, ("attention_mask", "positions"))
DECODER = Stack("decoder", True, "decoder_input_ids", t5.DEC_EMBED, t5.DEC_LAYERS,
                ("attention_mask", "positions", "decoder_attention_mask", "decoder_positions"))
STACKS = (ENCODER, DECODER)


def stack_meta(stack: Stack, batch: dict) -> dict:
    """The entries of a batch (or micro-batch) that a stack's biases need."""
    return {k: batch[k] for k in stack.meta if k in batch}


def head_subtree(tree: dict, tied: bool) -> dict:
    """The weights (or their gradients, shardings ...) of the head phase, with their whole-tree paths."""
    out = {"decoder": {"final_norm": tree["decoder"]["final_norm"]}}
    out["shared" if tied else "lm_head"] = tree["shared" if tied else "lm_head"]
    return out


def layer_list(layers: dict) -> list:
    """Stacked layer weights ``{name: [n, ...]}`` -> a list of the n per-layer trees."""
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    return [jax.tree.map(lambda w: w[i], layers) for i in range(n)]


def unstack_layers(tree: dict) -> dict:
    """The tree with each stack's stacked layer weights split into a list of per-layer trees
    (``layer_list``), each leaf its own buffer."""
    out = dict(tree)
    for stack in STACKS:
        out[stack.name] = {**tree[stack.name], "layers": layer_list(tree[stack.name]["layers"])}
    return out


def stack_layers(tree: dict) -> dict:
    """The inverse of ``unstack_layers``."""
    out = dict(tree)
    for stack in STACKS:
        s = dict(tree[stack.name])
        s["layers"] = jax.tree.map(lambda *ws: jnp.stack(ws), *s["layers"])
        out[stack.name] = s
    return out


def with_accumulators(layers_p: dict, acc: dict) -> dict:
    """One layer's weights (or a stack's) with every matmul weight paired with its float32 gradient
    accumulator (``layers.Accumulating``: the weight-gradient GEMM adds into it); the norms stay plain."""
    return {k: w if k.endswith("norm") else L.Accumulating(w, acc[k]) for k, w in layers_p.items()}


def accumulating_layers(p: dict, acc: dict) -> dict:
    """The whole weight tree with every stack's layers ``with_accumulators`` (stacked, or lists of
    per-layer trees after ``unstack_layers``); ``acc`` has the tree's structure."""
    out = dict(p)
    for stack in STACKS:
        s, a = dict(p[stack.name]), acc[stack.name]["layers"]
        if isinstance(s["layers"], list):
            s["layers"] = [with_accumulators(lp, la) for lp, la in zip(s["layers"], a)]
        else:
            s["layers"] = with_accumulators(s["layers"], a)
        out[stack.name] = s
    return out


def accumulate(acc, grads):
    """The accumulators after one micro-batch: ``acc + grads``, where a gradient taken through
    ``with_accumulators`` already is the new accumulator."""
    return jax.tree.map(lambda a, g: g.acc if isinstance(g, L.Accumulating) else a + g.astype(a.dtype), acc, grads,
                        is_leaf=lambda n: isinstance(n, L.Accumulating))


def micro_key(base: Optional[jax.Array], i) -> Optional[jax.Array]:
    """The dropout key of micro-batch ``i`` (None without dropout)."""
    return None if base is None else jax.random.fold_in(base, i)


def stream_key(key: Optional[jax.Array], *streams) -> Optional[jax.Array]:
    """A micro-batch key folded with a stream (and a layer index): modelling/t5.py's convention."""
    return t5._rng(key, *streams)


class PhaseBodies:
    """The per-device phase bodies for one model configuration (see the module docstring)."""

    def __init__(self, opts: t5.ModelOptions, tp_axis: Optional[str]):
        self.opts, self.tp = opts, tp_axis

    # ------------------------------------------------------------------ forward bodies

    def embeddings(self, shared: jax.Array, ids: jax.Array, rng=None) -> jax.Array:
        """shared [Vl, d] (compute dtype), ids int [b, l] -> float32 [b, l, d], identical over tp."""
        return t5.embeddings(shared, ids, self.opts, self.tp, rng)

    def biases(self, stack: Stack, relpos: jax.Array, meta: dict, length: int) -> tuple:
        """(self-attention bias [1 or b, h, l, l], cross-attention bias or None) of one micro-batch.

        meta: ``stack_meta`` of the micro-batch; length: the stack's sequence length."""
        packed = t5.is_packed(meta)
        if not stack.decoder:
            return t5.encoder_self_bias(relpos, meta["attention_mask"], self.opts, meta.get("positions")), None
        self_bias = t5.decoder_self_bias(relpos, length, self.opts, meta.get("decoder_attention_mask"),
                                         meta.get("decoder_positions"))
        return self_bias, t5.cross_bias(meta["attention_mask"], meta.get("decoder_attention_mask"), packed)

    def block(self, stack: Stack, p: dict, x: jax.Array, self_bias, cross_bias, enc, rng=None) -> jax.Array:
        """One layer. p: its weights (no layers axis); x float32 [b, l, d]; enc [b, k, d] (decoder)."""
        return t5.t5_block(p, x, self_bias, self.opts, self.tp, enc if stack.decoder else None, cross_bias, rng)

    def block_backward(self, stack: Stack, p: dict, x, self_bias, cross_bias, enc, rng, dy) -> tuple:
        """One layer's backward from its input: recomputes the forward, then its vjp.

        -> (gradient of p, dx, gradient of the self bias, gradient of enc (None for the encoder)).
        """
        if stack.decoder:
            _, vjp = jax.vjp(lambda p_, x_, b_, e_: self.block(stack, p_, x_, b_, cross_bias, e_, rng),
                             p, x, self_bias, enc)
            return vjp(dy)
        _, vjp = jax.vjp(lambda p_, x_, b_: self.block(stack, p_, x_, b_, None, None, rng), p, x, self_bias)
        return (*vjp(dy), None)

    def encoder_head(self, final_norm: jax.Array, x: jax.Array, rng=None) -> jax.Array:
        """Final encoder norm. x float32 [b, l, d] -> float32 [b, l, d]."""
        return t5.encoder_head(final_norm, x, self.opts, rng)

    def head_loss(self, head_p: dict, x: jax.Array, labels: jax.Array, rng=None) -> jax.Array:
        """head_p: ``head_subtree`` of the weights; x float32 [b, l, d]; labels int [b, l] (-100 ignored)
        -> the sum of the token cross entropies, identical over tp."""
        return t5.head(head_p, x, labels, self.opts, self.tp, rng)

    # ------------------------------------------------------------------ the fused composition

    def layers(self, stack: Stack, layers_p: dict, x: jax.Array, self_bias, cross_bias, enc, rng=None):
        """Every layer of a stack on one micro-batch: scanned over the stacked weights, or traced one by
        one (``unroll_layers``, or ``layers_p`` a list of per-layer weights); with ``recompute`` each
        layer's backward is ``block_backward`` (remat_policy full), or autodiff's keeping the matmul
        outputs (save_dots)."""
        def block(p, x_, sb, cb, e, r):
            return self.block(stack, p, x_, sb, cb, e, r)

        if self.opts.recompute and self.opts.remat_policy == "save_dots":
            # keep the outputs of the weight matmuls (projections and feed-forward, ``layers.dense``), recompute
            # the elementwise work, norms and attention from them
            block = jax.checkpoint(block, policy=jax.checkpoint_policies.save_only_these_names(L.DENSE))
        elif self.opts.recompute:
            block = self._recomputed_block(stack)

        def body(x_, inputs):
            p, i = inputs
            r = None if rng is None else jax.random.fold_in(rng, i)
            return block(p, x_, self_bias, cross_bias, enc, r), None

        if self.opts.unroll_layers and not isinstance(layers_p, list):
            layers_p = layer_list(layers_p)
        if isinstance(layers_p, list):  # per-layer weights: traced one by one
            for i, p in enumerate(layers_p):
                x, _ = body(x, (p, jnp.int32(i)))
            return x
        n = jax.tree_util.tree_leaves(layers_p)[0].shape[0]
        return lax.scan(body, x, (layers_p, jnp.arange(n)))[0]

    def _recomputed_block(self, stack: Stack):
        """``block`` whose backward is ``block_backward``: the forward saves only the layer's inputs."""

        @jax.custom_vjp
        def f(p, x, sb, cb, enc, rng):
            return self.block(stack, p, x, sb, cb, enc, rng)

        def fwd(p, x, sb, cb, enc, rng):
            return f(p, x, sb, cb, enc, rng), (p, x, sb, cb, enc, rng)

        def bwd(res, dy):
            p, x, sb, cb, enc, rng = res
            g_p, dx, g_sb, g_enc = self.block_backward(stack, p, x, sb, cb, enc, rng, dy)
            return g_p, dx, g_sb, None, g_enc, None

        f.defvjp(fwd, bwd)
        return f

    def loss(self, p: dict, mb: dict, rng=None) -> jax.Array:
        """The whole model on one micro-batch -> sum of token cross entropies.

        p: all weights, gathered and in the compute dtype; mb: one micro-batch {key: [b, l]};
        rng: this micro-batch's dropout key (``micro_key``) or None.
        """
        enc = None
        for stack in STACKS:
            sp = p[stack.name]
            x = self.embeddings(p["shared"], mb[stack.ids], stream_key(rng, stack.embed_stream))
            self_bias, cross_bias = self.biases(stack, sp["relpos"], stack_meta(stack, mb), x.shape[1])
            x = self.layers(stack, sp["layers"], x, self_bias, cross_bias, enc, stream_key(rng, stack.layers_stream))
            if not stack.decoder:
                enc = self.encoder_head(sp["final_norm"], x, stream_key(rng, t5.ENC_HEAD))
        head_p = head_subtree(p, self.opts.tie_word_embeddings)
        return self.head_loss(head_p, x, mb["labels"], stream_key(rng, t5.HEAD))
