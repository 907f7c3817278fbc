"""How long a `mula calibrate` job will take on this host, told before it measures.

Almost all of the job is work of a few kinds: the small model's forward + backward of a micro-batch
(`training_tflops`, the strategy's splits and its sharded optimizer run little else), matmuls, and
collectives at the job's message sizes. `probe` times one unit of each on every rank at once, at the
job's shapes; `phase_seconds` counts each phase's units from the settings (sequence length, message
sizes, repetitions, group sizes, split kinds) and prices them. Rank 0 prints the sum before it measures,
and the progress bar advances by each phase's estimate as the phase ends, so the time the bar says is
left is this estimate, corrected by how fast the finished phases went.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mula.calibrate.fit import fit_curve
from mula.calibrate.loop import ACCUMULATE, ROUNDS, STEPS
from mula.calibrate.measure import (
    COLLECTIVES,
    EXTRA_BLOCKS,
    FUNCTIONAL_CALLS,
    FUNCTIONAL_NUMEL,
    FUNCTIONAL_WIDTH,
    PEAK_SIZES,
    busy_times,
    matmul_shapes,
    matmul_tflops,
    small_model_config,
    time_collective,
    training_loss,
)
from mula.calibrate.settings import DTYPES, Settings
from mula.model.config import MulaConfig

# Lightning's loop around `mula.calibrate.loop`'s tiny model: seconds per micro-batch, its Trainers'
# setup included (1.5 s for its 130 micro-batches on this repository's 2-core CPU host). The one unit
# not probed: it is Python's work, about the same on any host.
LOOP_BATCH_S = 0.012
# `strategies/calibrate/reduction.py`'s passes per repetition: a plain step and one per ZeRO stage, each
# of two micro-batches
REDUCTION_PASSES = 6


@dataclass(frozen=True)
class Probe:
    """This host's units, timed at the job's start on every rank at once (the slowest rank's)."""

    pass_s: dict[str, float]  # dtype -> seconds of the small model's forward + backward of a micro-batch
    matmul_flops: dict[str, float]  # dtype -> FLOP/s of a 512-square matmul
    alpha_s: float  # a collective's latency over the job's ranks
    beta_s_per_byte: float  # and its seconds per byte


def probe(config: MulaConfig, settings: Settings, device: torch.device) -> Probe:
    """Time the units on this rank; every rank of the job must call it (it warms up what they time)."""
    from mula.model.transformer import Mula

    small = small_model_config(config)
    torch.manual_seed(0)
    ids = torch.randint(0, small.vocab_size, (settings.micro_batch, settings.seq_len + 1), device=device)
    models = {d: Mula(small).to(device=device, dtype=getattr(torch, d)) for d in DTYPES}
    steps = {d: lambda m=m: training_loss(m, ids).backward() for d, m in models.items()}
    square = {"probe": (512, 512, 512)}
    flops = {d: matmul_tflops(square, getattr(torch, d), device, 1)["probe"] * 1e12 for d in DTYPES}
    world = list(range(torch.distributed.get_world_size()))
    curve = fit_curve(time_collective("all_reduce", [1 << 10, 1 << 22], None, world, device, 1))
    # the median of 3 passes: the first ones after the warm-up still run slow (allocations, caches)
    return Probe(busy_times(steps, device, 3), flops, curve.alpha_s, curve.beta_s_per_byte)


def phase_seconds(
    settings: Settings,
    config: MulaConfig,
    groups: dict[str, list[int]],
    splits: dict[int, list[str]],
    probe: Probe,
) -> dict[str, float]:
    """Seconds of each phase of the job, in the order it runs them: `groups` the group sizes timed per
    scope ("intra", "inter"), `splits` the split kinds timed per group size inside a node."""
    reps = settings.reps
    rounds = 1 + 3 * reps  # busy_times' warm-up, then 3 x reps interleaved repetitions
    small = small_model_config(config)
    deeper = (small.num_layers + EXTRA_BLOCKS) / small.num_layers  # the deep model's pass, in small ones
    shapes = matmul_shapes(config, settings.micro_batch * settings.seq_len)
    flops = sum(2 * m * k * n for m, k, n in shapes.values()) + sum(2 * n**3 for n in PEAK_SIZES)
    out = {}
    for d in DTYPES:
        # the matmuls (a warm-up and reps), then the small and deep models' forward (a third of a pass)
        # and forward + backward
        passes = rounds * (1 + deeper) * (1 + 1 / 3)
        out[f"compute {d}"] = (reps + 1) * flops / probe.matmul_flops[d] + passes * probe.pass_s[d]
    out["loop"] = (ROUNDS * (STEPS + 2) * (1 + ACCUMULATE) + STEPS + 2) * LOOP_BATCH_S
    for scope, sizes in groups.items():
        for g in sizes:
            for kind in COLLECTIVES:
                # per message size a warm-up and reps calls, each repetition after a barrier
                out[f"{scope} {g} {kind}"] = sum(
                    (2 * reps + 1) * probe.alpha_s + (reps + 1) * probe.beta_s_per_byte * n
                    for n in settings.sizes
                )
            if scope != "intra":
                continue
            # per repetition, a warm-up and a timed loop with and without the calls
            mm = 2 * FUNCTIONAL_WIDTH**3 / probe.matmul_flops["float32"]
            call = probe.alpha_s + probe.beta_s_per_byte * 4 * FUNCTIONAL_NUMEL
            out[f"intra {g} functional"] = 3 * reps * 2 * FUNCTIONAL_CALLS * (2 * mm + call)
            for d in DTYPES:
                # the model whole and split, a split rank's pass costing about a whole one
                for kind in splits[g]:
                    out[f"intra {g} {d} {kind}"] = rounds * 2 * probe.pass_s[d]
                out[f"intra {g} {d} reduction"] = rounds * REDUCTION_PASSES * probe.pass_s[d]
    return out


def duration(seconds: float) -> str:
    """`seconds` as a person reads it: "40 s", "3.5 min"."""
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def announcement(settings: Settings, probe: Probe, phases: dict[str, float], world: int) -> str:
    """The line rank 0 prints before it measures: the expected duration and what it follows from."""
    mib = max(settings.sizes) / (1 << 20)
    passes = ", ".join(f"{1e3 * probe.pass_s[d]:.0f} ms ({d})" for d in DTYPES)
    return (
        f"mula: calibrating {world} ranks takes about {duration(sum(phases.values()))} here (estimated from "
        f"what it times: the small model's forward + backward of {settings.micro_batch} x {settings.seq_len} "
        f"tokens at {passes}, {1 + 3 * settings.reps} rounds each, collectives at {len(settings.sizes)} sizes "
        f"up to {mib:g} MiB)."
    )
