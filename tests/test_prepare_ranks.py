"""`mula prepare` over several ranks: the same bytes as one process, resumable after SIGKILL, one job per
output directory, checksums re-verified on request."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dist_helpers import free_port, run_distributed
from test_data import make_docs, token_stream, tokenizer_path  # noqa: F401  (the fixture)

from mula.data import prepare as prepare_module
from mula.data import prepare_plan
from mula.data.prepare import prepare
from mula.data.prepare_summary import SUMMARY_FILE, SourceSpec
from mula.data.shuffle import shuffle_shape
from mula.data.tokenizer import load_tokenizer

# Files of mixed sizes: several tasks per source even for these small inputs (as in test_data).
_SMALL_TASKS = 1
_LAUNCHER_VARS = re.compile(r"^(SLURM_|PMI_|PMIX_|OMPI_|PALS_|TORCHELASTIC_|MPI_|PBS_|LSB_|FLUX_)")
_LAUNCH_KEYS = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
}


def make_inputs(root: Path) -> list[SourceSpec]:
    """Two sources: JSONL.gz files of mixed sizes (one malformed record) and parquet files."""
    web, papers = root / "web", root / "papers"
    web.mkdir(parents=True)
    papers.mkdir()
    for i, n in enumerate([10, 40, 17, 25, 8, 60, 12, 30, 22, 35]):
        lines = [json.dumps({"text": t}) for t in make_docs(n, seed=100 + i)]
        if i == 3:
            lines.insert(5, '{"text": "unterminated')  # malformed: skipped and counted
        (web / f"{i:02d}.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    for i, n in enumerate([50, 14, 33, 18, 27, 41]):
        pq.write_table(
            pa.table({"text": make_docs(n, seed=200 + i)}), papers / f"{i}.parquet", row_group_size=9
        )
    return [
        SourceSpec("web", [str(web / "*.jsonl.gz")]),
        SourceSpec("papers", [str(papers / "*.parquet")], weight=2.0),
    ]


def output_bytes(out: Path) -> dict[str, bytes]:
    """Every file of a prepared directory by relative path (summary.json without its own location)."""
    files = {}
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.name != "mula.lock":
            data = path.read_bytes()
            if path.name == SUMMARY_FILE:
                summary = json.loads(data)
                summary.pop("output_dir")
                data = json.dumps(summary, sort_keys=True).encode()
            files[str(path.relative_to(out))] = data
    return files


def reference(
    tmp_path: Path,
    tokenizer: str,
    monkeypatch: pytest.MonkeyPatch,
    shuffle_seed: int | None = None,
    name: str = "ref",
) -> dict[str, bytes]:
    """One process, no worker processes."""
    monkeypatch.setattr(prepare_plan, "_MIN_TASK_BYTES", _SMALL_TASKS)
    if not (tmp_path / "in").exists():
        make_inputs(tmp_path / "in")
    prepare(
        _sources(str(tmp_path)),
        tokenizer,
        str(tmp_path / name),
        num_workers=0,
        skip_bad_records=True,
        progress=False,
        shuffle_seed=shuffle_seed,
    )
    return output_bytes(tmp_path / name)


def _prepare_rank(
    rank: int, world: int, root: str, tokenizer: str, out: str, workers: int, seed: int | None = None
) -> dict:
    prepare_plan._MIN_TASK_BYTES = _SMALL_TASKS
    summary = prepare(
        _sources(root),
        tokenizer,
        out,
        num_workers=workers,
        skip_bad_records=True,
        progress=False,
        shuffle_seed=seed,
    )
    return summary.to_dict()


def _sources(root: str) -> list[SourceSpec]:
    return [
        SourceSpec("web", [os.path.join(root, "in", "web", "*.jsonl.gz")]),
        SourceSpec("papers", [os.path.join(root, "in", "papers", "*.parquet")], weight=2.0),
    ]


def test_ranks_and_workers_write_the_same_bytes(tmp_path, tokenizer_path, monkeypatch):  # noqa: F811
    ref = reference(tmp_path, tokenizer_path, monkeypatch)
    assert {"web/index.json", "web/mula_source.json", "papers/index.json", SUMMARY_FILE} <= set(ref)
    assert sum(name.startswith("web/chunk-") for name in ref) >= 7  # one chunk per task at least
    saved = json.loads(ref[SUMMARY_FILE])
    assert saved["sources"][0]["bad_records"] == 1

    four = run_distributed(_prepare_rank, 4, str(tmp_path), tokenizer_path, str(tmp_path / "four"), 0)
    assert output_bytes(tmp_path / "four") == ref
    assert all(r == four[0] for r in four)  # every rank returns the summary

    run_distributed(_prepare_rank, 2, str(tmp_path), tokenizer_path, str(tmp_path / "two-by-two"), 2)
    assert output_bytes(tmp_path / "two-by-two") == ref

    # The global shuffle: the same bytes from 1 process, 4 ranks and 2 ranks x 2 workers, the seed recorded.
    shuffled = reference(tmp_path, tokenizer_path, monkeypatch, shuffle_seed=7, name="shuffled")
    run_distributed(_prepare_rank, 4, str(tmp_path), tokenizer_path, str(tmp_path / "four-shuffled"), 0, 7)
    assert output_bytes(tmp_path / "four-shuffled") == shuffled
    run_distributed(
        _prepare_rank, 2, str(tmp_path), tokenizer_path, str(tmp_path / "two-by-two-shuffled"), 2, 7
    )
    assert output_bytes(tmp_path / "two-by-two-shuffled") == shuffled
    assert json.loads(shuffled[SUMMARY_FILE])["shuffle_seed"] == 7
    assert json.loads(shuffled["web/mula_source.json"])["fingerprint"]["shuffle_seed"] == 7


def documents(out: Path, source: str, eos_id: int) -> list[tuple[int, ...]]:
    """The documents of a prepared source, in their order, as tuples of token ids."""
    stream = token_stream(str(out / source))
    ends = np.flatnonzero(stream == eos_id) + 1
    return [tuple(d) for d in np.split(stream, ends[:-1])]


def test_shuffle_permutes_documents_across_the_source_and_resumes(tmp_path, tokenizer_path, monkeypatch):  # noqa: F811
    reference(tmp_path, tokenizer_path, monkeypatch)
    eos = load_tokenizer(tokenizer_path).eos_id
    sources = _sources(str(tmp_path))
    kwargs = dict(num_workers=0, skip_bad_records=True, progress=False)
    prepare(sources, tokenizer_path, str(tmp_path / "a"), shuffle_seed=1, **kwargs)
    prepare(sources, tokenizer_path, str(tmp_path / "b"), shuffle_seed=2, **kwargs)
    for name in ("web", "papers"):
        plain = documents(tmp_path / "ref", name, eos)
        one, two = documents(tmp_path / "a", name, eos), documents(tmp_path / "b", name, eos)
        assert sorted(one) == sorted(plain) == sorted(two)  # the same documents, each once
        assert one != plain and one != two  # in another order for each seed
        # across the whole source: the first tenth of the shuffled order comes from all over the input
        position = {doc: i for i, doc in enumerate(plain)}
        head = [position[d] for d in one[: len(one) // 10]]
        assert max(head) - min(head) > len(plain) // 2

    # Killed in the second pass (after the first bucket): the re-run gathers only the missing buckets.
    real_run_task = prepare_module._run_task
    ran: list[tuple[str, str, int]] = []

    def dying(task):
        if task.kind == "bucket" and any(kind == "bucket" for kind, _, _ in ran):
            raise KeyboardInterrupt
        ran.append((task.kind, task.source, task.index))
        return real_run_task(task)

    monkeypatch.setattr(prepare_module, "_run_task", dying)
    with pytest.raises(KeyboardInterrupt):
        prepare(sources, tokenizer_path, str(tmp_path / "resumed"), shuffle_seed=1, **kwargs)
    first = list(ran)
    ran.clear()
    monkeypatch.setattr(
        prepare_module, "_run_task", lambda t: ran.append((t.kind, t.source, t.index)) or real_run_task(t)
    )
    prepare(sources, tokenizer_path, str(tmp_path / "resumed"), shuffle_seed=1, **kwargs)
    assert not [r for r in ran if r[0] in ("tokenize", "split")], "the first two passes were complete"
    assert [r for r in first if r[0] == "bucket"] == [("bucket", "web", 0)] and (
        "bucket",
        "web",
        0,
    ) not in ran
    every_bucket = set()
    for source in ("web", "papers"):
        tasks = sum(1 for kind, s, _ in first if kind == "tokenize" and s == source)
        coarse, fine = shuffle_shape(tasks)
        assert sum(1 for kind, s, _ in first if kind == "split" and s == source) == coarse
        every_bucket |= {("bucket", source, i) for i in range(coarse * fine)}
    assert sorted(ran) == sorted(every_bucket - {("bucket", "web", 0)})
    assert output_bytes(tmp_path / "resumed") == output_bytes(tmp_path / "a")


def test_verify_finds_a_changed_chunk(tmp_path, tokenizer_path, monkeypatch):  # noqa: F811
    reference(tmp_path, tokenizer_path, monkeypatch)
    sources = _sources(str(tmp_path))
    again = prepare(
        sources, tokenizer_path, str(tmp_path / "ref"), skip_bad_records=True, verify=True, progress=False
    )
    assert {s.status for s in again.sources} == {"up to date"}
    chunk = sorted((tmp_path / "ref" / "papers").glob("chunk-*.bin"))[1]
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"1 chunk\(s\) differ .*papers/{chunk.name}"):
        prepare(
            sources, tokenizer_path, str(tmp_path / "ref"), skip_bad_records=True, verify=True, progress=False
        )


# ---- launched as separate processes, as mpiexec would: SIGKILL, resume, a second job refused ----------------

_LAUNCHER = """
import os, sys, time
import mula.data.prepare as p
import mula.data.prepare_plan as pp
pp._MIN_TASK_BYTES = {small}
real, ran = p._run_task, []
def held(task):
    # With PREPARE_TEST_HOLD set, each rank finishes one task and then waits (for the SIGKILL).
    while ran and os.environ.get("PREPARE_TEST_HOLD"):
        time.sleep(0.1)
    ran.append(task.index)
    return real(task)
