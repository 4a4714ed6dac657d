"""The weights a decoding run reads: where they come from (an HF model, a checkpoint, LoRA adapters on the base they
were trained on) and how they are placed on the devices (``Weights.load``).

Decoding's layout is ``Decoder.decode_shardings`` (decoder/decoder.py): every weight whole on the devices of its tp group, in the
compute dtype (the family's float32 weights kept float32), and with ``--quantize int8`` its matmul weights as
int8 values with a float32 scale per output channel (modelling/quant.py). A quantized model is never whole in the
compute dtype on a device: the weights come from host memory (a checkpoint restored there, an HF model's numpy
arrays, a LoRA base) and each stacked weight is placed one layer at a time, merged with its adapter where it has
one, quantized, and written into its int8 stack; so a device holds the int8 model so far and one layer's weight in
the compute dtype (XXL: 10.4 GiB, where its bfloat16 weights alone are 20.7 GiB).
"""

from __future__ import annotations

import copy
import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from config.carry import saved_value
from config.fields import set_path
from config.schema import FIELDS
from modelling import lora, quant
from modelling.hf_mapping import load_hf_model
from partitioning import sharding as S
from partitioning.base import describe_base, device_base, fingerprint, fingerprint_rows, load_base
from partitioning.placement import Placement
from partitioning.sharding import HOST, put_global
from utils import checkpoint as ckpt
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


def _key(path) -> tuple:
    """A tree path as a tuple of strings (dict keys; a list index as its number)."""
    return tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


