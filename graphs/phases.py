"""The phase library: the per-device bodies of a training step, shared by both executors, for any family.

A body runs on one device (inside ``shard_map``, tensor parallelism through ``tp_axis``) on
one micro-batch, with its weights already all-gathered (RTS) and cast to the compute dtype. The
family (modelling/family.py) supplies the model; this module composes it:

    embeddings       token ids -> residual stream
    context          a stack's attention context (biases, rotary tables) from its context weights
                     and the micro-batch's segments and positions
    block            one layer of a stack, forward
    block_backward   one layer's backward, recomputing its forward from the layer's input
    stack_output     a stack's final norm whose output the next stack reads (T5's encoder)
    head_loss        final norm + LM head + vocab-sharded cross entropy, summed over tokens
    update_group     the optimizer update of one weight group         (graphs/optim.py)

Executors are schedules over these bodies:
- fused (graphs/fused.py): ``loss`` composes the bodies into the loss of one micro-batch and
  differentiates it; with recomputation every layer's backward is ``block_backward`` (the
  forward keeps only each layer's input), so both executors run the same layer backward;
- phased (graphs/phased.py): each body is a program of its own over all micro-batches, with its
  weights streamed in from host memory (graphs/phase_programs.py).

Stacks differ only in what their ``Stack`` says, so both executors loop over the family's stacks.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from modelling import family as families
from modelling import layers as L
from modelling import lora
from modelling.family import Family, Stack
from partitioning.tree import TreeStructure, layer_list


def stack_meta(stack: Stack, batch: dict) -> dict:
    """The entries of a batch (or micro-batch) that a stack's context needs."""
    return {k: batch[k] for k in stack.meta if k in batch}


def context_weights(stack: Stack, stack_tree: dict) -> dict:
    """The stack's own weights its context reads (``{}`` for none), from the stack's subtree."""
    return {k: stack_tree[k] for k in stack.context}


def micro_key(base: Optional[jax.Array], i) -> Optional[jax.Array]:
    """The dropout key of micro-batch ``i`` (None without dropout)."""
    return None if base is None else jax.random.fold_in(base, i)


def stream_key(key: Optional[jax.Array], *streams) -> Optional[jax.Array]:
    """A micro-batch key folded with a stream (and a layer index): modelling/family.py's convention."""
    return families.rng(key, *streams)


def accumulate(acc, grads):
    """The accumulators after one micro-batch: ``acc + grads``, where a gradient taken through
    ``with_accumulators`` already is the new accumulator."""
    return jax.tree.map(lambda a, g: g.acc if isinstance(g, L.Accumulating) else a + g.astype(a.dtype), acc, grads,
                        is_leaf=lambda n: isinstance(n, L.Accumulating))


