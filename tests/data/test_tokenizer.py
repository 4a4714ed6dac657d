"""The tokenizer's encoding through the Rust tokenizer directly (data/tokenizer.py's ``FastEncoder``): the ids the
transformers tokenizer gives, for a batch and for one text, whatever truncation or padding the tokenizer carries."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from data import synthetic
from modelling import registry


def test_the_fast_batch_encoding_gives_the_tokenizer_s_own_ids(tmp_path):
    """The cache tokenizes through the Rust tokenizer directly (data.tokenizer.FastEncoder): the family's inputs and
    targets get the ids the transformers tokenizer gives them (the word-level one and a learnt BPE one)."""
    from data.tokenizer import encoder_of
    from tests.mnli import train_tokenizer

    rows = synthetic.generate_split("train", 64, seed=4)
    texts = [f"premise: {r['premise']} hypothesis: {r['hypothesis']}" for r in rows] + ["", "unknown wörds"]
    for tok in (synthetic.make_tokenizer(), train_tokenizer(rows, 128, str(tmp_path / "bpe"), registry.get("t5"))):
        for family in (registry.get("t5"), registry.get("gptj")):
            assert family.encode_inputs(encoder_of(tok), texts) == family.encode_inputs(tok, texts)
            assert family.encode_targets(encoder_of(tok), texts) == family.encode_targets(tok, texts)


_TOKENIZERS: list = []


def _both_tokenizers() -> list:
    """The word-level tokenizer and a learnt BPE one (learnt once per test process)."""
    if not _TOKENIZERS:
        import tempfile
        from tests.mnli import train_tokenizer

        rows = synthetic.generate_split("train", 64, seed=4)
        with tempfile.TemporaryDirectory() as scratch:
            _TOKENIZERS.extend([synthetic.make_tokenizer(), train_tokenizer(rows, 128, scratch, registry.get("t5"))])
    return _TOKENIZERS


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(synthetic.vocabulary() + ["</s>", "<pad>", "wörds", "é", "\u4e2d", "  ", "\n",
                                                            "x" * 9, ".", "the cat", ""]), max_size=12),
       st.sampled_from([" ", "", "  "]))
def test_one_prompt_through_the_rust_tokenizer_gets_the_tokenizer_s_ids(words, sep):
    """A server's prompt goes alone to the Rust tokenizer's ``encode`` (data.tokenizer.FastEncoder, not its batch path):
    each family's inputs and targets get exactly the ids the transformers tokenizer gives that one text (special
    tokens written in the text, unknown words and characters, empty and blank texts included)."""
    from data.tokenizer import encoder_of

    text = sep.join(words)
    for tok in _both_tokenizers():
        for family in (registry.get("t5"), registry.get("gptj")):
            assert family.encode_inputs(encoder_of(tok), [text]) == family.encode_inputs(tok, [text]), text
            assert family.encode_targets(encoder_of(tok), [text]) == family.encode_targets(tok, [text]), text


def test_the_rust_encoding_ignores_truncation_and_padding_left_in_the_tokenizer():
    """A tokenizer.json may carry truncation and padding, and transformers' call sets them per call on the Rust
    tokenizer it shares: FastEncoder's copy has neither, so one text or several get the tokenizer's own ids, before
    and after a call of the tokenizer that set them."""
    from data.tokenizer import encoder_of

    tok = synthetic.make_tokenizer()
    tok.backend_tokenizer.enable_truncation(3)
    tok.backend_tokenizer.enable_padding(length=9)
    texts = ["the cat sleeps in the park .", "a dog"]
    encoder = encoder_of(tok)
    want = [tok([t])["input_ids"][0] for t in texts]
    assert [len(x) for x in want] == [8, 3]  # (the call itself neither truncates nor pads)
    assert [encoder([t])["input_ids"][0] for t in texts] == want and encoder(texts)["input_ids"] == want
    tok(texts, truncation=True, max_length=2, padding="max_length")  # a call that leaves both set
    assert [encoder([t])["input_ids"][0] for t in texts] == want and encoder(texts)["input_ids"] == want


@pytest.mark.parametrize("kind", ["synthetic", "metaspace", "bytelevel", "sentencepiece"])
def test_each_tokens_piece_is_the_text_it_adds_for_every_tokenizer_kind(kind):
    """data/tokenizer.py's ``token_pieces`` (what a grammar matches and the server shows of each token): for every
    kind of tokenizer (tests/tokenizer_kinds.py) the pieces of a text's tokens joined are ``decode``'s text, but for
    the one leading space a Metaspace, sentencepiece or word-level tokenizer's decode strips (which the function
    says it does); special tokens add nothing."""
    from data.tokenizer import token_pieces
    from tests.tokenizer_kinds import make

    tok = make(kind)
    pieces, strips = token_pieces(tok)
    assert len(pieces) == len(tok) and strips == (kind != "bytelevel")
    assert all(pieces[i] == b"" for i in tok.all_special_ids)
    texts = ["the cat sleeps in the park .", '{"name": "Ada", "age": 36, "tags": ["x"]}', "héllo wörld — “quotes”",
             "a dog runs 123 , 4.5e-3", "abc-def_ghi ; : ? !"]
    for text in texts:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        joined = b"".join(pieces[i] for i in ids).decode("utf-8")
        decoded = tok.decode(ids, skip_special_tokens=True)
        assert (joined[1:] if strips else joined) == decoded, (kind, text, joined, decoded)
        assert not strips or not joined or joined.startswith(" ")
