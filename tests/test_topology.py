"""Single-process pieces of the strategy: layouts, the mpiexec environment, XPU plumbing, registries."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import run_distributed
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry

import strategies
from mula.cluster_environments import PALSEnvironment
from mula.layout.parallel_layout import ParallelLayout
from strategies.devices.accelerator import XPUAccelerator, fix_mixed_precision_device, process_group_backend
from strategies.sharded_state import rescale_loop_progress
from strategies.topology import LayoutMesh, build_topology


def layout_ranks(world: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """All EP and all EDP groups of a (W, E) layout."""
    layout = ParallelLayout(world_size=world, ep=ep)
    return layout.all_groups("ep"), layout.all_groups("edp")


def validate_layout(world: int, ep: int, experts: int | None) -> None:
    """Build the layout, and place the experts when given."""
    layout = ParallelLayout(world_size=world, ep=ep)
    if experts is not None:
        layout.experts_of(0, experts)


def test_layout_groups_consecutive_ep_and_strided_edp() -> None:
    ep, edp = layout_ranks(8, 4)
    assert ep == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert edp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Aurora: 2 nodes x 12 tiles, E = 12 keeps every EP group on one node
    ep, edp = layout_ranks(24, 12)
    assert ep == [list(range(12)), list(range(12, 24))]
    assert edp[5] == [5, 17]


def test_topology_local_experts_and_group_ranks() -> None:
    topo = LayoutMesh(ParallelLayout(world_size=8, ep=4), 6)
    assert (topo.rank("ep"), topo.rank("edp_cp"), topo.size("edp_cp"), topo.group("ep")) == (2, 1, 2, None)
    assert topo.local_expert_range(16) == range(8, 12)
    assert topo.group_ranks("ep") == [4, 5, 6, 7]
    assert topo.group_ranks("edp_cp") == [2, 6]


@pytest.mark.parametrize(
    ("world", "ep", "experts", "needle"),
    [
        (4, 3, None, "world size 4 is not divisible by expert_parallel_size=3"),
        (4, 8, None, "expert_parallel_size=8 is larger than the world size 4"),
        (8, 4, 6, "6 experts, which is not divisible by expert_parallel_size=4"),
        (4, 0, None, "at least 1"),
    ],
)
def test_invalid_layouts_name_the_numbers(world: int, ep: int, experts: int | None, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        validate_layout(world, ep, experts)


def test_single_process_topology() -> None:
    topo = build_topology(1)
    assert (topo.size("replica"), topo.size("ep"), topo.size("edp_cp")) == (1, 1, 1)
    with pytest.raises(ValueError, match="larger than the world size 1"):
        build_topology(2)


def test_pals_environment_reads_mpiexec_variables(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x1000c0s0b0n0\nx1000c0s0b0n1\n")
    monkeypatch.setenv("PBS_NODEFILE", str(nodefile))
    monkeypatch.setenv("PBS_JOBID", "12345.aurora-pbs")
    monkeypatch.setenv("PALS_RANKID", "13")
    monkeypatch.setenv("PALS_LOCAL_RANKID", "1")
    monkeypatch.setenv("PALS_NODEID", "1")
    monkeypatch.setenv("PMI_SIZE", "24")
    monkeypatch.setenv("PMI_LOCAL_SIZE", "12")
    assert PALSEnvironment.detect()
    env = PALSEnvironment()
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == (13, 24, 1, 1)
    assert env.main_address == "x1000c0s0b0n0"
    assert 20000 <= env.main_port < 40000 and env.main_port == PALSEnvironment().main_port
    assert env.creates_processes_externally
    env.validate_settings(num_devices=12, num_nodes=2)
    with pytest.raises(ValueError, match="expects 12 processes .* mpiexec started 24"):
        env.validate_settings(num_devices=12, num_nodes=1)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert (env.main_address, env.main_port) == ("10.0.0.1", 29999)


def test_pals_environment_open_mpi_without_pbs(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "PALS_RANKID",
        "PALS_LOCAL_RANKID",
        "PALS_NODEID",
        "PMI_RANK",
        "PMI_SIZE",
        "PMI_LOCAL_RANK",
        "PMI_LOCAL_SIZE",
        "PBS_NODEFILE",
        "PBS_JOBID",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PALS_LOCAL_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    env = PALSEnvironment()
    assert (env.global_rank(), env.local_rank(), env.node_rank()) == (5, 1, 1)
    with pytest.raises(ValueError, match="set MASTER_ADDR"):
        _ = env.main_address
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert not PALSEnvironment.detect()  # a single process is not a distributed launch


def test_backends_per_device() -> None:
    assert process_group_backend(torch.device("cpu")) == "gloo"
    assert process_group_backend(torch.device("cuda", 0)) == "nccl"


def test_xpu_accelerator_registered_and_bf16_autocast_repointed() -> None:
    assert "xpu" in AcceleratorRegistry.available_accelerators()
    assert dict.get(AcceleratorRegistry, "xpu")["accelerator"] is XPUAccelerator
    assert (
        "xpu_moe" in StrategyRegistry and strategies.XPUMoEStrategy is StrategyRegistry["xpu_moe"]["strategy"]
    )
    # What Lightning builds for accelerator="xpu", precision="bf16-mixed": autocast on the wrong device.
    plugin = MixedPrecision("bf16-mixed", "cuda")
    fix_mixed_precision_device(plugin, "xpu")
    assert plugin.device == "xpu"
    with plugin.forward_context():  # autocast really targets xpu now (a CPU matmul stays fp32)
        assert torch.is_autocast_enabled("xpu")


def test_xpu_device_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("strategies.devices.accelerator._native_xpu_count", lambda: 12)
    assert XPUAccelerator.parse_devices(12) == list(range(12))
    assert XPUAccelerator.parse_devices("auto") == list(range(12))
    assert XPUAccelerator.parse_devices("0,3") == [0, 3]
    assert XPUAccelerator.get_parallel_devices([0, 3]) == [torch.device("xpu", 0), torch.device("xpu", 3)]
    with pytest.raises(ValueError, match="torch sees 12 XPU"):
        XPUAccelerator.parse_devices(13)


def test_resume_rescales_micro_batch_counters_to_new_accumulation() -> None:
    counters = {"ready": 8, "completed": 8, "started": 8, "processed": 8}
    meta = {
        "xpu_moe_layout": {"accumulate_grad_batches": 2},
        "loops": {
            "fit_loop": {"epoch_loop.batch_progress": {"total": dict(counters), "current": dict(counters)}}
        },
    }
    rescale_loop_progress(meta, 4)  # 4 optimizer steps of 2 micro-batches -> 4 steps of 4
    assert meta["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]["ready"] == 16


def _mesh_groups(rank: int, world: int) -> list[dict]:
    """For each (E, P) of `world` ranks: the members of this rank's groups as the mesh made them."""
    import torch.distributed as dist

    out = []
    for ep, pp in [(e, p) for e in (1, 2, 4) for p in (1, 2, 4) if world % (e * p) == 0]:
        topo = build_topology(ep, pp)
        groups = {dim: topo.group(dim) for dim in ("ep", "edp", "edp_cp", "replica", "pp", "world")}
        members = {k: dist.get_process_group_ranks(g) for k, g in groups.items() if g is not None}
        members["world_mesh"] = dist.get_process_group_ranks(topo.mesh("world").get_group())
        out.append({"ep": ep, "pp": pp, "members": members, "replica_rank": topo.rank("replica")})
    return out


@pytest.mark.parametrize("world", [1, 4])
def test_every_group_comes_from_the_mesh_as_the_layout_says(world: int) -> None:
    for rank, cases in enumerate(run_distributed(_mesh_groups, world)):
        for case in cases:
            layout = ParallelLayout(world_size=world, ep=case["ep"], pp=case["pp"])
            dims = ["ep", "edp", "edp_cp", "replica", "world"] + (["pp"] if case["pp"] > 1 else [])
            expected = {d: layout.group_ranks(d, rank) for d in dims}
            assert case["members"] == {**expected, "world_mesh": list(range(world))}, case
            assert case["replica_rank"] == layout.group_rank("replica", rank)
