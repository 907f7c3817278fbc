"""mula.host_sync: the meter counts what makes a device wait for the host, a training step has the syncs this
file states and no other, and the step's code reads device tensors on the host only through `to_host`.

The counts of a step of mula-tiny-moe (dropless routing, CPU, 2 micro-batches per rank, steps that are
not logging steps), the CPU expert kernel's host planning counted apart under its mark `CPU_EXPERT_KERNEL`:
* E1, Lightning's one-device strategy and XPUMoEStrategy: none. The clipping norm, the non-finite skip
  (the sharded AdamW masks its update by the device flag), the loss sums and the router's counts and
  bias update stay on the device.
* E2, two gloo ranks (XPUMoEStrategy(expert_parallel_size=2)): one read of the all-to-all's split sizes
  per MoE layer and micro-batch forward (`A2A_SPLITS`; combine and both backward exchanges reuse them),
  nothing else (Lightning's SIGTERM agreement and the skip report wait for logging steps).
* P2 x E2, four gloo ranks: the split sizes once per MoE layer of the rank's stage and micro-batch.
* With `capacity_factor` (E1, E2, P2 x E2): none at all (fixed all-to-all blocks, nothing to plan on the host).
So a dropless step has `split_reads(layers, forwards)` syncs: its rank's MoE layers times its micro-batch
forwards (recomputed forwards count as forwards: none here, no activation checkpointing).
The source scan's scope is `STEP_CODE` (the model, the strategies, the module's and Muon's step code) less
`OUT_OF_STEP` (checkpoint, evaluation and calibration code, each with its reason).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import run_distributed

from mula.bench.probe import logging_step, steady_steps
from mula.host_sync import (
    CPU_EXPERT_KERNEL,
    HostSyncMeter,
    host_syncs_excluded,
    optimizer_host_tensors,
    to_host,
)
from strategies.experts.all_to_all import A2A_SPLITS

ROOT = Path(__file__).resolve().parents[1]
aten = torch.ops.aten


# ----- the meter ------------------------------------------------------------------------------------
def test_the_meter_counts_each_kind_of_sync_once_and_nothing_else() -> None:
    x = torch.arange(6.0)
    counts = torch.tensor([2, 0, 1])
    with HostSyncMeter("cpu") as meter:
        y = (x * 2).sum()  # no sync: stays a tensor
        y.item()  # _local_scalar_dense
        float(y), bool(y > 0)  # two more scalar reads
        torch.nonzero(x)
        x[x > 2]  # a boolean mask: index
        x.masked_select(x > 2)
        torch.unique(counts)
        torch.repeat_interleave(counts)  # output size from the values
        torch.repeat_interleave(torch.arange(3), counts, output_size=3)  # given: no sync
        to_host(counts, "splits").tolist()  # a deliberate read, counted by reason (its copy not again)
        with host_syncs_excluded("cpu only"):
            int(counts.sum())
            to_host(counts, "planning")
    assert meter.counts() == {
        "ops": {
            "_local_scalar_dense": 3,
            "_unique2": 1,
            "index": 1,
            "masked_select": 1,
            "nonzero": 1,
            "repeat_interleave": 1,
        },
        "reads": {"splits": 1},
        "excluded": {"cpu only": 2},
    }
    assert meter.total == 9
    # entering again starts a new count; leaving stops counting
    with meter:
        pass
    x.sum().item()
    assert meter.total == 0 and meter.counts()["excluded"] == {}


def test_only_tensors_of_the_runs_device_count() -> None:
    """On a GPU run a CPU tensor's read is no sync; torch.optim's step counters live on the host on every
    device, so a CPU run does not count them either."""
    step = torch.tensor(3.0)
    with HostSyncMeter("cuda") as on_gpu:  # no GPU needed: CPU tensors are not the run's device's
        step.item(), to_host(step, "why")
    assert on_gpu.total == 0
    with HostSyncMeter("cpu", host_tensors=[step]) as on_cpu:
        step.item(), torch.tensor(1.0).item()
    assert on_cpu.counts()["ops"] == {"_local_scalar_dense": 1}

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    adamw = torch.optim.AdamW([p])
    adamw.step()
    assert [t is adamw.state[p]["step"] for t in optimizer_host_tensors([adamw])] == [True]
    fused = torch.optim.AdamW([p], fused=True)
    fused.step()
    assert optimizer_host_tensors([fused]) == []  # fused keeps its counter on the device


def test_copies_between_host_and_accelerator_count_when_blocking() -> None:
    """The copy rule on an accelerator (meta tensors stand in for one: the rule reads device types only)."""
    meter = HostSyncMeter("meta")
    device, host = torch.empty(3, device="meta"), torch.empty(3)
    cpu = torch.device("cpu")
    meter.record_op(aten._to_copy.default, (device,), {"device": cpu})  # device -> host
    meter.record_op(aten._to_copy.default, (host,), {"device": torch.device("meta")})  # host -> device
    meter.record_op(aten._to_copy.default, (device,), {"device": cpu, "non_blocking": True})  # no wait
    meter.record_op(aten._to_copy.default, (device,), {"dtype": torch.half})  # stays on the device
    meter.record_op(aten.copy_.default, (host, device), {})  # device -> host
    meter.record_op(aten.copy_.default, (device, device), {})
    assert meter.counts()["ops"] == {"_to_copy": 2, "copy_": 1}
    on_cpu = HostSyncMeter("cpu")  # a CPU run has no accelerator to copy from
    on_cpu.record_op(aten._to_copy.default, (host,), {"device": cpu})
    assert on_cpu.total == 0


# ----- a training step's syncs ----------------------------------------------------------------------
MICRO, SEQ, MICROS = 2, 32, 2  # micro-batch size, tokens, micro-batches per rank and step
STEPS, LOG_EVERY = 5, 3  # steps 2 and 5 are counted; 3 logs and 4 holds its hand-over (both dropped)
COUNTED, DROPPED = [2, 5], [3, 4]
MOE_LAYERS = 4  # mula-tiny-moe's blocks, all MoE
CAPACITY_FACTOR = 1.25  # `MulaConfig.capacity_factor` of the runs that drop (None: dropless)
CPU_PLANNING = 2  # the CPU kernel's host reads per MoE layer and forward: plan_buckets, sorted_to_padded


def split_reads(moe_layers: int, forwards: int) -> int:
    """The host syncs of a dropless step outside logging steps: one read of the all-to-all's split sizes
    per MoE layer of the rank (its stage's) and forward pass (micro-batches, plus recomputed forwards)."""
    return moe_layers * forwards


def expected(ops: dict[str, int], splits: int, micro_batches: int, moe_layers: int) -> dict[str, Any]:
    """A counted step's `HostSyncMeter.counts()` with "total": `ops`, `splits` reads of the expert
    all-to-all's split sizes, and the CPU kernel's planning under its mark (not in the total)."""
    reads = {A2A_SPLITS: splits} if splits else {}
    excluded = {CPU_EXPERT_KERNEL: CPU_PLANNING * moe_layers * micro_batches}
    return {"ops": ops, "reads": reads, "excluded": excluded, "total": sum(ops.values()) + splits}


def assert_step_syncs(run: dict[str, Any], step: dict[str, Any], what: str) -> None:
    """Every counted step of `run` (`_train`'s) has exactly the syncs `step`, and the logging steps were
    dropped."""
    assert sorted(run["counts"]) == COUNTED and run["logging_steps"] == DROPPED, (what, run)
    for n, counts in run["counts"].items():
        assert counts == step, f"{what}, step {n}: {counts} != {step}"


def _batches(rank: int, whole_steps: bool) -> torch.Tensor:
    """This rank's micro-batches [STEPS * MICROS, MICRO, SEQ + 1], or [STEPS, MICROS * MICRO, SEQ + 1] for a
    pipeline, which takes a step's micro-batches as one batch."""
    g = torch.Generator().manual_seed(1234 + rank)
    batches = torch.randint(0, 4096, (STEPS * MICROS, MICRO, SEQ + 1), generator=g)
    return batches.view(STEPS, MICROS * MICRO, SEQ + 1) if whole_steps else batches


def _train(rank: int, world: int, strategy: Any, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train mula-tiny-moe (dropless, fp32, clipping on) for STEPS steps of MICROS micro-batches per rank on
    `world` CPU ranks under `strategy`, counting the host syncs of steps 2..STEPS (`HostSyncSteps`).
    Returns {"counts": step -> counts with "total", "logging_steps": the dropped steps}."""
    import lightning.pytorch as L
    from torch.utils.data import DataLoader

    from mula.bench.probe import HostSyncSteps
    from mula.training.module import MulaLightningModule

    pipeline = getattr(strategy, "layout", None) is not None and strategy.layout.pp > 1
    if pipeline:  # what MulaDataModule sets: the step's micro-batches
        strategy.pipeline_microbatches = MICROS
    syncs = HostSyncSteps(range(2, STEPS + 1))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS,
        accumulate_grad_batches=1 if pipeline else MICROS, log_every_n_steps=LOG_EVERY, gradient_clip_val=1.0,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[syncs],
    )  # fmt: skip
    module = MulaLightningModule("mula-tiny-moe", overrides=overrides, lr=1e-3, min_lr=1e-4, warmup_steps=1)
    torch.manual_seed(0)
    trainer.fit(module, DataLoader(_batches(rank, pipeline), batch_size=None))
    return {"counts": syncs.counts, "logging_steps": syncs.logging_steps}


def _under_xpu_moe(
    rank: int, world: int, ep: int, pp: int = 1, capacity_factor: float | None = None
) -> dict[str, Any]:
    from dist_helpers import lightning_env

    from strategies import XPUMoEStrategy

    lightning_env(rank, world)
    strategy = XPUMoEStrategy(expert_parallel_size=ep, pipeline_parallel_size=pp)
    return _train(rank, world, strategy, {"capacity_factor": capacity_factor})


def test_a_step_at_e1_has_no_host_sync() -> None:
    """Lightning's own one-device step and XPUMoEStrategy's (the non-finite skip masked on the device):
    no sync at all. The CPU expert kernel's host planning is there, under its mark."""
    plain = _train(0, 1, "auto")
    assert_step_syncs(plain, expected({}, 0, MICROS, MOE_LAYERS), "E1, Lightning's strategy")
    (ours,) = run_distributed(_under_xpu_moe, 1, 1)
    assert_step_syncs(ours, expected({}, 0, MICROS, MOE_LAYERS), "E1, XPUMoEStrategy")


def test_a_dropless_step_at_e2_reads_the_splits_once_per_moe_layer_and_forward_and_nothing_else() -> None:
    """Two gloo ranks, E = 2: the all-to-all's split sizes once per MoE layer and micro-batch forward
    (combine and both backward exchanges reuse them); no other sync (Lightning's SIGTERM agreement waits
    for logging steps)."""
    step = expected({}, split_reads(MOE_LAYERS, MICROS), MICROS, MOE_LAYERS)
    for rank, run in enumerate(run_distributed(_under_xpu_moe, 2, 2)):
        assert_step_syncs(run, step, f"E2, rank {rank}")


def test_a_dropless_step_at_p2_e2_reads_the_splits_of_its_stages_moe_layers() -> None:
    """Four gloo ranks, P = 2 stages of E = 2: each rank's stage holds half the MoE layers and runs every
    micro-batch's forward once."""
    stage_layers = MOE_LAYERS // 2
    step = expected({}, split_reads(stage_layers, MICROS), MICROS, stage_layers)
    for rank, run in enumerate(run_distributed(_under_xpu_moe, 4, 2, 2)):
        assert_step_syncs(run, step, f"P2 x E2, rank {rank}")


@pytest.mark.parametrize(("world", "ep", "pp"), [(1, 1, 1), (2, 2, 1), (4, 2, 2)], ids=["E1", "E2", "P2xE2"])
def test_a_step_with_a_capacity_factor_has_no_host_sync(world: int, ep: int, pp: int) -> None:
    """`capacity_factor=1.25`: fixed-size all-to-all blocks (no split sizes to read) and a capacity
    kernel that plans on the device: nothing at all, on any rank, outside logging steps."""
    nothing = {"ops": {}, "reads": {}, "excluded": {}, "total": 0}
    for rank, run in enumerate(run_distributed(_under_xpu_moe, world, ep, pp, CAPACITY_FACTOR)):
        assert_step_syncs(run, nothing, f"E{ep} x P{pp}, capacity factor, rank {rank}")


def test_a_planted_sync_in_the_step_fails_the_count(monkeypatch) -> None:
    """A `.item()` and a `nonzero` planted in the loss bookkeeping are counted, once per micro-batch, and
    the step's stated count no longer holds."""
    from mula.training.module import MulaLightningModule

    record = MulaLightningModule.record_step_losses

    def planted(self, sums: torch.Tensor, count: int) -> None:
        sums.sum().item(), torch.nonzero(sums)
        record(self, sums, count)

    monkeypatch.setattr(MulaLightningModule, "record_step_losses", planted)
    run = _train(0, 1, "auto")
    with pytest.raises(AssertionError, match="step 2"):
        assert_step_syncs(run, expected({}, 0, MICROS, MOE_LAYERS), "E1, planted")
    assert run["counts"][2]["ops"] == {"_local_scalar_dense": MICROS, "nonzero": MICROS}


def test_without_its_mark_the_cpu_kernels_planning_counts(monkeypatch) -> None:
    """The mark is what keeps the CPU expert kernel's host reads out of the step's count."""
    import contextlib

    from mula.model.kernels import padded

    monkeypatch.setattr(padded, "host_syncs_excluded", lambda mark: contextlib.nullcontext())
    run = _train(0, 1, "auto")
    with pytest.raises(AssertionError, match="step 2"):
        assert_step_syncs(run, expected({}, 0, MICROS, MOE_LAYERS), "E1, unmarked")
    reads = MOE_LAYERS * MICROS  # plan_buckets' read of the counts, sorted_to_padded's int()
    assert run["counts"][2]["reads"] == {CPU_EXPERT_KERNEL: reads}
    assert run["counts"][2]["ops"] == {"_local_scalar_dense": reads}


def test_steady_steps_leave_out_every_window_that_holds_a_logging_step() -> None:
    assert steady_steps(4, 2, 5) == [4, 7]  # 5 logs, 6 holds its hand-over
    assert steady_steps(1, 3, 0) == [2, 3, 4]  # never logs; step 1 has no step before it
    assert steady_steps(3, 2, 1) == [] and steady_steps(3, 2, 2) == []  # every window holds one
    assert [logging_step(n, 3) for n in range(1, 7)] == [False, False, True, False, False, True]


# ----- the source scan ------------------------------------------------------------------------------
# The code a training step runs: the model (forward, backward, kernels), the strategies (dispatch, gradient
# reduction, the optimizer step), and the module's step hooks and Muon's update. Not scanned: callbacks
# (a recipe's choice, each with its own logging cadence), the data module, the bench and the loggers.
STEP_CODE = ("mula/model", "strategies", "mula/training/module.py", "mula/training/muon.py")
HOST_READS = ("cpu", "tolist", "numpy", "item")
# Code in STEP_CODE that no training step runs, by module or by function, with the reason.
OUT_OF_STEP = {
    "strategies/checkpoint_hooks.py": "checkpoint save and load, between steps",
    "strategies/sharded_state.py": "checkpoint save and load, between steps",
    "strategies/optim/state.py": "the sharded optimizer's checkpoint state",
    "strategies/eval_forward.py": "evaluation (downstream tasks), not a training step",
    "strategies/calibrate": "`mula calibrate`'s timings of the strategy, not a training step",
    "strategies/optim/sharded_optimizer.py:EPShardedAdamW.load_sharded_state_dict": "checkpoint load",
}


def step_sources(root: Path) -> list[Path]:
    """The files of STEP_CODE under `root`."""
    files = []
    for part in STEP_CODE:
        path = root / part
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path] if path.exists() else []
    return files


def _allowed(rel: str, qualname: str) -> bool:
    return any(
        rel == key or rel.startswith(key + "/") or f"{rel}:{qualname}" == key or
        f"{rel}:{qualname}".startswith(key + ".")
        for key in OUT_OF_STEP
    )  # fmt: skip


def _is_to_host(node: ast.expr) -> bool:
    """`to_host(...)` (or `host_sync.to_host(...)`): the read went through the one counted function."""
    func = node.func if isinstance(node, ast.Call) else None
    return (isinstance(func, ast.Name) and func.id == "to_host") or (
        isinstance(func, ast.Attribute) and func.attr == "to_host"
    )


def host_reads(root: Path, files: list[Path]) -> list[str]:
    """'path:line: function: call' for every `.cpu()`, `.tolist()`, `.numpy()`, `.item()` in `files` that is
    not applied to `to_host(...)`'s result and not in OUT_OF_STEP."""
    found = []

    def visit(node: ast.AST, scope: list[str], rel: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name], rel)
                continue
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr in HOST_READS
                and not _is_to_host(child.func.value)
                and not _allowed(rel, ".".join(scope))
            ):
                found.append(f"{rel}:{child.lineno}: {'.'.join(scope) or '<module>'}: {ast.unparse(child)}")
            visit(child, scope, rel)

    for path in files:
        rel = path.relative_to(root).as_posix()
        visit(ast.parse(path.read_text(), str(path)), [], rel)
    return found


