"""Mixture-of-Experts building blocks: router, dispatcher, grouped experts, and the layer."""

from mula.moe.dispatcher import LocalDispatcher, LocalDispatchState
from mula.moe.experts import GroupedExperts
from mula.moe.layer import MoELayer, MoEStats
from mula.moe.router import Router, RouterOutput, expert_counts, load_balancing_loss, router_z_loss

__all__ = [
    "GroupedExperts",
    "LocalDispatchState",
    "LocalDispatcher",
    "MoELayer",
    "MoEStats",
    "Router",
    "RouterOutput",
    "expert_counts",
    "load_balancing_loss",
    "router_z_loss",
]
