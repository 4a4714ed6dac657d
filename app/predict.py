"""Prediction: what the decoding drivers share above the decoder (decoder/decoder.py): the decoding config, a
task's prompts as features, the inputs run_inference.py decodes, its predictions file and the record of what wrote
it, HF ``generate`` beside ours, and decoding's memory plan.

    cfg = start_decoding(args, overrides)   # the inference preset, the checkpoint's shape and task; devices, JAX
    decoder = Decoder.of_config(cfg, tokenizer)
    params = decoder.load_params(directory, step)
    texts = decoder.predict(params, prompt_features(examples, tokenizer, decoder.family, length)[0])

Prompts are never cut: each batch is padded to its own longest prompt, and laid out as the family reads them
(``Family.layout_prompts``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import jax
import numpy as np
from tqdm import tqdm

from app.args import carried_model, make_config
from app.entry import keeping, written_whole
from app.runtime import is_main_process, start_devices
from config.fields import get_path
from config.schema import FIELDS
from data.tasks import Example, tokenize_prompts
from data.tokenizer import pad_id, unknown_share
from decoder.adapters import stack_of
from decoder.decoder import Decoder
from decoder.grammar import GrammarError, Grammars, HostMasks
from decoder.plan import decode_plan, format_plan
from modelling.processors import LabelTrie, Processors, bitmask_words
from partitioning.base import fingerprint
from partitioning.plan import device_memory_limit, host_memory_limit, human_bytes
from utils import checkpoint as ckpt
from utils.errors import DataError, FlanT5Error

logger = logging.getLogger("flan_t5")


def decoding_config(args, overrides: dict, purpose: str = "validate or decode"):
    """The inference preset, the model's own shape (explicit flags that contradict it are errors), the task the
    checkpoint was trained on (its data, template, labels, metrics, tokenizer, output length: flags change them),
    the command line, and what decoding requires (eval mode, no RTS), validated once. ``purpose``: what the driver
    does, as its error says it."""
    load, hf_model = overrides.get("load"), overrides.get("hf_model")
    if not load and not hf_model:
        raise FlanT5Error(f"nothing to {purpose}: pass --load CKPT (a --save directory of run_finetuning.py) or "
                          "--hf_model NAME_OR_DIR")
    carried = carried_model(overrides, load, hf_model)
    if "dataset" in overrides or "split" in overrides:  # data named on the command line: its rows, not held-out ones
        carried["holdout"] = 0
    # a LoRA checkpoint's adapters are merged into their base (decoder/weights.py's merged_params): the model decoded has none
    return make_config("inference", args.config, overrides, fixed={"eval": True, "rts": False, "lora_rank": 0},
                       defaults=carried)


def start_decoding(args, overrides: dict, purpose: str = "validate or decode"):
    """``decoding_config``, then this process's simulated devices and JAX's set-up from it (both before JAX starts a
    backend) -> the config: how every decoding driver starts."""
    cfg = decoding_config(args, overrides, purpose)
    start_devices(cfg)
    return cfg


def trained_prompt_length(cfg) -> int | None:
    """The longest prompt (tokens, as the model reads it) of the rows the checkpoint --load names was trained on, as
    its meta records it (None: an HF model, or a checkpoint older than the record)."""
    if not cfg.checkpoint.load:
        return None
    directory, step = ckpt.resolve(cfg.checkpoint.load)[-1]
    return (ckpt.read_meta(directory, step) or {}).get("longest_prompt")


def decoding_options(cfg, tokenizer, decoder, task=None):
    """The decoder's options with the processors the inference flags ask for (modelling/processors.py): HF's
    repetition penalty and no_repeat_ngram_size; --bad_words, each word's tokens alone and after a space banned as a
    sequence (HF's bad_words_ids; a word that is the end-of-text token alone is left to end answers, as HF leaves
    it); --constrain labels, the task's labels as a token trie (each label's target tokens, its end-of-text token
    last); --regex or --json_schema FILE, a grammar (decoder/grammar.py) each row follows, asked of the host at each
    step. ``task``: the task decoded (data.tasks.Task; its labels)."""
    i, eos = cfg.inference, tokenizer.eos_token_id
    bias = tuple((seq, float("-inf")) for seq in bad_words(tokenizer, i.bad_words, eos))
    trie = None
    if i.constrain == "labels":
        if task is None or not task.labels:
            raise FlanT5Error(f"--constrain labels restricts answers to the task's label set, and the task "
                              f"{getattr(task, 'name', '')!r} has none (free text): drop --constrain")
        trie = LabelTrie.of(decoder.family.encode_targets(tokenizer, list(task.labels)), eos)
    host = grammar_host(i, tokenizer, decoder) if i.regex is not None or i.json_schema is not None else None
    procs = Processors(bias, i.repetition_penalty, i.no_repeat_ngram_size, trie, host, bitmask_words(decoder.n_tokens))
    return dataclasses.replace(decoder.options, processors=procs)


def bad_words(tokenizer, words: tuple, eos: int) -> list:
    """Each word's token sequences, alone and after a space (a word starting a text and inside one), once each."""
    out = []
    for word in words:
        for text in (word.strip(), " " + word.strip()):
            ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids and ids != (eos,) and ids not in out:
                out.append(ids)
    return out


