"""Readers, tokenizers and `prepare`: every format round-trips to the original documents + EOS."""

from __future__ import annotations

import gzip
import json
import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer, models, processors

from mula.data import prepare as prepare_module
from mula.data import prepare_plan
from mula.data.paths import expand_paths, stdlib_dir
from mula.data.prepare import prepare
from mula.data.prepare_summary import SUMMARY_FILE, SourceSpec
from mula.data.readers import ReadStats, iter_documents
from mula.data.tokenizer import load_tokenizer, train_tokenizer

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "épsilon",
    "ζήτα",
    "数据",
    "token",
    "def",
    "return",
    "{x}",
    "(y)",
    "42",
    "\t",
]


def make_docs(n: int, seed: int) -> list[str]:
    """Documents with unicode, newlines, tabs and a literal special-token string (data, not a boundary)."""
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))) for _ in range(n)]
    docs[0] = "first line\nsecond line <|endoftext|> still the same document\n"
    return docs


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("tok")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(make_docs(300, seed=0)), encoding="utf-8")
    return train_tokenizer([str(corpus)], str(d / "tokenizer.json"), vocab_size=400, show_progress=False)


def write_jsonl(path: str, docs: list[str]) -> None:
    data = "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(docs)).encode()
    if path.endswith(".gz"):
        data = gzip.compress(data)
    elif path.endswith(".zst"):
        # Two frames, as concatenated shards are: the reader must read across frames.
        cctx = zstandard.ZstdCompressor()
        half = len(data) // 2
        half = data.index(b"\n", half) + 1
        data = cctx.compress(data[:half]) + cctx.compress(data[half:])
    with open(path, "wb") as fh:
        fh.write(data)


def token_stream(source_dir: str) -> np.ndarray:
    """Every token id of a prepared source, in order, read back through litdata."""
    from litdata import StreamingDataset
    from litdata.streaming.item_loader import TokensLoader

    ds = StreamingDataset(source_dir, item_loader=TokensLoader(block_size=1))
    return np.concatenate([ds[i] for i in range(len(ds))])


def split_documents(stream: np.ndarray, eos_id: int, tok) -> list[str]:
    assert stream[-1] == eos_id, "every document, the last one included, ends with EOS"
    ends = np.flatnonzero(stream == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(stream[s:e]) for s, e in zip(starts, ends)]


def test_round_trip_every_format(tmp_path, tokenizer_path):
    docs = {fmt: make_docs(40, seed=i + 1) for i, fmt in enumerate(["jsonl", "gz", "zst", "parquet", "txt"])}
    inp = tmp_path / "in"
    inp.mkdir()
    write_jsonl(str(inp / "a.jsonl"), docs["jsonl"][:25])
    write_jsonl(str(inp / "b.jsonl"), docs["jsonl"][25:])
    write_jsonl(str(inp / "a.jsonl.gz"), docs["gz"])
    write_jsonl(str(inp / "a.json.zst"), docs["zst"])
    pq.write_table(
        pa.table({"text": docs["parquet"], "n": list(range(40))}), inp / "a.parquet", row_group_size=7
    )
    for i, d in enumerate(docs["txt"]):
        (inp / f"doc{i:03d}.txt").write_text(d, encoding="utf-8")
    sources = [
        SourceSpec("jsonl", [str(inp / "*.jsonl")]),
        SourceSpec("gz", [str(inp / "*.jsonl.gz")]),
        SourceSpec("zst", [str(inp / "*.json.zst")], weight=2.0),
        {"name": "parquet", "paths": [str(inp / "*.parquet")]},
        SourceSpec("txt", [str(inp / "doc*.txt")]),
    ]
    out = tmp_path / "out"
    summary = prepare(sources, tokenizer_path, str(out), num_workers=0, progress=False)

    tok = load_tokenizer(tokenizer_path)
    for s in summary.sources:
        stream = token_stream(str(out / s.name))
        assert split_documents(stream, tok.eos_id, tok) == docs[s.name], s.name
        assert s.documents == 40 and s.tokens == len(stream) and s.bad_records == 0
    # the literal "<|endoftext|>" inside document 0 is text: exactly one EOS per document
    assert int((token_stream(str(out / "jsonl")) == tok.eos_id).sum()) == 40
    saved = json.loads((out / SUMMARY_FILE).read_text())
    assert saved["tokenizer"]["eos_id"] == tok.eos_id and saved["dtype"] == "uint16"
    assert [s["weight"] for s in saved["sources"]] == [1.0, 1.0, 2.0, 1.0, 1.0]
    assert saved["totals"]["documents"] == 200