class Weights:
    """The weights of one Decoder (decoder/decoder.py): loaded, merged and placed in its layout."""

    def __init__(self, decoder):
        self.decoder, self.placement, self.cfg = decoder, decoder.place, decoder.cfg
        self._programs: dict = {}

    # ------------------------------------------------------------------ sources

    def load(self, directory=None, step=None, hf_model=None, base: bool = False):
        """The weights decoded, on the devices: an HF model's, a checkpoint's, or a LoRA checkpoint's adapters merged
        into the base they were trained on; quantized (``--quantize int8``) one layer at a time from host memory.
        ``base``: they are a base adapters are served over (decoder/adapters.py): -> (the weights, their
        fingerprint, partitioning/base.py's: what a LoRA checkpoint records of the base it was trained on), and a
        LoRA checkpoint is refused (one line)."""
        g, direct = self.placement, self.decoder.quantize == "none"
        if hf_model:
            _, host = load_hf_model(hf_model, g.tp, expect=self.cfg.model)
            params = self.convert(g.shard_params(host)) if direct else self.place(host)
            return (params, fingerprint_rows([[x] for x in jax.tree.leaves(host)])) if base else params
        saved = ckpt.load_meta(directory, step)
        if saved.get("lora_base"):
            if base:
                raise FlanT5Error(f"--load {directory} holds LoRA adapters, and adapters are served over the model "
                                  "they were trained on: --load that base (a full checkpoint, or --hf_model) and "
                                  f"name this one with --lora NAME={directory}")
            return self.convert(self.merged_params(directory, step, saved))
        shardings = g.param_shardings if direct else S.with_memory_kind(g.param_shardings, HOST)
        params, _, _ = ckpt.load(directory, step, ckpt.abstract_like(g.abstract_params(), shardings),
                                 hint=g.shape_hint)
        digest = None
        if base:  # (of the weights as stored, before any conversion: the digest a LoRA run took of its frozen base)
            digest = fingerprint(params) if direct else fingerprint_rows([[x] for x in jax.tree.leaves(params)])
        params = self.convert(params) if direct else self.place(params)
        return (params, digest) if base else params

    def convert(self, params: dict) -> dict:
        """Weights on the devices in training's layout -> decoding's, in one program (``Decoder.to_decoding``); a tree
        already in decoding's layout comes back as it is."""
        g = self.decoder
        return params if g.is_decoding_layout(params) else g.to_decoding(params)

    def host_tree(self, params: dict) -> dict:
        """Weights in decoding's layout (or training's) -> numpy in training's layout (every stack's layers stacked),
        int8 weights dequantized to float32 (q * scale): what an HF model of them (--compare_hf, an export) reads."""
        def value(x):
            return np.asarray(quant.dequantize(x)) if quant.is_int8(x) else np.asarray(x)

        tree = jax.tree.map(value, params, is_leaf=quant.is_int8)
        for stack, sub in tree.items():
            if isinstance(sub, dict) and isinstance(sub.get("layers"), (list, tuple)):
                rows = sub["layers"]
                tree[stack] = {**sub, "layers": jax.tree.map(lambda *r: np.stack(r), *rows)}
        return tree

    def merged_params(self, directory: str, step: int, saved: dict):
        """A LoRA checkpoint's adapters on their frozen base (which its meta names), merged: the weights decoded.
        A checkpoint trained phased (the presets whose base never fits a device beside anything else), or one decoded
        with int8 weights, is merged from host memory (``merged_from_host``): its device then holds the merged model
        alone, never the base beside it (XXL: 20.7 GiB, not 41)."""
        if saved_value(saved["config"], "phased") or self.decoder.quantize != "none":
            return self.merged_from_host(directory, step, saved)
        return self.merged_on_device(directory, step, saved)

    def merged_on_device(self, directory: str, step: int, saved: dict):
        """``merged_params`` with the whole base placed on the devices and merged there in one program."""
        lg, adapters, frozen = self.lora_parts(directory, step, saved)
        merge = lambda b, a: lora.merged(b, a, lg.opts)  # noqa: E731
        return jax.jit(merge, out_shardings=self.placement.param_shardings)(frozen, adapters)

    def merged_from_host(self, directory: str, step: int, saved: dict):
        """``merged_params`` from the base in host memory: each adapted weight placed and merged on the devices
        (the same arithmetic as ``merged_on_device``'s, so the same values), then the rest placed. Without
        quantization each adapted weight is merged whole; with it, one layer at a time (``place``)."""
        lg, adapters, _ = self.lora_parts(directory, step, saved, base=False)
        base = load_base(lg, saved["lora_base"]["source"], HOST)  # (an HF model's: numpy, read tensor by tensor)
        self.check_base(directory, step, saved, fingerprint_rows([[x] for x in jax.tree.leaves(base)]))
        if self.decoder.quantize != "none":
            return self.place(base, adapters, lg.opts)
        shardings, tree = self.placement.param_shardings, dict(base)
        for stack, sub in adapters.items():  # the adapted weights first, while the devices hold little else
            layers, sh = dict(base[stack]["layers"]), shardings[stack]["layers"]
            for name in sorted(k[: -len(lora.A)] for k in sub["layers"] if k.endswith(lora.A)):
                def merge(w, a, s=stack, n=name):
                    return lora.merged({s: {"layers": {n: w}}}, {s: {"layers": a}}, lg.opts)[s]["layers"][n]

                pair = {name + k: sub["layers"][name + k] for k in (lora.A, lora.B)}
                layers[name] = jax.jit(merge, out_shardings=sh[name])(_place(layers[name], sh[name]), pair)
            tree[stack] = {**base[stack], "layers": layers}
        return jax.tree.map(_place, tree, shardings)  # (the merged ones are in place already)

    def lora_graphs(self, saved: dict) -> Placement:
        """The placement of a LoRA checkpoint's run on these devices: its adapters' rank, alpha and targets."""
        lcfg = copy.deepcopy(self.cfg)
        for flag in ("lora_rank", "lora_alpha", "lora_targets"):
            set_path(lcfg, FIELDS[flag].path, saved_value(saved["config"], flag))
        return Placement(lcfg, mesh=self.placement.mesh)

    @staticmethod
    def check_base(directory: str, step: int, saved: dict, found: str) -> None:
        """Refuses (one line) a base whose fingerprint is not the one the checkpoint's adapters were trained on."""
        meta, source = saved["lora_base"], saved["lora_base"]["source"]
        if found != meta["fingerprint"]:
            raise FlanT5Error(f"{directory} step {step} holds adapters trained on other weights than "
                              f"{describe_base(source)} as found now (fingerprint {meta['fingerprint']} != "
                              f"{found}): restore that base")

    def lora_parts(self, directory: str, step: int, saved: dict, base: bool = True) -> tuple:
        """(the LoRA run's placement, its adapters, its frozen base on the devices or None) of a LoRA checkpoint: the
        base found where the checkpoint's meta says, and refused (one line) when its fingerprint is not the one
        trained on."""
        lg = self.lora_graphs(saved)
        adapters, _, _ = ckpt.load(directory, step, ckpt.abstract_like(lg.abstract_params(), lg.param_shardings),
                                   hint=lg.shape_hint)
        if not base:
            return lg, adapters, None
        frozen = device_base(lg, saved["lora_base"]["source"])
        self.check_base(directory, step, saved, fingerprint(frozen))
        return lg, adapters, frozen

    # ------------------------------------------------------------------ placement in decoding's layout

    def place(self, host: dict, adapters: dict | None = None, lora_opts=None) -> dict:
        """Host weights (numpy, or arrays in host memory) in training's layout -> decoding's on the devices
        (``Decoder.decode_shardings``): each weight in its decoding dtype, int8 where decoding quantizes it; a stacked
        weight one layer at a time, merged first with its LoRA adapter (``adapters``: the adapters' tree on the
        devices) where it has one; a streamed or unrolled stack's layers one tree per layer."""
        g = self.decoder
        targets = g.abstract_decode_params()
        flat, treedef = jax.tree_util.tree_flatten_with_path(targets, is_leaf=quant.is_int8)
        host_leaves = dict((_key(p), x) for p, x in jax.tree_util.tree_flatten_with_path(host)[0])
        rows: dict = {}  # (stack, name) -> rows(i) of its host weight, for a stack held one tree per layer
        out = []
        for path, target in flat:
            key = _key(path)
            if key[0] in g.layered_stacks and key[1] == "layers":  # (stack, "layers", i, name): one layer's tree
                i, name = int(key[2]), key[3:]
                source = (key[0], "layers") + name
                if source not in rows:
                    rows[source] = _host_rows(host_leaves[source], _row_source_sharding(target))
                row = rows[source](i)
                pair = _adapter_pair(adapters, source)
                if pair is not None:
                    row = self._program("merge", target, lora_opts)(row, *(a[i: i + 1] for a in pair))
                out.append(self._program("row", target, None)(row))
                if i == len(targets[key[0]]["layers"]) - 1:
                    del rows[source]  # (its host copy, read shard by shard, is no longer needed)
                continue
            out.append(self._place_weight(host_leaves[key], target, key, _adapter_pair(adapters, key), lora_opts))
        return jax.tree_util.tree_unflatten(treedef, out)

    def _place_weight(self, x, target, key: tuple, pair, lora_opts):
        stacked = "layers" in key[:-1]
        if not stacked:  # whole (the LM head, the embedding, final norms, position tables)
            return self._program("whole", target, None)(_place(x, _device_sharding(target)))
        rows = _host_rows(x, _device_sharding(target))
        out = self._program("zeros", target, None)()
        write = self._program("write", target, None)
        for i in range(target.shape[0]):
            row = rows(i)  # [1, ...] on the devices, as stored
            if pair is not None:
                row = self._program("merge", target, lora_opts)(row, *(a[i: i + 1] for a in pair))
            out = write(out, row, jnp.int32(i))
        return out

    def _program(self, kind: str, target, lora_opts):
        """The compiled programs of a weight's placement, one per target shape and layout."""
        sig = (kind, str(jax.tree.map(lambda t: (t.shape, t.dtype, t.sharding), target)), id(lora_opts))
        if sig in self._programs:
            return self._programs[sig]
        shardings = jax.tree.map(lambda t: t.sharding, target)
        int8 = quant.is_int8(target)
        dtype = target.dtype
        n_in = target.n_in if int8 else None

        def convert(w, lead):
            return quant.quantize(w, n_in, lead, dtype) if int8 else w.astype(dtype)

        if kind == "whole":
            fn = jax.jit(lambda w: convert(w, 0), out_shardings=shardings)
        elif kind == "row":  # one layer [1, ...] as stored -> the layer's own weight in decoding's layout
            fn = jax.jit(lambda w: convert(w[0], 0), out_shardings=shardings)
        elif kind == "zeros":
            fn = jax.jit(lambda: jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), target), out_shardings=shardings)
        elif kind == "write":
            def write(stack, row, i):  # row [1, ...] in its stored dtype -> converted and written at layer i
                new = convert(row, 1)
                return jax.tree.map(lambda s, r: jax.lax.dynamic_update_index_in_dim(s, r[0], i, 0), stack, new)

            fn = jax.jit(write, donate_argnums=0, out_shardings=shardings)
        else:  # merge: a layer's base weight [1, ...] with its adapter pair -> the merged weight [1, ...]
            fn = jax.jit(partial(_merge_row, opts=lora_opts))
        self._programs[sig] = fn
        return fn