p._run_task = held
from mula.commands.entry import main
main(["prepare", "-c", sys.argv[1]])
"""


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not _LAUNCHER_VARS.match(k) and k not in _LAUNCH_KEYS}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def _launch(script: Path, config: Path, world: int, logs: Path, hold: bool) -> list[subprocess.Popen]:
    """``world`` ranks with the variables mpiexec sets (PMI_RANK, PMI_SIZE) and a rendezvous address."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = _clean_env()
        if hold:
            env.update(PREPARE_TEST_HOLD="1")
        if world > 1:
            env.update(
                PMI_RANK=str(rank), PMI_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
            )
        log = open(logs / f"rank{rank}.log", "w")  # noqa: SIM115  (closed by the process's end)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
    return procs


def _done_tasks(logs: Path) -> list[tuple[str, int]]:
    done = []
    for path in logs.glob("rank*.log"):
        done += [(m[1], int(m[2])) for m in re.finditer(r"rank \d+: (\w+) task (\d+) done", path.read_text())]
    return done


def _wait_for(predicate, procs: list[subprocess.Popen], what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"never saw {what}")
        time.sleep(0.2)


def test_sigkill_resume_and_a_second_job_refused(tmp_path, tokenizer_path, monkeypatch):  # noqa: F811
    ref = reference(tmp_path, tokenizer_path, monkeypatch)
    out = tmp_path / "out"
    config = tmp_path / "prepare.yaml"
    config.write_text(
        json.dumps(
            {
                "sources": [
                    {"name": s.name, "paths": s.paths, "weight": s.weight} for s in _sources(str(tmp_path))
                ],
                "tokenizer_path": tokenizer_path,
                "output_dir": str(out),
                "num_workers": 0,
                "skip_bad_records": True,
            }
        )
    )
    script = tmp_path / "launch.py"
    script.write_text(_LAUNCHER.format(small=_SMALL_TASKS))
    first_logs, second_logs, other_logs = tmp_path / "logs1", tmp_path / "logs2", tmp_path / "other"
    for logs in (first_logs, second_logs, other_logs):
        logs.mkdir()

    first = _launch(script, config, 4, first_logs, hold=True)
    try:
        # Every rank finishes one task, then holds: the job is half-way.
        _wait_for(lambda: len(_done_tasks(first_logs)) == 4, first, "one finished task per rank")
        # The output directory is held: another (2-rank) job on it stops on every rank with one sentence
        # and exit status 2.
        other = _launch(script, config, 2, other_logs, hold=False)
        for rank, p in enumerate(other):
            log = (other_logs / f"rank{rank}.log").read_text() if p.wait(timeout=300) is not None else ""
            assert p.returncode == 2, log
            assert re.fullmatch(
                r"mula: error: .*out is being prepared by another job \(host .*\): .*dead\.",
                log.strip().splitlines()[-1],
            )
    finally:
        for p in first:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    done_before = set(_done_tasks(first_logs))
    assert len(done_before) == 4
    assert not (out / SUMMARY_FILE).exists(), "killed half-way"

    second = _launch(script, config, 4, second_logs, hold=False)
    for p in second:
        assert p.wait(timeout=600) == 0, (second_logs / "rank0.log").read_text()
    redone = _done_tasks(second_logs)
    rank0 = (second_logs / "rank0.log").read_text()
    resumed = int(re.search(r"resuming: (\d+) of (\d+) tasks already done", rank0)[1])
    assert resumed >= len(done_before) and len(redone) + resumed == int(
        re.search(r"of (\d+) tasks", rank0)[1]
    )
    assert not done_before & set(redone), "a finished task ran again"
    assert re.search(r"rank +3 \(.*\): +\d+ tasks", rank0)  # per-rank throughput at the end
    assert output_bytes(out) == ref


