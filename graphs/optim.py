"""Optimizer: AdamW or Adafactor (T5X's defaults), applied one weight group at a time.

Weight groups (partitioning/tree.py) are the unit of an optimizer update in both executors: the
embedding, the LM head, the small weights (norms, biases, relative-position tables), and one group
per layer of each stack.

The fused executor keeps a stack's layers stacked and vmaps the update over them; the phased
executor updates one layer at a time. Both give the same numbers, also for Adafactor, whose
factored second moments, update clipping and parameter scaling are per weight: each layer's
matrices are their own weights (T5X treats scanned layers the same way), never the stack as one.
Global-norm clipping is applied by ``update_group`` with the norm of all gradients, so every
group sees the same clipping factor.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax

from modelling.family import leaf_name

F32 = jnp.float32
SR_STREAM = 0x5352  # the random stream of stochastic rounding, folded into the step's key


def learning_rate_schedule(maximum: float, warmup_steps: int):
    """Linear warm-up from 0 to ``maximum`` over ``warmup_steps``, then constant."""
    if warmup_steps <= 0:
        return optax.constant_schedule(maximum)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, maximum, warmup_steps), optax.constant_schedule(maximum)], [warmup_steps])


def decay_mask(decays):
    """The optax mask function: True where weight decay applies (``decays(name)``, the family's rule)."""

    def mask(params):
        return jax.tree_util.tree_map_with_path(lambda path, _: decays(leaf_name(path)), params)

    return mask


def make_optimizer(training, decays) -> optax.GradientTransformation:
    """The per-group optimizer of a ``Training`` config section (clipping is done by ``update_group``);
    ``decays(name)``: whether a weight gets weight decay (the family says: not norms, biases, tables).

    adamw: decoupled weight decay (not on norms or relative biases). adafactor: optax's
    Adafactor with T5X's defaults (factored second moments for dims >= 128, decay 0.8, update
    clipping 1.0, scaling by the parameter's RMS), a first moment only when ``beta1`` is set.
    """
    o = training.optimizer
    lr = learning_rate_schedule(o.learning_rate.maximum, o.learning_rate.warmup_steps)
    if o.name == "adamw":
        b1 = 0.9 if o.beta1 is None else o.beta1
        return optax.adamw(lr, b1=b1, b2=o.beta2, eps=1e-8, weight_decay=o.weight_decay, mask=decay_mask(decays))
    return matrix_view(optax.adafactor(lr, momentum=o.beta1 or None, weight_decay_rate=o.weight_decay or None,
                                       weight_decay_mask=decay_mask(decays)))


def _as_matrix(path, x):
    """An attention weight [d, h, kv] as [d, h * kv], its output projection [h, kv, d] as [h * kv, d]
    (T5X's layout); other weights as they are."""
    if x.ndim != 3:
        return x
    name = str(getattr(path[-1], "key", path[-1]))
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2]) if name in ("o", "co") else x.reshape(x.shape[0], -1)


