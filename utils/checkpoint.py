"""Sharded train-state checkpoints with orbax.

A save directory holds one sub-directory per step (orbax's layout), each with
three items: ``params`` and ``opt_state`` (sharded arrays, written by every
process in parallel) and ``meta`` (JSON: step, data position, seed, config,
library versions). orbax writes a step into a temporary directory and renames
it only when complete, so a crash mid-write leaves the earlier steps intact.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
from typing import Optional

import jax
import orbax.checkpoint as ocp

from utils.errors import FlanT5Error


class CheckpointNotFound(FlanT5Error, FileNotFoundError):
    """No loadable checkpoint at a path; the message says what to pass instead."""


class CheckpointShapeError(FlanT5Error, ValueError):
    """A checkpoint of another model shape; the message names both shapes and the flags that fit."""


COMMIT = "commit_success.txt"  # orbax writes it into a step directory once the step is complete


def manager(directory: str, read_only: bool = False) -> ocp.CheckpointManager:
    """orbax's manager of a save directory; it never deletes anything (retention is ``prune``'s: orbax would
    count any numbered folder as a step and delete it)."""
    opts = ocp.CheckpointManagerOptions(max_to_keep=None, create=not read_only, read_only=read_only,
                                        save_interval_steps=1)
    return ocp.CheckpointManager(os.path.abspath(directory), options=opts,
                                 item_names=("params", "opt_state", "meta"))


def is_ours(step_dir: str) -> bool:
    """Whether a numbered folder is one of this project's checkpoint steps: its meta item holds our schema
    (step and config). A user's own folder named like a step is not."""
    try:
        with open(os.path.join(step_dir, "meta", "metadata")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "step" in meta and "config" in meta


def is_complete(step_dir: str) -> bool:
    """Whether orbax finished writing a step (its commit marker is there)."""
    return os.path.isfile(os.path.join(step_dir, COMMIT))


def _numbered(directory: str) -> list:
    if not os.path.isdir(directory):
        return []
    return sorted(int(d) for d in os.listdir(directory) if d.isdigit() and os.path.isdir(os.path.join(directory, d)))


def saved_steps(directory: str) -> list:
    """This project's complete checkpoint steps in a save directory (empty if none or no directory)."""
    return [s for s in _numbered(directory)
            if is_ours(os.path.join(directory, str(s))) and is_complete(os.path.join(directory, str(s)))]


def foreign_steps(directory: str) -> list:
    """Numbered folders in a save directory that are not this project's checkpoints (never touched)."""
    return [s for s in _numbered(directory) if not is_ours(os.path.join(directory, str(s)))
            and not os.path.isdir(os.path.join(directory, str(s), "meta"))]


def incomplete_steps(directory: str) -> list:
    """Steps of this project whose write did not finish, or whose meta cannot be read."""
    return [s for s in _numbered(directory) if s not in saved_steps(directory) and s not in foreign_steps(directory)]


def prune(directory: str, to_keep: int, keep: tuple = ()) -> list:
    """Deletes the oldest of this project's complete steps beyond the newest ``to_keep`` (0: keep all), never a
    step in ``keep`` and never a folder that is not ours -> the steps deleted."""
    if to_keep <= 0:
        return []
    steps = saved_steps(directory)
    gone = [s for s in steps[: max(len(steps) - to_keep, 0)] if s not in keep]
    for s in gone:
        shutil.rmtree(os.path.join(directory, str(s)))
    return gone


def _previous_complete(directory: str, step: int) -> str:
    earlier = [s for s in saved_steps(directory) if s < step]
    return (f"load the previous complete step, {directory}/{earlier[-1]}" if earlier else
            "no earlier complete step exists in this directory: start afresh, or load another run")


def check_step(directory: str, step: int) -> None:
    """CheckpointNotFound (one line: the step, what is missing, the fix) unless the step is complete and ours."""
    d = os.path.join(directory, str(step))
    if not os.path.isdir(os.path.join(d, "meta")) or not os.path.isfile(os.path.join(d, "meta", "metadata")):
        raise CheckpointNotFound(f"{d} has no meta/metadata (its step, data position and config): it is not a "
                                 f"complete checkpoint of this project; {_previous_complete(directory, step)}")
    if not is_complete(d):
        raise CheckpointNotFound(f"{d} is incomplete: it has no {COMMIT} (its write was interrupted); "
                                 f"{_previous_complete(directory, step)}")
    if not is_ours(d):
        raise CheckpointNotFound(f"{d}/meta/metadata is unreadable or not this project's: "
                                 f"{_previous_complete(directory, step)}")


def resolve(path: str) -> list:
    """[(save_dir, step)] named by a path: a save dir (its latest complete step), a step dir, or a glob of either.

    Sorted by step, as the original validated checkpoints in training order. A step directory that is
    incomplete or not ours is an error naming the previous complete step.
    """
    found = []
    for p in sorted(glob.glob(path)) or [path]:
        p = p.rstrip("/")
        name = os.path.basename(p)
        if name.isdigit() and os.path.isdir(p) and (os.path.isdir(os.path.join(p, "meta")) or not saved_steps(p)):
            parent = os.path.dirname(p) or "."
            check_step(parent, int(name))
            found.append((parent, int(name)))
        elif saved_steps(p):
            steps = saved_steps(p)
            later = [s for s in incomplete_steps(p) if s > steps[-1]]
            if later:
                logging.getLogger("flan_t5").warning("%s/%d is incomplete (its write was interrupted): using %s/%d",
                                                     p, later[-1], p, steps[-1])
            found.append((p, steps[-1]))
    if not found:
        if os.path.isfile(os.path.join(path, "config.json")):  # run_export.py's output, or any HF model
            raise CheckpointNotFound(f"{path} is a Hugging Face model (it holds a config.json), not a checkpoint of "
                                     f"ours: pass --hf_model {path} instead (every driver reads one there)")
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


def check_shapes(directory: str, step: int, params_target, hint=None) -> None:
    """CheckpointShapeError naming a weight's two shapes when the saved weights do not fit the target; ``hint(saved
    config or None) -> str`` says how to run the checkpoint instead (config.shape_hint: the flags it was trained
    with)."""
    try:
        saved = saved_shapes(directory, step)
    except Exception:
        return  # unreadable metadata: the restore below reports it
    want = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(params_target)[0]}
    for key in want:
        if key in saved and saved[key] != want[key]:
            meta = _meta_or_none(directory, step)
            how = hint((meta or {}).get("config")) if hint else "use the preset and flags of the run that wrote it"
            raise CheckpointShapeError(f"{directory}/{step} holds {key} of shape {saved[key]} but this run's model "
                                       f"has {want[key]}: {how}")


