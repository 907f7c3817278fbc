"""Tokenizers: train a byte-level BPE ``tokenizer.json`` offline, and load any Hugging Face ``tokenizer.json``
or a named one (``olmo``: ``mula.data.named_tokenizers``).

The end-of-document (EOS) token that `mula prepare` appends to every document is found, in this order:
an explicit ``eos_token``; ``eos_token`` in a ``tokenizer_config.json`` next to the file (a named tokenizer's
own settings instead); the special token the file's post-processor appends to a single sequence; a well-known
EOS token among the special tokens (``<|endoftext|>`` for GPT-2/NeoX/OLMo, id 50279 in OLMo's tokenizer,
``<|end_of_text|>``, ``</s>``, ``<eos>``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from mula.checkpoint.atomic import atomic_write
from mula.data.named_tokenizers import looks_like_a_name, named_tokenizer, unknown_name_error
from mula.data.paths import expand_paths
from mula.data.readers import iter_documents
from mula.data.token_bytes import token_byte_lengths

EOS_TOKEN = "<|endoftext|>"
# Tried in order when neither the caller, tokenizer_config.json nor the post-processor names the EOS token.
KNOWN_EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
# One encode_batch call per this many documents: large enough to amortise the call, small enough for RAM.
_ENCODE_BATCH = 256


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds every token id of a vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


@dataclass
class LoadedTokenizer:
    """A ``tokenizers.Tokenizer`` with its EOS token and the facts `mula prepare` records."""

    tokenizer: Tokenizer = field(repr=False)
    path: str  # the tokenizer.json file (a named tokenizer's file inside its package)
    eos_token: str
    eos_id: int
    vocab_size: int  # largest token id + 1
    sha256: str
    name: str | None = None  # the named tokenizer it was loaded as (`mula.data.named_tokenizers`), if any

    @property
    def config(self) -> dict[str, Any]:
        """The tokenizer_config.json settings that go with the file: a named tokenizer's own, else the
        ``tokenizer_config.json`` next to the file ({} when there is none or it is broken)."""
        named = named_tokenizer(self.name) if self.name is not None else None
        if named is not None:
            return dict(named.config)
        try:
            config = json.loads((Path(self.path).parent / "tokenizer_config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return config if isinstance(config, dict) else {}

    def byte_lengths(self) -> np.ndarray | None:
        """int64 [vocab_size]: the UTF-8 bytes each token stands for, special tokens (EOS) 0, or None when the
        tokenizer is not byte-level (`mula.data.token_bytes`: the denominator of val/bpb)."""
        return token_byte_lengths(self.tokenizer)

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each document with EOS appended, as arrays of :func:`token_dtype`.

        Special-token strings inside a document (a literal "<|endoftext|>" in a web page or a source
        file) are encoded as ordinary text, so EOS appears exactly once per document, at its end.
        """
        dtype = token_dtype(self.vocab_size)
        out = []
        for enc in self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False):
            ids = np.empty(len(enc.ids) + 1, dtype=dtype)
            ids[:-1] = enc.ids
            ids[-1] = self.eos_id
            out.append(ids)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Text of a list of token ids, special tokens included."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


def _resolve_tokenizer_file(path: str | os.PathLike) -> Path:
    named = named_tokenizer(str(path))
    if named is not None:
        return named.file()
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        if looks_like_a_name(str(path)) and not Path(path).exists():
            raise unknown_name_error(str(path))
        raise FileNotFoundError(
            f"tokenizer file {p} does not exist; train one with `mula train-tokenizer` or pass a Hugging Face "
            "tokenizer.json."
        )
    return p


