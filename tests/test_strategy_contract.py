"""mula.training.strategy_contract: XPUMoEStrategy provides every capability of `MulaStrategy`, each of the
kind the contract declares; Lightning's own strategies provide none, and their callers keep the defaults."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from typing_extensions import get_protocol_members

from mula.training.module import MulaLightningModule, check_master_weights
from mula.training.strategy_contract import MulaStrategy, mula_strategy
from strategies import XPUMoEStrategy


def _kind(value: object) -> str:
    """'method' for a function (plain, static or class), else 'attribute' (a property or a value)."""
    if isinstance(value, (staticmethod, classmethod)) or inspect.isfunction(value):
        return "method"
    return "attribute"


def _defined(strategy: object, name: str) -> object:
    """What `name` is on the strategy, without running it: its class's member, else an instance attribute."""
    return inspect.getattr_static(strategy, name)


def test_the_contract_names_each_capability_once_with_its_kind():
    members = get_protocol_members(MulaStrategy)
    assert len(members) >= 13  # the capabilities callers asked for by name before the contract
    methods = {n for n in members if _kind(inspect.getattr_static(MulaStrategy, n)) == "method"}
    assert methods == {
        "build_optimizer",
        "parallel_layout",
        "save_checkpoint_async",
        "skip_optimizer_step",
        "spread_forward",
    }
    for name in members:  # one line of meaning each
        assert inspect.getdoc(inspect.getattr_static(MulaStrategy, name)), name


def test_xpu_moe_strategy_provides_every_capability_of_its_kind():
    strategy = XPUMoEStrategy()
    missing, wrong = [], []
    for name in sorted(get_protocol_members(MulaStrategy)):
        declared = inspect.getattr_static(MulaStrategy, name)
        try:
            defined = _defined(strategy, name)
        except AttributeError:
            missing.append(name)
            continue
        if _kind(defined) != _kind(declared):
            wrong.append(f"{name}: {_kind(defined)}, the contract says {_kind(declared)}")
        elif _kind(declared) == "method":  # the same parameters, so a caller's arguments fit
            expected = list(inspect.signature(declared).parameters)[1:]
            assert list(inspect.signature(getattr(strategy, name)).parameters) == expected, name
    assert not missing and not wrong, (missing, wrong)
    assert mula_strategy(strategy) is strategy


def test_lightning_strategies_get_the_plain_defaults():
    single = SingleDeviceStrategy("cpu")
    assert (
        mula_strategy(single) is None and mula_strategy(DDPStrategy()) is None and mula_strategy(None) is None
    )

    class Partial(SingleDeviceStrategy):  # one capability is not the contract
        data_parallel_size = 2

    assert mula_strategy(Partial("cpu")) is None

    # half-precision weights: refused without the strategy's fp32 masters, accepted with them
    with pytest.raises(ValueError, match="keeps no fp32 masters"):
        check_master_weights("bf16-true", single)
    check_master_weights("bf16-true", XPUMoEStrategy(shard_optimizer=True))

    # gradients: the module zeroes them before a step unless the strategy zeroes them after its step
    zeroed = []
    optimizer = SimpleNamespace(zero_grad=lambda: zeroed.append(True))
    module = MulaLightningModule("mula-tiny-dense")
    module.trainer = SimpleNamespace(strategy=single)
    module.optimizer_zero_grad(0, 0, optimizer)
    module.trainer = SimpleNamespace(strategy=XPUMoEStrategy())
    module.optimizer_zero_grad(0, 0, optimizer)
    assert zeroed == [True]


def _missing_or_different(cls: type, protocol: type) -> list[str]:
    """The methods and properties of `protocol` that `cls` does not define with the same kind and
    parameters (its data members are instance attributes: `isinstance` checks those)."""
    out = []
    for name in sorted(get_protocol_members(protocol)):
        declared = inspect.getattr_static(protocol, name, None)
        if declared is None:  # a data member (an annotation only)
            continue
        try:
            defined = inspect.getattr_static(cls, name)
        except AttributeError:
            out.append(f"{cls.__name__}.{name}: missing")
            continue
        if _kind(defined) != _kind(declared):
            out.append(f"{cls.__name__}.{name}: {_kind(defined)}, the protocol says {_kind(declared)}")
        elif _kind(declared) == "method" and list(inspect.signature(defined).parameters) != list(
            inspect.signature(declared).parameters
        ):
            out.append(f"{cls.__name__}.{name}: other parameters than the protocol's")
    return out


def test_every_declared_capability_is_provided_by_its_implementers():
    """Each protocol a caller asks with `isinstance` (instead of looking a name up) is provided, with its
    members' kinds and parameters, by the classes it names."""
    from callbacks import AnomalyGuard, FaultTolerantCheckpoint, HangWatchdog
    from callbacks._peers import Checkpointer, CheckpointGate, Heartbeat
    from callbacks.throughput import CountsBatches
    from mula.checkpoint.discovery import ResumeFinder
    from mula.checkpoint.lock import RunDirLocker
    from mula.downstream.lm import SpreadModel
    from mula.training.muon import MulaMuon
    from mula.training.strategy_contract import OptimizerBytes, ShardedOptimizer
    from strategies.eval_forward import SpreadForward
    from strategies.optim.sharded_muon import EPShardedMuon
    from strategies.optim.sharded_optimizer import EPShardedAdamW

    provided = [
        (EPShardedAdamW, ShardedOptimizer),
        (EPShardedMuon, ShardedOptimizer),
        (MulaMuon, OptimizerBytes),
        (FaultTolerantCheckpoint, Checkpointer),
        (FaultTolerantCheckpoint, ResumeFinder),
        (FaultTolerantCheckpoint, RunDirLocker),
        (AnomalyGuard, CheckpointGate),
        (HangWatchdog, Heartbeat),
        (MulaLightningModule, CountsBatches),
        (SpreadForward, SpreadModel),
    ]
    found = [problem for cls, protocol in provided for problem in _missing_or_different(cls, protocol)]
    assert not found, found


def test_plain_objects_are_not_taken_for_mula_capabilities():
    """torch's AdamW is no sharded optimizer and counts no bytes; `MulaMuon` counts its bytes but reduces
    no gradients; a module that is not Mula's gets no typed access; the all-to-all dispatcher meters its
    bytes and the local one does not."""
    import torch

    from mula.model.moe import LocalDispatcher, MeteredDispatcher
    from mula.training.module import mula_module
    from mula.training.muon import MulaMuon
    from mula.training.strategy_contract import OptimizerBytes, ShardedOptimizer
    from strategies.experts.all_to_all import AllToAllDispatcher

    params = [torch.nn.Parameter(torch.zeros(2, 2))]
    adamw = torch.optim.AdamW(params)
    assert not isinstance(adamw, OptimizerBytes) and not isinstance(adamw, ShardedOptimizer)
    muon = MulaMuon([{"params": params, "muon": False}])
    assert isinstance(muon, OptimizerBytes) and not isinstance(muon, ShardedOptimizer)
    module = MulaLightningModule("mula-tiny-dense")
    assert mula_module(module) is module and mula_module(torch.nn.Linear(1, 1)) is None
    assert isinstance(AllToAllDispatcher(4, 1, 0, None), MeteredDispatcher)
    assert not isinstance(LocalDispatcher(4), MeteredDispatcher)
