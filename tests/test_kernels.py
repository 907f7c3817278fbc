"""Expert kernels against the loop reference: grouped GEMM, fused grouped SwiGLU, token permutation.

Every backend's outputs and gradients (dX and dW) must match the loop reference (plain per-expert
matmuls, gradients by autograd) on random routings and the edge cases: experts with no tokens, all
tokens on one expert, counts that are not multiples of any block size, no tokens at all, and shapes
whose rows are not 16-byte aligned (torch's grouped GEMM rejects those; the backend pads).

Tolerances, as max |a - ref| / max |ref| per tensor, with the reference computed in fp32 from the
same (rounded) inputs: fp32 1e-5, bf16 3e-2 (bf16 rounds inputs to 8 significant bits and our
kernels also round the gate/up pre-activations to bf16, as the unfused computation does).

Triton kernels run through Triton's interpreter on CPU: TRITON_INTERPRET=1 must be set before triton
is imported, so `test_triton_interpreter` re-runs the `TestTritonInterpreted` class of this file in
a subprocess with that variable; this process does not collect it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mula.model.kernels as mk
from mula.model.kernels import padded
from mula.model.kernels.backends import resolve_backend, torch_grouped_mm_supported

IN_TRITON_SUBPROCESS = os.environ.get("MULA_TRITON_INTERPRET_TESTS") == "1"
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}

# (counts, hidden, ffn): random routing with an empty expert; all rows on one expert; counts that are
# not multiples of 16/32/64; a single expert; no rows at all; odd widths (unaligned for torch's kernel).
ROUTINGS = [
    ([10, 0, 23, 7, 1], 24, 20),
    ([0, 0, 37, 0], 16, 16),
    ([17, 1, 33], 32, 48),
    ([5], 8, 12),
    ([0, 0, 0], 16, 8),
    ([3, 9, 0, 2], 6, 10),
]


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    return (a.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)


def _inputs(counts: list[int], hidden: int, ffn: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    e, t = len(counts), sum(counts)
    x = torch.randn(t, hidden, generator=gen).to(device, dtype)
    gate_up = (torch.randn(e, 2 * ffn, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    down = (torch.randn(e, hidden, ffn, generator=gen) / ffn**0.5).to(device, dtype)
    dy = torch.randn(t, hidden, generator=gen).to(device, dtype)
    return x, gate_up, down, dy, torch.tensor(counts, dtype=torch.long, device=device)


def _grads(fn, tensors: list[torch.Tensor], dy: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]


def check_grouped_mm(
    backend: str, counts: list[int], hidden: int, ffn: int, dtype: torch.dtype, device: str = "cpu"
) -> None:
    """grouped_mm(x, w) and its dX, dW against the fp32 loop on the same inputs (on `device`)."""
    x, w, _, _, c = _inputs(counts, hidden, ffn, dtype, device=device)
    dy = torch.randn(x.shape[0], 2 * ffn, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    got = _grads(lambda a, b: mk.grouped_mm(a, b, c, backend=backend), [x, w], dy)
    ref = _grads(lambda a, b: mk.grouped_mm(a, b, c, backend="loop"), [x.float(), w.float()], dy.float())
    for name, a, r in zip(("y", "dx", "dw"), got, ref):
        assert a.dtype == dtype and a.shape == r.shape
        assert _rel_err(a, r) <= TOL[dtype], f"{backend} {dtype} {counts}: {name} off by {_rel_err(a, r):.2e}"


def check_grouped_swiglu(
    backend: str, counts: list[int], hidden: int, ffn: int, dtype: torch.dtype, device: str = "cpu"
) -> None:
    """grouped_swiglu and its dX, d(gate_up), d(down) against the fp32 loop on the same inputs (on `device`)."""
    x, gate_up, down, dy, c = _inputs(counts, hidden, ffn, dtype, device=device)
    got = _grads(lambda a, b, d: mk.grouped_swiglu(a, b, d, c, backend=backend), [x, gate_up, down], dy)
    ref = _grads(
        lambda a, b, d: mk.grouped_swiglu(a, b, d, c, backend="loop"),
        [x.float(), gate_up.float(), down.float()],
        dy.float(),
    )
    for name, a, r in zip(("y", "dx", "d_gate_up", "d_down"), got, ref):
        assert a.dtype == dtype and a.shape == r.shape
        assert _rel_err(a, r) <= TOL[dtype], f"{backend} {dtype} {counts}: {name} off by {_rel_err(a, r):.2e}"


def naive_moe_combine(x, topk_idx, topk_weight, f):
    """y[n] = sum_k w[n,k] * f(x[n], e[n,k]), one (token, slot) at a time."""
    rows = []
    for n in range(x.shape[0]):
        acc = torch.zeros_like(x[n])
        for k in range(topk_idx.shape[1]):
            acc = acc + topk_weight[n, k] * f(x[n], int(topk_idx[n, k]))
        rows.append(acc)
    return torch.stack(rows)


def check_permutation(backend: str, weighted: bool, device: str = "cpu") -> None:
    """permute -> per-expert map -> unpermute equals the token-by-token reference, with gradients."""
    gen = torch.Generator().manual_seed(3)
    n, k, e, h = 11, 3, 5, 20
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    idx[0] = torch.tensor([4, 2, 1])  # expert 0 and 3 may be empty for some tokens; keep order mixed
    x0 = torch.randn(n, h, generator=gen).to(device)
    w0 = torch.rand(n, k, generator=gen).to(device)
    scale = torch.randn(e, h, generator=gen).to(device)
    dy = torch.randn(n, h, generator=gen).to(device)
    idx = idx.to(device)

    def mula_path(x, w):
        plan = mk.plan_routing(idx, e)
        xs = mk.permute(x, plan, backend=backend)
        experts = torch.repeat_interleave(torch.arange(e, device=device), plan.counts)
        ys = torch.tanh(xs * scale[experts])
        return mk.unpermute(ys, plan, w if weighted else None, backend=backend)

    def ref_path(x, w):
        weights = w if weighted else torch.ones_like(w)
        return naive_moe_combine(x, idx, weights, lambda row, ex: torch.tanh(row * scale[ex]))

    got = _grads(mula_path, [x0, w0], dy)
    ref = _grads(ref_path, [x0, w0], dy)
    for name, a, r in zip(("y", "dx", "dw"), got, ref):
        assert torch.allclose(a, r, atol=1e-5, rtol=1e-5), f"{backend} weighted={weighted}: {name}"


# ----- torch backend and the loop reference -------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts,hidden,ffn", ROUTINGS)
def test_torch_grouped_mm_matches_loop(counts, hidden, ffn, dtype):
    check_grouped_mm("torch", counts, hidden, ffn, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["bucketed", "one-bucket", "grouped", "one-gemm"])
@pytest.mark.parametrize("counts,hidden,ffn", ROUTINGS)
def test_torch_grouped_swiglu_matches_loop(counts, hidden, ffn, dtype, path, monkeypatch):
    # force each strategy: batched GEMMs over bucketed padded experts (CPU default; cheap call cost so
    # the tiny cases really cut several buckets), one bucket in expert order, or per-expert grouped
    # GEMMs (gate and up apart, or as one GEMM as on accelerators)
    from mula.model.kernels import autograd

    if path == "bucketed":
        monkeypatch.setattr(padded, "CALL_COST_ROWS", 0.5)
    if path == "one-bucket":
        monkeypatch.setattr(padded, "CALL_COST_ROWS", 1e9)
    if path in ("grouped", "one-gemm"):
        monkeypatch.setattr(padded, "DEVICES", ())
    if path == "one-gemm":
        monkeypatch.setattr(autograd, "SPLIT_GATE_UP_DEVICES", ())
    check_grouped_swiglu("torch", counts, hidden, ffn, dtype)


def test_bucket_plan_and_padded_rows():
    counts = torch.tensor([2, 0, 3, 9, 8])
    layout = padded.plan_buckets(counts)
    rows_of = {}
    for first, n, cap, row in layout.buckets:
        for j in range(n):
            e = int(layout.order[first + j])
            assert counts[e] <= cap  # every expert fits its bucket
            rows_of[e] = (row + j * cap, cap)
            assert int(layout.expert_row[e]) == row + j * cap
    assert {0, 2, 3, 4} <= set(rows_of)
    assert layout.rows == sum(n * cap for _, n, cap, _ in layout.buckets) >= int(counts.sum())
    index = padded.sorted_to_padded(layout)
    x = torch.arange(22.0).view(22, 1)
    xp = padded.pad(x, index, layout.rows)
    assert torch.equal(xp.index_select(0, index), x)
    assert xp.abs().sum() == x.sum()  # padding rows are zero
    # one bucket in expert order when calls are expensive: capacity = the largest count
    single = padded.plan_buckets(counts, single=True)
    assert single.identity and single.buckets == [(0, 5, 9, 0)] and single.rows == 45
    # all rows on one of 64 experts: one bucket of one expert, no padding at all
    skewed = torch.zeros(64, dtype=torch.long)
    skewed[5] = 1000
    layout = padded.plan_buckets(skewed)
    assert layout.rows == 1000 and layout.buckets == [(0, 1, 1000, 0)] and int(layout.order[0]) == 5
    assert padded.plan_buckets(torch.zeros(4, dtype=torch.long)).rows == 0


@pytest.mark.parametrize("fold_weights", [False, True])
def test_padded_plan_end_to_end_matches_reference(fold_weights):
    """plan_routing (padded plan) -> permute (writes the padded layout) -> grouped_swiglu(plan) ->
    unpermute == loop path.

    fold_weights: the combine weights go into the experts (plan.row_weight, as the CPU dispatcher
    does) and unpermute sums; both the torch and the loop backends take that path.
    """
    gen = torch.Generator().manual_seed(5)
    n, k, e, h, i = 40, 3, 6, 16, 8
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    idx[:, 0] = 1  # expert 1 much fuller than the rest: several buckets
    idx[idx == 4] = 5  # expert 4 empty
    x0, w0 = torch.randn(n, h, generator=gen), torch.rand(n, k, generator=gen)
    gate_up0 = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    down0 = torch.randn(e, h, i, generator=gen) / i**0.5
    dy = torch.randn(n, h, generator=gen)

    def run(x, w, gate_up, down, backend):
        if backend is None:  # reference: sorted rows, loop backend, weights in the combine
            plan = mk.plan_routing(idx, e)
            ys = mk.grouped_swiglu(mk.permute(x, plan), gate_up, down, plan.counts, backend="loop")
            return mk.unpermute(ys, plan, w)
        # the torch backend's plan on CPU is the padded one; the loop backend also runs on it
        plan = mk.plan_routing(idx, e, w if fold_weights else None, backend="torch", dtype=x.dtype)
        layout = plan.layout
        xs = mk.permute(x, plan)
        assert xs.shape[0] == layout.rows
        ys = mk.grouped_swiglu(xs, gate_up, down, plan, backend=backend)
        return mk.unpermute(ys, plan, None if fold_weights else w)

    ref = _grads(lambda *t: run(*t, None), [x0, w0, gate_up0, down0], dy)
    for backend, cost in (("torch", 0.5), ("torch", 1e9), ("loop", 0.5)):
        # several buckets (weights gathered by count), or one bucket in expert-id order
        padded.CALL_COST_ROWS, saved = cost, padded.CALL_COST_ROWS
        try:
            got = _grads(lambda *t, b=backend: run(*t, b), [x0, w0, gate_up0, down0], dy)
        finally:
            padded.CALL_COST_ROWS = saved
        for name, a, r in zip(("y", "dx", "dw", "d_gate_up", "d_down"), got, ref):
            assert _rel_err(a, r) <= 1e-5, f"{backend} call cost {cost}: {name} off by {_rel_err(a, r):.2e}"


def test_expanded_gradient_and_autocast():
    x, gate_up, down, _, c = _inputs([4, 0, 7], 16, 8, torch.float32)
    x.requires_grad_()
    # y.sum() gives a stride-0 gradient, which torch's grouped GEMM rejects unless made contiguous
    mk.grouped_mm(x, gate_up, c, backend="torch").sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    gate_up.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mk.grouped_swiglu(x, gate_up, down, c)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert gate_up.grad is not None and gate_up.grad.dtype == torch.float32


def test_plan_routing():
    idx = torch.tensor([[2, 0], [2, 1], [0, 2]])
    plan = mk.plan_routing(idx, 4)
    assert plan.counts.tolist() == [2, 1, 3, 0]
    assert plan.order.tolist() == [1, 4, 3, 0, 2, 5]  # stable: token order kept within an expert
    assert plan.token.tolist() == [0, 2, 1, 0, 1, 2]
    assert torch.equal(plan.unsort[plan.order], torch.arange(6))


@pytest.mark.parametrize("weighted", [True, False])
def test_torch_permutation_matches_reference(weighted):
    check_permutation("torch", weighted)


def test_auto_backend_and_bad_inputs():
    auto = resolve_backend("auto", torch.device("cpu"), torch.float32)
    assert auto == ("torch" if torch_grouped_mm_supported("cpu", torch.float32) else "loop")
    x, w, down, _, c = _inputs([3, 2], 8, 8, torch.float32)
    with pytest.raises(ValueError, match="Unknown expert backend"):
        mk.grouped_mm(x, w, c, backend="cutlass")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="cannot run on cpu"):
            mk.grouped_mm(x, w, c, backend="triton")
    with pytest.raises(ValueError, match="counts sum to 4 but x has 5 rows"):
        mk.grouped_mm(x, w, torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="2 experts in the weights but 3 counts"):
        mk.grouped_mm(x, w, torch.tensor([3, 1, 1]))
    with pytest.raises(ValueError, match="x has 8 features"):
        mk.grouped_mm(x, w[:, :, :4], c)
    with pytest.raises(ValueError, match="cast one of them"):
        mk.grouped_mm(x.bfloat16(), w, c)
    with pytest.raises(ValueError, match="expected gate_up"):
        mk.grouped_swiglu(x, w, down[:, :, :3], c)
    with pytest.raises(ValueError, match="topk_idx must be"):
        mk.plan_routing(torch.zeros(4, dtype=torch.long), 2)


def test_moe_layer_matches_fused_path():
    """The kernels' permute + grouped_swiglu + unpermute reproduce mula.model.moe.MoELayer exactly."""
    from mula import MulaConfig
    from mula.model.moe import MoELayer

    cfg = MulaConfig(hidden_size=32, num_heads=4, num_experts=6, top_k=2, expert_intermediate_size=24)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    x = torch.randn(2, 9, 32)
    y_ref, _ = layer(x)
    route = layer.router(x.view(-1, 32))
    plan = mk.plan_routing(route.topk_idx, 6)
    ys = mk.grouped_swiglu(
        mk.permute(x.view(-1, 32), plan), layer.experts.gate_up, layer.experts.down, plan.counts
    )
    y = mk.unpermute(ys, plan, route.topk_weight).view_as(x)
    assert torch.allclose(y, y_ref, atol=1e-6, rtol=1e-5)


