"""The suite's equality rule (tests/equality.py) tells a near-tied top-k flip from a routing bug.

One-process runs of test_strategy.py's tiny MoE against the same reference: the same run again is
compared whole; a run in which one near-tied choice of step 3 goes to its runner-up (what rounding does
to a near tie in a parallel run) fails the rule as a flip, with its reason (the steps after it and the
weights could not be compared); a run in which many clear choices of step 3 go elsewhere (what a routing
bug does) fails the rule as a bug. Near ties within the rule's margin are rare in so
small a run, so every run (the reference too) makes some: before step 3 each router's expert 1 gets
expert 0's weights (`_TieExperts`), and a token ranking those two k-th and (k+1)-th then has a gap of
exactly 0 at step 3. And the rule never passes on nothing: hand-made records of fewer than
`MIN_COMPARED_STEPS` steps fail it, two equal steps pass.
"""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from dist_helpers import cpu_trainer
from equality import FLIP_MARGIN, MIN_COMPARED_STEPS, RoutingRecord, assert_same_training
from test_strategy import MICROS_PER_STEP, STEPS, _module, _StepBatches, _StepLosses

from mula.model.moe.router import Router, RouterOutput

TIED = 2  # the 0-based step whose forwards have the exact ties (step 3)


class _Reroute:
    """In step 3's training forwards (`once`: only the first with a match), send each token matching `pick`
    from its k-th expert to its (k+1)-th instead. `pick(gap, runner_up)` chooses tokens from the
    gaps between their k-th and (k+1)-th choices and the (k+1)-th experts' indices."""

    def __init__(self, pick, once: bool, step: int = TIED) -> None:
        self.pick, self.once, self.step = pick, once, step
        self.moved = 0

    def install(self, trainer, model) -> None:
        for module in model.modules():
            if isinstance(module, Router):
                module.register_forward_hook(self._hook(trainer))

    def _hook(self, trainer):
        def reroute(router: Router, args, out: RouterOutput):
            if (self.once and self.moved) or trainer.global_step != self.step or not torch.is_grad_enabled():
                return None
            assert router.scoring == "softmax" and not router.norm_topk_prob and router.scaling_factor == 1.0
            top = router.choice(router.scores(out.logits)).topk(router.top_k + 1, dim=-1)
            tokens = self.pick(top.values[:, -2] - top.values[:, -1], top.indices[:, -1]).nonzero().flatten()
            if tokens.numel() == 0:
                return None
            idx = out.topk_idx.clone()
            for t in tokens.tolist():
                idx[t][idx[t] == top.indices[t, -2]] = top.indices[t, -1]
            self.moved += tokens.numel()
            return RouterOutput(out.logits, out.probs, idx, out.probs.gather(1, idx))

        return reroute


class _TieExperts(L.Callback):
    """Before step 3's first micro-batch, every router's expert 1 gets expert 0's weights (in every run
    alike), and `reroute`'s hooks are installed at the start."""

    def __init__(self, reroute: _Reroute | None) -> None:
        self.reroute = reroute

    def on_train_start(self, trainer, pl_module) -> None:
        if self.reroute is not None:
            self.reroute.install(trainer, pl_module.model)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == TIED and batch_idx == TIED * MICROS_PER_STEP:
            with torch.no_grad():
                for module in pl_module.model.modules():
                    if isinstance(module, Router):
                        module.weight[1].copy_(module.weight[0])


def _run(reroute: _Reroute | None, near_ties: bool = False) -> dict:
    loader = _StepBatches(0, 1, STEPS)
    routing = RoutingRecord(near_ties=near_ties)
    losses = _StepLosses(loader, routing)
    trainer = cpu_trainer(
        1, None, max_steps=STEPS, accumulate_grad_batches=MICROS_PER_STEP,
        callbacks=[losses, routing, _TieExperts(reroute)], gradient_clip_val=0.5,
    )  # fmt: skip
    trainer.fit(_module(), loader)
    return losses.record()


@pytest.fixture(scope="module")
def reference() -> dict:
    return _run(None, near_ties=True)


def test_the_same_run_is_compared_whole(reference) -> None:
    assert reference["near_ties"] and all(t.shape == (2, 8) for t in reference["near_ties"])
    assert reference["near_ties"][TIED][:, :2].all()  # the tied experts' near ties at step 3, in both layers
    assert_same_training(_run(None), reference, what="again")


def test_a_near_tied_flip_fails_with_its_reason(reference) -> None:
    """A flip ends what can be compared (the steps after it, the weights after the last step), so it
    fails the test as a flip -- not as a bug, and not with a warning that lets it pass."""
    flip = _Reroute(lambda gap, runner_up: _first(gap < FLIP_MARGIN), once=True)
    run = _run(flip)
    assert flip.moved == 1
    assert run["counts"][TIED].ne(reference["counts"][TIED]).any()  # the flip shows in the counts
    assert (
        run["losses"][:TIED] == reference["losses"][:TIED]
        and run["losses"][TIED:] != reference["losses"][TIED:]
    )
    with pytest.raises(AssertionError, match="near-tied top-k choice flipped at step 3") as failure:
        assert_same_training(run, reference, what="near tie")
    assert "not a top-k flip" not in str(failure.value)


def test_a_routing_bug_is_not_excused(reference) -> None:
    # clear choices (100 x the margin) moved to one expert, as a bug would, not both ways as near ties do
    bug = _Reroute(_clear_choices_to_one_expert, once=False)
    run = _run(bug)
    assert bug.moved > 1
    with pytest.raises(AssertionError, match="not a top-k flip"):
        assert_same_training(run, reference, what="bug")


def _record(steps: int) -> dict:
    """A hand-made record of `steps` steps, shaped as `_run`'s (2 MoE layers, 8 experts): losses, norms,
    the same expert counts every step and no near ties."""
    return {
        "losses": [2.0 - 0.1 * s for s in range(steps)],
        "norms": [1.0 + 0.1 * s for s in range(steps)],
        "counts": [torch.full((2, 8), 4) for _ in range(steps)],
        "near_ties": [torch.zeros(2, 8, dtype=torch.long) for _ in range(steps)],
    }


@pytest.mark.parametrize("steps", [0, 1])
def test_the_rule_never_passes_on_fewer_than_two_steps(steps: int) -> None:
    """Zero steps compare nothing, and one step shows no optimizer update applied: either fails."""
    run = _record(steps)
    with pytest.raises(
        AssertionError, match=rf"only {steps} step\(s\) compared.*at least {MIN_COMPARED_STEPS}"
    ):
        assert_same_training(run, _record(4), what="short")


def test_two_equal_steps_pass_the_rule() -> None:
    assert MIN_COMPARED_STEPS == 2
    assert_same_training(_record(2), _record(2), what="two steps")


def _clear_choices_to_one_expert(gap: torch.Tensor, runner_up: torch.Tensor) -> torch.Tensor:
    """The tokens choosing clearly (100 x the flip margin) whose runner-up is the most common one."""
    clear = gap > 100 * FLIP_MARGIN
    return clear & (runner_up == runner_up[clear].mode().values)


def _first(mask: torch.Tensor) -> torch.Tensor:
    """`mask` with only its first True kept."""
    out = torch.zeros_like(mask)
    hits = mask.nonzero().flatten()
    if hits.numel():
        out[hits[0]] = True
    return out
