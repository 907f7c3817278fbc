"""One rank of `mula calibrate`: join the job, measure, and (rank 0) write the machine file. What runs the
strategy's own code (its splits, its sharded AdamW) comes from the strategy (`mula.calibrate.strategy`)."""

from __future__ import annotations

import os
import socket
import statistics
from typing import Any

import torch
import torch.distributed as dist

from mula.calibrate.estimate import announcement, phase_seconds, probe
from mula.calibrate.fit import fit_curve
from mula.calibrate.loop import loop_seconds
from mula.calibrate.measure import (
    COLLECTIVES,
    PEAK_SIZES,
    TRAINING_RATES,
    elementwise_gbps,
    functional_call_seconds,
    matmul_shapes,
    matmul_tflops,
    peak_tflops,
    synchronize,
    time_collective,
    training_tflops,
)
from mula.calibrate.settings import DTYPES, Settings, host_description, now, write_machine_file
from mula.calibrate.splits import splits_for
from mula.calibrate.strategy import StrategyCalibration
from mula.model.config import MulaConfig
from mula.torch_compat import xpu_available
from mula.training.host_allocator import reuse_freed_host_memory


def _device_and_backend(backend: str, local_rank: int) -> tuple[torch.device, str]:
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "xccl" if _xpu() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), backend
    if backend == "xccl":
        torch.xpu.set_device(local_rank)
        return torch.device("xpu", local_rank), backend
    return torch.device("cpu"), backend


def _xpu() -> bool:
    return xpu_available()


def _powers_up_to(n: int) -> list[int]:
    sizes, g = [], 2
    while g < n:
        sizes.append(g)
        g *= 2
    return sizes + ([n] if n >= 2 else [])


def _groups(hosts: list[str]) -> dict[str, dict[int, list[int]]]:
    """The groups to time: inside node 0 (its first g ranks), and across nodes (the first rank of each
    of the first g nodes)."""
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    firsts = [ranks[0] for ranks in nodes.values()]
    node0 = next(iter(nodes.values()))
    return {
        "intra": {g: node0[:g] for g in _powers_up_to(len(node0))},
        "inter": {g: firsts[:g] for g in _powers_up_to(len(firsts))} if len(firsts) > 1 else {},
    }


def _flop_weighted(
    rates: dict[str, float], shapes: dict[str, tuple[int, int, int]], counts: dict[str, int]
) -> float:
    """TFLOP/s of the whole set of matmuls (each shape `counts` times): total FLOPs over total time."""
    flops = {k: 2 * m * kk * n * counts.get(k, 1) for k, (m, kk, n) in shapes.items()}
    return sum(flops.values()) / sum(flops[k] / rates[k] for k in rates)


def run_rank(
    rank: int, world: int, settings: Settings, strategy: StrategyCalibration, local_rank: int | None = None
) -> None:
    """Measure on this rank (its device: `local_rank`, default `rank`), the strategy's splits and optimizer
    with `strategy`'s timings; rank 0 gathers the results and writes the file."""
    device, backend = _device_and_backend(settings.backend, rank if local_rank is None else local_rank)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
    try:
        _measure(rank, world, device, backend, settings, strategy)
    finally:
        dist.destroy_process_group()