class PhaseBodies:
    """The per-device phase bodies for one model configuration (see the module docstring)."""

    def __init__(self, opts: families.ModelOptions, tp_axis: Optional[str], family: Family, tree=None):
        self.opts, self.tp = opts, tp_axis
        self.family = family
        self.stacks = self.family.stacks
        self.tree = tree or TreeStructure(tuple(s.name for s in self.stacks), self.family.head_paths(opts))

    def cast(self, tree):
        """Weights in the compute dtype (the family's float32 weights, norms and tables, kept)."""
        return families.cast_params(tree, self.opts.compute_dtype, self.family.keeps_f32)

    # ------------------------------------------------------------------ accumulation of layer gradients

    def with_accumulators(self, layers_p: dict, acc: dict) -> dict:
        """One layer's weights (or a stack's) with every matmul weight paired with its float32 gradient
        accumulator (``layers.Accumulating``: the weight-gradient GEMM adds into it); the rest stays plain."""
        dense = self.family.is_dense
        return {k: L.Accumulating(w, acc[k]) if dense(k) else w for k, w in layers_p.items()}

    def accumulating_layers(self, p: dict, acc: dict) -> dict:
        """The whole weight tree with every stack's layers ``with_accumulators`` (stacked, or lists of
        per-layer trees after ``unstack_layers``); ``acc`` has the tree's structure."""
        out = dict(p)
        for stack in self.stacks:
            s, a = dict(p[stack.name]), acc[stack.name]["layers"]
            if isinstance(s["layers"], list):
                s["layers"] = [self.with_accumulators(lp, la) for lp, la in zip(s["layers"], a)]
            else:
                s["layers"] = self.with_accumulators(s["layers"], a)
            out[stack.name] = s
        return out

    # ------------------------------------------------------------------ forward bodies

    def embeddings(self, shared: jax.Array, ids: jax.Array, rng=None) -> jax.Array:
        """shared [Vl, d] (compute dtype), ids int [b, l] -> float32 [b, l, d], identical over tp."""
        return self.family.embeddings(shared, ids, self.opts, self.tp, rng)

    def context(self, stack: Stack, ctx_w: dict, meta: dict, length: int) -> tuple:
        """(self-attention context, cross-attention context or None) of one micro-batch.

        ctx_w: ``context_weights``; meta: ``stack_meta`` of the micro-batch; length: the stack's length."""
        return self.family.context(stack, ctx_w, meta, length, self.opts)

    def block(self, stack: Stack, p: dict, x: jax.Array, self_ctx, cross_ctx, enc, rng=None) -> jax.Array:
        """One layer. p: its weights (no layers axis), with LoRA adapters beside them (modelling/lora.py); x float32
        [b, l, d]; enc [b, k, d] (cross stacks)."""
        if lora.enabled(self.opts):
            p = lora.attach(p, self.family, self.opts, self.tp, rng)
        return self.family.block(stack, p, x, self_ctx, cross_ctx, enc, self.opts, self.tp, rng)

    def block_backward(self, stack: Stack, p: dict, x, self_ctx, cross_ctx, enc, rng, dy, extra=None) -> tuple:
        """One layer's backward from its input: recomputes the forward, then its vjp.

        -> (gradient of p, dx, gradient of the self context (None when the stack has no context
        weights), gradient of enc (None for a stack without cross-attention)). ``extra``: more weights of the layer,
        constants of the vjp (LoRA's frozen base: only the adapters are differentiated).
        """
        ctx_free = not stack.context  # a context without weights needs no gradient
        if lora.enabled(self.opts) and extra is None:  # the frozen weights get no gradient (None: a zero, never formed)
            frozen = {k: v for k, v in p.items() if not lora.is_adapter(k)}
            g_a, *rest = self.block_backward(stack, {k: v for k, v in p.items() if lora.is_adapter(k)}, x, self_ctx,
                                             cross_ctx, enc, rng, dy, frozen)
            return ({**{k: None for k in frozen}, **g_a}, *rest)
        extra = extra or {}

        def f(p_, x_, c_, e_):
            return self.block(stack, {**extra, **p_}, x_, self_ctx if ctx_free else c_, cross_ctx, e_, rng)

        if stack.cross:
            if ctx_free:
                _, vjp = jax.vjp(lambda p_, x_, e_: f(p_, x_, None, e_), p, x, enc)
                g_p, dx, g_e = vjp(dy)
                return g_p, dx, None, g_e
            _, vjp = jax.vjp(f, p, x, self_ctx, enc)
            return vjp(dy)
        if ctx_free:
            _, vjp = jax.vjp(lambda p_, x_: f(p_, x_, None, None), p, x)
            return (*vjp(dy), None, None)
        _, vjp = jax.vjp(lambda p_, x_, c_: f(p_, x_, c_, None), p, x, self_ctx)
        return (*vjp(dy), None)

    def stack_output(self, stack: Stack, w: jax.Array, x: jax.Array, rng=None) -> jax.Array:
        """A stack's output norm (T5's encoder final norm). x float32 [b, l, d] -> float32 [b, l, d]."""
        return self.family.stack_output(stack, w, x, self.opts, rng)

    def head_loss(self, head_p: dict, x: jax.Array, labels: jax.Array, rng=None) -> jax.Array:
        """head_p: the head phase's weights (``TreeStructure.head_subtree``); x float32 [b, l, d]; labels int
        [b, l] (-100 ignored) -> the sum of the token cross entropies, identical over tp."""
        return self.family.head_loss(head_p, x, labels, self.opts, self.tp, rng)

    # ------------------------------------------------------------------ the fused composition

    def layers(self, stack: Stack, layers_p: dict, x: jax.Array, self_ctx, cross_ctx, enc, rng=None):
        """Every layer of a stack on one micro-batch: scanned over the stacked weights, or traced one by
        one (``unroll_layers``, or ``layers_p`` a list of per-layer weights); with ``recompute`` each
        layer's backward is ``block_backward`` (remat_policy full), or autodiff's keeping the matmul
        outputs (save_dots)."""
        def block(p, x_, sc, cc, e, r):
            return self.block(stack, p, x_, sc, cc, e, r)

        if self.opts.recompute and self.opts.remat_policy == "save_dots":
            # keep the outputs of the weight matmuls (projections and feed-forward, ``layers.dense``), recompute
            # the elementwise work, norms and attention from them
            block = jax.checkpoint(block, policy=jax.checkpoint_policies.save_only_these_names(L.DENSE))
        elif self.opts.recompute:
            block = self._recomputed_block(stack)

        def body(x_, inputs):
            p, i = inputs
            r = None if rng is None else jax.random.fold_in(rng, i)
            return block(p, x_, self_ctx, cross_ctx, enc, r), None

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
        def f(p, x, sc, cc, enc, rng):
            return self.block(stack, p, x, sc, cc, enc, rng)

        def fwd(p, x, sc, cc, enc, rng):
            return f(p, x, sc, cc, enc, rng), (p, x, sc, cc, enc, rng)

        def bwd(res, dy):
            p, x, sc, cc, enc, rng = res
            g_p, dx, g_sc, g_enc = self.block_backward(stack, p, x, sc, cc, enc, rng, dy)
            if g_sc is None:  # a context without weights: its cotangent is zero
                g_sc = jax.tree.map(jnp.zeros_like, sc)
            return g_p, dx, g_sc, None, g_enc, None

        f.defvjp(fwd, bwd)
        return f

    def loss(self, p: dict, mb: dict, rng=None) -> jax.Array:
        """The whole model on one micro-batch -> sum of token cross entropies.

        p: all weights, gathered and in the compute dtype; mb: one micro-batch {key: [b, l]};
        rng: this micro-batch's dropout key (``micro_key``) or None.
        """
        enc = None
        for stack in self.stacks:
            sp = p[stack.name]
            x = self.embeddings(p["shared"], mb[stack.ids], stream_key(rng, stack.embed_stream))
            self_ctx, cross_ctx = self.context(stack, context_weights(stack, sp), stack_meta(stack, mb), x.shape[1])
            x = self.layers(stack, sp["layers"], x, self_ctx, cross_ctx, enc, stream_key(rng, stack.layers_stream))
            if stack.output:
                enc = self.stack_output(stack, sp[stack.output], x, stream_key(rng, stack.output_stream))
        return self.head_loss(self.tree.head_subtree(p), x, mb["labels"], stream_key(rng, self.family.head_stream))
