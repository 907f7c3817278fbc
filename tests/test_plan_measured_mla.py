"""The planner's activation bytes of the DeepSeek-V3 family (multi-head latent attention, shared
experts, a dense first block) against the saved-tensor bytes of one process's forward, within 10 %.

With the MoE layers recomputed ("moe") the two agree to the byte: MLA and the dense block are exact, the
remaining few percent elsewhere are the MoE layer's routing (the planner assumes balanced experts)."""

from __future__ import annotations

import pytest
import torch

from mula import MulaConfig
from mula.plan import Layout
from mula.plan.activations import activation_bytes
from mula.training.memory_meter import SavedTensorMeter
from mula.training.module import MulaLightningModule

B, T = 4, 128
SHAPES = {
    "q-latent": {},
    "plain-q, 2 shared, wide v": {"q_lora_rank": None, "num_shared_experts": 2, "v_head_dim": 48},
}
SETTINGS = [("32-true", "none"), ("bf16-true", "none"), ("32-true", ["moe"]), ("bf16-true", ["attention"])]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("precision, checkpointing", SETTINGS)
def test_mla_activation_bytes_match_the_plan(shape, precision, checkpointing) -> None:
    config = MulaConfig.from_name("deepseek-v3-tiny", vocab_size=512, num_layers=3, **SHAPES[shape])
    torch.manual_seed(0)
    module = MulaLightningModule(config, decay_steps=10, activation_checkpointing=checkpointing)
    module.configure_model()
    if precision == "bf16-true":
        module.to(torch.bfloat16)
    batch = torch.randint(0, config.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))
    with SavedTensorMeter(exclude=module.parameters()) as meter:
        module._losses(batch)
    layout = Layout(micro_batch=B, seq_len=T, precision=precision, checkpointing=checkpointing)
    planned = activation_bytes(config, layout, range(config.num_layers), first=True, last=True)
    assert planned == pytest.approx(meter.bytes, rel=0.10)
    if checkpointing == ["moe"]:
        assert abs(planned - meter.bytes) <= 8  # MLA, the dense block and the rest exact