# ----- Triton: compiled for a GPU target (no GPU needed), and run through the interpreter (CPU) -----
def _signature(kernel, constexprs: dict, dtype: str) -> dict[str, str]:
    """Triton signature for our kernels: data pointers of `dtype`, index pointers int, scalars i32."""
    index_ptrs = {"tile_expert_ptr": "*i32", "tile_row_ptr": "*i64", "ends_ptr": "*i64", "counts_ptr": "*i64",
                  "idx_ptr": "*i64", "scale_ptr": "*fp32", "w_ptr": "*fp32"}  # fmt: skip
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif kernel.fn.__name__ == "_gather_dot_kernel" and name == "out_ptr":
            sig[name] = "*fp32"
        elif name == "w_ptr" and kernel.fn.__name__ == "_gemm_kernel":
            sig[name] = f"*{dtype}"
        elif name in index_ptrs:
            sig[name] = index_ptrs[name]
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "i32"
    return sig


# (backend, arch, warp size, binary): an H100 (sm_90) and Frontier's MI250X GCD (gfx90a, wave64). Intel XPU
# targets need the Intel backend for Triton (`pytorch-triton-xpu`), which PyPI does not carry: see
# docs/benchmarks.md ("Triton ahead of time").
GPU_TARGETS = [("cuda", 90, 32, "cubin"), ("hip", "gfx90a", 64, "hsaco")]


