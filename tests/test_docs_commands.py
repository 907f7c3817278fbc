"""Every command of a fenced block in README.md and docs/*.md runs, or is named in NOT_RUN with the reason.

A command is each line of a `bash` block (continuation lines and multi-line quotes joined, `&&` chains
split, comments dropped) and each `$ ` line of an unlabeled block (the lines after it, up to the next
`$ `, are output the command must still print). `test_every_documented_command_is_run_or_excused` fails
when a document gains a command that is in neither RUN nor NOT_RUN, or loses one that is.

Each command in RUN runs as written, in a scratch directory holding a copy of recipes/, with `mula`
(and `.venv/bin/mula`) as this interpreter's `python -m mula`. A training command gets small settings
(`FIT_SMALL`: 2 steps of 64-token sequences on a few stdlib files) after its recipe files and before
its own options, so what it documents is what runs; a run other than the README's first gets a run
directory of its own, so none resumes another. `mula calibrate` runs as written (the documented
`--quick true`: under 2 minutes on a 2-core host) in tests/test_calibrate.py, which says it is this command:
it says how long it takes before it measures, and the machine file it writes is read by `mula plan
--machine`. A command in NOT_RUN needs a cluster launcher, a
download or the network; the recipe files and scripts it names must still exist, and a cluster job's
`mula fit` (under srun, torchrun or mpiexec, and scripts/mula-resilient) runs as `mula plan --dry_run` with
the same files and options (`test_a_cluster_fit_dry_runs`: the rule is written there).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_calibrate import DOCUMENTED as DOCUMENTED_CALIBRATE
from test_cli import FAST, read_metrics

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")

# what makes a documented training command take seconds here (test_cli's small demo, then 2 steps of a
# global batch every documented layout splits): inserted after its -c files, so its own options still win
FIT_SMALL = [*FAST, "--trainer.max_steps=2", "--trainer.val_check_interval=8", "--data.global_batch_size=16",
             "--data.micro_batch_size=4"]  # fmt: skip
MAIN_JOB = ".venv/bin/mula fit -c recipes/mula-tiny-moe.yaml"  # the README's first command (after setup)

# how each runnable command runs: "fit" (FIT_SMALL inserted), "as is", "after fit" (as is, once the README's
# first run is there), or "calibrate" (as is, then planned with:
# by tests/test_calibrate.py, whose DOCUMENTED it must be; run once, it is the suite's longest command)
RUN = {
    MAIN_JOB: "fit",
    ".venv/bin/ruff check .": "lint",
    ".venv/bin/ruff format --check .": "lint",
    "mula fit -c recipes/mula-tiny-moe.yaml --trainer.max_steps=20 --data.seq_len=128": "fit",
    "mula fit -c recipes/mula-tiny-moe.yaml --model.overrides.num_layers=2 --model.lr=1e-3": "fit",
    "mula fit -c recipes/mula-tiny-moe.yaml --print_config > my-recipe.yaml": "as is",
    "mula fit --help": "as is",
    "mula bench -c recipes/mula-tiny-moe.yaml": "as is",
    "mula eval --run runs/mula-tiny-moe --tasks olmoe-quick": "after fit",
    "mula fit -c recipes/mula-tiny-moe.yaml -c recipes/evals/olmo-in-loop.yaml": "fit",
    "mula validate -c recipes/mula-tiny-moe.yaml --ckpt_path runs/mula-tiny-moe/checkpoints/last.ckpt": "fit",
    "mula fit -c recipes/mula-tiny-moe.yaml -c recipes/strategies/ddp.yaml --trainer.devices=2 --trainer.accelerator=cpu": "fit",
    "mula fit -c recipes/mula-tiny-moe.yaml -c recipes/strategies/xpu-moe.yaml --trainer.devices=4 --trainer.accelerator=cpu": "fit",
    "mula fit -c recipes/mula-tiny-dense.yaml -c recipes/strategies/context-parallel.yaml --trainer.devices=4": "fit",
    "mula fit -c recipes/mula-tiny-moe.yaml -c recipes/strategies/pipeline.yaml --trainer.devices=4": "fit",
    "mula fit -c recipes/mula-tiny-dense.yaml -c recipes/strategies/tensor-parallel.yaml --trainer.devices=4": "fit",
    "mula plan -c recipes/mula-220b-a10b.yaml -c recipes/strategies/aurora-xpu-moe.yaml --machine aurora --nodes 32": "as is",
    "mula calibrate --devices 2 --output recipes/machines/this-host.yaml --model mula-tiny-moe --quick true": "calibrate",
    "mula upcycle --weights mula-1b --model mula-7b-a1b --overrides {norm: layernorm, qk_norm: false, norm_topk_prob: true} --output mula-7b-a1b-upcycled.pt --dry_run true": "as is",
    "mula plan -c recipes/mula-tiny-moe.yaml --trainer.devices=2 --trainer.strategy=strategies.XPUMoEStrategy --trainer.strategy.init_args.expert_parallel_size=2 --machine recipes/machines/example-cpu-calibrated.yaml": "as is",
    "mula plan -c recipes/mula-220b-a10b.yaml -c recipes/strategies/aurora-pipeline.yaml --machine=aurora --nodes=1024 --data.global_batch_size=12288 --dry_run": "as is",
    "mula plan -c recipes/frontier/mula-gpt-22b.yaml --machine=frontier": "as is",
    "mula plan -c recipes/frontier/mula-gpt-22b.yaml --machine=frontier --nodes=16 --scaling_nodes=[32]": "as is",
    "mula plan -c recipes/frontier/mula-gpt-175b.yaml --machine=frontier": "as is",
    "mula plan -c recipes/frontier/mula-gpt-175b.yaml --machine=frontier --nodes=64 --scaling_nodes=[128]": "as is",
    "mula plan -c recipes/frontier/mula-gpt-1t.yaml --machine=frontier": "as is",
    "mula plan -c recipes/frontier/mula-gpt-1t.yaml --machine=frontier --nodes=192 --scaling_nodes=[384]": "as is",
}  # fmt: skip

CLUSTER = "a cluster launcher's job (SLURM, torchrun across nodes, PBS + mpiexec on Aurora)"
# the two cluster fits whose node count no line of their document states (see CHOSEN_NODES)
TORCHRUN_1B = ("torchrun --nnodes=$NNODES --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 "
               "-m mula.cli fit -c recipes/mula-1b.yaml --trainer.num_nodes=$NNODES")  # fmt: skip
AURORA_PIPELINE_220B = ("mpiexec -n $((NNODES * 12)) --ppn 12 mula fit -c recipes/mula-220b-a10b.yaml "
                        "-c recipes/strategies/aurora-pipeline.yaml --trainer.num_nodes=$NNODES")  # fmt: skip
NOT_RUN = {
    "mula prepare --sources=[{name: c4_en, paths: [ppl/c4_en/val]}] --tokenizer_path olmo --output_dir data/ppl/c4_en": "the held-out set's data is remote (OLMo's v3-small-ppl-validation)",
    "mula validate -c recipes/mula-7b-a1b.yaml --ckpt_path runs/mula-7b-a1b/checkpoints/last.ckpt --data.data_dir data/ppl/c4_en --data.val_samples 1000": "needs a trained mula-7b-a1b checkpoint and the prepared remote set",
    "bash scripts/setup.sh": "sets up the environment these tests run in (.ci/run runs its dev variant first)",
    "bash scripts/setup.sh dev": "sets up the environment these tests run in (.ci/run runs it first)",
    ".venv/bin/python -m pytest -q -n 2 --dist loadfile": "the test suite itself",
    "mula eval --ckpt runs/mula-1b/checkpoints/step=000010000.ckpt --tasks lm_eval:arc_easy,lm_eval:hellaswag,"
    "lambada_openai":
        "lm-eval downloads these tasks' datasets from the Hugging Face Hub (tests/test_downstream_eval.py runs local tasks)",
    "mula eval --run runs/mula-1b --tasks lm_eval:arc_easy,lm_eval:hellaswag --limit 500":
        "lm-eval downloads these tasks' datasets from the Hugging Face Hub (tests/test_downstream_eval.py runs local tasks)",
    "mula eval --ckpt runs/mula-100b-a7b/checkpoints/step=000050000.ckpt --tasks arc_easy,hellaswag --devices 12 "
    "--num_nodes 4 --strategy {class_path: strategies.XPUMoEStrategy, init_args: {expert_parallel_size: 12, "
    "pipeline_parallel_size: 4, meta_init: true}}": CLUSTER,
    "mula prepare -c recipes/datasets/olmoe-mix-0924.yaml --num_workers 64":
        "needs the downloaded OLMoE-mix-0924 corpus (tests/test_named_tokenizers.py prepares local files with its tokenizer)",
    "srun --nodes 128 --ntasks-per-node 1 --cpus-per-task 64 mula prepare -c recipes/datasets/olmoe-mix-0924.yaml":
        CLUSTER,
    TORCHRUN_1B: CLUSTER,
    "srun .venv/bin/mula fit -c recipes/mula-7b-a1b.yaml -c recipes/strategies/xpu-moe.yaml --trainer.devices=8 "
    "--trainer.num_nodes=$SLURM_NNODES": CLUSTER,
    "cd $PBS_O_WORKDIR": CLUSTER,
    "export ZE_FLAT_DEVICE_HIERARCHY=FLAT": CLUSTER,
    "NNODES=$(wc -l < $PBS_NODEFILE)": CLUSTER,
    "mpiexec -n $((NNODES * 12)) --ppn 12 .venv/bin/mula fit -c recipes/mula-20b-a2b.yaml "
    "-c recipes/strategies/aurora-xpu-moe.yaml --trainer.num_nodes=$NNODES": CLUSTER,
    "wandb login": "needs the network (W&B's servers); runs log offline here",
    "WANDB_MODE=online mula fit -c recipes/mula-7b-a1b.yaml": "needs the network (W&B's servers) and a 7B model",
    AURORA_PIPELINE_220B: CLUSTER,
    "srun mula fit -c recipes/mula-7b-a1b.yaml -c recipes/strategies/xpu-moe.yaml --trainer.devices=8 "
    "--trainer.num_nodes=64 --trainer.strategy.init_args.expert_parallel_size=8": CLUSTER,
    "scripts/mula-resilient -n 5 -d 30 -- mpiexec -n 1536 --ppn 12 mula fit -c recipes/mula-20b-a2b.yaml "
    "-c recipes/strategies/aurora-xpu-moe.yaml --trainer.num_nodes=128": CLUSTER,
    "rc=$?": CLUSTER,
    "[ $rc -eq 75 ]": CLUSTER,
    "qsub -W depend=afterany:$PBS_JOBID $0": CLUSTER,
    "exit $rc": CLUSTER,
    "torchrun --nnodes=16 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=$HEAD:29500 --max-restarts=3 "
    "$(which mula) fit -c recipes/mula-1b.yaml --trainer.num_nodes=16": CLUSTER,
    "srun --nodes 2 --ntasks-per-node 8 mula calibrate --output recipes/machines/mycluster.yaml --model mula-7b-a1b "
    "--peak_bf16_tflops 989": CLUSTER,
}  # fmt: skip


def _blocks(path: Path):
    """(language, lines) of every fenced block of a markdown file."""
    lang, lines = None, []
    for line in path.read_text().splitlines():
        match = FENCE.match(line.strip())
        if lang is None and match:
            lang, lines = match.group(1), []
        elif lang is not None and line.strip() == "```":
            yield lang, lines
            lang = None
        elif lang is not None:
            lines.append(line)


def _logical_lines(lines: list[str]):
    """Shell lines with backslash continuations and multi-line quotes joined, comment lines dropped."""
    buffer = ""
    for line in lines:
        if not buffer and line.lstrip().startswith("#"):
            continue
        buffer = f"{buffer} {line.strip()}" if buffer else line.strip()
        if buffer.endswith("\\"):
            buffer = buffer[:-1].rstrip()
            continue
        try:
            shlex.split(buffer, comments=True)
        except ValueError:  # a quote still open: the next line continues it
            continue
        if buffer:
            yield buffer
        buffer = ""


def _commands(line: str) -> list[list[str]]:
    """The commands of one shell line: its tokens, split at `&&`, `||` and `;`."""
    out, current = [], []
    for token in shlex.split(line, comments=True):
        if token in ("&&", "||", ";"):
            out.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in [*out, current] if c]


def documented_commands() -> list[tuple[str, str, list[str], list[str]]]:
    """(document, command (its tokens joined by spaces), its tokens, the output lines the document shows
    for it), in document order."""
    found = []
    for path in DOCS:
        for lang, lines in _blocks(path):
            if lang in ("bash", "sh"):
                for line in _logical_lines(lines):
                    found += [(path.name, " ".join(tokens), tokens, []) for tokens in _commands(line)]
            elif lang == "":
                for i, line in enumerate(lines):
                    if line.startswith("$ "):
                        shown = []
                        for after in lines[i + 1 :]:
                            if after.startswith("$ "):
                                break
                            shown.append(after)
                        found += [
                            (path.name, " ".join(tokens), tokens, shown) for tokens in _commands(line[2:])
                        ]
    return found


COMMANDS = documented_commands()


def test_every_documented_command_is_run_or_excused() -> None:
    documented = {command for _, command, _, _ in COMMANDS}
    neither = sorted(documented - set(RUN) - set(NOT_RUN))
    assert not neither, f"documented commands neither run by this test nor excused in NOT_RUN: {neither}"
    stale = sorted((set(RUN) | set(NOT_RUN)) - documented)
    assert not stale, f"RUN / NOT_RUN name commands no document shows any more: {stale}"
    assert not set(RUN) & set(NOT_RUN)


@pytest.mark.parametrize("command", sorted(NOT_RUN))
def test_a_command_not_run_names_files_that_exist(command: str) -> None:
    for token in command.split():
        for path in re.findall(r"(?:^|=)((?:recipes|scripts)/[\w./-]+)", token):
            if not path.startswith("recipes/machines/mycluster"):  # the file that command writes
                assert (ROOT / path).exists(), f"{command}: {path} does not exist"


# A cluster job's `mula fit` runs here as `mula plan --dry_run` with the same `-c` files and options: the
# launcher (srun, torchrun, mpiexec; scripts/mula-resilient around it) is stripped, and its variables take
# the values the job script states -- `#SBATCH --nodes=N` is $SLURM_NNODES (and `--ntasks-per-node=K` srun's
# ranks per node), `#PBS -l select=N` is $NNODES (the node file's line count) -- or, where no line of the
# document states them, the value CHOSEN_NODES gives with its source. The plan prices the node the launcher
# fills, one rank per device: `--machine` is NODE_MACHINES[ranks per node] (12: an Aurora node of tiles, as
# the docs' mpiexec jobs say; 8: an 8-GPU node, H100's machine file). It must (1) plan as many ranks as the
# launcher starts (trainer.devices x num_nodes: mpiexec's cluster environment refuses a difference, and
# `mula fit`'s memory check plans trainer.num_nodes), with an explicit trainer.devices equal to the ranks per
# node, (2) fit the device, as `mula fit`'s start-of-run check requires, and (3) build its rank on the meta
# device with every byte equal to the plan's (`mula plan --dry_run`'s own exit status).
CHOSEN_NODES = {
    TORCHRUN_1B: (16, "the node count of docs/resilience.md's torchrun job of the same recipe"),
    AURORA_PIPELINE_220B: (32, "the Aurora nodes recipes/mula-220b-a10b.yaml's header plans it on"),
}
NODE_MACHINES = {12: "aurora", 8: "h100"}
CLUSTER_FITS = [c for c, why in NOT_RUN.items() if why == CLUSTER and "fit" in c.split()]


def _job_directives() -> dict[str, list[str]]:
    """Each documented command -> the scheduler lines (`#SBATCH`, `#PBS`) of the block it is in."""
    found: dict[str, list[str]] = {}
    for path in DOCS:
        for lang, lines in _blocks(path):
            if lang in ("bash", "sh"):
                directives = [line.strip() for line in lines if line.strip().startswith(("#SBATCH", "#PBS"))]
                for line in _logical_lines(lines):
                    found.update((" ".join(tokens), directives) for tokens in _commands(line))
    return found


def _option(tokens: list[str], *names: str) -> str | None:
    """The value of a launcher option written `--name=V` or `--name V` (the first of `names` present)."""
    for i, token in enumerate(tokens):
        for name in names:
            if token == name and i + 1 < len(tokens):
                return tokens[i + 1]
            if token.startswith(name + "="):
                return token[len(name) + 1 :]
    return None


def _number(text: str, env: dict[str, int]) -> int:
    """A launcher count: a number, `$VAR`, or `$((VAR * 12))` (a product), with the job's variables."""
    expression = text.removeprefix("$((").removesuffix("))").removeprefix("$")
    factors = [f.strip().removeprefix("$") for f in expression.split("*")]
    value = 1
    for factor in factors:
        value *= int(env[factor]) if factor in env else int(factor)
    return value


