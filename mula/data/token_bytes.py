"""UTF-8 bytes of every token of a byte-level BPE tokenizer: the denominator of bits per byte.

A byte-level BPE (GPT-2's scheme; OLMo's, Mula's own trained tokenizers, Qwen's, Llama 3's, DeepSeek's) writes
each byte of the text as one of 256 printable characters (``bytes_to_unicode``), so a vocabulary entry is
a string of those characters and its raw bytes are their inverse images. That is what the tokenizer's
``ByteLevel`` decoder does before it joins the bytes into text: here the bytes are counted per token
instead, so a token that holds part of a multi-byte character (one byte of a CJK character, say) counts
exactly the bytes it holds, and the tokens of any text sum to that text's UTF-8 length.

The rule, per token id:

* special tokens (EOS, padding, any added token marked special) count 0 bytes: they are markers the
  data adds (a document's end), not text;
* an added token that is not special (OLMo's runs of spaces, ``|||IP_ADDRESS|||``) counts what the decoder
  gives it: the inverse images when every character is in the byte alphabet, else its own UTF-8 bytes;
* every other token counts its inverse images, one byte per character.

Ids below the vocabulary's largest that name no token count 0.
"""

from __future__ import annotations

import json
from functools import cache

import numpy as np
from tokenizers import Tokenizer


@cache
def byte_decoder() -> dict[str, int]:
    """The byte-level alphabet's inverse: character -> the byte it stands for (GPT-2's ``bytes_to_unicode``:
    printable Latin-1 bytes stand for themselves, the other 68 bytes for characters from U+0100 on)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _is_byte_level(spec: object) -> bool:
    """Whether a decoder spec (tokenizer.json's ``decoder``) is ByteLevel, alone or in a Sequence."""
    if not isinstance(spec, dict):
        return False
    if spec.get("type") == "Sequence":
        return any(_is_byte_level(d) for d in spec.get("decoders", []))
    return spec.get("type") == "ByteLevel"


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The raw bytes token `token_id` stands for, by the module's rule (b"" for special tokens)."""
    added = tokenizer.get_added_tokens_decoder().get(token_id)
    if added is not None and added.special:
        return b""
    token = tokenizer.id_to_token(token_id)
    if token is None:
        return b""
    decoder = byte_decoder()
    if all(c in decoder for c in token):
        return bytes(decoder[c] for c in token)
    return token.encode("utf-8")


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray | None:
    """int64 [largest id + 1]: the UTF-8 bytes of each token (the module's rule), or None when the
    tokenizer is not byte-level (its decoder is not ByteLevel: bytes per token are then not defined here)."""
    if not _is_byte_level(json.loads(tokenizer.to_str()).get("decoder")):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    lengths = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
    decoder = byte_decoder()
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    for token, i in vocab.items():
        if i in special:
            continue
        # as `token_bytes`, without building the bytes: one per character, or the token's own UTF-8
        lengths[i] = len(token) if all(c in decoder for c in token) else len(token.encode("utf-8"))
    return lengths
