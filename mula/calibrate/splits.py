"""Which tensor-, context- and expert-parallel splits a `mula calibrate` job times on a group of a node:
those the model's heads, experts and sequence allow at that group size (the timing itself runs the
strategy's own split functions, `mula.calibrate.strategy`).
"""

from __future__ import annotations

from mula.layout.rules import check_context_parallel, check_tensor_parallel
from mula.model.config import MulaConfig


def splits_for(config: MulaConfig, group: int, seq_len: int) -> list[str]:
    """The split kinds (`mula.plan.split_compute.SPLIT_KINDS`) a group of `group` ranks can run this model
    at `seq_len` tokens: the heads (and key/value heads) must divide by it, and where the sequence is
    split (sequence parallelism, an MoE layer's tokens under TP, Ulysses' slices) the sequence too."""
    kinds = []
    even = seq_len % group == 0
    try:
        check_tensor_parallel(config, group)
    except ValueError:
        pass
    else:
        if even or not config.is_moe:
            kinds.append("tp")
        if even:
            kinds.append("tp_sp")
    try:
        check_context_parallel(config, group)
    except ValueError:
        pass
    else:
        if even:
            kinds.append("cp")
    if config.is_moe and config.num_experts % group == 0:
        kinds.append("ep")
    return kinds
