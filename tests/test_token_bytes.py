"""Bytes per token (mula/data/token_bytes.py), the denominator of val/bpb.

The invariant: the byte lengths of the tokens of any text sum to the text's UTF-8 length, also when tokens
hold parts of a character (checked on text whose encoding has such tokens, with OLMo's tokenizer and a
byte-level BPE Mula trains), and special tokens (EOS, padding) count 0. A length taken from decoding each
token alone (U+FFFD for a partial character) breaks the invariant: the check can fail. Each token's raw
bytes equal what the tokenizer's own decoder gives the token wherever they are whole UTF-8, over OLMo's
whole vocabulary; the byte alphabet is the ByteLevel pre-tokenizer's. A tokenizer that is not byte-level
has no table.
"""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from mula.data.token_bytes import byte_decoder, token_byte_lengths, token_bytes
from mula.data.tokenizer import load_tokenizer, train_bpe

TEXT = unicodedata.normalize(  # NFC: OLMo's normalizer leaves it as it is
    "NFC",
    "Hello, world! épsilon ζήτα 数据 データ 🙂🚀 naïve café\n\tdef f(x):  return x  # ok\n"
    "   three spaces, |||IP_ADDRESS||| and ∑ᵢ xᵢ² ≤ 1 — done.",
)


def olmo() -> Tokenizer:
    return load_tokenizer("olmo").tokenizer


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Tokenizer:
    """A 300-token byte-level BPE Mula trains on ASCII code: TEXT's other characters are split into bytes."""
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    corpus = ["def main(argv):\n    return 0  # Hello, world!\n"] * 20
    return load_tokenizer(train_bpe(corpus, path, vocab_size=300, show_progress=False)).tokenizer


def decoded_lengths(tok: Tokenizer) -> np.ndarray:
    """The wrong way (a planted bug): each token decoded alone, a partial character then being U+FFFD."""
    n = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    return np.array([len(tok.decode([i], skip_special_tokens=False).encode()) for i in range(n)])


def bytes_mismatch(tok: Tokenizer, lengths: np.ndarray) -> tuple[int, int]:
    """(the sum of `lengths` over TEXT's tokens, TEXT's UTF-8 length): equal when the lengths are right."""
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    return int(lengths[ids].sum()), len(TEXT.encode("utf-8"))


@pytest.mark.parametrize("which", ["olmo", "trained"])
def test_token_bytes_sum_to_the_text_bytes_and_specials_count_zero(which, trained):
    tok = olmo() if which == "olmo" else trained
    lengths = token_byte_lengths(tok)
    assert (
        lengths.dtype == np.int64 and len(lengths) == max(tok.get_vocab(with_added_tokens=True).values()) + 1
    )
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    partial = [i for i in ids if not _is_utf8(token_bytes(tok, i))]
    assert partial, "the text must have tokens that hold part of a character"
    total, expected = bytes_mismatch(tok, lengths)
    assert total == expected
    assert b"".join(token_bytes(tok, i) for i in ids) == TEXT.encode("utf-8")
    eos = tok.token_to_id("<|endoftext|>")
    assert lengths[eos] == 0 and token_bytes(tok, eos) == b""
    if which == "olmo":
        assert (eos, lengths[1], lengths[50276], lengths[0]) == (
            50279,
            0,
            2,
            16,
        )  # pad 0, "  " 2, |||IP...||| 16
        assert len(lengths) == 50280
    # planted: lengths from decoding each token alone miscount the partial characters
    total, expected = bytes_mismatch(tok, decoded_lengths(tok))
    assert total != expected


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_raw_bytes_agree_with_the_tokenizers_decoder_over_olmos_vocabulary():
    tok = olmo()
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    lengths = token_byte_lengths(tok)
    whole = 0
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        raw = token_bytes(tok, i)
        assert len(raw) == lengths[i], i
        if i in special:
            assert raw == b""
        elif _is_utf8(raw):
            assert raw.decode("utf-8") == tok.decode([i], skip_special_tokens=False), i
            whole += 1
    assert whole > 49000  # nearly every token is whole text; the rest are partial characters


def test_byte_alphabet_is_the_byte_level_pre_tokenizers():
    decoder = byte_decoder()
    assert set(decoder) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(decoder.values()) == list(
        range(256)
    )
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for text in ("A z~!", "é", "数", "🙂", "\n\t\x00\x7f"):  # 1- to 4-byte characters and control bytes
        (chars, _), *_ = pre.pre_tokenize_str(text)
        assert bytes(decoder[c] for c in chars) == text.encode("utf-8")


def test_a_tokenizer_that_is_not_byte_level_has_no_table():
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    assert token_byte_lengths(tok) is None