def test_text_mode_reads_any_file(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    return 1\n")
    assert list(iter_documents(tmp_path / "m.py", format="text")) == ["def f():\n    return 1\n"]
    with pytest.raises(ValueError, match=r"m\.py: unknown input format.*format='text'"):
        list(iter_documents(tmp_path / "m.py"))
    assert expand_paths(["{stdlib}/os.py"]) == [os.path.join(stdlib_dir(), "os.py")]


def test_malformed_records_name_file_and_line(tmp_path, tokenizer_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"text": "ok one"}\n\n{"text": "ok two"}\n{not json\n{"txt": "wrong key"}\n{"text": "ok three"}\n'
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 4: invalid JSON"):
        list(iter_documents(bad))
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 4: invalid JSON.*skip_bad_records"):
        prepare(
            [SourceSpec("s", [str(bad)])],
            tokenizer_path,
            str(tmp_path / "out"),
            num_workers=0,
            progress=False,
        )
    assert not (tmp_path / "out" / "s").exists()  # nothing half-written is left as "prepared"

    stats = ReadStats()
    assert list(iter_documents(bad, skip_bad_records=True, stats=stats)) == ["ok one", "ok two", "ok three"]
    assert (stats.documents, stats.bad_records) == (3, 2)
    summary = prepare(
        [SourceSpec("s", [str(bad)])],
        tokenizer_path,
        str(tmp_path / "out"),
        num_workers=0,
        skip_bad_records=True,
        progress=False,
    )
    assert (summary.sources[0].documents, summary.sources[0].bad_records) == (3, 2)
    assert summary.totals()["bad_records"] == 2

    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"text": "a"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"nokey\.jsonl, line 2: no string field 'text'"):
        list(iter_documents(nokey))


def test_bad_parquet_and_compressed_inputs(tmp_path):
    pq.write_table(pa.table({"text": ["a", None, "b"]}), tmp_path / "n.parquet")
    with pytest.raises(ValueError, match=r"n\.parquet, row 2: null 'text'"):
        list(iter_documents(tmp_path / "n.parquet"))
    stats = ReadStats()
    assert list(iter_documents(tmp_path / "n.parquet", skip_bad_records=True, stats=stats)) == ["a", "b"]
    assert stats.bad_records == 1
    pq.write_table(pa.table({"content": ["a"]}), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=r"c\.parquet: parquet file has no column 'text'"):
        list(iter_documents(tmp_path / "c.parquet"))
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:-20])
    with pytest.raises(ValueError, match=r"t\.jsonl\.gz: cannot read the file"):
        list(iter_documents(tmp_path / "t.jsonl.gz"))
    (tmp_path / "z.json.zst").write_bytes(b"not zstd at all")
    with pytest.raises(ValueError, match=r"z\.json\.zst: cannot read the file"):
        list(iter_documents(tmp_path / "z.json.zst"))
    (tmp_path / "latin1.txt").write_bytes("a\nb\ncaf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt, line 3: not valid UTF-8"):
        list(iter_documents(tmp_path / "latin1.txt"))


