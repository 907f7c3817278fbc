"""The one rule by which a parallel or compiled training run equals its one-process reference (test helper).

Two correct runs that add the same numbers in another order (two ranks' partial gradient sums against
one process's, a fused kernel against eager) differ by rounding, and how they round depends on the host
(Intel and AMD CPUs round differently). Three mechanisms can turn that rounding into differences far
above it; the rule removes them by construction instead of widening allowances until one host passes:

1. **AdamW's epsilon.** The update lr * m / (sqrt(v) + eps) moves a weight by at most about 2 lr / eps
   per unit of gradient error. Summation order changes a summed gradient here by up to ~1e-9; with the
   recipes' eps of 1e-8 that is a few percent of a whole step for an element whose summed gradient is
   near zero, and which elements those are depends on the host. Every equality run trains with
   `ADAMW_EPS` = 1e-5: the same rounding then moves a weight by at most 2 * 1e-2 * 1e-9 / 1e-5 = 2e-6
   per step at the tests' lr of 1e-2, far inside `WEIGHT_ATOL` over the few steps a test takes, while a
   gradient element above ~1e-4 (nearly every one) is updated as with 1e-8.
2. **Near-tied top-k choices.** Once the weights differ by rounding, the router's scores differ by
   ~1e-7, and a token whose k-th and (k+1)-th choices are that close picks another expert in one of the
   runs; that single token then moves its two experts' weights by up to a whole step, and the change
   spreads. No tie-break or choice of inputs removes near ties from a continuous router (any decision
   rule has a boundary), and a few thousand decisions per test make one likely now and then, on some host.
   So the rule detects them: `RoutingRecord` keeps each step's global expert counts, and in the
   reference how many choices of each step, MoE layer and expert were within `FLIP_MARGIN` of a tie (the
   expert ranking's or, with group-limited routing, the groups'; `NearTies` for a plain training loop). A
   step whose counts differ from the reference's fails the test: as a bug when some expert gained or lost
   more choices than the reference had near ties involving that expert in that step (a bug moves
   choices where there was no near tie, or more than the near ties), else as a top-k flip, with the
   reason. A flip ends what can be compared -- the steps after it and the weights after the last step --
   and a comparison that compares less than the whole run proves less than it says, so it is not
   excused: the test chooses data and seeds whose choices rounding does not flip. Near ties within the
   margin are common (a few per step in the covering array's references), flips rare: a choice flips
   only where two runs' scores, ~1e-7 apart, straddle it.
3. **Muon's bf16 Newton-Schulz.** Muon casts its fp32 update to bf16 before orthogonalising it, so a
   rounding-level difference in the summed gradient moves an element across a bf16 rounding boundary
   now and then (which elements, depends on the host), a move of 2^-8 of it; Newton-Schulz then
   amplifies the matrix's near-null directions ~500x (5 quintic steps of slope 3.4), so the update
   moves by bf16 amounts (a gradient norm 2.2e-5 off one process at step 4 of a covering-array row on an
   AMX Xeon, where an AMD EPYC stayed inside 1e-5). Every equality run with Muon therefore runs
   Newton-Schulz in fp32 (`MUON_NS_DTYPE`, `model.muon_ns_dtype`): the same difference then stays at
   fp32 rounding times that amplification (measured ~1e-7 relative in the gradient norms at lr 1e-2).
   bf16 Newton-Schulz is checked where no rounding boundary decides the result: against torch's Muon on
   the same inputs (tests/test_muon.py), on exact-grid gradients (tests/test_sharded_muon.py), and by
   bf16's own rule (the bf16-true rows of tests/composition.py).

What the rule cannot remove is a test whose training amplifies rounding by itself: a one-process run
against itself with each step's micro-batches accumulated in another order must stay well within
`LOSS_RTOL` over the test's steps, or no two layouts can be compared. A test chooses its learning rate
and steps so that it does (test_deepseek_v3_dist.py: lr 1e-3, where 1e-2 drifted 7e-5 by step 6).

What is compared (`assert_same_training`): the losses and gradient norms of every step (and any other
per-step series the test records), of at least `MIN_COMPARED_STEPS` steps, within `LOSS_RTOL`; then the
weights within `WEIGHT_ATOL` (`assert_same_weights`: non-expert weights whole, expert weights as the
rank's slice of the reference's, router biases included).

`seeded(n)` moves every seed a test draws by `MULA_TEST_SEED` (default 0), so the same files can be run
at other seeds: `MULA_TEST_SEED=3 pytest tests/test_qwen3_moe_parallel.py`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import lightning.pytorch as L
import torch
from torch import Tensor

from mula.model.moe.router import Router, group_scores
from mula.training.lightning_compat import ends_optimizer_step

ADAMW_EPS = 1e-5
MUON_NS_DTYPE = "float32"  # what equality runs with Muon run Newton-Schulz in (mechanism 3)
LOSS_RTOL = 1e-5  # per-step losses and gradient norms (relative)
WEIGHT_ATOL = 1e-4  # weights after the last step (absolute)
# a reference decision this close to a tie (in score units) may flip once the weights differ by rounding:
# the scores of two runs were measured up to ~2e-7 apart after a few steps (~1e-6 with eps=1e-8)
FLIP_MARGIN = 1e-5
# the fewest steps `assert_same_training` compares: a comparison over zero steps compares nothing, and one
# over a single step proves nothing about an optimizer's update being applied across steps (the second
# step's loss and gradients are the first ones computed on updated weights): the equality rule never
# passes on nothing
MIN_COMPARED_STEPS = 2


def seeded(seed: int) -> int:
    """`seed` moved by the suite's seed knob `MULA_TEST_SEED` (0: the seeds as written)."""
    return seed + 7919 * int(os.environ.get("MULA_TEST_SEED", "0"))