@pytest.mark.parametrize("target", GPU_TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_triton_kernels_compile_for_gpu(dtype, target, tmp_path, monkeypatch):
    """Every Triton kernel compiles to a GPU binary (frontend, lowering, MMA layouts) without a GPU."""
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("compilation is not available under the interpreter")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mula.model.kernels import triton_gmm, triton_permute

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    bk = 64 if dtype == "bf16" else 32
    cases = [
        (
            triton_gmm._gemm_kernel,
            {"MODE": m, "PRECISION": "ieee", "DOT_F32": False, "BM": 64, "BN": 64, "BK": bk},
        )
        for m in (0, 1, 2)
    ] + [
        (triton_gmm._wgrad_kernel, {"PRECISION": "ieee", "DOT_F32": False, "BM": 64, "BN": 64, "BK": 64}),
        (triton_permute._gather_rows_kernel, {"HAS_SCALE": True, "BH": 256}),
        (triton_permute._gather_sum_kernel, {"K": 8, "HAS_WEIGHT": True, "BH": 256}),
        (triton_permute._gather_dot_kernel, {"K": 8, "BH": 256}),
    ]
    for kernel, constexprs in cases:
        src = ASTSource(kernel, _signature(kernel, constexprs, dtype), constexprs)
        backend, arch, warp_size, binary = target
        compiled = triton.compile(src, target=GPUTarget(backend, arch, warp_size), options={"num_warps": 4})
        assert compiled.asm[binary], kernel.fn.__name__


# ----- Triton through the interpreter (CPU) --------------------------------------------------------------
def test_triton_interpreter():
    """Runs TestTritonInterpreted in a subprocess with TRITON_INTERPRET=1 (must precede `import triton`)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "MULA_TRITON_INTERPRET_TESTS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        f"{Path(__file__)}::TestTritonInterpreted",
    ]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]


class _TritonInterpreted:
    """Triton kernels (grouped GEMM, fused SwiGLU epilogues, permutation) on CPU tensors."""

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("counts,hidden,ffn", ROUTINGS[:5])
    def test_grouped_mm(self, counts, hidden, ffn, dtype):
        check_grouped_mm("triton", counts, hidden, ffn, dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("counts,hidden,ffn", ROUTINGS[:5])
    def test_grouped_swiglu(self, counts, hidden, ffn, dtype):
        check_grouped_swiglu("triton", counts, hidden, ffn, dtype)

    @pytest.mark.parametrize("weighted", [True, False])
    def test_permutation(self, weighted):
        check_permutation("triton", weighted)

    def test_tile_map(self):
        """Device-side schedule: every row in exactly one tile of its own expert; spare tiles marked -1."""
        from mula.model.kernels.triton_gmm import _tile_map

        counts = torch.tensor([0, 17, 16, 0, 1, 40])
        tile_expert, tile_row, ends = _tile_map(counts, int(counts.sum()), 16)
        covered = []
        for e, r in zip(tile_expert.tolist(), tile_row.tolist()):
            if e < 0:
                continue
            end = int(ends[e])
            assert int(ends[e] - counts[e]) <= r < end
            covered += list(range(r, min(r + 16, end)))
        assert sorted(covered) == list(range(int(counts.sum())))
        assert (tile_expert >= 0).sum() == sum(-(-c // 16) for c in counts.tolist())


if IN_TRITON_SUBPROCESS:  # only collected in test_triton_interpreter's subprocess

    class TestTritonInterpreted(_TritonInterpreted):
        """See _TritonInterpreted."""


# ----- on an accelerator (CUDA/XPU): the kernels compiled and run for real ------------------------------
ACCELERATOR = (
    "cuda"
    if torch.cuda.is_available()
    else "xpu"
    if hasattr(torch, "xpu") and torch.xpu.is_available()
    else None
)
# the routings above, and one of the OLMoE layer's width with 64 experts, some of them empty
ACCELERATOR_ROUTINGS = [
    *ROUTINGS,
    ([int(c) for c in torch.randint(0, 96, (64,), generator=torch.Generator().manual_seed(5))], 256, 128),
]


def _accelerator_backends() -> list[str]:
    if ACCELERATOR is None:
        return []
    backends = ["triton"] if importlib.util.find_spec("triton") is not None else []
    return backends + ["torch"]


@pytest.mark.skipif(ACCELERATOR is None, reason="no CUDA or XPU device")
class TestOnAccelerator:
    """Every accelerator backend (Triton's grouped GEMM and permutation kernels compiled for the device,
    torch's grouped GEMM) against the fp32 loop on the device, forward and backward, fp32 and bf16."""

    @pytest.mark.parametrize("backend", _accelerator_backends())
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("counts,hidden,ffn", ACCELERATOR_ROUTINGS)
    def test_grouped_mm(self, backend, counts, hidden, ffn, dtype):
        check_grouped_mm(backend, counts, hidden, ffn, dtype, device=ACCELERATOR)

    @pytest.mark.parametrize("backend", _accelerator_backends())
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("counts,hidden,ffn", ACCELERATOR_ROUTINGS)
    def test_grouped_swiglu(self, backend, counts, hidden, ffn, dtype):
        check_grouped_swiglu(backend, counts, hidden, ffn, dtype, device=ACCELERATOR)

    @pytest.mark.parametrize("backend", _accelerator_backends())
    @pytest.mark.parametrize("weighted", [True, False])
    def test_permutation(self, backend, weighted):
        check_permutation(backend, weighted, device=ACCELERATOR)


def test_grouped_mm_probe_ignores_the_callers_autocast():
    """The probe is cached per process: a first call from inside autocast (a bf16-mixed forward) must
    give the same answer as a clean one, or `auto` falls back to the loop for the rest of the run."""
    from mula.model.kernels import backends

    backends.torch_grouped_mm_supported.cache_clear()
    clean = backends.torch_grouped_mm_supported("cpu", torch.bfloat16)
    backends.torch_grouped_mm_supported.cache_clear()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert backends.torch_grouped_mm_supported("cpu", torch.bfloat16) == clean
    finally:
        backends.torch_grouped_mm_supported.cache_clear()