def matrix_view(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` applied to every weight seen as a matrix (``_as_matrix``). Adafactor factors the two
    largest dims of a weight: on [d, h, kv] these would be d and 64, too small to factor, and the
    second moment of every attention weight would be stored whole; as [d, h * kv] it is two vectors."""

    def view(tree):
        return jax.tree_util.tree_map_with_path(_as_matrix, tree)

    def init(params):
        return inner.init(view(params))

    def update(updates, state, params=None):
        out, state = inner.update(view(updates), state, None if params is None else view(params))
        return jax.tree.map(lambda u, g: u.reshape(g.shape), out, updates), state

    return optax.GradientTransformation(init, update)


# --------------------------------------------------------------------------- weight groups


def as_f32(tree):
    return jax.tree.map(lambda x: x.astype(F32), tree)


def init_group(optimizer, params, stacked: bool = False):
    """Optimizer state of one group, float32 whatever the weights' dtype (16-bit master weights under stochastic
    rounding keep float32 moments); ``stacked``: one state per layer, stacked on a leading axis."""
    init = lambda p: optimizer.init(as_f32(p))  # noqa: E731
    return jax.vmap(init)(params) if stacked else init(params)


# --------------------------------------------------------------------------- stochastic rounding


def stochastic_round(x: jax.Array, dtype, key) -> jax.Array:
    """x (float32) rounded to ``dtype`` up or down at random, with the probability that makes the result's expected
    value x: the nearer neighbour y = round(x), the other neighbour y' on x's side of y, y' with probability
    |x - y| / |y' - y|. Any float dtype (bfloat16, float16); a value the dtype holds exactly stays as it is."""
    y = x.astype(dtype)
    yf = y.astype(F32)
    other = jnp.nextafter(y, jnp.where(x > yf, jnp.inf, -jnp.inf).astype(dtype)).astype(F32)
    gap = other - yf
    p = jnp.where(gap != 0, (x - yf) / jnp.where(gap != 0, gap, 1.0), 0.0)
    u = jax.random.uniform(key, x.shape, F32)
    return jnp.where(u < p, other, yf).astype(dtype)


def group_key(rng_data, group: str):
    """The stochastic-rounding key of a weight group at a step (rng_data: the step's key data); the phased
    executor folds in the layer index as the fused one's vmap does, so both draw the same bits."""
    key = jax.random.fold_in(jax.random.wrap_key_data(rng_data), SR_STREAM)
    return jax.random.fold_in(key, zlib.crc32(group.encode()) & 0x7FFFFFFF)


def layer_keys(key, n: int):
    """The keys of a stacked group's n layers: fold_in(key, layer)."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n))


def round_like(new, old, key):
    """The updated float32 weights back in their master dtype: float32 leaves as they are, 16-bit ones rounded
    stochastically (a key per leaf, folded from ``key``), or to nearest when key is None."""
    leaves, treedef = jax.tree.flatten(new)
    dtypes = [w.dtype for w in jax.tree.leaves(old)]
    out = [x if dt == F32 else x.astype(dt) if key is None else stochastic_round(x, dt, jax.random.fold_in(key, i))
           for i, (x, dt) in enumerate(zip(leaves, dtypes))]
    return jax.tree.unflatten(treedef, out)


def init_state(optimizer, params: dict, tree) -> dict:
    """{group: state} for a whole (stacked) parameter tree; ``tree``: its TreeStructure (partitioning/tree.py)."""
    return {name: init_group(optimizer, p, tree.is_layer_group(name)) for name, p in tree.split_groups(params).items()}


def update_group(optimizer, max_norm: float, params, state, grads, g_norm, stacked: bool = False, key=None,
                 loss_scale=None, clip_norm=None, skip_non_finite: bool = True):
    """The optimizer phase body for one weight group -> (params, state).

    Gradients are clipped with ``g_norm``, the global norm of every gradient of the step, first.
    ``stacked``: the group's leaves carry a leading layers axis and each layer is updated on its own.
    The update is computed in float32; 16-bit master weights (``training.stochastic_rounding``) are rounded back
    stochastically with ``key`` (``group_key``; a stacked group's layer i with fold_in(key, i)).
    ``loss_scale``: the gradients arrive multiplied by it (the phased executor's, kept scaled in float16) and are
    divided first; ``g_norm`` is always the unscaled norm. ``clip_norm``: the norm to clip with, when it is not
    ``g_norm`` (``execution.update_in_backward`` clips with the previous step's; 0 clips nothing).

    When ``g_norm`` is not finite (an overflow: dynamic loss scaling then lowers the scale) nothing is updated: the
    group's weights and state come back as they were (graphs/loss_scale.py). ``skip_non_finite=False`` leaves that
    to the caller (the phased executor reads the norm on the host and runs no optimizer program).
    """

    def one(p, s, g, k):
        p32 = as_f32(p)
        g = as_f32(g)  # gradients may arrive in the compute dtype
        if loss_scale is not None:
            g = jax.tree.map(lambda x: x / loss_scale, g)
        g = clip_by_norm(g, g_norm if clip_norm is None else clip_norm, max_norm)
        updates, s = optimizer.update(g, s, p32)
        return round_like(optax.apply_updates(p32, updates), p, k), s

    def apply(params, state):
        if stacked:
            n = jax.tree.leaves(params)[0].shape[0]
            keys = None if key is None else layer_keys(key, n)
            return jax.vmap(one, in_axes=(0, 0, 0, None if key is None else 0))(params, state, grads, keys)
        return one(params, state, grads, key)

    if not skip_non_finite:
        return apply(params, state)
    # a conditional, not a select of new and old values: the select kept the old weights and state alive beside the
    # new ones (XLA's temporaries of an update tripled); the conditional adds one weight-sized temporary
    return jax.lax.cond(jnp.isfinite(g_norm), apply, lambda p, s: (p, s), params, state)


def clip_by_norm(tree, g_norm: jax.Array, max_norm: float):
    """What ``optax.clip_by_global_norm(max_norm)`` does to a tree, given the global norm of all gradients: each
    gradient times one scalar, 1 below ``max_norm``, else max_norm / g_norm (optax's (t / g_norm) * max_norm to a
    rounding). A scalar factor, not a select between the gradient and its scaled copy: XLA:CPU formed the scaled
    gradients as a buffer of their own, read again by the moments' updates (15 passes over a weight's size for
    AdamW where 10 do)."""
    if max_norm <= 0:
        return tree
    factor = jnp.where(g_norm < max_norm, jnp.ones_like(g_norm), max_norm / g_norm)
    return jax.tree.map(lambda t: t * factor.astype(t.dtype), tree)


# --------------------------------------------------------------------------- the updater


@dataclass(frozen=True)
class Updater:
    """The optimizer phase of a run, resolved once from its config (the executors read this, not the config):
    the optimizer, its global-norm clipping threshold, the learning-rate schedule and stochastic rounding."""

    optimizer: optax.GradientTransformation
    max_norm: float  # gradient_clipping (0: none)
    stochastic_rounding: bool
    maximum: float  # the schedule's peak learning rate
    warmup_steps: int

    @classmethod
    def of_config(cls, training, decays) -> "Updater":
        """The updater of a ``Training`` config section; ``decays(name)``: the family's weight-decay rule."""
        o = training.optimizer
        return cls(make_optimizer(training, decays), o.gradient_clipping, training.stochastic_rounding,
                   o.learning_rate.maximum, o.learning_rate.warmup_steps)

    def learning_rate(self, step: int) -> float:
        return float(learning_rate_schedule(self.maximum, self.warmup_steps)(step))

    def init_state(self, params: dict, tree) -> dict:
        return init_state(self.optimizer, params, tree)

    def init_group(self, params, stacked: bool = False):
        return init_group(self.optimizer, params, stacked)

    def update(self, group: str, params, state, grads, g_norm, rng_data, layer=None, stacked: bool = False,
               loss_scale=None, clip_norm=None, skip_non_finite: bool = True):
        """``update_group`` of weight group ``group`` (of its layer ``layer``, an index, in the phased executor);
        with stochastic rounding its key is ``group_key`` of the step's key data, folded with the layer."""
        key = group_key(rng_data, group) if self.stochastic_rounding else None
        if key is not None and layer is not None:
            key = jax.random.fold_in(key, layer)
        return update_group(self.optimizer, self.max_norm, params, state, grads, g_norm, stacked, key, loss_scale,
                            clip_norm, skip_non_finite)