def test_rerun_skips_finished_sources(tmp_path, tokenizer_path):
    inp = tmp_path / "a.jsonl"
    write_jsonl(str(inp), make_docs(30, seed=5))
    out = tmp_path / "out"
    first = prepare([SourceSpec("s", [str(inp)])], tokenizer_path, str(out), num_workers=0, progress=False)
    chunk = next((out / "s").glob("chunk-*.bin"))
    mtime = chunk.stat().st_mtime_ns
    again = prepare(
        [SourceSpec("s", [str(inp)], weight=3.0)], tokenizer_path, str(out), num_workers=0, progress=False
    )
    assert again.sources[0].status == "up to date" and chunk.stat().st_mtime_ns == mtime
    assert again.sources[0].tokens == first.sources[0].tokens
    assert (
        json.loads((out / SUMMARY_FILE).read_text())["sources"][0]["weight"] == 3.0
    )  # weights need no re-run

    write_jsonl(str(inp), make_docs(31, seed=5))  # changed input: refuse to silently replace
    with pytest.raises(ValueError, match="prepared from different inputs"):
        prepare([SourceSpec("s", [str(inp)])], tokenizer_path, str(out), num_workers=0, progress=False)
    replaced = prepare(
        [SourceSpec("s", [str(inp)])], tokenizer_path, str(out), num_workers=0, overwrite=True, progress=False
    )
    assert replaced.sources[0].status == "prepared" and replaced.sources[0].documents == 31


def test_workers_and_interrupted_run_give_the_same_stream(tmp_path, tokenizer_path, monkeypatch):
    inp = tmp_path / "in"
    inp.mkdir()
    for i in range(6):
        write_jsonl(str(inp / f"{i}.jsonl"), make_docs(20, seed=10 + i))
    monkeypatch.setattr(prepare_plan, "_MIN_TASK_BYTES", 1)  # several tasks even for tiny inputs
    spec = [SourceSpec("s", [str(inp / "*.jsonl")])]
    ref = prepare(spec, tokenizer_path, str(tmp_path / "ref"), num_workers=0, progress=False)
    ref_stream = token_stream(str(tmp_path / "ref" / "s"))

    # A run that dies after two tasks leaves a .partial folder; the next run finishes only the rest.
    calls = {"n": 0}
    real_run_task = prepare_module._run_task

    def dying(task):
        if calls["n"] == 2:
            raise KeyboardInterrupt
        calls["n"] += 1
        return real_run_task(task)

    monkeypatch.setattr(prepare_module, "_run_task", dying)
    with pytest.raises(KeyboardInterrupt):
        prepare(spec, tokenizer_path, str(tmp_path / "resumed"), num_workers=0, progress=False)
    assert (tmp_path / "resumed" / "s.partial").is_dir() and not (tmp_path / "resumed" / "s").exists()
    calls["n"] = -100  # lets the remaining tasks run
    counted = []
    monkeypatch.setattr(prepare_module, "_run_task", lambda t: counted.append(t.index) or real_run_task(t))
    prepare(spec, tokenizer_path, str(tmp_path / "resumed"), num_workers=0, progress=False)
    assert counted and 0 not in counted and 1 not in counted
    np.testing.assert_array_equal(token_stream(str(tmp_path / "resumed" / "s")), ref_stream)

    # Two spawned worker processes write the same stream.
    monkeypatch.setattr(prepare_module, "_run_task", real_run_task)
    par = prepare(spec, tokenizer_path, str(tmp_path / "par"), num_workers=2, progress=False)
    np.testing.assert_array_equal(token_stream(str(tmp_path / "par" / "s")), ref_stream)
    assert par.sources[0].tokens == ref.sources[0].tokens == len(ref_stream)