def grammar_host(inference, tokenizer, decoder):
    """The host side of --regex or --json_schema FILE: the grammar compiled (xgrammar), a matcher for every row of a
    batch (key: its index + 1, each anew at a batch's first token)."""
    flag = "--regex" if inference.regex is not None else "--json_schema"
    if inference.regex is not None:
        kind, spec = "regex", inference.regex
    else:
        try:
            with open(inference.json_schema) as f:
                kind, spec = "json_schema", json.load(f)
        except (OSError, ValueError) as e:
            raise FlanT5Error(f"--json_schema {inference.json_schema}: cannot be read as JSON ({e}): pass a file "
                              "holding a JSON schema") from None
    try:
        compiled = Grammars(tokenizer, decoder.n_tokens, tokenizer.eos_token_id).compile(kind, spec, flag)
    except GrammarError as e:
        raise FlanT5Error(f"{flag} cannot be followed: {e.reason}") from None
    masks = HostMasks(decoder.n_tokens, tokenizer.eos_token_id)
    for key in range(1, decoder.batch_size + 1):
        masks.open(compiled, key=key)
    return masks


def decoding_plan(cfg, rows: int, exact: bool = False, prompt_length: int | None = None, adapters=None):
    """The memory plan (decoder/plan.py) of decoding ``rows`` prompts of ``prompt_length`` tokens (default
    ``sequence_length``) to ``output_length`` new ones with this config's weights: a LoRA checkpoint's base counted
    in host memory while its adapters are merged. ``adapters``: a server's ServeOptions with LoRA adapters served
    side by side (their stack counted beside the weights)."""
    g = Decoder.of_config(cfg)
    stack = None
    if adapters is not None and adapters.max_loras:
        stack = stack_of(g, adapters.loras, adapters.max_loras, adapters.max_lora_rank, adapters.lora_targets)
    base = 0
    load = cfg.checkpoint.load
    if load:
        directory, step = ckpt.resolve(load)[-1]
        saved = ckpt.read_meta(directory, step)
        if saved.get("lora_base") and stack is not None:
            raise FlanT5Error(f"--load {directory} holds LoRA adapters, and adapters are served over the model they "
                              "were trained on: --load that base (a full checkpoint, or --hf_model) and name this one "
                              f"with --lora NAME={directory}")
        if saved.get("lora_base"):
            lg = g.weights.lora_graphs(saved)
            base = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(lg.abstract_base()))
    return decode_plan(g, rows, prompt_length or cfg.model.sequence_length, cfg.inference.output_length, exact, base,
                       stack, adapters.loras if stack is not None else ())


def print_plan(cfg, rows: int, exact: bool = False, prompt_length: int | None = None, adapters=None):
    """``decoding_plan`` printed, and checked against this machine's memory (a line saying what does not fit)."""
    plan = decoding_plan(cfg, rows, exact, prompt_length, adapters)
    print(format_plan(plan), flush=True)
    dev, host = device_memory_limit(), host_memory_limit()
    if dev and plan.device_peak > dev:
        print(f"does not fit: a device has {human_bytes(dev)}: try --quantize int8, --stream_encoder, fewer rows "
              "(--micro_batch_size) or --tensor_parallel", flush=True)
    if host and plan.host_peak > host:
        print(f"does not fit: this machine has {human_bytes(host)} of memory available", flush=True)
    return plan


def prompt_features(examples: list, tokenizer, family, sequence_length: int, given: bool = False) -> tuple:
    """(input features of the examples padded to the longest prompt, none cut, the share of unknown prompt tokens),
    each input in the family's prompt format (``Family.prompt``: as training and validation render it; a
    --prompt's text too). ``given``: the inputs are whole prompts, read as they are (a raw continuation, as the
    server's /v1/completions reads one)."""
    feats = tokenize_prompts(examples, tokenizer, family, given=given)  # never truncated
    longest = feats["input_ids"].shape[1]
    if longest > sequence_length:
        logger.info("%d prompt(s) are longer than sequence_length %d (the longest: %d tokens): each batch is padded "
                    "to its own longest prompt, as the original validated, none is cut",
                    int((feats["attention_mask"].sum(1) > sequence_length).sum()), sequence_length, longest)
    unknown = unknown_share([row[m > 0] for row, m in zip(feats["input_ids"], feats["attention_mask"])], tokenizer,
                            sample=len(examples))
    if unknown > 0.01:
        logger.warning("%.1f%% of the prompt tokens are unknown to tokenizer %s: the model sees <unk> there; pass "
                       "the tokenizer of this model (--tokenizer)", 100 * unknown, tokenizer.name_or_path)
    return feats, unknown


