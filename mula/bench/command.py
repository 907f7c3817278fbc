"""`mula bench -c RECIPE [-c MORE] [--steps N] [--warmup W] [--layers K] [--format json]`.

The recipe's model, precision and parallel layout on the devices at hand (one device, or several under
torchrun / srun / mpiexec, or `--trainer.devices=N`, as `mula fit`), trained for real optimizer steps on
random tokens in the recipe's batch shapes (`mula.data.synthetic.SyntheticTokens`: no data to prepare),
with the recipe's loggers, callbacks and checkpoints left out. Rank 0 prints one table (or JSON): tokens/s
per device, step time median [min-max], model TFLOP/s per device and MFU against the device's published
bf16 peak (the machine file's `peak_bf16_tflops`: `--machine`, else the one named after the device), the
share of the step in the MoE layers, the host syncs per step (`mula.host_sync`: the times a step makes the
host wait for the device, counted on steady-state steps after the timed ones, logging steps excluded), and
memory per rank against `mula plan`'s prediction for the same layout (`mula.bench.probe` says how each
is measured), and the bytes each rank's collectives send and receive per step by kind of collective
beside the plan's for the same layout (`mula.bench.collectives`, counted on steady-state steps after the
host-sync ones, logging steps excluded; `mula.plan.collective_kinds.planned_collectives`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch
from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

from mula.bench.collectives import CollectiveSteps, collective_result
from mula.bench.probe import BenchProbe, HostSyncSteps, steady_steps
from mula.bench.report import format_text
from mula.commands.lightning_cli import MulaCLI, check_expert_backend, strategy_class_path
from mula.training.devices import device_name
from mula.training.module import check_master_weights

FORMATS = ("text", "json")
HOST_SYNC_STEPS = 2  # steady-state steps whose host syncs are counted (after the timed ones)
COLLECTIVE_STEPS = 2  # steady-state steps whose collectives are counted (after the host-sync ones)
LIGHTNING_LOG_EVERY_N_STEPS = 50  # the Trainer's default `log_every_n_steps`


class BenchCLI(MulaCLI):
    """The parser of `mula bench`: `mula fit`'s trainer/model/data options plus the benchmark's."""

    def __init__(self, args: list[str]) -> None:
        super().__init__(
            args=list(args),
            run=False,
            parser_kwargs={"prog": "mula bench"},
            load_from_checkpoint_support=False,
        )

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--steps", type=int, default=10, help="Optimizer steps timed.")
        parser.add_argument(
            "--warmup",
            type=int,
            default=3,
            help="Optimizer steps run first, not timed (compilation, caches).",
        )
        parser.add_argument(
            "--layers",
            type=int | None,
            default=None,
            help="Blocks of the model (model.overrides.num_layers): a deep model's shape on fewer devices.",
        )
        parser.add_argument("--format", type=str, default="text", help="text (a table) or json.")
        parser.add_argument(
            "--machine",
            type=str | None,
            default=None,
            help="Machine file whose peak_bf16_tflops MFU is against (name or path; default: the one named "
            "after the device, none on CPU).",
        )

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse, then refuse a benchmark option out of range before anything else happens."""
        from mula.plan.machines import load_machine

        super().parse_arguments(parser, args)
        config = self.config
        check_bench_options(config.steps, config.warmup, config.layers, config.format)
        if config.machine is not None:
            load_machine(config.machine)  # an unknown machine

    @override
    def before_instantiate_classes(self) -> None:
        """Drop the recipe's loggers, callbacks and checkpoints; set the steps and the depth."""
        config = self.config
        trainer = config.trainer
        strategy_class_path(trainer)
        # + the memory step, + the steps whose host syncs are counted (the memory step may be one)
        log_every = trainer.log_every_n_steps
        self.log_every_n_steps = LIGHTNING_LOG_EVERY_N_STEPS if log_every is None else int(log_every)
        first = config.warmup + config.steps + 1
        self.sync_steps = steady_steps(first, HOST_SYNC_STEPS, self.log_every_n_steps)
        # after the host-sync steps (the two meters' dispatch modes never share a window), logging steps
        # left out as there: they add Lightning's loss sums and its SIGTERM agreement
        after = max([first, *self.sync_steps]) + 1
        self.collective_steps = steady_steps(after, COLLECTIVE_STEPS, self.log_every_n_steps)
        trainer.max_steps = max([first, *self.sync_steps, *self.collective_steps])
        trainer.max_epochs = None
        trainer.logger = False
        trainer.callbacks = None
        trainer.enable_checkpointing = False
        trainer.enable_progress_bar = False
        trainer.enable_model_summary = False
        trainer.limit_val_batches = 0
        trainer.num_sanity_val_steps = 0
        trainer.val_check_interval = None
        trainer.default_root_dir = tempfile.mkdtemp(prefix="mula-bench-")
        if config.layers is not None:
            config.model.overrides = {**(config.model.overrides or {}), "num_layers": config.layers}

    def run(self) -> dict[str, Any]:
        """Train on random tokens, then print and return the result (rank 0 prints)."""
        from mula.data.synthetic import SyntheticTokens
        from mula.plan.command import layout_summary
        from mula.plan.memory import plan_memory
        from mula.plan.settings import plan_inputs

        config, trainer, module = self.config, self.trainer, self.model
        data = config.data
        sections = {
            k: config[k].as_dict() if config.get(k) is not None else {} for k in ("trainer", "model", "data")
        }
        inputs = plan_inputs(**sections, world_size=trainer.world_size)  # refuses a layout that cannot run
        check_expert_backend(module.config, trainer)
        check_master_weights(str(trainer.precision), trainer.strategy)
        tokens = SyntheticTokens(data.seq_len, data.global_batch_size, data.micro_batch_size, data.seed)
        probe = BenchProbe(config.warmup, config.steps, moe_timing=not module.compile_settings)
        trainer.callbacks.append(probe)
        # not for compiled models: a dispatch mode around their regions would change what is compiled
        syncs = HostSyncSteps(self.sync_steps if not module.compile_settings else ())
        trainer.callbacks.append(syncs)
        collectives = CollectiveSteps(self.collective_steps if not module.compile_settings else ())
        trainer.callbacks.append(collectives)  # (after `syncs`: its window closes before this one opens)
        # the process group the strategy starts is the benchmark's: gone when it returns, as it would be
        # after `mula fit`'s process, so a caller in the same process (a test, a script) finds none
        started_group = not torch.distributed.is_initialized()
        try:
            trainer.fit(module, datamodule=tokens)
            result = self._result(
                probe, inputs, plan_memory(inputs.config, inputs.layout), layout_summary(inputs.layout)
            )
            result.update(self._host_syncs(syncs))
            result.update(collective_result(trainer, collectives, inputs, self.collective_steps))
        finally:
            if started_group and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        if trainer.is_global_zero:
            print(json.dumps(result, indent=2) if config.format == "json" else format_text(result))
        return result

    def _result(self, probe: BenchProbe, inputs: Any, plan: Any, layout: dict[str, Any]) -> dict[str, Any]:
        """Rank 0's timing, every rank's memory (the largest of each), the rates and the plan."""
        from mula.plan.machines import load_machine, machine_for_device

        trainer, config = self.trainer, inputs.config
        measured = probe.summary()
        per_rank = trainer.strategy.all_gather(
            torch.tensor([measured["memory"].get(k, -1) for k in MEMORY_KEYS], dtype=torch.float64)
        )
        per_rank = per_rank.reshape(-1, len(MEMORY_KEYS))
        # the plan's numbers are its fullest pipeline stage's: compare that stage's ranks (the largest)
        stage = [
            r for r in range(per_rank.shape[0]) if inputs.layout.parallel.coordinates(r).pp == plan.stage
        ]
        per_rank = per_rank[stage]
        memory = {k: int(per_rank[:, i].max()) for i, k in enumerate(MEMORY_KEYS) if per_rank[0, i] >= 0}
        device = trainer.strategy.root_device
        name = device_name(device)
        machine_name = self.config.machine or machine_for_device(name)
        peak = load_machine(machine_name).peak_bf16_tflops if machine_name else None
        step = measured["step_time_s"]["median"]
        tokens_per_step = inputs.global_batch * inputs.layout.seq_len
        per_device = tokens_per_step / step / trainer.world_size
        tflops = per_device * config.flops_per_token(inputs.layout.seq_len) / 1e12
        moe = measured["moe_seconds"]
        return {
            "model": config.name,
            "params": config.num_params(),
            "active_params": config.num_active_params(),
            "layout": layout,
            "world_size": trainer.world_size,
            "device": name,
            "precision": str(trainer.precision),
            "compiled": bool(self.model.compile_settings),
            "warmup": self.config.warmup,
            **measured,
            "tokens_per_step": tokens_per_step,
            "tokens_per_s_per_device": per_device,
            "tflops_per_device": tflops,
            "machine": machine_name,
            "peak_bf16_tflops": peak,
            "mfu": tflops / peak if peak else None,
            "moe_share": moe / sum(measured["step_times_s"]) if moe is not None else None,
            "memory": memory,
            "planned_stage": plan.stage,
            "planned": {
                "params": plan.param_tensor_bytes,
                "grads": plan.grads,
                "optimizer": plan.optimizer,
                "activations": plan.activations,
                "total": plan.total,
            },
            "command": " ".join(["mula", *sys.argv[1:]]) if sys.argv[1:] else "mula bench",
        }

    def _host_syncs(self, syncs: HostSyncSteps) -> dict[str, Any]:
        """`host_syncs_per_step`: the largest over the ranks of a rank's mean over its counted steps (None
        when no step was counted); `host_syncs`: the counted steps, each rank's mean, and rank 0's (this
        rank's) mean count per op, per `to_host` reason and per excluded mark."""
        per_step = syncs.per_step()
        per_rank = self.trainer.strategy.all_gather(
            torch.tensor([-1.0 if per_step is None else per_step], dtype=torch.float64)
        )
        per_rank = [float(v) for v in per_rank.reshape(-1)]
        counted = per_step is not None and min(per_rank) >= 0
        return {
            "host_syncs_per_step": max(per_rank) if counted else None,
            "host_syncs": {
                "steps": sorted(syncs.counts),
                "per_rank": per_rank if counted else None,
                **syncs.breakdown(),
                "logging_steps_excluded": True,
                "log_every_n_steps": self.log_every_n_steps,
                "compiled": bool(self.model.compile_settings),
            },
        }


MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "peak_allocated")


def check_bench_options(steps: int, warmup: int, layers: int | None, format: str) -> None:
    """One sentence for each option out of range, before anything is built."""
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}.")
    if warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {warmup}.")
    if layers is not None and layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}.")
    if format not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {format!r}.")


def bench(args: list[str]) -> dict[str, Any]:
    """`mula bench ARGS`."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return BenchCLI(args).run()
