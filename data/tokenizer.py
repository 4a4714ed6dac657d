"""The tokenizer: loaded (the synthetic task's word-level one, or an HF name or directory), learnt from a task's
texts in seconds offline (``--tokenizer train``), its pad id, its encoding through the Rust tokenizer directly, and
the share of tokens it does not know. No data set library here: the decoder and the server read a tokenizer
without importing Hugging Face ``datasets`` (tests/test_architecture.py)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Optional

import numpy as np

from data import synthetic
from utils.errors import DataError
from utils.hub import fetch

TRAINED = "train"  # --tokenizer train: learn one from the training data (train_tokenizer)


class FastEncoder:
    """A fast tokenizer's encoding as the family's ``encode_inputs`` / ``encode_targets`` call it
    (``tok(texts, add_special_tokens=...)["input_ids"]``), through the Rust tokenizer directly: the same ids
    without transformers' per-row dictionaries (half the time of a large tokenization). One text (a server's
    prompt) goes to the backend's ``encode``, not its batch path: about a third of transformers' call's time on
    this project's CPU machine, where a server's main thread tokenized each prompt in 0.3 ms through
    transformers."""

    def __init__(self, tokenizer):
        from tokenizers import Tokenizer

        # its own copy of the Rust tokenizer, set as transformers' call sets it for every call (no truncation, no
        # padding: a tokenizer.json may carry either, and the one shared with transformers keeps what its last call
        # set; special tokens split or not as the tokenizer says)
        self.backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self.backend.no_truncation()
        self.backend.no_padding()
        self.backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
        self.eos_token_id = tokenizer.eos_token_id
        self._encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)

    def __call__(self, texts: list, add_special_tokens: bool = True) -> dict:
        if len(texts) == 1:
            return {"input_ids": [self.backend.encode(texts[0], add_special_tokens=add_special_tokens).ids]}
        return {"input_ids": [e.ids for e in self._encode(list(texts), add_special_tokens=add_special_tokens)]}


def encoder_of(tokenizer):
    """What encodes a batch of texts: ``FastEncoder`` for a fast tokenizer whose encoding is transformers' own (not a
    class that encodes its own way), else the tokenizer itself."""
    from transformers import PreTrainedTokenizerFast

    own = getattr(type(tokenizer), "_encode_plus", None) is not getattr(PreTrainedTokenizerFast, "_encode_plus", None)
    return FastEncoder(tokenizer) if getattr(tokenizer, "is_fast", False) and not own else tokenizer


def pad_id(tokenizer) -> int:
    """The id that pads a row and follows a finished output: the tokenizer's pad token, else its end-of-text token
    (what Hugging Face ``generate`` pads with when the model's config sets no pad token: GPT-J's and GPT-2's
    tokenizers have none). Padding is masked everywhere, so which id it is never changes a result."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    raise DataError("the tokenizer has neither a pad token nor an end-of-text token: give it one (e.g. "
                    "tokenizer.add_special_tokens({'eos_token': '</s>'}) and save_pretrained) or pass another "
                    "--tokenizer")


def train_tokenizer(batches, vocab_size: int, out_dir: str, labels: Optional[tuple] = None):
    """A BPE tokenizer learnt in seconds, no download, from ``batches``: an iterable of lists of texts (the inputs as
    the family reads them, and the targets; read twice: for the alphabet, then for the merges): at most
    ``vocab_size`` tokens (the model's), <pad> 0, </s> 1, <unk> 2 as T5's, every character of the data in its
    alphabet (so no word of the data is unknown), saved to ``out_dir`` (a directory AutoTokenizer loads, which
    checkpoints name and validation uses). A label set's words are frequent: they become whole tokens.
    ``batches`` is a callable giving a fresh iterable each time."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    chars = set(" ".join(labels or ()))
    for texts in batches():
        chars.update(*texts)
    alphabet = sorted({c for c in chars if not c.isspace()} | {"\u2581"})  # + Metaspace's word marker
    specials = ["<pad>", "</s>", "<unk>"]
    if len(alphabet) + len(specials) + 1 > vocab_size:
        raise DataError(f"the training data has {len(alphabet)} distinct characters but vocab_size is {vocab_size}: "
                        f"a tokenizer needs at least {len(alphabet) + len(specials) + 1} tokens; raise --vocab_size")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()

    def texts():
        for part in batches():
            yield from part
        yield from labels or ()

    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                         initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                                         show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out_dir)
    return fast


FRAGMENTED = 1.5  # tokens a word above which a learnt tokenizer that filled its vocabulary is said to split words


def vocabulary_fit(tok, sample: list, vocab_size: int, cap: int = 1 << 15) -> Optional[str]:
    """One line when a tokenizer learnt with ``vocab_size`` tokens filled them and still splits the words of
    ``sample`` (texts of the data) into more than ``FRAGMENTED`` tokens each on average, which a model learns
    poorly, naming the size that holds the sample's words whole (a BPE learnt from the sample with up to ``cap``
    tokens, rounded up to a multiple of 128); else None. The model's vocabulary stays the config's: it is part of
    the model's shape, which no data changes behind the user's back."""
    words = sum(len(text.split()) for text in sample)
    if len(tok) < vocab_size or not words:
        return None
    pieces = sum(len(ids) for ids in tok(sample, add_special_tokens=False)["input_ids"])
    if pieces / words <= FRAGMENTED:
        return None
    with tempfile.TemporaryDirectory() as scratch:
        whole = len(train_tokenizer(lambda: [sample], cap, scratch))
    need = "more than %d" % cap if whole >= cap else str(-(-whole // 128) * 128)
    return (f"the learnt tokenizer filled --vocab_size {vocab_size} (the model's vocabulary) and splits the data's "
            f"words into {pieces / words:.1f} tokens each on average, which a model learns poorly: {need} tokens "
            f"hold them whole; pass --vocab_size {need.split()[-1]}")


def load_tokenizer(name: str):
    """The tokenizer: 'synthetic' (the NLI task's offline word-level one) or an HF name/directory."""
    if name == "synthetic":
        return synthetic.make_tokenizer()
    if name == TRAINED:
        raise DataError("--tokenizer train learns a tokenizer from the training data: run_finetuning.py does that; "
                        "validation then uses the one saved with the checkpoint")
    from transformers import AutoTokenizer

    fix = ("pass --tokenizer train to learn one from the training data offline, or download it elsewhere "
           f"(huggingface-cli download {name} --local-dir DIR), copy DIR here and pass --tokenizer DIR")
    try:
        if os.path.isdir(name):
            return AutoTokenizer.from_pretrained(name)
        return fetch(lambda **kw: AutoTokenizer.from_pretrained(name, **kw), name, "tokenizer", fix, DataError)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"cannot load tokenizer '{name}' ({type(e).__name__}): {fix}") from None


