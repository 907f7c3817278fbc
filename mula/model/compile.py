"""`model.compile`: regional `torch.compile` of a Mula model's blocks, its cache and its counters.

Each transformer block is compiled in place (`nn.Module.compile`, so no `_orig_mod.` prefix ever
reaches a state dict), after the strategy has laid the model out (experts sliced, tensor-parallel
hooks, pipeline stages) and with activation checkpointing already set: the compiled regions are the
largest pieces of a block that no checkpoint boundary cuts (`compile_blocks`). The MoE layer's routed
experts are left out of the graphs (`mula.model.moe.MoELayer.routed`, `torch.compiler.disable`): one graph
break per MoE block, none per dense block, and no recompilation when routing changes. docs/compile.md
explains the choices; `CompileWatch` counts compilations, recompilations, graph breaks and compile
time, and logs them once after the warm-up steps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from mula import torch_compat

log = logging.getLogger(__name__)

__all__ = [
    "CompileSettings",
    "CompileWatch",
    "compile_blocks",
    "parse_compile",
    "rank_cache_dir",
    "use_cache_dir",
]

# the `torch.compile` arguments a recipe may set (the rest are Mula's own)
_TORCH_KEYS = ("mode", "dynamic", "fullgraph", "backend", "options")


@dataclass(frozen=True)
class CompileSettings:
    """What `model.compile` asks for (`parse_compile`).

    mode, dynamic, fullgraph, backend, options: `torch.compile`'s arguments for every region.
    cache_dir: Inductor's cache (FX graphs, AOTAutograd, kernels); default `<run directory>/compile_cache`,
        so a resumed run finds the graphs its first start compiled.
    warmup_steps: optimizer steps after which the counters are logged once; any compilation after
        them is a recompilation that continues, and is warned about.
    """

    mode: str | None = None
    dynamic: bool | None = None
    fullgraph: bool = False
    backend: str = "inductor"
    options: dict[str, Any] | None = None
    cache_dir: str | None = None
    warmup_steps: int = 3

    def torch_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `torch.compile`."""
        return {key: getattr(self, key) for key in _TORCH_KEYS}


def parse_compile(value: bool | dict[str, Any] | None) -> CompileSettings | None:
    """`model.compile` (false/None, true, or a mapping of `CompileSettings` fields) -> settings or None.

    Refuses an unknown key or a bad value with one sentence, before any work.
    """
    if value is None or value is False:
        return None
    if value is True:
        return CompileSettings()
    if not isinstance(value, dict):
        raise ValueError(f"model.compile must be false, true or a mapping, got {value!r}.")
    known = {f.name for f in fields(CompileSettings)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"model.compile: unknown key(s) {unknown}; known: {sorted(known)}.")
    if value.get("mode") not in (
        None,
        "default",
        "reduce-overhead",
        "max-autotune",
        "max-autotune-no-cudagraphs",
    ):
        raise ValueError(f"model.compile.mode must be one of torch.compile's modes, got {value['mode']!r}.")
    if value.get("mode") is not None and value.get("options") is not None:
        raise ValueError("model.compile takes mode or options, not both (torch.compile refuses the pair).")
    warmup = value.get("warmup_steps", 3)
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
        raise ValueError(f"model.compile.warmup_steps must be an integer >= 1, got {warmup!r}.")
    return CompileSettings(**value)


def use_cache_dir(path: str) -> None:
    """Put Inductor's caches (FX graph, AOTAutograd, kernels) under `path`, for this process.

    Inductor reads TORCHINDUCTOR_CACHE_DIR each time it looks a cache up, so setting it before the first
    compilation moves every cache there; the FX graph and AOTAutograd caches are switched on explicitly
    (a later torch changing their defaults would otherwise make a resumed run compile everything again).
    """
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(path)
    torch_compat.enable_compile_caches()


def rank_cache_dir(path: str, rank: int, tp_size: int, cp_size: int) -> str:
    """The Inductor cache directory of global rank `rank`: `path` itself, shared by all ranks, unless the
    compiled blocks hold collectives over the rank's own groups (tensor parallelism, T > 1; Ulysses
    context parallelism, C > 1): then `path/rank<rank>`. A compiled graph names the process group of
    each collective by torch's per-process counter (the TP group of ranks 0-1 is "11" where that of
    ranks 2-3 is "12"), and Inductor's cache keys leave the name out: a rank loading a graph another
    rank wrote stops with "Could not resolve the process group registered under the name 12" (seen
    under torch 2.13 with T = 2 x DP = 2, the second run in the same cache). Each rank's own graphs name
    its own groups, the same in a resumed run (the groups are made in the same order)."""
    if tp_size > 1 or cp_size > 1:
        return os.path.join(path, f"rank{rank}")
    return path


def compile_regions(block: nn.Module) -> list[tuple[nn.Module, str | None]]:
    """The regions of a block to compile, as (module, attribute): attribute None compiles the module in
    place; "_forward" compiles the block's body under a whole-block checkpoint.

    torch.compile cannot trace a checkpoint whose body breaks the graph (an MoE block's routed experts
    do), so each region lies wholly inside or outside every checkpoint: the block without checkpointing;
    the body a "full" checkpoint recomputes; with selective checkpointing each part (norms, attention,
    MLP or MoE layer), the residual additions between them running eagerly.
    """
    parts = block.checkpointing
    if not parts:
        return [(block, None)]
    if "full" in parts:
        return [(block, "_forward")]
    return [(getattr(block, name), None) for name in ("attn_norm", "attn", "mlp_norm", "mlp")]