@pytest.mark.parametrize(
    "env, kind",
    [
        (
            dict(
                TORCHELASTIC_RUN_ID="x",
                RANK="3",
                WORLD_SIZE="8",
                LOCAL_RANK="1",
                GROUP_RANK="1",
                LOCAL_WORLD_SIZE="2",
            ),
            "TorchElasticEnvironment",
        ),
        (
            dict(
                SLURM_NTASKS="8",
                SLURM_NTASKS_PER_NODE="2",  # srun --ntasks-per-node (Lightning refuses a bare --ntasks)
                SLURM_PROCID="3",
                SLURM_LOCALID="1",
                SLURM_NODEID="1",
                SLURM_JOB_NAME="prep",
                SLURM_JOB_ID="1234",
            ),
            "SLURMEnvironment",
        ),
        (dict(PMI_RANK="3", PMI_SIZE="8"), "PALSEnvironment"),
    ],
)
def test_prepare_reads_the_launchers_of_mula_fit(env, kind, monkeypatch):
    from mula.data import ranks

    for name in [k for k in os.environ if _LAUNCHER_VARS.match(k) or k in _LAUNCH_KEYS]:
        monkeypatch.delenv(name)
    assert ranks.launcher_environment() is None and ranks.job_ranks().world == 1  # a plain process
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    found = ranks.launcher_environment()
    assert type(found).__name__ == kind and (found.global_rank(), found.world_size()) == (3, 8)
    assert ranks.job_ranks(distributed=False).world == 1