def test_the_step_reads_device_tensors_on_the_host_only_through_to_host() -> None:
    found = host_reads(ROOT, step_sources(ROOT))
    assert not found, (
        "a host read in the training step's code: go through mula.host_sync.to_host(tensor, reason) (counted "
        "by the meter), or keep it out of the step (OUT_OF_STEP, with the reason):\n" + "\n".join(found)
    )
    for key in OUT_OF_STEP:  # every exception names code that exists
        path = key.split(":")[0]
        assert (ROOT / path).exists(), key


def test_the_scan_finds_a_planted_host_read(tmp_path: Path) -> None:
    files = {
        "mula/model/layer.py": (
            "from mula.host_sync import to_host\n"
            "def forward(x, counts):\n"
            "    n = x.sum().item()\n"  # planted
            "    splits = to_host(counts, 'splits').tolist()\n"  # counted: fine
            "    return x.cpu().numpy(), n, splits\n"  # two planted
        ),
        "strategies/optim/step.py": (
            "class Step:\n    def step(self, flag):\n        return flag.tolist()\n"  # planted
        ),
        "strategies/checkpoint_hooks.py": "def save(t):\n    return t.cpu()\n",  # out of the step
        "strategies/optim/sharded_optimizer.py": (
            "class EPShardedAdamW:\n"
            "    def load_sharded_state_dict(self, s):\n"
            "        return s.item()\n"  # out of the step
            "    def step(self, s):\n"
            "        return s.item()\n"  # planted
        ),
        "callbacks/anomaly.py": "def f(t):\n    return t.item()\n",  # not step code
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert host_reads(tmp_path, step_sources(tmp_path)) == [
        "mula/model/layer.py:3: forward: x.sum().item()",
        "mula/model/layer.py:5: forward: x.cpu().numpy()",
        "mula/model/layer.py:5: forward: x.cpu()",
        "strategies/optim/sharded_optimizer.py:5: EPShardedAdamW.step: s.item()",
        "strategies/optim/step.py:3: Step.step: flag.tolist()",
    ]
