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


class CheckpointNotFound(FileNotFoundError):
    """No loadable checkpoint at a path; the message says what to pass instead."""


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


def load_meta(directory: str, step: int) -> dict:
    mgr = manager(directory, read_only=True)
    return mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def load(directory: str, step: int, params_target, opt_state_target=None) -> tuple:
    """(params, opt_state or None, meta) of a step, restored into the targets' shardings."""
    mgr = manager(directory, read_only=True)
    items = {"params": ocp.args.StandardRestore(params_target), "meta": ocp.args.JsonRestore()}
    if opt_state_target is not None:
        items["opt_state"] = ocp.args.StandardRestore(opt_state_target)
    try:
        out = mgr.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax/tensorstore raise many types for missing, corrupt or mismatched data
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if re.search(r"shape|structure|tree|mismatch", str(e), re.I):
            fix = "use the preset (model size and tensor_parallel) it was trained with"
        else:
            fix = "it is incomplete or corrupt: load an earlier step"
        raise CheckpointNotFound(f"cannot load checkpoint {directory}/{step} ({type(e).__name__}: {first}): {fix}") from None
    return out["params"], out.get("opt_state"), out["meta"]


def has_item(directory: str, step: int, item: str) -> bool:
    """Whether a saved step holds an item (e.g. 'opt_state': saved with --optim_state false, it does not)."""
    return os.path.isdir(os.path.join(directory, str(step), item))


def latest_step(directory: str) -> Optional[int]:
    steps = saved_steps(directory)
    return steps[-1] if steps else None