def compile_blocks(blocks: Iterable[nn.Module], settings: CompileSettings) -> int:
    """Compile every block's regions in place (`compile_regions`); returns the number of regions.

    Parameter and buffer names are unchanged (`nn.Module.compile` wraps the call, not the module).
    `fullgraph` is refused for MoE blocks (their routed experts are a graph break by design).
    Sets `torch._dynamo.config.nested_graph_breaks` for the process: the break inside the MoE layer
    then splits only the MoE layer's frame, instead of also the block's around its call (four graphs
    per MoE block instead of two, the attention and router apart).
    """
    from mula.model.moe import MoELayer

    blocks = list(blocks)
    if settings.fullgraph and any(isinstance(m, MoELayer) for b in blocks for m in b.modules()):
        raise ValueError(
            "model.compile.fullgraph cannot compile MoE blocks: their routed experts run outside the "
            "graph (docs/compile.md); leave fullgraph false."
        )
    torch_compat.allow_nested_graph_breaks()
    kwargs = settings.torch_kwargs()
    regions = 0
    for block in blocks:
        for module, attribute in compile_regions(block):
            if attribute is None:
                module.compile(**kwargs)
            else:  # a plain attribute, not a submodule: no state-dict entry
                setattr(module, attribute, torch.compile(getattr(module, attribute), **kwargs))
            regions += 1
    return regions


class CompileWatch:
    """Counts this process's dynamo compilations from `torch._dynamo.callback_handler`'s callbacks.

    A compilation whose `CompileId.frame_compile_id` is above 0 compiles a frame again: a recompilation
    (a guard failed: new shapes, a new kind of block on the same code, a changed attribute). Compile
    time is the wall time between the callbacks (forward and lazily compiled backward graphs). Graph
    breaks come from `torch._dynamo.utils.counters`, counted from `start`.
    """

    def __init__(self, warmup_steps: int = 3) -> None:
        self.warmup_steps = warmup_steps
        self.compiles = self.recompiles = 0
        self.compile_s = 0.0
        self.reasons: list[str] = []
        self._t0: float | None = None
        self._breaks0 = 0
        self._at_warmup: int | None = None  # recompiles when the warm-up ended
        self._warned = 0
        self.steps = 0  # optimizer steps seen

    def start(self) -> CompileWatch:
        """Begin counting (registers the callbacks)."""
        callback_handler = torch_compat.dynamo_callback_handler()
        self._breaks0 = torch_compat.graph_break_count()
        callback_handler.register_start_callback(self._on_start)
        callback_handler.register_end_callback(self._on_end)
        return self

    def stop(self) -> None:
        """Stop counting (removes the callbacks)."""
        callback_handler = torch_compat.dynamo_callback_handler()
        for remove, fn in (
            (callback_handler.remove_start_callback, self._on_start),
            (callback_handler.remove_end_callback, self._on_end),
        ):
            try:
                remove(fn)
            except ValueError:  # already removed
                pass

    def _on_start(self, args: Any) -> None:
        self._t0 = time.perf_counter()
        if not torch_compat.triggered_by_dynamo(args):
            return
        self.compiles += 1
        compile_id = torch_compat.current_compile_id()
        if compile_id is not None and (compile_id.frame_compile_id or 0) > 0:
            self.recompiles += 1

    def _on_end(self, args: Any) -> None:
        if self._t0 is not None:
            self.compile_s += time.perf_counter() - self._t0
            self._t0 = None

    @property
    def graph_breaks(self) -> int:
        """Graph breaks dynamo met since `start` (each traced code once: identical blocks share it)."""
        return torch_compat.graph_break_count() - self._breaks0

    def metrics(self) -> dict[str, float]:
        """compile/compiles, compile/recompiles, compile/graph_breaks, compile/time_s so far."""
        return {
            "compile/compiles": float(self.compiles),
            "compile/recompiles": float(self.recompiles),
            "compile/graph_breaks": float(self.graph_breaks),
            "compile/time_s": self.compile_s,
        }

    def after_step(self) -> dict[str, float] | None:
        """Call after each optimizer step of this process (a resumed run counts its warm-up afresh): the
        metrics to log once at the end of the warm-up (None otherwise); a warning each time
        recompilation continues after it."""
        self.steps += 1
        if self.steps == self.warmup_steps:
            self._at_warmup = self._warned = self.recompiles
            return self.metrics()
        if self._at_warmup is not None and self.recompiles > self._warned:
            log.warning(
                "torch.compile recompiled %d time(s) after the %d warm-up steps (%d in all): a new shape "
                "or mode (a validation's first no-grad forward compiles again once); if it continues, every step pays "
                "a compile (TORCH_LOGS=recompiles names the failing guard).",
                self.recompiles - self._at_warmup,
                self.warmup_steps,
                self.recompiles,
            )
            self._warned = self.recompiles
        return None
