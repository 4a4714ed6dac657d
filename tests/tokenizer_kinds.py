"""Every kind of tokenizer the project meets, built offline in a fraction of a second each: the synthetic word-level
one (data/synthetic.py), a Metaspace BPE as ``--tokenizer train`` learns one (T5-like), a byte-level BPE (GPT-J's
kind: tokenizers' ByteLevel pre-tokenizer and decoder), and a sentencepiece model trained with the ``sentencepiece``
library and loaded as T5's tokenizer loads its ``spiece.model`` (byte fallback off, as T5's; transformers 5 reads it
into its Rust tokenizer, as for T5). Their texts hold JSON's characters,
so that a grammar over JSON can be written with each (the synthetic one has none: a JSON grammar is refused there)."""

from __future__ import annotations

import functools
import os
import tempfile

TEXTS = ['{"name": "Ada", "age": 36, "tags": ["x", "y"], "ok": true, "n": null}', "the cat sleeps in the park .",
         "a dog runs in the garden 123 , 4.5e-3 [1, 2] {\"k\": false}", "positive negative neutral entailment",
         "héllo wörld ünïcode — “quotes” ok", "abc-def_ghi 7890 ; : ? ! ( ) / \\ @ # $ % ^ & * + = ~ ` ' < >"] * 20

KINDS = ("synthetic", "metaspace", "bytelevel", "sentencepiece")


@functools.lru_cache(maxsize=None)
def make(kind: str):
    if kind == "synthetic":
        from data.synthetic import make_tokenizer

        return make_tokenizer()
    if kind == "metaspace":
        from data.tokenizer import train_tokenizer

        return train_tokenizer(lambda: [TEXTS], 400, tempfile.mkdtemp(prefix="tok_metaspace_"))
    if kind == "bytelevel":
        return _bytelevel()
    return _sentencepiece()


def _bytelevel():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def _sentencepiece():
    import sentencepiece as spm
    from transformers import T5Tokenizer

    d = tempfile.mkdtemp(prefix="tok_sp_")
    with open(os.path.join(d, "text.txt"), "w") as f:
        f.write("\n".join(TEXTS))
    spm.SentencePieceTrainer.train(input=os.path.join(d, "text.txt"), model_prefix=os.path.join(d, "spiece"),
                                   vocab_size=120, model_type="bpe", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   byte_fallback=False, character_coverage=1.0, minloglevel=2)
    return T5Tokenizer.from_pretrained(d, extra_ids=0, legacy=False)
