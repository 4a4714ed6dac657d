"""Optimizer phase: AdamW (or Adafactor) with the original's hyper-parameters, via optax."""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(maximum: float, warmup_steps: int):
    """Linear warm-up from 0 to ``maximum`` over ``warmup_steps``, then constant."""
    if warmup_steps <= 0:
        return optax.constant_schedule(maximum)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, maximum, warmup_steps), optax.constant_schedule(maximum)], [warmup_steps])


def decay_mask(params):
    """True where weight decay applies: not norms, not the relative-position bias table."""

    def keep(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        return not (name.endswith("norm") or name == "relpos")

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(training, clip: bool = True) -> optax.GradientTransformation:
    """The optimizer of a ``Training`` config section (global-norm clipping first).

    ``clip=False`` puts an identity where the clipping goes (same state tree): the
    phased executor clips with the norm of the whole model itself (``clip_by_norm``)
    and then updates one layer at a time.
    """
    o = training.optimizer
    lr = learning_rate_schedule(o.learning_rate.maximum, o.learning_rate.warmup_steps)
    parts = []
    if o.gradient_clipping > 0:
        parts.append(optax.clip_by_global_norm(o.gradient_clipping) if clip else optax.identity())
    if o.name == "adamw":
        parts.append(optax.adamw(lr, b1=o.beta1, b2=o.beta2, eps=1e-8, weight_decay=o.weight_decay, mask=decay_mask))
    else:
        parts.append(optax.adafactor(lr, weight_decay_rate=o.weight_decay or None, weight_decay_mask=decay_mask))
    return optax.chain(*parts)


def clip_by_norm(tree, g_norm: jax.Array, max_norm: float):
    """What ``optax.clip_by_global_norm(max_norm)`` does to a tree, given the global norm of all gradients."""
    if max_norm <= 0:
        return tree
    trigger = g_norm < max_norm
    return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), tree)
