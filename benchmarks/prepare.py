"""`mula prepare` tokens per second per core against a plain loop of the same tokenizer.

Candidates, on the same JSONL.gz inputs and tokenizer, each writing the same litdata chunks (token
ids, EOS after every document, items of about 1M tokens, TokensLoader):

  plain loop     one process: read each file's records, ``tokenizers``' ``encode_batch_fast`` in batches
                 of 256, append EOS, ``litdata.BinaryWriter.add_item`` -- the least a script can do.
  mula prepare   ``prepare(num_workers=1)`` (one process) and ``prepare(num_workers=N)`` (N = the cores:
                 spawned workers, one task each at a time).

Every process tokenizes on one thread (TOKENIZERS_PARALLELISM=false), so tokens/s divided by the
processes is the rate per core, the figure that scales to nodes: a corpus of T tokens takes
T / (rate per core x cores per node x nodes). Rounds run every candidate once, in order, and repeat
(background load hits all alike); the table gives the median of the rounds and the spread of each
candidate's ratio to the plain loop. Inputs: the running Python's standard library sources as
documents (code and prose), in JSONL.gz files; tokenizer: a byte-level BPE trained on them.

    python benchmarks/prepare.py                                  # 48 MB of text, 3 rounds
    python benchmarks/prepare.py --doc docs/benchmarks.md
    python benchmarks/prepare.py --tokenizer olmo                 # OLMo's (or a tokenizer.json path)

Benchmarks print tables and never assert.
"""

from __future__ import annotations

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers is imported: one thread per process

import gzip
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from common import (  # benchmarks/ is on sys.path when run as a script
    command_line,
    host_line,
    markdown_table,
    publish,
    spread,
)

from mula.data.paths import expand_paths
from mula.data.prepare import SourceSpec, prepare
from mula.data.tokenizer import load_tokenizer, train_tokenizer

SECTION = "## prepare"


def make_corpus(root: Path, megabytes: float, files: int) -> list[str]:
    """JSONL.gz files of about ``megabytes`` of text in all: the standard library's non-empty .py files as
    documents (repeated if the library is smaller)."""
    texts = [
        Path(p).read_text(encoding="utf-8", errors="replace")
        for p in expand_paths(["{stdlib}/**/*.py"], what="the benchmark corpus")
    ]
    texts = [t for t in texts if t.strip()]
    docs, size = [], 0
    while size < megabytes * 1e6:
        text = texts[len(docs) % len(texts)]
        docs.append(text)
        size += len(text.encode())
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(files):
        path = root / f"{i:03d}.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            for doc in docs[i::files]:
                fh.write(json.dumps({"text": doc}) + "\n")
        out.append(str(path))
    return out


def plain_loop(files: list[str], tokenizer_path: str, out_dir: str) -> int:
    """The baseline: read, batch-encode, append EOS, write litdata chunks; the number of tokens."""
    from litdata.streaming.item_loader import TokensLoader
    from litdata.streaming.writer import BinaryWriter
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    eos = tok.token_to_id("<|endoftext|>")
    dtype = np.uint16 if tok.get_vocab_size() <= 2**16 else np.uint32
    os.environ["DATA_OPTIMIZER_GLOBAL_RANK"] = "0"
    writer = BinaryWriter(out_dir, chunk_bytes="64MB", item_loader=TokensLoader())
    item, pending, pending_tokens, tokens = 0, [], 0, 0

    def encode(texts: list[str]) -> None:
        nonlocal item, pending, pending_tokens, tokens
        for enc in tok.encode_batch_fast(texts, add_special_tokens=False):
            ids = np.empty(len(enc.ids) + 1, dtype=dtype)
            ids[:-1], ids[-1] = enc.ids, eos
            pending.append(ids)
            pending_tokens += len(ids)
            tokens += len(ids)
        if pending_tokens >= 1 << 20:
            writer.add_item(item, np.concatenate(pending))
            item, pending, pending_tokens = item + 1, [], 0

    for path in files:
        batch = []
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                batch.append(json.loads(line)["text"])
                if len(batch) == 256:
                    encode(batch)
                    batch = []
        if batch:
            encode(batch)
    if pending:
        writer.add_item(item, np.concatenate(pending))
    writer.done()
    writer._merge_no_wait()
    return tokens


def run_prepare(files: list[str], tokenizer_path: str, out_dir: str, workers: int) -> int:
    """``mula prepare`` of the files as one source; the number of tokens."""
    summary = prepare(
        [SourceSpec("bench", files)],
        tokenizer_path,
        out_dir,
        num_workers=workers,
        progress=False,
        distributed=False,
    )
    return summary.sources[0].tokens


