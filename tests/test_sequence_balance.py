"""aux_loss_scope="sequence" (DeepSeek-V3's sequence-wise balance loss, `TokenSplit.sequence_aux_loss`).

* One process: an MoE layer's loss and its gradients equal a plain-torch reference written from
  DeepSeek-V3's eq. 17-20 per sequence (times top_k, averaged over the sequences); planted, the
  micro-batch's loss in its place fails it.
* Layouts: at E2 with gradient accumulation, P2, C2 and T2 (2 gloo processes each, the covering array's
  row machinery, tests/composition.py) the training equals one process by the suite's equality rule
  (tests/equality.py). Planted, C2 with each rank's sequence slices taken as whole sequences (no sum
  over the CP group) fails it at the first step's loss.
"""

from __future__ import annotations

import pytest
import torch
from composition import assert_row_matches, fit_row
from dist_helpers import run_distributed
from equality import LOSS_RTOL, seeded

from mula import MulaConfig
from mula.layout.features import Row
from mula.model.moe import MoELayer
from mula.model.moe.balancing import TokenSplit

CONFIG = MulaConfig.from_name(
    "mula-tiny-moe", hidden_size=32, num_heads=2, num_experts=8, top_k=2, expert_intermediate_size=16,
    aux_loss_scope="sequence",
)  # fmt: skip
SEQUENCES, TOKENS = 4, 16


def reference_loss(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> torch.Tensor:
    """top_k * the mean over sequences of DeepSeek-V3's L_Bal / alpha = sum_i f_i P_i, per sequence:
    f_i = E / (K T) * (tokens of the sequence choosing i), P_i = mean of the tokens' softmax scores."""
    experts = weight.shape[0]
    losses = []
    for seq in x:  # [T, H]
        scores = (seq @ weight.t()).float().softmax(dim=-1)
        chosen = scores.topk(top_k, dim=-1).indices.flatten()
        f = experts / (top_k * seq.shape[0]) * torch.bincount(chosen, minlength=experts).float()
        losses.append((f * scores.mean(dim=0)).sum())
    return top_k * torch.stack(losses).mean()


def _inputs() -> torch.Tensor:
    """Sequences whose tokens lean each their own way: their routing differs, so per sequence is not per batch."""
    g = torch.Generator().manual_seed(seeded(11))
    lean = 2.0 * torch.randn(SEQUENCES, 1, CONFIG.hidden_size, generator=g)
    return lean + torch.randn(SEQUENCES, TOKENS, CONFIG.hidden_size, generator=g)


def _loss_and_grads(loss_fn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seeded(0))
    layer = MoELayer(CONFIG)
    x = _inputs().requires_grad_(True)
    loss = loss_fn(layer, x)
    loss.backward()
    return loss.detach(), layer.router.weight.grad, x.grad


def _layer_loss(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    return layer(x)[1].aux_loss


def _reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    return reference_loss(x, layer.router.weight, CONFIG.top_k)


def test_the_loss_and_its_gradients_equal_the_per_sequence_reference() -> None:
    got, want = _loss_and_grads(_layer_loss), _loss_and_grads(_reference)
    for mine, ref in zip(got, want):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-7)


def test_a_planted_micro_batch_mean_fails_the_reference(monkeypatch) -> None:
    def over_the_micro_batch(self, route, sequences):  # the bug: one f and P for all the sequences
        return TokenSplit().router_losses(route, torch.bincount(route.topk_idx.flatten(), minlength=8), None)[
            0
        ]

    monkeypatch.setattr(TokenSplit, "sequence_aux_loss", over_the_micro_batch)
    got, want = _loss_and_grads(_layer_loss), _loss_and_grads(_reference)
    assert abs(float(got[0] - want[0])) > 1e-2 * float(want[0])


# ----- layouts -----------------------------------------------------------------------------------------
# E2 folds over the 2 ranks' data (2 micro-batches accumulated per rank), P2 and C2 read the whole step
LAYOUTS = {
    "E2": Row({"E"}, world=2), "P2": Row({"P"}, world=2), "C2": Row({"C"}, world=2), "T2": Row({"T"}, world=2),
}  # fmt: skip
# a large weight: a wrong balance loss moves the training loss well beyond the rule's LOSS_RTOL
SCOPE = {"aux_loss_scope": "sequence", "router_aux_loss_coef": 1.0}


def _shards_as_sequences(self, route, sequences):
    """The planted bug: each rank's slices taken as whole sequences (no sum over the ranks sharing them)."""
    return TokenSplit.sequence_aux_loss(TokenSplit(), route, sequences)


def _rows(rank: int, world: int) -> dict:
    out = {name: fit_row(row, rank, overrides=SCOPE) for name, row in LAYOUTS.items()}
    from strategies.context_parallel import ContextParallelTokens

    ContextParallelTokens.sequence_aux_loss = _shards_as_sequences  # this process only, after the real rows
    out["C2 planted"] = fit_row(LAYOUTS["C2"], rank, overrides=SCOPE)
    return out


@pytest.fixture(scope="module")
def runs() -> tuple[dict, list[dict]]:
    # one reference serves every layout: each accumulates the same 4 micro-batches of 2 sequences a step
    return fit_row(LAYOUTS["C2"], overrides=SCOPE), run_distributed(_rows, 2)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_layout_trains_as_one_process(runs, layout: str) -> None:
    ref, results = runs
    for rank, result in enumerate(results):
        assert_row_matches(result[layout], ref, LAYOUTS[layout], what=f"{layout} rank {rank}")


def test_cp_shards_taken_as_sequences_fail(runs) -> None:
    ref, results = runs
    for rank, result in enumerate(results):
        planted = result["C2 planted"]
        assert abs(planted["losses"][0] / ref["losses"][0] - 1) > 10 * LOSS_RTOL, (planted["losses"][0], ref)
        with pytest.raises(AssertionError):
            assert_row_matches(planted, ref, LAYOUTS["C2"], what=f"planted C2 rank {rank}")
