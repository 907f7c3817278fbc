"""The training loop's fixed work: what Lightning's loop, hooks, logging and `zero_grad` cost per
optimizer step and per micro-batch beyond the model's forward and backward and the optimizer update.

A model too small to compute anything (one block of width 16, 8 tokens; of the calibrated model's kind:
an MoE block with its experts and top-k for an MoE model, whose every micro-batch also adds its expert
counts and logs its load imbalance) trains a few optimizer steps with `MulaLightningModule` under
Lightning's Trainer, with one micro-batch per step and with `ACCUMULATE`, `ROUNDS` times each in turns;
the same model's forward + backward and optimizer step, timed by hand, are taken off. Two points give
the two costs: per micro-batch (the slope) and per step (the rest).
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from typing import Any

import torch

from mula.model.config import MulaConfig

ACCUMULATE = 3  # micro-batches per step of the second run
ROUNDS = 3  # runs of each, in turns
STEPS = 8  # optimizer steps timed per run (after two warm-up steps)
_TINY = dict(
    vocab_size=64, hidden_size=16, num_layers=1, num_heads=1, intermediate_size=32, max_position_embeddings=16
)
_SEQ, _MICRO = 8, 1


def _tiny(config: MulaConfig | None) -> tuple[str, dict[str, Any]]:
    """The preset and overrides of the loop's model: tiny, of `config`'s kind (dense or MoE)."""
    if config is None or not config.is_moe:
        return "mula-tiny-dense", _TINY
    moe = dict(num_experts=config.num_experts, top_k=config.top_k, expert_intermediate_size=16)
    return "mula-tiny-moe", {**_TINY, **moe}


def _clock() -> Any:
    import lightning.pytorch as L

    class Clock(L.Callback):
        """Seconds of every optimizer step: from one step's end to the next's."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._last = time.perf_counter()
            self._step = 0

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step != self._step:
                now = time.perf_counter()
                self.times.append(now - self._last)
                self._last, self._step = now, trainer.global_step

    return Clock()


class _Batches:
    """An iterable of micro-batches (a list would be read as a list of data loaders)."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def _lightning_step_s(accumulate: int, steps: int, name: str, overrides: dict[str, Any]) -> float:
    import lightning.pytorch as L

    from mula.training.module import MulaLightningModule

    torch.manual_seed(0)
    module = MulaLightningModule(name, overrides=overrides, decay_steps=100)
    batches = [torch.randint(0, 64, (_MICRO, _SEQ + 1)) for _ in range((steps + 2) * accumulate)]
    clock = _clock()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps + 2, accumulate_grad_batches=accumulate,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[clock], use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(module, _Batches(batches))
    return statistics.median(clock.times[2:])  # past two warm-up steps


def _manual_s(steps: int, name: str, overrides: dict[str, Any]) -> tuple[float, float]:
    """(forward + backward of one micro-batch, optimizer step + zero_grad) of the same model by hand."""
    from mula.model.config import resolve_config
    from mula.model.transformer import Mula

    torch.manual_seed(0)
    model = Mula(resolve_config(name, overrides))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 64, (_MICRO, _SEQ + 1))
    fb, up = [], []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        out = model(ids[:, :-1])
        ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten())
        (ce + out.aux_loss + out.z_loss).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        fb.append(t1 - t0)
        up.append(time.perf_counter() - t1)
    return statistics.median(fb[2:]), statistics.median(up[2:])


def loop_seconds(config: MulaConfig | None = None, steps: int = STEPS) -> dict[str, float]:
    """{"step": s, "batch": s}: the loop's fixed seconds per optimizer step and per micro-batch on this
    rank for a model of `config`'s kind (each at least 0: on a loaded host the difference of two
    timings can come out negative)."""
    name, overrides = _tiny(config)
    import lightning.pytorch  # noqa: F401  (its loggers exist once it is imported)

    # Lightning's banner of devices and hints, once per Trainer, on every rank: kept quiet
    quiet = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict) if n.startswith("lightning")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's hints about workers and loggers
            # in turns, the median of each: one disturbed run (a neighbour's burst on a shared host) would
            # otherwise land whole in the per-step cost
            ones, manys = [], []
            for _ in range(ROUNDS):
                ones.append(_lightning_step_s(1, steps, name, overrides))
                manys.append(_lightning_step_s(ACCUMULATE, steps, name, overrides))
            one, many = statistics.median(ones), statistics.median(manys)
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    fb, up = _manual_s(steps, name, overrides)
    batch = max(0.0, (many - one) / (ACCUMULATE - 1) - fb)
    step = max(0.0, one - fb - batch - up)
    return {"step": step, "batch": batch}
