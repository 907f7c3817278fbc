"""Router balancing on 4 gloo processes against one process over the same global batch (fp32).

* aux_loss_scope="global": the loss and every gradient of 4 data-parallel ranks (one micro-batch
  each) equal those of one process running the whole global batch, also with expert parallelism
  (E=2: the loss and the dense gradients); the micro-batch scope does not.
* router bias balancing under `XPUMoEStrategy` (W=4, E=2): the training equals the single-process
  run's by the suite's equality rule (tests/equality.py), and after every step it compares the bias
  is the same on all ranks and equals the single-process run's exactly (the same global counts, the
  same sign updates); a checkpoint of it resumes at (W=2, E=1) with the bias the uninterrupted run has.
"""

from __future__ import annotations

import itertools
import os
import tempfile

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import cpu_trainer, lightning_env, run_distributed
from equality import ADAMW_EPS, RoutingRecord, assert_compared_through, assert_same_training, seeded
from test_strategy import MICROS_PER_STEP, OVERRIDES, _StepBatches, _StepLosses

from mula import Mula, MulaConfig
from mula.model.moe import is_expert_param, iter_moe_layers
from mula.training.module import MulaLightningModule
from strategies import XPUMoEStrategy
from strategies.experts.expert_parallel import apply_expert_parallel
from strategies.topology import build_topology

WORLD, MICRO, SEQ = 4, 2, 16
CONFIG = MulaConfig.from_name("mula-tiny-moe", **OVERRIDES, aux_loss_scope="global", router_aux_loss_coef=0.5)


def _global_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(seeded(7))
    return torch.randint(0, CONFIG.vocab_size, (WORLD * MICRO, SEQ + 1), generator=g)


def _loss_and_grads(config: MulaConfig, batch: torch.Tensor, world: int, ep_size: int = 1) -> dict:
    """Loss and gradients of `batch` as data parallelism computes them: each rank's mean, averaged.
    With expert parallelism (`ep_size` > 1) only the dense (replicated) parameters' gradients."""
    torch.manual_seed(seeded(0))
    model = Mula(config)
    if ep_size > 1:
        apply_expert_parallel(model, build_topology(ep_size))
    out = model(batch[:, :-1])
    ce = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
    loss = ce + config.router_aux_loss_coef * out.aux_loss + config.router_z_loss_coef * out.z_loss
    (loss / world).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if ep_size == 1 or not is_expert_param(n)}
    values = torch.stack([loss.detach(), out.aux_loss.detach()]) / world
    if world > 1:
        for g in [values, *grads.values()]:
            dist.all_reduce(g)
    return {"loss": values[0], "aux": values[1], "grads": grads}


def _rank_losses(rank: int, world: int) -> dict:
    micro = _global_batch().split(MICRO)[rank]
    local = MulaConfig(**{**CONFIG.__dict__, "aux_loss_scope": "micro_batch"})
    return {
        "global": _loss_and_grads(CONFIG, micro, world),
        "global_ep2": _loss_and_grads(CONFIG, micro, world, ep_size=2),
        "micro_batch": _loss_and_grads(local, micro, world),
    }


def test_global_scope_loss_and_gradients_equal_one_process_over_the_global_batch() -> None:
    ref = _loss_and_grads(CONFIG, _global_batch(), 1)
    result = run_distributed(_rank_losses, WORLD)
    for rank, key in itertools.product(range(WORLD), ("global", "global_ep2")):
        got = result[rank][key]
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got["aux"], ref["aux"], rtol=1e-6, atol=1e-6)
        assert len(got["grads"]) >= len(ref["grads"]) // 2
        for name, grad in got["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-6, atol=1e-6, msg=f"{key} {name}")
    # the per-micro-batch f is another loss: the comparison above can fail
    assert abs(float(result[0]["micro_batch"]["aux"]) - float(ref["aux"])) > 1e-4


class _Biases(L.Callback):
    """Every router's bias [layers, E] after each optimizer step."""

    def __init__(self) -> None:
        self.biases: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            routers = [layer.router for _, layer in iter_moe_layers(pl_module)]
            self.biases.append(torch.stack([r.bias.detach().clone() for r in routers]))


def _fit(world: int, strategy, max_steps: int, ckpt_path=None, save_dir=None) -> dict:
    """Train; return what `equality.assert_same_training` compares (the one-process reference's near
    ties included) and the router biases after each step."""
    torch.manual_seed(seeded(0))
    module = MulaLightningModule(
        "mula-tiny-moe",
        overrides={**OVERRIDES, "router_bias_update_rate": 0.01},
        lr=1e-2,
        min_lr=1e-3,
        warmup_steps=1,
        decay_steps=10,
        eps=ADAMW_EPS,
    )
    loader = _StepBatches(int(os.environ.get("LOCAL_RANK", 0)), world, max_steps)
    routing = RoutingRecord(near_ties=strategy is None)  # the one-process reference's near ties
    losses = _StepLosses(loader, routing)  # it also counts the loader's consumed batches
    record = _Biases()
    trainer = cpu_trainer(
        world,
        strategy,
        max_steps=max_steps,
        accumulate_grad_batches=MICROS_PER_STEP // world,
        callbacks=[losses, routing, record],
        save_dir=save_dir,
    )
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return {**losses.record(), "biases": record.biases}


def _run(rank: int, world: int, ep_size: int, max_steps: int, ckpt: str | None, save_dir: str | None):
    lightning_env(rank, world)
    return _fit(world, XPUMoEStrategy(expert_parallel_size=ep_size), max_steps, ckpt, save_dir)


def _assert_biases(run: dict, ref: dict, first_step: int = 0, what: str = "") -> None:
    """The equality rule for `run` (the reference's steps first_step, first_step + 1, ...), and its
    router bias after every step equal to the reference's, bit for bit: the bias after a step follows
    from the global counts of that step and the steps before."""
    assert_same_training(run, ref, first_step=first_step, what=what)
    steps = len(run["losses"])
    for step, (got, want) in enumerate(zip(run["biases"][:steps], ref["biases"][first_step:])):
        assert torch.equal(got, want), f"{what}: router bias after step {first_step + step + 1}"


def test_router_bias_is_the_same_on_every_rank_and_survives_resharding() -> None:
    reference = _fit(1, None, max_steps=4)
    assert reference["biases"][-1].abs().sum() > 0  # the bias moved
    with tempfile.TemporaryDirectory() as root:
        w4 = run_distributed(_run, 4, 2, 2, None, root)
        # a resumed run continues the reference: the run that saved it followed it there (equality.py)
        for rank, run in enumerate(w4):
            _assert_biases(run, reference, what=f"w4e2 rank {rank}")
            assert_compared_through(run, reference, 2, what=f"w4e2 rank {rank} saving")
        resumed = run_distributed(_run, 2, 1, 4, f"{root}/epoch=0-step=2.ckpt", None)
        for rank, run in enumerate(resumed):
            assert len(run["biases"]) == 2
            _assert_biases(run, reference, first_step=2, what=f"w4e2 -> w2e1 rank {rank}")
