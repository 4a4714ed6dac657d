"""Sharded train-state checkpoints with orbax.

A save directory holds one sub-directory per step (orbax's layout), each with
three items: ``params`` and ``opt_state`` (sharded arrays, written by every
process in parallel) and ``meta`` (JSON: step, data position, seed, config,
library versions). orbax writes a step into a temporary directory and renames
it only when complete, so a crash mid-write leaves the earlier steps intact.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Optional

import jax
import orbax.checkpoint as ocp

from utils.errors import FlanT5Error


class CheckpointNotFound(FlanT5Error, FileNotFoundError):
    """No loadable checkpoint at a path; the message says what to pass instead."""


class CheckpointShapeError(FlanT5Error, ValueError):
    """A checkpoint of another model shape; the message names both shapes and the flags that fit."""


def manager(directory: str, to_keep: int | None = None, read_only: bool = False) -> ocp.CheckpointManager:
    opts = ocp.CheckpointManagerOptions(max_to_keep=to_keep, create=not read_only, read_only=read_only,
                                        save_interval_steps=1)
    return ocp.CheckpointManager(os.path.abspath(directory), options=opts,
                                 item_names=("params", "opt_state", "meta"))


def saved_steps(directory: str) -> list:
    """Completed checkpoint steps in a save directory (empty if none or no directory)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory)
                  if d.isdigit() and os.path.isdir(os.path.join(directory, d, "meta")))


def resolve(path: str) -> list:
    """[(save_dir, step)] named by a path: a save dir (latest step), a step dir, or a glob of either.

    Sorted by step, as the original validated checkpoints in training order.
    """
    found = []
    for p in sorted(glob.glob(path)) or [path]:
        p = p.rstrip("/")
        name = os.path.basename(p)
        if name.isdigit() and os.path.isdir(os.path.join(p, "meta")):
            found.append((os.path.dirname(p) or ".", int(name)))
        elif saved_steps(p):
            found.append((p, saved_steps(p)[-1]))
    if not found:
        raise CheckpointNotFound(
            f"no checkpoint at {path}: pass the --save directory of a run (or one of its step directories)")
    return sorted(set(found), key=lambda x: x[1])


def abstract_like(tree, shardings):
    """ShapeDtypeStructs with target shardings, for restoring into a (possibly different) layout."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def save(mgr: ocp.CheckpointManager, step: int, params, opt_state, meta: dict) -> None:
    """Starts writing a checkpoint (asynchronously); call mgr.wait_until_finished() before exit."""
    items = {"params": ocp.args.StandardSave(params), "meta": ocp.args.JsonSave(meta)}
    if opt_state is not None:
        items["opt_state"] = ocp.args.StandardSave(opt_state)
    mgr.save(step, args=ocp.args.Composite(**items), force=True)


def read_meta(directory: str, step: int) -> dict:
    """A saved step's meta (step, data position, config) read as the JSON file it is: no JAX needed, so a
    driver can read the model's config before JAX starts."""
    import json

    path = os.path.join(directory, str(step), "meta", "metadata")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return load_meta(directory, step)


def load_meta(directory: str, step: int) -> dict:
    mgr = manager(directory, read_only=True)
    try:
        return mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    finally:
        mgr.close()


def saved_shapes(directory: str, step: int) -> dict:
    """{weight path: shape} of a saved step's weights, read from its metadata (no array data)."""
    meta = ocp.StandardCheckpointer().metadata(os.path.join(os.path.abspath(directory), str(step), "params"))
    tree = getattr(meta, "item_metadata", meta)
    return {jax.tree_util.keystr(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_shapes(directory: str, step: int, params_target, config: Optional[dict] = None, current=None) -> None:
    """CheckpointShapeError naming a weight's two shapes (and the flags the checkpoint was trained with, where
    they differ from ``current``, this run's config) when the saved weights do not fit the target."""
    try:
        saved = saved_shapes(directory, step)
    except Exception:
        return  # unreadable metadata: the restore below reports it
    want = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params_target)[0]}
    for key in want:
        if key in saved and saved[key] != want[key]:
            hint = "use the preset and flags of the run that wrote it"
            if config:
                from config.config import FIELDS, model_shape

                theirs = model_shape(config)
                ours = model_shape(current) if current is not None else {k: FIELDS[k].default for k in theirs}
                hint = "it was trained with " + " ".join(f"--{k} {v}" for k, v in theirs.items()
                                                         if v != ours[k]) + ": pass the same (or that run's preset)"
            raise CheckpointShapeError(f"{directory}/{step} holds {key} of shape {saved[key]} but this run's model "
                                       f"has {want[key]}: {hint}")


def load(directory: str, step: int, params_target, opt_state_target=None, cfg=None) -> tuple:
    """(params, opt_state or None, meta) of a step, restored into the targets' shardings (``cfg``: this run's
    config, named in the error when the checkpoint's model has another shape)."""
    meta = None
    try:
        meta = read_meta(directory, step)
    except Exception:
        pass
    check_shapes(directory, step, params_target, (meta or {}).get("config"), cfg)
    mgr = manager(directory, read_only=True)
    items = {"params": ocp.args.StandardRestore(params_target), "meta": ocp.args.JsonRestore()}
    if opt_state_target is not None:
        items["opt_state"] = ocp.args.StandardRestore(opt_state_target)
    try:
        out = mgr.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax/tensorstore raise many types for missing, corrupt or mismatched data
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        if opt_state_target is not None and re.search(r"opt_state|structure|tree", str(e), re.I):
            fix = "its optimizer state has another layout (another optimizer, or an older version): pass " \
                  "--optim_state false to start the optimizer afresh"
        else:
            fix = "it is incomplete or corrupt: load an earlier step"
        raise CheckpointNotFound(f"cannot load checkpoint {directory}/{step} ({type(e).__name__}: {first}): {fix}") from None
    finally:
        mgr.close()  # its background threads end here, not at interpreter exit
    return out["params"], out.get("opt_state"), out["meta"]


def has_item(directory: str, step: int, item: str) -> bool:
    """Whether a saved step holds an item (e.g. 'opt_state': saved with --optim_state false, it does not)."""
    return os.path.isdir(os.path.join(directory, str(step), item))


def latest_step(directory: str) -> Optional[int]:
    steps = saved_steps(directory)
    return steps[-1] if steps else None