def flippable_choices(router: Router, logits: Tensor) -> Tensor:
    """[E]: how many of these tokens' expert choices could move into or out of each expert when the scores
    move by rounding: for each token whose k-th and (k+1)-th experts are within `FLIP_MARGIN` of each
    other, one for each of those two experts; with group-limited routing, for each token whose last group
    kept and first group left out are that close, one for every expert of those two groups."""
    scores = router.scores(logits.float())
    choice = router.choice(scores)
    near = torch.zeros(scores.shape[-1], dtype=torch.long)
    if choice.shape[-1] > router.top_k:
        top = choice.topk(router.top_k + 1, dim=-1)
        gap = top.values[:, router.top_k - 1] - top.values[:, router.top_k]
        tied = torch.isfinite(gap) & (gap < FLIP_MARGIN)
        for column in (router.top_k - 1, router.top_k):
            near += torch.bincount(top.indices[tied, column], minlength=near.numel())
    if router.n_group > 1 and router.topk_group < router.n_group:
        before = scores.detach() if router.bias is None else scores.detach() + router.bias
        groups = group_scores(before, router.n_group).topk(router.topk_group + 1, dim=-1)
        tied = groups.values[:, -2] - groups.values[:, -1] < FLIP_MARGIN
        size = near.numel() // router.n_group
        for column in (-2, -1):
            per_group = torch.bincount(groups.indices[tied, column], minlength=router.n_group)
            near += per_group.repeat_interleave(size)
    return near


class NearTies:
    """Counts, per optimizer step, MoE layer and expert, the expert choices of a model's training forwards
    that were within `FLIP_MARGIN` of a tie (`flippable_choices`), through a forward hook on every router.

    `step()` tells the hooks which step a forward belongs to; `at(s)` gives step s's [MoE layers, E]
    counts. For a plain training loop; Lightning runs use `RoutingRecord`.
    """

    def __init__(self, model: torch.nn.Module, config: Any, step: Callable[[], int]) -> None:
        self.shape = (config.num_moe_layers, config.num_experts)
        self._ties: dict[int, Tensor] = {}
        for name, module in model.named_modules():
            if isinstance(module, Router):
                module.register_forward_hook(self._hook(step, config.moe_layer_row(int(name.split(".")[1]))))

    def _hook(self, step: Callable[[], int], row: int):
        def count(router: Router, args: Any, out: Any) -> None:
            if torch.is_grad_enabled():  # not a validation forward
                ties = self._ties.setdefault(step(), torch.zeros(self.shape, dtype=torch.long))
                ties[row] += flippable_choices(router, out.logits.detach())

        return count

    def at(self, step: int) -> Tensor:
        """[MoE layers, E] near-tied choices of `step` (0-based) by the experts they could move into or out of."""
        return self._ties.get(step, torch.zeros(self.shape, dtype=torch.long))


