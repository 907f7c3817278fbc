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
    with pytest.raises(ValueError, match="keeps no fp32 master weights"):
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
