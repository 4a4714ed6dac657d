"""The structure of a parameter tree, in one place: stacks, weight groups, and the splits of a tree that
the executors, the optimizer, the host state and the memory plan work with.

Every family's tree (modelling/family.py) has the same top level: the token embedding ``shared``,
head weights (``lm_head`` ...), and one subtree per stack holding ``layers`` (stacked on a leading
axis) and the stack's own small weights (norms, relative-position tables). The same functions
apply to any tree of that shape: weights, gradients, shardings, layouts, optimizer moments.

Weight groups, the unit of an optimizer update in both executors:

    shared, lm_head   a group each (the ``big`` top-level weights present in the tree)
    small             everything else outside the layers (norms, biases, relative-position tables)
    <stack>           the layers of a stack, each layer its own group (stacked: one state per layer)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BIG = ("shared", "lm_head")  # top-level weights with an optimizer group of their own


class TreeStructure:
    """The structure of one family's parameter tree (its stack names) and the splits of it."""

    def __init__(self, stacks: tuple, head_paths: tuple = ()):
        self.stacks = tuple(stacks)  # stack names, in forward order
        self.head_paths = tuple(tuple(p) for p in head_paths)  # the weights the head phase reads

    # ------------------------------------------------------------------ rest / layers

    def split_rest(self, tree: dict) -> dict:
        """Everything but the stacked layers, with the same paths."""
        out = {k: v for k, v in tree.items() if k not in self.stacks}
        for s in self.stacks:
            out[s] = {k: v for k, v in tree[s].items() if k != "layers"}
        return out

    def with_layers(self, rest: dict, layers: dict) -> dict:
        """The inverse of ``split_rest``: rest + {stack: layers} -> the whole tree."""
        tree = dict(rest)
        for s in self.stacks:
            tree[s] = {**rest[s], "layers": layers[s]}
        return tree

    def map_layers(self, fn, tree: dict) -> dict:
        """The tree with each stack's layers replaced by ``fn(layers)``."""
        return self.with_layers(self.split_rest(tree), {s: fn(tree[s]["layers"]) for s in self.stacks})

    # ------------------------------------------------------------------ weight groups

    def split_groups(self, tree: dict) -> dict:
        """A parameter-shaped tree -> {group: subtree}; layer groups keep their stacked [layers, ...] leaves.
        Each group is a tree whose paths end in the weights' names."""
        rest = self.split_rest(tree)
        out = {k: {k: rest[k]} for k in BIG if k in rest}
        out["small"] = {k: v for k, v in rest.items() if k not in BIG}
        for s in self.stacks:
            out[s] = tree[s]["layers"]
        return out

    def merge_groups(self, groups: dict) -> dict:
        """The inverse of ``split_groups``."""
        rest = dict(groups["small"])
        rest.update({k: groups[k][k] for k in BIG if k in groups})
        return self.with_layers(rest, {s: groups[s] for s in self.stacks})

    def rest_groups(self, rest: dict) -> dict:
        """The non-layer weight groups of a ``split_rest`` tree."""
        groups = self.split_groups(self.with_layers(rest, {s: None for s in self.stacks}))
        return {k: v for k, v in groups.items() if k not in self.stacks}

    def rest_from_groups(self, groups: dict) -> dict:
        """The inverse of ``rest_groups``."""
        return self.split_rest(self.merge_groups({**groups, **{s: None for s in self.stacks}}))

    def is_layer_group(self, name: str) -> bool:
        return name in self.stacks

    # ------------------------------------------------------------------ the head phase

    def head_subtree(self, tree: dict) -> dict:
        """The weights (or their gradients, shardings ...) the head phase reads, with their whole-tree paths."""
        out: dict = {}
        for path in self.head_paths:
            src, dst = tree, out
            for k in path[:-1]:
                src, dst = src[k], dst.setdefault(k, {})
            dst[path[-1]] = src[path[-1]]
        return out

    # ------------------------------------------------------------------ per-layer buffers

    def unstack_layers(self, tree: dict) -> dict:
        """The tree with each stack's stacked layer weights split into a list of per-layer trees
        (``layer_list``), each leaf its own buffer."""
        return self.map_layers(layer_list, tree)

    def stack_layers(self, tree: dict) -> dict:
        """The inverse of ``unstack_layers``."""
        return self.map_layers(lambda ls: jax.tree.map(lambda *ws: jnp.stack(ws), *ls), tree)


def layer_list(layers: dict) -> list:
    """Stacked layer weights ``{name: [n, ...]}`` -> a list of the n per-layer trees."""
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    return [jax.tree.map(lambda w: w[i], layers) for i in range(n)]


def flat_paths(tree) -> list:
    """The key paths of a tree's leaves, as tuples of names."""
    return [tuple(str(getattr(k, "key", k)) for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def from_flat(like, values: dict):
    """A tree shaped like ``like`` whose leaf at each path (``flat_paths``) is ``values[path]``."""
    return jax.tree.unflatten(jax.tree.structure(like), [values[p] for p in flat_paths(like)])