def _merge_row(w, a, b, opts):
    name = "w"
    return lora.merged({"s": {"layers": {name: w}}}, {"s": {"layers": {name + lora.A: a, name + lora.B: b}}},
                       opts)["s"]["layers"][name]


def _adapter_pair(adapters: dict | None, key: tuple):
    """(A, B) of the adapter of the weight at ``key`` (stack, "layers", name), or None."""
    if not adapters or len(key) < 3 or key[0] not in adapters:
        return None
    layers = adapters[key[0]].get("layers", {})
    name = key[-1]
    if name + lora.A not in layers:
        return None
    return layers[name + lora.A], layers[name + lora.B]


def _row_source_sharding(target) -> NamedSharding:
    """The sharding of a [1, ...] slice of the stacked weight a per-layer ``target`` comes from (its spec with the
    unsharded layers axis in front)."""
    sh = _device_sharding(target)
    return NamedSharding(sh.mesh, P(None, *sh.spec))


def _device_sharding(target):
    """The device sharding of a target (an Int8's: its values')."""
    return (target.q if quant.is_int8(target) else target).sharding


def _place(x, sharding):
    """A host weight (numpy: each process places its devices' part; or an array in host memory) in ``sharding``."""
    return put_global(x, sharding) if isinstance(x, np.ndarray) else jax.device_put(x, sharding)


def _host_rows(x, sharding):
    """rows(i) -> layer i of a stacked host weight as a [1, ...] array on the devices in ``sharding`` (the stacked
    weight's device layout, whose spec its host layout shares): numpy sliced, or an array in host memory read
    shard by shard (never whole on a device)."""
    if isinstance(x, np.ndarray):
        return lambda i: put_global(x[i: i + 1], sharding)
    shards = {s.device: s.data for s in x.addressable_shards}
    cache: dict = {}

    def rows(i):
        parts = []
        for d in sharding.addressable_devices:
            if d not in cache:
                cache[d] = np.asarray(shards[d])
            parts.append(jax.device_put(cache[d][i: i + 1], SingleDeviceSharding(d)))
        return jax.make_array_from_single_device_arrays((1,) + tuple(x.shape[1:]), sharding, parts)

    return rows