def inference_inputs(prompts, input_file, limit, cfg, td) -> list:
    """The examples run_inference.py decodes: prompt texts (the task's inputs), a file's rows (the first ``limit``, or
    all), or the held-out examples of the task ``td`` (data.mixture.TaskData: the first ``limit``, 4 by default)."""
    from data import sources  # (the data sets' library: the server, which reads its config here, needs none)
    from data.mixture import evaluation_set

    task = td.task
    if limit is not None and limit < 1:
        raise FlanT5Error(f"--limit {limit} must be at least 1")
    if prompts:
        if limit is not None:
            raise FlanT5Error("--limit applies to --input's rows or the task's held-out data, not to --prompt's texts: "
                              "drop --limit (or pass fewer --prompt texts)")
        return [Example(t, "") for t in prompts]
    if input_file:
        if not os.path.exists(input_file):
            raise DataError(f"--input {input_file} does not exist: pass --input with an existing file of rows "
                            f"(jsonl, json, csv, tsv, parquet) holding the task's columns ({', '.join(task.fields)})")
        rows, kept = sources.read(input_file, "", cfg.model.seed), []
        examples = task.examples(rows, targets=False, kept=kept)[:limit]
        column = id_column(rows, task)
        if column is not None:  # each example's row's id, carried to its prediction (predict_file)
            examples = [Named(e, column, rows.rows[int(i)][column]) for e, i in zip(examples, kept)]
        return examples
    return evaluation_set(td).examples[:4 if limit is None else limit]


ID_COLUMNS = ("id", "idx", "uid", "guid")  # (any case) the column that names a row, kept in its prediction


def id_column(rows, task):
    """The input's column that names each row (``ID_COLUMNS``, in any case; the task's own columns excluded), or
    None."""
    names = getattr(rows.rows, "column_names", None) or list(dict.fromkeys(k for r in rows.rows for k in r))
    return next((c for c in names if c.lower() in ID_COLUMNS and c not in task.fields), None)


class Named(Example):
    """An example with its row's id (``column``: the input's name for it), kept in its prediction."""

    def __init__(self, example: Example, column: str, id_):
        super().__init__(example.input, example.target, example.label)
        object.__setattr__(self, "column", column)  # (Example is frozen)
        object.__setattr__(self, "id", id_)


def side_by_side(decoder, params, examples: list, feats: dict, tokenizer, compare_hf: bool = False) -> list:
    """[{prompt, ours[, reference][, hf, same_tokens]}] of each example: our output, its reference, and with
    ``compare_hf`` Hugging Face ``generate``'s on the same weights with the same decoding options (app/hf_generate.py,
    imported here: torch is needed only then)."""
    tokens = decoder.predict_tokens(params, feats)
    ours = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    theirs = agree = None
    if compare_hf:
        from app.hf_generate import hf_generate  # torch, only for --compare_hf

        if decoder.options.processors.host is not None:
            raise FlanT5Error("--compare_hf: HF generate has no grammar to follow --regex or --json_schema: drop one")
        host = decoder.weights.host_tree(params)  # (training's layout; int8 weights dequantized: the same values)
        ids, mask = decoder.family.layout_prompts(feats["input_ids"], feats["attention_mask"])
        hf_tokens = hf_generate(decoder.cfg, decoder.family, host, ids, mask, tokenizer.eos_token_id,
                                pad_id(tokenizer), decoder.options)
        theirs = tokenizer.batch_decode(hf_tokens, skip_special_tokens=True)
        agree = [bool(np.array_equal(a, h)) for a, h in zip(tokens, hf_tokens)]
    return [{"prompt": e.input, "ours": o, **({"reference": e.target} if e.target else {}),
             **({} if theirs is None else {"hf": h, "same_tokens": a})}
            for e, o, h, a in zip(examples, ours, theirs or ours, agree or ours)]


