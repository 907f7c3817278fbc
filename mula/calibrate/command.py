"""`mula calibrate`: the job that measures a machine and writes its machine file (see the package doc)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

from mula.calibrate.settings import Settings

BACKENDS = ("auto", "gloo", "nccl", "xccl")
DEFAULT_SEQ_LEN = 2048  # tokens per sequence timed when the model allows as many
# --quick's: the tiny recipes' sequence, a quarter of the tiny models' positions; each pass of the small
# model, nearly all of the job's time, costs a third of one at 1024 tokens, and splits by every group
# size up to 256
QUICK_SEQ_LEN = 256


def calibrate(
    output: str,
    devices: int | None = None,
    name: str | None = None,
    model: str = "mula-tiny-moe",
    overrides: dict[str, Any] | None = None,
    seq_len: int | None = None,
    micro_batch: int = 1,
    backend: str = "auto",
    quick: bool = False,
    peak_bf16_tflops: float | None = None,
    memory_per_tile_gb: float | None = None,
    progress: bool = True,
    strategy: str = "strategies.XPUMoEStrategy",
) -> None:
    """Measure this machine and write a machine file for `mula plan --machine FILE`.

    Times matmuls at the model's shapes (fp32 and bf16), elementwise traffic, and for every collective
    Mula issues (all-to-all with uneven splits, reduce-scatter, all-gather, all-reduce, pipeline
    send/recv) latency and bandwidth over message sizes, per group size, inside a node and across nodes.
    Launch it like `mula fit` (torchrun, srun or mpiexec: one rank per device), or locally with
    `--devices N`. It prints how long it expects to take (from what it will time, priced by a probe of
    this host) before it measures, then shows its progress. mula-tiny-moe on a 2-core CPU host: about 2
    minutes, `--quick true` about one (more while other work shares the cores).

    Args:
        output: The machine file to write (.yaml), e.g. recipes/machines/mycluster.yaml.
        devices: Start this many local ranks (without a launcher); at least 2.
        name: The machine's name in the file (default: the output file's stem).
        model: The preset whose matmul shapes are timed (the model you will train).
        overrides: MulaConfig fields changed from the preset (as a recipe's `model.overrides`).
        seq_len: Tokens per sequence of those shapes (default: 2048, or the model's
            max_position_embeddings when it is smaller; 256 with --quick).
        micro_batch: Sequences per micro-batch of those shapes.
        backend: auto (nccl on CUDA, xccl on XPU, else gloo), gloo, nccl or xccl.
        quick: A calibration to try the planner with, sized by what its fits need (mula-tiny-moe: under
            2 minutes on a 2-core CPU host): message sizes 1 KiB to 4 MiB by factors of 4 (latency- to
            bandwidth-bound on a node: the two parameters of each curve, and five points more for its
            error band), 3 timed repetitions of each (the fewest whose median one disturbed repetition
            cannot move; 9, in turns, of the rates that are differences of two timings) and 256-token
            sequences unless --seq_len is given (the small model's passes, nearly all of the job's time,
            cost a third of theirs at 1024 tokens; the rates are a short sequence's: calibrate in full
            to plan a real run).
        peak_bf16_tflops: The device's published bf16 peak (default: the fastest bf16 matmul measured).
        memory_per_tile_gb: Device memory, GB (default: what the device reports; on CPU the host's memory
            divided by the ranks on the node).
        progress: Show a progress bar on rank 0, with the time it expects is left.
        strategy: The strategy whose tensor-, context- and expert-parallel splits and sharded optimizer are
            timed, as a recipe's trainer.strategy names its class.
    """
    from mula.calibrate.strategy import strategy_calibration
    from mula.data.ranks import launcher_environment
    from mula.model.config import MulaConfig

    # Bad input: one sentence before anything is measured or started.
    path = Path(output)
    if path.suffix not in (".yaml", ".yml"):
        raise ValueError(f"output must be a .yaml file, got {output!r}.")
    parent = path.resolve().parent
    if (
        not parent.is_dir()
        or not os.access(parent, os.W_OK)
        or (path.exists() and not os.access(path, os.W_OK))
    ):
        raise ValueError(f"cannot write {output}: {parent} is not a writable directory.")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}.")
    config = MulaConfig.from_name(model, **(overrides or {}))  # an unknown preset or field is refused here
    positions = config.max_position_embeddings
    if seq_len is None:
        seq_len = min(QUICK_SEQ_LEN if quick else DEFAULT_SEQ_LEN, positions)
    elif not 0 < seq_len <= positions:
        raise ValueError(
            f"--seq_len {seq_len} does not fit {model}, whose max_position_embeddings is {positions}; "
            f"give a sequence length from 1 to {positions}."
        )
    env = launcher_environment()
    if env is not None and devices is not None:
        raise ValueError(
            "--devices starts local ranks; under a launcher (torchrun, srun, mpiexec) leave it out."
        )
    world = env.world_size() if env is not None else (devices or 1)
    if world < 2:
        raise ValueError(
            f"calibrating collectives needs at least 2 ranks, got {world}; launch one rank per device with "
            "torchrun, srun or mpiexec, or pass --devices N (N >= 2) to start local ranks."
        )
    settings = Settings(
        output=str(path), name=name or path.stem, model=model, overrides=dict(overrides or {}), seq_len=seq_len, micro_batch=micro_batch,
        backend=backend, quick=quick, peak_bf16_tflops=peak_bf16_tflops, memory_per_tile_gb=memory_per_tile_gb,
        progress=progress, command=" ".join(["mula", *sys.argv[1:]]) if sys.argv[1:] else "mula calibrate",
    )  # fmt: skip
    timings = strategy_calibration(strategy)
    if env is not None:
        os.environ.setdefault("MASTER_ADDR", str(env.main_address))
        os.environ.setdefault("MASTER_PORT", str(env.main_port))
        from mula.calibrate.job import run_rank

        run_rank(env.global_rank(), world, settings, timings, env.local_rank())
        return
    import torch.multiprocessing as mp

    from mula.calibrate.job import run_rank

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    # the ranks take a while to import torch and probe the host: say something at once
    print(f"mula: starting {world} local ranks; they say how long they take once they are up", flush=True)
    mp.spawn(run_rank, args=(world, settings, timings), nprocs=world, join=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
