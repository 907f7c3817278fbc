"""What an MoE layer with an expert capacity dropped: a running tally per layer, read by the metrics.

`MoELayer` adds each training micro-batch's dropped choices (a device tensor, no host read) and its
number of choices N * K (a host integer) to its `DropTally`; a forward recomputed in backward (activation
checkpointing) adds nothing, since it repeats a micro-batch already counted. The tally only grows: a
reader keeps the totals it last saw and takes the difference (`callbacks.MoEMetrics` and
`callbacks.ExpertLoad` both read it, each over its own window).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mula.torch_compat import running_backward


class DropTally:
    """One MoE layer's dropped choices and choices on this rank since it was built (module docstring)."""

    def __init__(self) -> None:
        self.dropped: Tensor | None = None  # 0-d fp32 on the layer's device
        self.choices = 0

    def add(self, dropped: Tensor, choices: int) -> None:
        """Count one micro-batch's `dropped` choices (0-d tensor) of its `choices`, unless recomputed or
        not training (no gradient: evaluation)."""
        if running_backward() or not torch.is_grad_enabled():
            return
        dropped = dropped.detach().float()
        self.dropped = dropped if self.dropped is None else self.dropped + dropped
        self.choices += choices

    def totals(self, device: torch.device) -> Tensor:
        """[2] fp32 (dropped, choices) on `device` (the one host-to-device copy: on logging steps only)."""
        dropped = torch.zeros((), device=device) if self.dropped is None else self.dropped.to(device)
        return torch.stack((dropped, torch.tensor(float(self.choices), device=device)))