class RoutingRecord(L.Callback):
    """Each optimizer step's global expert counts, and in a reference run its near ties.

    `counts[s]`: step s's [MoE layers, E] tokens per expert over the whole global batch
    (`MulaLightningModule.step_expert_counts`, the same on every rank). With `near_ties=True` (a
    one-process reference), `near_ties[s]`: [MoE layers, E] the expert choices of step s that were within
    `FLIP_MARGIN` of a tie, by the experts they could move into or out of (`NearTies`). `as_dict()` is what `assert_same_training` reads.
    """

    def __init__(self, near_ties: bool = False) -> None:
        self.counts: list[Tensor] = []
        self.near_ties: list[Tensor] | None = [] if near_ties else None
        self._watch: NearTies | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.near_ties is not None and pl_module.config.is_moe:
            self._watch = NearTies(pl_module.model, pl_module.config, lambda: trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not ends_optimizer_step(trainer):
            return
        counts = getattr(pl_module, "step_expert_counts", None)
        if counts is not None:
            self.counts.append(counts.detach().cpu().clone())
        if self._watch is not None:
            self.near_ties.append(self._watch.at(trainer.global_step - 1))  # the step that just ended

    def as_dict(self) -> dict[str, Any]:
        """{"counts": [...], "near_ties": [...] or None}."""
        return {"counts": self.counts, "near_ties": self.near_ties}


class LoopRecord:
    """A plain training loop's record for `assert_same_training`, as `RoutingRecord` and a test's step
    callback give a Lightning run: per optimizer step the global loss, the gradient norm and the global
    expert counts (summed over the default process group when there is one), and for a one-process
    reference given `near_ties_of=(model, config)` its near ties (`NearTies`).

    Per micro-batch `add(loss, tokens_per_expert)`: this rank's share of the step's loss and its
    [MoE layers, E] counts (`MulaOutput.tokens_per_expert`); per optimizer step `end_step(norm)`.
    """

    def __init__(self, near_ties_of: tuple[torch.nn.Module, Any] | None = None) -> None:
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.counts: list[Tensor] = []
        self._loss = torch.zeros((), dtype=torch.float64)
        self._tokens: Tensor | None = None
        self._ties = None if near_ties_of is None else NearTies(*near_ties_of, lambda: len(self.counts))

    def add(self, loss: Tensor | float, tokens: Tensor) -> None:
        self._loss += float(loss)
        self._tokens = tokens.detach().clone() if self._tokens is None else self._tokens + tokens.detach()

    def end_step(self, norm: Tensor | float) -> None:
        assert self._tokens is not None, "add() every micro-batch before end_step()"
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(self._loss)
            torch.distributed.all_reduce(self._tokens)
        self.losses.append(float(self._loss))
        self.norms.append(float(norm))
        self.counts.append(self._tokens)
        self._loss, self._tokens = torch.zeros((), dtype=torch.float64), None

    def as_dict(self) -> dict[str, Any]:
        """{"losses", "norms", "counts", "near_ties" (None unless a reference)}."""
        ties = None if self._ties is None else [self._ties.at(s) for s in range(len(self.counts))]
        return {"losses": self.losses, "norms": self.norms, "counts": self.counts, "near_ties": ties}


def first_flip(
    run: Mapping[str, Any], ref: Mapping[str, Any], first_step: int = 0, what: str = ""
) -> int | None:
    """The first of `run`'s steps (1-based, the reference's numbering) that routed differently from the
    reference within the reference's near ties (a top-k flip: rounding decided a near-tied choice), or
    None when every step routed as the reference's; a difference the near ties do not explain fails the
    test here (a routing bug, module docstring, mechanism 2)."""
    counts, ref_counts = run.get("counts") or [], ref.get("counts") or []
    if not counts:  # a dense model, or a test that records no routing
        return None
    steps = len(run["losses"])
    assert len(counts) == steps, f"{what}: {len(counts)} steps of expert counts for {steps} losses"
    for s, mine in enumerate(counts):
        theirs = ref_counts[first_step + s]
        if torch.equal(mine, theirs):
            continue
        changed = (mine - theirs).abs()  # [layers, E]: choices gained or lost by each expert
        near = ref["near_ties"][first_step + s]
        beyond = (changed > near).nonzero().tolist()
        assert not beyond, (
            f"{what}: step {first_step + s + 1} routed differently from the reference where it had no near tie "
            f"to explain it ([MoE layer, expert]: {beyond}; choices gained or lost {changed.tolist()}, reference's "
            f"choices within {FLIP_MARGIN} of a tie {near.tolist()}): not a top-k flip"
        )
        return first_step + s + 1
    return None


def compared_steps(
    run: Mapping[str, Any], ref: Mapping[str, Any], first_step: int = 0, what: str = ""
) -> int:
    """The number of `run`'s steps (which are the reference's steps first_step, first_step + 1, ...), after
    checking that each routed as the reference did: a step that did not fails the test, as a routing bug
    or as a top-k flip (module docstring, mechanism 2)."""
    flip = first_flip(run, ref, first_step, what)
    if flip is not None:
        raise AssertionError(
            f"{what}: a near-tied top-k choice flipped at step {flip}, so the steps after it and the weights "
            f"after the last cannot be compared: choose data or seeds whose choices rounding does not flip "
            f"(MULA_TEST_SEED moves every seed)"
        )
    return len(run["losses"])


def assert_compared_through(
    run: Mapping[str, Any], ref: Mapping[str, Any], steps: int, first_step: int = 0, what: str = ""
) -> None:
    """`run` followed the reference through its `steps`-th step (a run that saved the checkpoint another
    run resumes from must have): it has that many steps, each routed as the reference's
    (`compared_steps`), else the test fails with the reason; it does not skip what depends on it."""
    compared = compared_steps(run, ref, first_step, what)
    assert compared >= steps, (
        f"{what}: {compared} step(s) recorded from the reference's step {first_step + 1}, where what follows "
        f"needs step {first_step + steps}"
    )


def assert_same_training(
    run: Mapping[str, Any],
    ref: Mapping[str, Any],
    *,
    first_step: int = 0,
    series: Sequence[str] = ("losses", "norms"),
    what: str = "",
) -> None:
    """`run`'s per-step `series` (each a list of floats, one per step; a missing one is skipped) equal the
    reference's within `LOSS_RTOL` for every step, each routed as the reference's (`compared_steps`), and
    there are at least `MIN_COMPARED_STEPS` of them; else the test fails. Every step is then compared, so
    the weights after the last must match too (the caller's `assert_same_weights`, unconditionally)."""
    n = compared_steps(run, ref, first_step, what)
    assert n >= MIN_COMPARED_STEPS, (
        f"{what}: only {n} step(s) compared; the equality rule needs at least {MIN_COMPARED_STEPS}"
    )
    for key in series:
        if key not in run or run[key] is None:
            continue
        mine = torch.tensor(run[key][:n], dtype=torch.float64)
        theirs = torch.tensor(ref[key][first_step : first_step + n], dtype=torch.float64)
        torch.testing.assert_close(
            mine, theirs, rtol=LOSS_RTOL, atol=0, msg=lambda m, k=key: f"{what} {k}: {m}"
        )


def assert_same_weights(
    mine: Mapping[str, Tensor], want: Mapping[str, Tensor], names: Iterable[str] | None = None, what: str = ""
) -> None:
    """Every tensor of `mine` (or of `names`) within `WEIGHT_ATOL` of `want`'s (same keys, aligned by the
    caller: a rank's expert slice against the same experts of the reference)."""
    keys = list(names) if names is not None else list(mine)
    assert set(keys) <= set(want), (what, sorted(set(keys) - set(want)))
    for name in keys:
        torch.testing.assert_close(
            mine[name], want[name], rtol=0, atol=WEIGHT_ATOL, msg=lambda m, n=name: f"{what} {n}: {m}"
        )
