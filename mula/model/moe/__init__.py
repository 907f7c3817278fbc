"""Mixture-of-Experts building blocks: router, dispatcher, grouped experts, and the layer."""

from mula.model.moe.contract import is_expert_param, iter_moe_layers, num_global_experts
from mula.model.moe.dispatcher import Dispatcher, LocalDispatcher, MeteredDispatcher
from mula.model.moe.experts import GroupedExperts
from mula.model.moe.layer import MoELayer, MoEStats
from mula.model.moe.router import Router, RouterOutput, expert_counts, load_balancing_loss, router_z_loss

__all__ = [
    "Dispatcher",
    "GroupedExperts",
    "LocalDispatcher",
    "MeteredDispatcher",
    "MoELayer",
    "MoEStats",
    "Router",
    "RouterOutput",
    "expert_counts",
    "is_expert_param",
    "iter_moe_layers",
    "load_balancing_loss",
    "num_global_experts",
    "router_z_loss",
]