def token_content(token: object) -> str | None:
    """An AddedToken-like value from tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    return None


def _eos_from_post_processor(spec: dict | None) -> str | None:
    """The special token a TemplateProcessing post-processor appends to a single sequence, if any."""
    if not isinstance(spec, dict):
        return None
    if spec.get("type") == "Sequence":
        for sub in reversed(spec.get("processors", [])):
            found = _eos_from_post_processor(sub)
            if found:
                return found
        return None
    if spec.get("type") != "TemplateProcessing":
        return None
    single = spec.get("single") or []
    if single and "SpecialToken" in single[-1]:
        return single[-1]["SpecialToken"].get("id")
    return None


def _discover_eos(
    tok: Tokenizer, file: Path, eos_token: str | int | None, config: dict | None = None
) -> tuple[str, int]:
    vocab = tok.get_vocab(with_added_tokens=True)
    if isinstance(eos_token, int):
        if tok.id_to_token(eos_token) is None:
            raise ValueError(f"eos_token id {eos_token} is not in the vocabulary of {file}.")
        return tok.id_to_token(eos_token), eos_token
    if eos_token is not None:
        if eos_token not in vocab:
            raise ValueError(f"eos_token {eos_token!r} is not in the vocabulary of {file}.")
        return eos_token, vocab[eos_token]
    candidates: list[str | None] = []
    config_file = file.parent / "tokenizer_config.json"
    if config is not None:  # a named tokenizer's own config
        candidates.append(token_content(config.get("eos_token")))
    elif config_file.is_file():
        try:
            candidates.append(token_content(json.loads(config_file.read_text()).get("eos_token")))
        except (json.JSONDecodeError, AttributeError):
            pass  # a broken sidecar file must not hide the other ways of finding EOS
    candidates.append(_eos_from_post_processor(json.loads(tok.to_str()).get("post_processor")))
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    candidates += [t for t in KNOWN_EOS_TOKENS if t in special]
    for name in candidates:
        if name is not None and name in vocab:
            return name, vocab[name]
    raise ValueError(f"cannot tell the end-of-document token of {file}; pass eos_token explicitly.")


def load_tokenizer(path: str | os.PathLike, eos_token: str | int | None = None) -> LoadedTokenizer:
    """Load a Hugging Face ``tokenizer.json`` (or a directory containing one) and find its EOS token.

    Args:
        path: The tokenizer.json file, a Hugging Face model directory holding one, or a tokenizer name
            (``olmo``; `mula.data.named_tokenizers`).
        eos_token: Override the EOS token (its string, or its id); found automatically when None.

    Raises:
        FileNotFoundError: the file does not exist, or the package of a named tokenizer is not installed.
        ValueError: the file is not a tokenizer.json, no EOS token can be found, or a bare word names no
            tokenizer.
    """
    named = named_tokenizer(str(path))
    file = _resolve_tokenizer_file(path)
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for malformed files
        raise ValueError(f"{file} is not a Hugging Face tokenizer.json ({e}).") from None
    name, eos_id = _discover_eos(tok, file, eos_token, named.config if named is not None else None)
    vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    # Special tokens inside documents are data, not document boundaries (see encode_documents).
    tok.encode_special_tokens = True
    return LoadedTokenizer(
        tokenizer=tok,
        path=str(file),
        eos_token=name,
        eos_id=eos_id,
        vocab_size=vocab_size,
        sha256=_sha256(str(file)),
        name=named.name if named is not None else None,
    )


def train_tokenizer(
    inputs: list[str],
    output_path: str,
    vocab_size: int = 4096,
    format: str = "auto",
    text_key: str = "text",
    min_frequency: int = 2,
    max_documents: int | None = None,
    skip_bad_records: bool = False,
    eos_token: str = EOS_TOKEN,
    overwrite: bool = False,
    show_progress: bool = True,
) -> str:
    """Train a byte-level BPE tokenizer on local text and save it as a Hugging Face tokenizer.json (offline).

    Args:
        inputs: Files or glob patterns (``**`` recurses; ``{stdlib}`` is the running Python's standard library).
        output_path: The tokenizer.json to write.
        vocab_size: Vocabulary size, including the 256 byte tokens and the EOS token.
        format: Input format: auto (from the file name), jsonl, parquet or text (a whole file is one document).
        text_key: JSON field / parquet column with the text.
        min_frequency: Minimum count of a pair to be merged.
        max_documents: Train on at most this many documents (None: all).
        skip_bad_records: Skip and count malformed records instead of failing.
        eos_token: The end-of-document special token.
        overwrite: Replace an existing output file.
        show_progress: Show the trainer's progress bar.

    Returns:
        The path of the written tokenizer.json.
    """
    files = expand_paths(inputs, what="tokenizer training inputs")

    def documents() -> Iterator[str]:
        for file in files:
            yield from iter_documents(
                file, format=format, text_key=text_key, skip_bad_records=skip_bad_records
            )

    return train_bpe(
        documents(),
        output_path,
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        max_documents=max_documents,
        eos_token=eos_token,
        overwrite=overwrite,
        show_progress=show_progress,
    )


def train_bpe(
    documents: Iterable[str],
    output_path: str | os.PathLike,
    vocab_size: int = 4096,
    min_frequency: int = 2,
    max_documents: int | None = None,
    eos_token: str = EOS_TOKEN,
    overwrite: bool = False,
    show_progress: bool = True,
) -> str:
    """Train a byte-level BPE tokenizer on an iterable of documents; see :func:`train_tokenizer`."""
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes + EOS), got {vocab_size}.")
    out = Path(output_path).expanduser()
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; pass overwrite=True to replace it.")
    if max_documents is not None:
        documents = itertools.islice(documents, max_documents)

    tok = Tokenizer(models.BPE())
    # Byte-level: every string round-trips exactly, and no byte is ever unknown.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[eos_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out) as tmp:  # never leave a half-written tokenizer behind
        tok.save(str(tmp))
    return str(out)