def worker_start_seconds(tokenizer_path: str) -> float:
    """Seconds to spawn one `mula prepare` worker process and load its tokenizer (paid once per worker)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from mula.data import prepare as prepare_module

    start = time.perf_counter()
    pool = ProcessPoolExecutor(
        1,
        mp_context=mp.get_context("spawn"),
        initializer=prepare_module._init_worker,
        initargs=(tokenizer_path, None, True),
    )
    pool.submit(os.getpid).result()
    seconds = time.perf_counter() - start
    pool.shutdown()
    return seconds


def main(
    megabytes: float = 48.0,
    files: int = 16,
    rounds: int = 3,
    workers: int | None = None,
    tokenizer: str | None = None,
    vocab_size: int = 16384,
    doc: Path | None = None,
) -> str:
    """Time the candidates over interleaved rounds; print the table; optionally update ``doc``'s section.

    Args:
        megabytes: Text in the corpus (the standard library's sources, repeated to reach it).
        files: JSONL.gz files it is split into (`mula prepare` tasks follow the files).
        rounds: Interleaved rounds (every candidate once per round).
        workers: Worker processes of the parallel `mula prepare` row (default: the cores).
        tokenizer: A tokenizer.json or a named tokenizer (olmo) to use (default: a byte-level BPE trained on
            the corpus).
        vocab_size: Vocabulary of the trained tokenizer.
        doc: Markdown file whose "## prepare" section is replaced with the results.
    """
    workers = workers or len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        inputs = make_corpus(root / "in", megabytes, files)
        if tokenizer is None:
            tokenizer = train_tokenizer(
                inputs[:2], str(root / "tokenizer.json"), vocab_size=vocab_size, show_progress=False
            )
        tok = load_tokenizer(tokenizer)
        candidates = {
            "plain loop (1 process)": (1, lambda out: plain_loop(inputs, tok.path, out)),
            "mula prepare, 1 worker": (1, lambda out: run_prepare(inputs, tok.path, out, 1)),
            f"mula prepare, {workers} workers": (
                workers,
                lambda out: run_prepare(inputs, tok.path, out, workers),
            ),
        }
        rates: dict[str, list[float]] = {name: [] for name in candidates}
        tokens: dict[str, int] = {}
        for r in range(rounds):
            for name, (procs, fn) in candidates.items():
                out = root / f"out-{r}-{len(rates[name])}-{name.split()[0]}"
                start = time.perf_counter()
                tokens[name] = fn(str(out))
                rates[name].append(tokens[name] / (time.perf_counter() - start) / procs)
                shutil.rmtree(out)
                print(f"round {r + 1}: {name}: {rates[name][-1]:,.0f} tokens/s per core", flush=True)
        input_mb = sum(os.path.getsize(f) for f in inputs) / 1e6
        start_s = worker_start_seconds(tok.path)
    load = os.getloadavg()[0]
    base = rates["plain loop (1 process)"]
    head = ["candidate", "processes", "tokens", "tokens/s per core (median)",
            "vs plain loop per core (median [min-max])"]  # fmt: skip
    table = markdown_table(head, [
        [name, procs, f"{tokens[name]:,}", f"{statistics.median(rates[name]):,.0f}",
         spread([a / b for a, b in zip(rates[name], base)])]
        for name, (procs, _) in candidates.items()
    ])  # fmt: skip
    # The steady rate of one tokenizer process: what each core of a node sustains once its worker runs.
    per_core = statistics.median(rates["mula prepare, 1 worker"])
    text = "\n".join(
        [
            f"{SECTION}\n",
            command_line(),
            host_line() + "  ",
            f"Corpus: {megabytes:g} MB of Python standard-library sources as documents in {files} JSONL.gz files "
            f"({input_mb:.1f} MB compressed); tokenizer: {os.path.basename(tok.path)}, vocab {tok.vocab_size:,}; "
            f"{rounds} interleaved rounds, each tokenizer process on one thread; load average during the "
            f"run {load:.1f} (a shared machine: the ratios are more reliable than the rates).\n",
            table,
            "",
            f"At {per_core:,.0f} tokens/s per core, 4T tokens take 4e12 / ({per_core:,.0f} x cores per node x "
            f"nodes) seconds: {4e12 / (per_core * 64 * 128) / 3600:,.1f} h on 128 nodes of 64 cores. "
            f"Starting one worker process (spawn, importing litdata and torch, loading the tokenizer) took "
            f"{start_s:.1f} s here, paid once per worker. {_workers_note(workers, load)} The rate "
            "depends on the tokenizer and the text (a 50k-vocabulary BPE on English web text is slower per "
            "token than this one on code), so measure with `--tokenizer` on a sample of your corpus.",
        ]
    )
    return publish(text, doc, SECTION)


def _workers_note(workers: int, load: float) -> str:
    """What the many-worker row measures, given the load average the run saw (its own processes included)."""
    cores = os.cpu_count() or 1
    if load > cores:  # more runnable processes than cores: other jobs took a share
        return (
            f"The {workers}-worker row needs {workers} free cores: with a load average of {load:.1f} on {cores} "
            "cores its per-core figure measures the other jobs' share of the cores more than prepare's parallel "
            "efficiency (measure it on a dedicated node)."
        )
    return (
        f"The {workers}-worker row puts a worker on every core of this host, beside the parent process "
        "(planning, the job's bar, merging) and the kernel's writes of the chunks: its per-core rate is what "
        "a node whose every core runs a worker can expect, the 1-worker rate an upper bound."
    )


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