def test_bad_prepare_arguments(tmp_path, tokenizer_path):
    with pytest.raises(FileNotFoundError, match=r"no files match '.*nothing-\*\.jsonl' \(source 'web'\)"):
        prepare([SourceSpec("web", [str(tmp_path / "nothing-*.jsonl")])], tokenizer_path, str(tmp_path / "o"))
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    ok = [str(tmp_path / "a.jsonl")]
    with pytest.raises(FileNotFoundError, match="tokenizer file .*missing.json does not exist"):
        prepare([SourceSpec("web", ok)], str(tmp_path / "missing.json"), str(tmp_path / "o"))
    with pytest.raises(ValueError, match="source names must be unique"):
        prepare([SourceSpec("a", ok), SourceSpec("a", ok)], tokenizer_path, str(tmp_path / "o"))
    with pytest.raises(ValueError, match="source name '../x'"):
        prepare([SourceSpec("../x", ok)], tokenizer_path, str(tmp_path / "o"))
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    with pytest.raises(ValueError, match="produced no tokens"):
        prepare(
            [SourceSpec("e", [str(tmp_path / "empty.jsonl")])],
            tokenizer_path,
            str(tmp_path / "o"),
            num_workers=0,
        )


def _wordlevel(tmp_path, n_base: int, specials: list[str], post=None) -> str:
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n_base)}, unk_token="w0"))
    tok.add_special_tokens(specials)
    if post is not None:
        tok.post_processor = post
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def test_eos_discovery(tmp_path, tokenizer_path):
    ours = load_tokenizer(tokenizer_path)
    assert (ours.eos_token, ours.eos_id) == ("<|endoftext|>", 0) and ours.vocab_size <= 400

    # OLMo's layout (gpt-neox-olmo-dolma-v1_5): 50277 base tokens, then PII masks, then <|endoftext|> = 50279.
    olmo = tmp_path / "olmo"
    olmo.mkdir()
    path = _wordlevel(olmo, 50277, ["|||EMAIL_ADDRESS|||", "|||PHONE_NUMBER|||", "<|endoftext|>"])
    t = load_tokenizer(path)
    assert (t.eos_token, t.eos_id, t.vocab_size) == ("<|endoftext|>", 50279, 50280)
    assert load_tokenizer(olmo).eos_id == 50279  # a model directory works too
    assert load_tokenizer(path, eos_token="|||PHONE_NUMBER|||").eos_id == 50278
    assert load_tokenizer(path, eos_token=50277).eos_token == "|||EMAIL_ADDRESS|||"
    (olmo / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "|||EMAIL_ADDRESS|||"}}))
    assert load_tokenizer(path).eos_id == 50277  # tokenizer_config.json names it

    llama = tmp_path / "llama"
    llama.mkdir()
    post = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 10), ("</s>", 11)])
    assert load_tokenizer(_wordlevel(llama, 10, ["<s>", "</s>"], post)).eos_token == "</s>"

    none = tmp_path / "none"
    none.mkdir()
    with pytest.raises(ValueError, match="cannot tell the end-of-document token.*eos_token"):
        load_tokenizer(_wordlevel(none, 10, ["<pad>"]))
    with pytest.raises(ValueError, match="eos_token '<nope>' is not in the vocabulary"):
        load_tokenizer(tokenizer_path, eos_token="<nope>")
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="junk.json is not a Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path / "junk.json")


def test_train_tokenizer_checks(tmp_path, tokenizer_path):
    with pytest.raises(ValueError, match="already exists; pass overwrite=True"):
        train_tokenizer([tokenizer_path], tokenizer_path, vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size must be at least 257"):
        train_tokenizer([tokenizer_path], str(tmp_path / "t.json"), vocab_size=100)
    with pytest.raises(FileNotFoundError, match="no files match"):
        train_tokenizer([str(tmp_path / "*.nothing")], str(tmp_path / "t.json"))
    # byte-level BPE round-trips any text exactly
    tok = load_tokenizer(tokenizer_path)
    text = "naïve café — 🙂 \r\n\ttabs  and  spaces <|endoftext|>"
    assert tok.decode(tok.encode_documents([text])[0][:-1]) == text