def cluster_fit_as_plan(command: str, directives: list[str]) -> tuple[list[str], int, int]:
    """(the `mula plan --dry_run` tokens of a cluster job's `mula fit`, the ranks its launcher starts, and
    the ranks per node), by the rule above."""
    env: dict[str, int] = {}
    for line in directives:
        if line.startswith("#SBATCH") and (nodes := _option(line.split(), "--nodes")):
            env["SLURM_NNODES"] = int(nodes)
        if line.startswith("#PBS") and (select := re.search(r"select=(\d+)", line)):
            env["NNODES"] = int(select.group(1))
    if command in CHOSEN_NODES:
        env["NNODES"] = CHOSEN_NODES[command][0]
    # `$((NNODES * 12))` is one launcher count: shlex splits it at its spaces
    tokens = shlex.split(re.sub(r"\$\(\((\w+) \* (\d+)\)\)", r"$((\1*\2))", command))
    if tokens[0] == "scripts/mula-resilient":
        tokens = tokens[tokens.index("--") + 1 :]
    launcher, fit = tokens[0], tokens.index("fit")
    options = tokens[1:fit]
    sbatch = [token for line in directives if line.startswith("#SBATCH") for token in line.split()[1:]]
    if launcher == "torchrun":
        nodes, per_node = _option(options, "--nnodes"), _option(options, "--nproc-per-node")
    elif launcher == "srun":
        nodes = _option(options, "--nodes", "-N") or _option(sbatch, "--nodes", "-N")
        per_node = _option(options, "--ntasks-per-node") or _option(sbatch, "--ntasks-per-node")
    elif launcher == "mpiexec":
        total, per_node = _option(options, "-n", "-np"), _option(options, "--ppn", "-ppn")
        assert total and per_node, command
        nodes = str(_number(total, env) // _number(per_node, env))
    else:
        raise AssertionError(f"{command}: no launcher this test knows (srun, torchrun, mpiexec)")
    assert nodes and per_node, f"{command}: the launcher's nodes and ranks per node are not stated"
    nodes_count, per_node_count = _number(nodes, env), _number(per_node, env)
    own = [re.sub(r"\$(\w+)", lambda m: str(env[m.group(1)]), token) for token in tokens[fit + 1 :]]
    plan = ["mula", "plan", *own, f"--machine={NODE_MACHINES[per_node_count]}", "--dry_run"]
    return plan, nodes_count * per_node_count, per_node_count


_PLANNED: dict[tuple[str, ...], str] = {}  # one run per distinct plan (two documents may show the same job)


def test_a_cluster_fit_becomes_its_plan() -> None:
    """The rule above on planted jobs: the scheduler's lines and the launcher's counts give the plan's nodes,
    the machine and the ranks the launcher starts (which test_a_cluster_fit_dry_runs compares with the plan's)."""
    slurm = "srun .venv/bin/mula fit -c recipes/x.yaml --trainer.devices=8 --trainer.num_nodes=$SLURM_NNODES"
    assert cluster_fit_as_plan(slurm, ["#SBATCH --nodes=4 --ntasks-per-node=8 --gpus-per-node=8"]) == (
        ["mula", "plan", "-c", "recipes/x.yaml", "--trainer.devices=8", "--trainer.num_nodes=4", "--machine=h100",
         "--dry_run"], 32, 8,
    )  # fmt: skip
    pbs = "scripts/mula-resilient -n 5 -- mpiexec -n $((NNODES * 12)) --ppn 12 mula fit -c recipes/x.yaml"
    assert cluster_fit_as_plan(pbs, ["#PBS -l select=3 -l walltime=06:00:00"]) == (
        ["mula", "plan", "-c", "recipes/x.yaml", "--machine=aurora", "--dry_run"],
        36,
        12,
    )  # a Trainer left at num_nodes=1: its plan has 12 ranks, not the 36 started, and the dry run fails
    torchrun = (
        "torchrun --nnodes=2 --nproc-per-node=8 -m mula.cli fit -c recipes/x.yaml --trainer.num_nodes=2"
    )
    assert cluster_fit_as_plan(torchrun, [])[1:] == (16, 8)


@pytest.mark.parametrize("command", CLUSTER_FITS)
def test_a_cluster_fit_dry_runs(command: str) -> None:
    from mula.plan.command import PLAN_OPTIONS
    from mula.plan.recipe_reader import read_plan_command

    plan, ranks, per_node = cluster_fit_as_plan(command, _job_directives()[command])
    output = _PLANNED.get(tuple(plan)) or _run(plan, ROOT)
    _PLANNED[tuple(plan)] = output
    head = re.search(r"^mula plan: [\w.-]+, (\d+) ranks \(", output, re.MULTILINE)
    assert head, output
    assert int(head.group(1)) == ranks, (
        f"{shlex.join(plan)} plans {head.group(1)} ranks; the launcher starts {ranks}"
    )
    parsed = read_plan_command(
        plan[2:], {name: (tp, default) for name, (tp, default, _) in PLAN_OPTIONS.items()}
    )
    assert parsed is not None, plan
    devices = parsed["trainer"].get("devices")
    assert devices in (None, "auto", -1, "-1", per_node, str(per_node)), (
        f"trainer.devices={devices}, {per_node} per node"
    )
    assert re.search(r"^  total .*: fits", output, re.MULTILINE), output
    rows = re.findall(
        r"^  [a-z ]+?\s+[\d,]+\s+[\d,]+\s+(\w+)$", output[output.index("dry run: rank") :], re.MULTILINE
    )
    assert len(rows) >= 4 and set(rows) == {"yes"}, output


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A scratch directory with a copy of recipes/ (a documented command may write into it)."""
    work = tmp_path_factory.mktemp("docs")
    shutil.copytree(ROOT / "recipes", work / "recipes")
    return work


def _mula(tokens: list[str]) -> list[str]:
    program = tokens[0].removeprefix(".venv/bin/")
    assert program in ("mula", "ruff"), tokens
    return [sys.executable, "-m", program, *tokens[1:]]


def _run(tokens: list[str], cwd: Path, stdout_to: Path | None = None) -> str:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("MULA_TRACEBACK", None)
    done = subprocess.run(_mula(tokens), cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{shlex.join(tokens)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    if stdout_to is not None:
        stdout_to.write_text(done.stdout)
    return done.stdout


def _with_small_settings(tokens: list[str], run_dir: str | None) -> list[str]:
    """FIT_SMALL after the last `-c FILE`, then the command's own options (a run directory first)."""
    last = max(i for i, t in enumerate(tokens) if t == "-c") + 2
    own = [f"--trainer.default_root_dir={run_dir}"] if run_dir else []
    return [*tokens[:last], *FIT_SMALL, *own, *tokens[last:]]


def _main_job(workdir: Path) -> None:
    """The README's first command (after setup), once per session: later commands read its checkpoint."""
    if not (workdir / "runs/mula-tiny-moe/checkpoints/last.ckpt").is_file():
        _run(_with_small_settings(shlex.split(MAIN_JOB), None), workdir)


@pytest.mark.parametrize("command", list(RUN))
def test_a_documented_command_runs(command: str, workdir: Path) -> None:
    kind = RUN[command]
    tokens, shown = next((t, out) for _, c, t, out in COMMANDS if c == command)
    if command == MAIN_JOB:
        _main_job(workdir)
        assert (workdir / "data/stdlib/summary.json").is_file()
        return
    if kind == "lint":
        _run(tokens, ROOT)
        return
    if ">" in tokens:
        redirect = tokens.index(">")
        _run(tokens[:redirect], workdir, stdout_to=workdir / tokens[redirect + 1])
        assert "model:" in (workdir / tokens[redirect + 1]).read_text()
        return
    if kind == "fit":
        _main_job(workdir)  # the data (prepared on first use) and, for `validate`, the checkpoint
        own_dir = None if tokens[1] == "validate" else f"runs/doc-{list(RUN).index(command)}"
        output = _run(_with_small_settings(tokens, own_dir), workdir)
        if own_dir is not None:  # it trained: logged its steps' losses and checkpointed (on every layout)
            rows = read_metrics(workdir / own_dir / "version_0" / "metrics.csv")
            assert any(r.get("train/loss") for r in rows), command
            assert (workdir / own_dir / "checkpoints" / "last.ckpt").exists(), command
    elif kind == "calibrate":  # run as written, with the planner reading what it wrote, by test_calibrate
        assert command == DOCUMENTED_CALIBRATE
        assert not shown  # nothing to compare that test_calibrate does not
        return
    elif kind == "after fit":  # reads the README's first run (OLMo's tasks: offline)
        _main_job(workdir)
        output = _run(tokens, workdir)
    else:
        output = _run(tokens, workdir)
    lines = output.splitlines()
    for line in shown:  # what the document shows the command printing, it still prints
        assert line in lines, f"{command} no longer prints the documented line:\n{line}"