def unknown_share(ids: list, tokenizer, sample: int = 5000) -> float:
    """The share of the token ids (a list of id sequences) that are the tokenizer's <unk> (0 without one)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    ids = ids[:sample]
    total = sum(len(x) for x in ids)
    if unk is None or not total:
        return 0.0
    return sum(int(np.sum(np.asarray(x) == unk)) for x in ids) / total


def check_unknown(share: float, name: str, dataset: str, limit: float = 0.01) -> float:
    """``share`` of the input tokens unknown (<unk>) to tokenizer ``name``; DataError above ``limit``, naming a
    tokenizer that fits (a word-level synthetic tokenizer turns other text into almost nothing but <unk>)."""
    if share > limit:
        hint = ("the synthetic tokenizer knows only the synthetic NLI task's words: pass --tokenizer train to learn "
                "one from this data (offline, seconds), or the model's tokenizer, e.g. --tokenizer "
                "google/flan-t5-small (a hub name or a local directory) with a preset of that model"
                if name == "synthetic" else "pass the tokenizer of the model this data is for (--tokenizer "
                                            "NAME_OR_DIR)")
        raise DataError(f"{share:.0%} of the prompt tokens of {dataset} are unknown (<unk>) to tokenizer {name!r}: "
                        f"{hint}")
    return share


# --------------------------------------------------------------------------- each token's text


def _byte_decoder() -> dict:
    """GPT-2's byte-level alphabet back to bytes: the printable character that stands for each byte -> the byte
    (the inverse of its ``bytes_to_unicode``, which a byte-level BPE's tokens are spelt in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _decoders(tokenizer) -> list:
    """The Rust tokenizer's decoder steps, flattened ([{type: ...}, ...]; none: [])."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return [{"type": "Metaspace", "replacement": "\u2581"}] if hasattr(tokenizer, "sp_model") else []
    dec = json.loads(backend.to_str()).get("decoder")
    if dec is None:
        return []
    return dec.get("decoders", []) if dec.get("type") == "Sequence" else [dec]


def _piece(token: str, steps: list, bytes_of: dict) -> bytes:
    kinds = {d.get("type") for d in steps}
    if "ByteLevel" in kinds:
        return bytes(bytes_of[c] for c in token if c in bytes_of)
    if "ByteFallback" in kinds and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    if "WordPiece" in kinds:
        return (token[2:] if token.startswith("##") else " " + token).encode()
    if not kinds:  # no decoder: decode joins the tokens with spaces
        return (" " + token).encode()
    for d in steps:
        if d.get("type") == "Metaspace":
            token = token.replace(d.get("replacement", "\u2581"), " ")
        elif d.get("type") == "Replace":
            token = token.replace(d["pattern"].get("String", "\u0000"), d["content"])
    return token.encode()


def token_pieces(tokenizer) -> tuple:
    """(the bytes each token id adds to the text of the tokens before it, id by id up to ``len(tokenizer)``; whether
    ``decode`` strips the first token's leading space): what a grammar matches a token against (decoder/grammar.py),
    and what the server shows of each token (serving/output.py, where the tokens follow a prompt). A byte-level
    BPE's tokens as their bytes (GPT-2's alphabet undone), a Metaspace or sentencepiece one's with the word marker
    a space (byte-fallback tokens their byte), a tokenizer with no decoder (the synthetic word-level one: decode
    joins the words with spaces) a space and the word; special tokens none (they add no text)."""
    steps, bytes_of = _decoders(tokenizer), _byte_decoder()
    special = set(tokenizer.all_special_ids)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    pieces = [b"" if i in special or t is None else _piece(t, steps, bytes_of) for i, t in enumerate(tokens)]
    ids = [i for i in tokenizer("a b", add_special_tokens=False)["input_ids"] if i not in special][:2]
    if len(ids) < 2:
        ids = [i for i in range(len(pieces)) if pieces[i].strip()][:2]
    joined = b"".join(pieces[i] for i in ids).decode("utf-8", "replace")
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    return pieces, joined != decoded and joined.startswith(" ") and joined[1:] == decoded