def _meta_or_none(directory: str, step: int) -> Optional[dict]:
    try:
        return read_meta(directory, step)
    except Exception:
        return None


def load(directory: str, step: int, params_target, opt_state_target=None, hint=None) -> tuple:
    """(params, opt_state or None, meta) of a step, restored into the targets' shardings (``hint``: as
    ``check_shapes`` takes it, for a checkpoint whose model has another shape)."""
    check_step(directory, step)  # a step without its commit marker is never loaded as if complete
    check_shapes(directory, step, params_target, hint)
    mgr = manager(directory, read_only=True)
    items = {"params": ocp.args.StandardRestore(params_target), "meta": ocp.args.JsonRestore()}
    if opt_state_target is not None:
        items["opt_state"] = ocp.args.StandardRestore(opt_state_target)
    try:
        out = mgr.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax/tensorstore raise many types for missing, corrupt or mismatched data
        first = _cause(e)
        fix = _previous_complete(directory, step)
        if opt_state_target is not None and "opt_state" in str(e):
            fix += " (or pass --optim_state false if only its optimizer state is unreadable)"
        raise CheckpointNotFound(f"cannot load checkpoint {directory}/{step}: it is corrupt or incomplete "
                                 f"({type(e).__name__}: {first}); {fix}") from None
    finally:
        mgr.close()  # its background threads end here, not at interpreter exit
    return out["params"], out.get("opt_state"), out["meta"]


def _cause(e: BaseException, limit: int = 160) -> str:
    """An error's first line without TensorStore's internals (source locations, specs, its "See full TensorStore
    details" pointer to a Python object), cut at a word with an ellipsis, never inside one."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.split(r"\s*(?:\[source locations=|\[tensorstore_spec=|See full TensorStore details)", text)[0]
    text = " ".join(text.split()).rstrip(" .:;,") or type(e).__name__
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0].rstrip(" .:;,") + " ..."


def has_item(directory: str, step: int, item: str) -> bool:
    """Whether a saved step holds an item (e.g. 'opt_state': saved with --optim_state false, it does not)."""
    return os.path.isdir(os.path.join(directory, str(step), item))