def cpu_threads_per_rank(ranks_on_host: int) -> int | None:
    """The torch threads of a CPU rank as Lightning's launchers set them for `mula fit`: the host's cores
    shared by its ranks, unless OMP_NUM_THREADS says otherwise (None: leave torch's setting). Torch's
    default, every core for every rank, would oversubscribe the host and time it several times slower
    than training runs (this repository's example file once came out 3x too slow that way)."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // max(1, ranks_on_host))


def _measure(
    rank: int,
    world: int,
    device: torch.device,
    backend: str,
    settings: Settings,
    strategy: StrategyCalibration,
) -> None:
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())  # ranks on one host share a node's fabric
    threads = cpu_threads_per_rank(hosts.count(hosts[rank])) if device.type == "cpu" else None
    if threads is not None:
        torch.set_num_threads(threads)
    if device.type == "cpu":  # as `mula fit` trains on CPU: what a step frees stays for the next
        reuse_freed_host_memory()
    groups = _groups(hosts)
    config = MulaConfig.from_name(settings.model, **settings.overrides)
    shapes = matmul_shapes(config, settings.micro_batch * settings.seq_len)
    counts = {"attention": 2 * config.num_heads}  # scores and values, per head
    kinds = {g: splits_for(config, g, settings.seq_len) for g in groups["intra"]}
    # what the job will take, said before it measures; the bar advances by each phase's share
    units = probe(config, settings, device)
    phases = phase_seconds(settings, config, {s: list(sized) for s, sized in groups.items()}, kinds, units)
    if rank == 0:
        print(announcement(settings, units, phases, world), flush=True)
    bar = _bar(sum(phases.values()), settings.progress and rank == 0)

    def done(phase: str) -> None:
        bar.update(min(phases[phase], bar.total - bar.n))  # the sum's rounding never past the end

    # compute: every rank at once (as in training), the slowest rank's rate per shape
    local = {}
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        local[dtype_name] = matmul_tflops(shapes, dtype, device, settings.reps)
        local[dtype_name + "_peak"] = peak_tflops(dtype, device, settings.reps, PEAK_SIZES)
        local[dtype_name + "_training"] = training_tflops(
            config, settings.micro_batch, settings.seq_len, dtype, device, settings.reps
        )
        done(f"compute {dtype_name}")
    local["elementwise_gbps"] = elementwise_gbps(device, 1 << 24, settings.reps)
    local["loop_s"] = loop_seconds(config)
    done("loop")
    local["threads"] = torch.get_num_threads()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, local)

    curves: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    calls: dict[int, float] = {}  # a functional collective's seconds between computes, per group size
    splits: dict[str, dict[str, dict[int, dict[str, float]]]] = {}  # dtype -> kind -> group size -> times
    reductions: dict[str, dict[int, dict[int, dict[str, float]]]] = {}  # dtype -> ZeRO stage -> group size
    for scope, sized in groups.items():
        for g, ranks in sized.items():
            group = dist.new_group(ranks)  # every rank creates every group, in the same order
            for kind in COLLECTIVES:
                if rank in ranks:
                    points = time_collective(kind, settings.sizes, group, ranks, device, settings.reps)
                    if rank == ranks[0]:
                        curve = fit_curve(points)
                        entry = {
                            "alpha_s": curve.alpha_s,
                            "beta_s_per_byte": curve.beta_s_per_byte,
                            "max_error": round(curve.max_error, 4),
                            "points": [[int(b), t] for b, t in points],
                        }
                        curves.setdefault(scope, {}).setdefault(kind, {})[g] = entry
                synchronize(device)
                dist.barrier()
                done(f"{scope} {g} {kind}")
            if scope == "intra" and rank in ranks:  # TP and CP groups stay in a node
                seconds = functional_call_seconds(group, device, 3 * settings.reps)
                if rank == ranks[0]:
                    calls[g] = seconds
                done(f"intra {g} functional")
                # the model split over the group as the strategy splits it (strategies/calibrate/splits.py)
                for dtype_name in DTYPES:
                    for kind in kinds[g]:
                        measured = strategy.split_training_seconds(
                            config, kind, settings.micro_batch, settings.seq_len, getattr(torch, dtype_name),
                            device, group, ranks.index(rank), g, 3 * settings.reps,
                        )  # fmt: skip
                        if rank == ranks[0]:
                            splits.setdefault(dtype_name, {}).setdefault(kind, {})[g] = measured
                        done(f"intra {g} {dtype_name} {kind}")
                    # the sharded optimizer's reduction over the group (strategies/calibrate/reduction.py)
                    by_stage = strategy.reduction_seconds(
                        config, settings.micro_batch, settings.seq_len, getattr(torch, dtype_name), device,
                        group, ranks.index(rank), g, 3 * settings.reps,
                    )  # fmt: skip
                    if rank == ranks[0]:
                        for stage, measured in by_stage.items():
                            reductions.setdefault(dtype_name, {}).setdefault(stage, {})[g] = measured
                    done(f"intra {g} {dtype_name} reduction")
            dist.barrier()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (curves, calls, splits, reductions))
    bar.close()
    if rank == 0:
        functional = {g: s for _, sized_calls, _, _ in gathered for g, s in sized_calls.items()}
        merged = _merge(part[0] for part in gathered)  # scope -> collective -> group size -> curve
        split_s = _merge(part[2] for part in gathered)  # dtype -> split kind -> group size -> times
        reduction_s = _merge(part[3] for part in gathered)  # dtype -> ZeRO stage -> group size -> times
        _write(
            settings, every, merged, functional, split_s, reduction_s, hosts, backend, device, shapes, counts
        )


def _merge(parts: Any) -> dict[str, Any]:
    """Each group's first rank's {a: {b: {group size: entry}}}, merged into one."""
    merged: dict[str, Any] = {}
    for part in parts:
        for a, inner in part.items():
            for b, sized in inner.items():
                merged.setdefault(a, {}).setdefault(b, {}).update(sized)
    return merged


def _bar(seconds: float, enabled: bool) -> Any:
    """A progress bar counting the job's estimated seconds (its remaining time: the estimate's rest, at
    the pace the finished phases went)."""
    from tqdm.auto import tqdm

    return tqdm(
        total=seconds, desc="calibrate", disable=not enabled, dynamic_ncols=True,
        bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed} elapsed, about {remaining} left",
    )  # fmt: skip


def _write(
    settings: Settings,
    every: list[dict[str, Any]],
    curves: dict[str, Any],
    functional: dict[int, float],
    splits: dict[str, Any],
    reductions: dict[str, Any],
    hosts: list[str],
    backend: str,
    device: torch.device,
    shapes: dict[str, tuple[int, int, int]],
    counts: dict[str, int],
) -> None:
    per_node = hosts.count(hosts[0])
    nodes = len(dict.fromkeys(hosts))
    matmul = {d: {k: min(r[d][k] for r in every) for k in shapes} for d in DTYPES}
    model = {d: _flop_weighted(matmul[d], shapes, counts) for d in DTYPES}
    peak = settings.peak_bf16_tflops or min(r["bfloat16_peak"] for r in every)
    a2a = curves["intra"]["all_to_all"][max(curves["intra"]["all_to_all"])]
    p2p = curves.get("inter", curves["intra"])["send_recv"]
    p2p = p2p[max(p2p)]
    machine = {
        "name": settings.name,
        "device_type": device.type,
        "tiles_per_node": per_node,
        "memory_per_tile_gb": round(settings.memory_per_tile_gb or _device_memory_gb(device, per_node), 1),
        "peak_bf16_tflops": round(peak, 4),
        "intra_node_gbps": round(1e-9 / max(a2a["beta_s_per_byte"], 1e-30), 4),
        "inter_node_gbps": round(1e-9 / max(p2p["beta_s_per_byte"], 1e-30), 4),
        "compute_mfu": round(min(1.0, model["bfloat16"] / peak), 4),
    }
    errors = [e["max_error"] for kinds in curves.values() for sized in kinds.values() for e in sized.values()]
    calibration = {
        "measured_at": now(),
        **host_description(),
        "world_size": len(hosts),
        "nodes": nodes,
        "backend": backend,
        "threads_per_rank": min(r["threads"] for r in every),  # torch's intra-op threads on each rank
        "torch": str(torch.__version__),
        "model": settings.model,
        "overrides": settings.overrides,
        "tokens_per_micro_batch": settings.micro_batch * settings.seq_len,
        "matmul_tflops": matmul,
        "model_tflops": {d: round(v, 6) for d, v in model.items()},
        # forward + backward (and the forward alone) of a micro-batch, per rank, all ranks busy: of a
        # block, and of the rest (embedding, LM head, loss)
        "training_tflops": {
            d: {k: round(min(r[d + "_training"][k] for r in every), 6) for k in TRAINING_RATES}
            for d in DTYPES
        },
        # the training loop's fixed seconds per optimizer step and per micro-batch (mula.calibrate.loop)
        "loop_s": {k: round(statistics.median(r["loop_s"][k] for r in every), 6) for k in ("step", "batch")},
        "elementwise_gbps": round(statistics.median(r["elementwise_gbps"] for r in every), 3),
        "error_band": round(max(errors), 4),
        # per group size inside a node: a small functional collective's seconds between computes (the
        # tensor- and context-parallel calls' price, mula.calibrate.measure.functional_call_seconds)
        "functional_call_s": {g: round(s, 7) for g, s in sorted(functional.items())},
        # per dtype, split kind and group size inside a node: one micro-batch's forward + backward of the
        # small model whole and split as the strategy splits it (strategies/calibrate/splits.py; the planner's
        # compute factor of a TP or CP rank, mula.plan.split_compute)
        "split_training_s": {
            d: {k: {g: _rounded(m) for g, m in sorted(sized.items())} for k, sized in kinds.items()}
            for d, kinds in splits.items()
        },
        # per dtype, ZeRO stage and group size inside a node: a step of two micro-batches of the small
        # model without a reducer and with the sharded optimizer reducing over the group
        # (strategies/calibrate/reduction.py; the reducer's own work, mula.plan.grad_reduction)
        "grad_reduction_s": {
            d: {z: {g: _rounded(m) for g, m in sorted(sized.items())} for z, sized in sorted(stages.items())}
            for d, stages in reductions.items()
        },
        "collectives": curves,
    }
    write_machine_file(settings, machine, calibration)
    print(f"mula: wrote {settings.output} (fit error of the curves up to {100 * max(errors):.0f} %)")


def _rounded(measured: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 7) if isinstance(v, float) else v for k, v in measured.items()}


def _device_memory_gb(device: torch.device, per_node: int) -> float:
    if device.type in ("cuda", "xpu"):
        return getattr(torch, device.type).get_device_properties(device).total_memory / 1e9
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return pages * size / 1e9 / per_node
