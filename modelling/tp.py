"""The two Megatron collectives of the original app, as named custom-vjp functions.

Model code calls them with ``tp_axis``: the mesh axis name of tensor
parallelism inside ``shard_map``, or ``None`` on one device (then both are the
identity). All autodiff across devices goes through these two functions and
the vocab-sharded loss, so JAX never has to transpose a collective itself.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
from jax import lax


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _identical_inputs(x, axis):
    return x


def _ii_fwd(x, axis):
    return x, None


def _ii_bwd(axis, _, g):
    return (lax.psum(g, axis),)


_identical_inputs.defvjp(_ii_fwd, _ii_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _identical_grad_inputs(x, axis):
    return lax.psum(x, axis)


def _igi_fwd(x, axis):
    return lax.psum(x, axis), None


def _igi_bwd(axis, _, g):
    return (g,)


_identical_grad_inputs.defvjp(_igi_fwd, _igi_bwd)


def trivial(tp_axis: Optional[str]) -> bool:
    """Whether tp is one device: no axis, or an axis of size 1 (then every collective over it is the identity, and
    left out: XLA:CPU ran each such all-reduce as an operation of its own, 25 a decoded token of Flan-T5-small)."""
    return tp_axis is None or lax.axis_size(tp_axis) == 1


def identical_inputs(x: jax.Array, tp_axis: Optional[str]) -> jax.Array:
    """Megatron's ``f``: identity forward, all-reduce of the gradient over tp backward.

    Used where an activation identical on every tp replica enters a
    tp-sharded computation (column-parallel matmul).
    """
    return x if trivial(tp_axis) else _identical_inputs(x, tp_axis)


def identical_grad_inputs(x: jax.Array, tp_axis: Optional[str]) -> jax.Array:
    """Megatron's ``g``: all-reduce over tp forward, identity backward.

    Used where partial sums of a row-parallel matmul become an activation
    identical on every tp replica.
    """
    return x if trivial(tp_axis) else _identical_grad_inputs(x, tp_axis)


def tp_index(tp_axis: Optional[str]):
    """Index of this device along tp (0 on one device)."""
    return 0 if trivial(tp_axis) else lax.axis_index(tp_axis)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _share_of_sum(x, axis):
    return x / lax.axis_size(axis)


def _sos_fwd(x, axis):
    return _share_of_sum(x, axis), None


def _sos_bwd(axis, _, g):
    return (g,)


_share_of_sum.defvjp(_sos_fwd, _sos_bwd)


def share_of_sum(x: jax.Array, tp_axis: Optional[str]) -> jax.Array:
    """A value identical on every tp replica, entering a sum over tp that a row-parallel matmul's partial sums go
    through (``identical_grad_inputs``): each replica adds its 1/tp share forward, and its gradient is the whole
    gradient backward, as the value's own (identical on every replica)."""
    return x if trivial(tp_axis) else _share_of_sum(x, tp_axis)