def written_by(cfg, directory, step, params) -> dict:
    """What writes a predictions file, as its record (``record_path``) holds it: one key a line. A run where any of
    them differs does not continue the file (``check_writer``): its rows would come from another model or setting."""
    return {
        "checkpoint": os.path.abspath(directory) if directory else None,
        "step": step,
        "hf_model": None if directory else cfg.data.hf_model,
        "weights": fingerprint(params),  # a digest of the weights decoded (partitioning/base.py)
        "tokenizer": cfg.data.tokenizer,
        "decoding": {r.flag: get_path(cfg, r.path) for r in FIELDS.values() if r.path[0] == "inference"},
        # the weights' storage format when decoding reads a narrower one (None: as trained)
        "quantization": None if cfg.inference.quantize == "none" else cfg.inference.quantize,
    }


def record_path(path: str) -> str:
    """The record of what wrote the predictions file ``path``: ``NAME.meta.json`` beside ``NAME.jsonl``."""
    return os.path.splitext(path)[0] + ".meta.json"


def check_writer(path: str, writer: dict) -> None:
    """Refuses (one line naming every difference and the flag that starts a new file) to continue the predictions
    file ``path`` with other weights or settings than those its record says wrote it."""
    record = record_path(path)
    if not os.path.exists(record):
        raise FlanT5Error(f"--predictions {path} exists with no record of what wrote it ({record} is missing): pass "
                          "--predictions NEW.jsonl to start a new file (this one is left as it is)")
    with open(record) as f:
        before = json.load(f).get("written_by", {})
    now = json.loads(json.dumps(writer))
    differ = [f"{k} {before.get(k)!r} (now {now[k]!r})" for k in now if k != "decoding" and before.get(k) != now[k]]
    old = before.get("decoding") or {}
    differ += [f"--{k} {old.get(k)!r} (now {v!r})" for k, v in now["decoding"].items() if old.get(k) != v]
    if differ:
        raise FlanT5Error(f"--predictions {path} was written by other weights or settings: {'; '.join(differ)}: pass "
                          "--predictions NEW.jsonl to start a new file (this one is left as it is)")


def write_record(path: str, writer: dict) -> None:
    tmp = record_path(path) + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"predictions": os.path.basename(path), "written_by": writer}, f, indent=1)
    os.replace(tmp, record_path(path))


def predict_file(decoder, params, examples: list, feats: dict, path: str, writer: dict) -> tuple:
    """Predictions of a file's rows appended to the JSONL ``path`` batch by batch, in the input's order
    ({row[, its id], input, prediction[, reference]}), with what wrote them (``writer``: ``written_by``) in its record; a file
    that already holds the first rows' predictions (an interrupted run's) is continued after them, by the same
    weights and settings only. Each batch's lines are written whole (a signal waits for them) and Ctrl-C's line names
    the rows kept. -> (the lines written, how many rows were done before)."""
    done = finished_rows(path, examples)
    if os.path.exists(path):
        check_writer(path, writer)
    elif is_main_process():
        write_record(path, writer)
    if done:
        logger.info("%s holds the predictions of the first %d of %d rows: continuing after them", path, done,
                    len(examples))

    def kept(n: int) -> None:  # what the line of a Ctrl-C says is kept (app/entry.py)
        keeping(f"the predictions of the first {n} of {len(examples)} rows are kept in {path}: the same command "
                "continues after them" if n else None)

    out, primary = [], is_main_process()
    with open(path, "a") if primary else open(os.devnull, "w") as f:
        kept(done)
        try:
            for start in tqdm(range(done, len(examples), decoder.batch_size), desc="predicting", unit="batch",
                              disable=None if primary else True):
                idx = np.arange(start, min(start + decoder.batch_size, len(examples)))
                lines = [{"row": int(i), **named(examples[i]), "input": examples[i].input, "prediction": text,
                          **({"reference": examples[i].target} if examples[i].target else {})}
                         for i, text in zip(idx, decoder.predict_batch(params, feats, idx))]
                with written_whole():  # a batch's lines reach the file whole: Ctrl-C stops after them
                    f.write("".join(json.dumps(line) + "\n" for line in lines))
                    f.flush()
                    os.fsync(f.fileno())
                    kept(int(idx[-1]) + 1)
                out += lines
        finally:
            keeping(None)
    return out, done


def named(example) -> dict:
    """{its input's id column: its row's id} of a ``Named`` example, else nothing."""
    return {example.column: example.id} if isinstance(example, Named) else {}


def finished_rows(path: str, examples: list) -> int:
    """How many rows an existing predictions file already holds (they must be this input's first rows, in order);
    a file of other inputs is an error, never written over."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    try:
        rows = [json.loads(line) for line in lines]
    except ValueError:
        rows = None
    if rows is None or len(rows) > len(examples) or any(
            r.get("row") != i or r.get("input") != examples[i].input for i, r in enumerate(rows)):
        raise FlanT5Error(f"--predictions {path} exists and holds other predictions than this input's first rows: "
                          "choose another --predictions path (nothing was written)")
    return len(rows)
