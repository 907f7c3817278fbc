"""What `mula calibrate` times: matmuls at the model's shapes, elementwise traffic, and every collective
Mula issues, each at several message sizes over one process group.

Times are the median over repetitions of the slowest rank's time (every rank of the group starts
together after a barrier, and a collective ends for the job when its last rank is done). Sizes are
bus bytes per rank, the convention of nccl-tests and of `mula.plan.step_time`'s volumes: what an
all-to-all sends to the other ranks, (n - 1) / n of a reduce-scatter's or all-gather's whole buffer,
2 (n - 1) / n of an all-reduce's, a point-to-point message itself.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from mula.model.config import MulaConfig
from mula.torch_compat import all_gather_single, c10d_functional_ops, reduce_scatter_single

COLLECTIVES = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce", "send_recv")
# `training_tflops`' rates: a block's forward + backward and forward, and the rest of the model's
TRAINING_RATES = ("step", "forward", "head_step", "head_forward")
PEAK_SIZES = (512, 1024, 2048)  # the square matmuls whose fastest is the device's practical peak
# torch >= 2.10 names the tensor collectives *_single (as strategies/optim/grad_reduce.py uses them)
_reduce_scatter = reduce_scatter_single
_all_gather = all_gather_single


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def _best_time(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    fn()  # warm-up (kernel selection, first-touch allocation)
    synchronize(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def busy_times(
    fns: dict[str, Callable[[], Any]], device: torch.device, reps: int, group: Any = None
) -> dict[str, float]:
    """The median time of each of `fns` with every rank of `group` (default: the job) running it at once
    (a barrier before each repetition): rates for ranks that share the device's memory, caches or cores,
    as training's do. Each repetition counts at its slowest rank's time, as a training step ends when its
    slowest rank does; the median, not the best: the best is a repetition the other ranks happened not to
    disturb. The functions take turns (one repetition of each), so that a drift of the host's speed during
    the measurement moves them all alike and their differences stay right. Every rank of `group` must
    call it; the others must not."""
    for fn in fns.values():
        fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if dist.is_initialized():
                dist.barrier(group=group)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    if dist.is_initialized():
        slowest = torch.tensor(list(times.values()), dtype=torch.float64).to(device)  # gloo: host tensors
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times = dict(zip(times, slowest.cpu().tolist()))
    return {name: statistics.median(t) for name, t in times.items()}


def matmul_shapes(config: MulaConfig, tokens: int) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of the matmuls one layer runs per micro-batch of `tokens`: its projections (MLA's latent
    ones where it has them), the dense MLP, one expert's share of the routed rows (tokens x top_k /
    experts), the shared experts, and one head's attention."""
    h, heads = config.hidden_size, config.num_heads
    if config.kv_lora_rank:  # multi-head latent attention (mula/model/mla.py)
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        shapes = {"attention": (tokens, qk, tokens), "o_proj": (tokens, heads * config.v_head_dim, h)}
        if config.q_lora_rank:
            shapes |= {
                "q_a": (tokens, h, config.q_lora_rank),
                "q_b": (tokens, config.q_lora_rank, heads * qk),
            }
        else:
            shapes |= {"q": (tokens, h, heads * qk)}
        shapes |= {
            "kv_a": (tokens, h, config.kv_lora_rank + config.qk_rope_head_dim),
            "kv_b": (tokens, config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim)),
        }
    else:
        d = config.head_size
        q, kv = heads * d, (config.num_kv_heads or heads) * d
        shapes = {"qkv": (tokens, h, q + 2 * kv), "o_proj": (tokens, q, h), "attention": (tokens, d, tokens)}
    if config.num_dense_layers or not config.is_moe:
        shapes |= {
            "mlp_up": (tokens, h, 2 * config.intermediate_size),
            "mlp_down": (tokens, config.intermediate_size, h),
        }
    if config.is_moe:
        rows = max(1, tokens * config.top_k // config.num_experts)
        f = config.expert_intermediate_size
        shapes |= {"expert_up": (rows, h, 2 * f), "expert_down": (rows, f, h)}
        if config.num_shared_experts:
            width = config.num_shared_experts * (config.shared_expert_intermediate_size or f)
            shapes |= {"shared_up": (tokens, h, 2 * width), "shared_down": (tokens, width, h)}
    return shapes


def matmul_tflops(
    shapes: dict[str, tuple[int, int, int]], dtype: torch.dtype, device: torch.device, reps: int
) -> dict[str, float]:
    """TFLOP/s of each (M, K, N) matmul in `dtype` (the best of `reps`)."""
    out = {}
    for name, (m, k, n) in shapes.items():
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        out[name] = 2 * m * k * n / _best_time(lambda a=a, b=b: torch.mm(a, b), device, reps) / 1e12
    return out


def peak_tflops(dtype: torch.dtype, device: torch.device, reps: int, sizes: tuple[int, ...]) -> float:
    """The fastest square matmul's TFLOP/s in `dtype` over `sizes` (the device's practical peak)."""
    rates = matmul_tflops({str(n): (n, n, n) for n in sizes}, dtype, device, reps)
    return max(rates.values())


def elementwise_gbps(device: torch.device, numel: int, reps: int) -> float:
    """GB/s of an elementwise add (two tensors read, one written: the norm/rotary/residual pattern)."""
    a = torch.ones(numel, device=device)
    b, out = torch.ones_like(a), torch.empty_like(a)
    seconds = _best_time(lambda: torch.add(a, b, out=out), device, reps)
    return 3 * numel * a.element_size() / seconds / 1e9


def _uneven_splits(numel: int, size: int, rank: int) -> list[int]:
    """Elements rank `rank` sends to each peer: uneven (as routed tokens are), summing to `numel`."""
    weights = [1 + (rank + peer) % 3 for peer in range(size)]
    splits = [numel * w // sum(weights) for w in weights]
    splits[-1] += numel - sum(splits)
    return splits


def _collective(
    kind: str, nbytes: int, group: Any, ranks: list[int], device: torch.device
) -> tuple[Callable[[], Any], float]:
    """A call of collective `kind` over `group` (global ranks `ranks`) moving about `nbytes` bus bytes per
    rank, and the bus bytes it exactly moves."""
    n, me = len(ranks), ranks.index(dist.get_rank())
    numel = max(n, nbytes // 4 // n * n)  # fp32 elements, divisible by the group
    if kind == "all_to_all":
        send_counts = _uneven_splits(numel, n, me)
        # what each peer sends to this rank, by the same rule
        recv_counts = [_uneven_splits(numel, n, p)[me] for p in range(n)]
        x = torch.ones(numel, device=device)
        y = torch.empty(sum(recv_counts), device=device)
        bus = 4 * (numel - send_counts[me])  # what leaves this rank
        return lambda: dist.all_to_all_single(y, x, recv_counts, send_counts, group=group), bus
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // n, device=device)
    ring = 4 * numel * (n - 1) / n
    if kind == "reduce_scatter":
        return lambda: _reduce_scatter(shard, full, group=group), ring
    if kind == "all_gather":
        return lambda: _all_gather(full, shard, group=group), ring
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group), 2 * ring
    if kind == "send_recv":
        # the group's first rank sends to its last (across nodes for an inter-node group)
        first, last = ranks[0], ranks[-1]
        msg = torch.ones(numel, device=device)

        def p2p() -> None:
            if dist.get_rank() == first:
                dist.send(msg, last)
            elif dist.get_rank() == last:
                dist.recv(msg, first)

        return p2p, 4 * numel
    raise ValueError(f"unknown collective {kind!r}; known: {', '.join(COLLECTIVES)}.")


def time_collective(
    kind: str, sizes: list[int], group: Any, ranks: list[int], device: torch.device, reps: int
) -> list[tuple[float, float]]:
    """(bus bytes, seconds) of `kind` over the group at each size: the median over `reps` of the slowest
    rank's time. Every rank of `ranks` must call it; the others must not."""
    points = []
    for nbytes in sizes:
        fn, bus = _collective(kind, nbytes, group, ranks, device)
        fn()  # warm-up: connections, buffers
        synchronize(device)
        times = torch.zeros(reps, dtype=torch.float64)
        for i in range(reps):
            dist.barrier(group=group)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[i] = time.perf_counter() - start
        slowest = times.to(device)  # NCCL/XCCL reduce device tensors, gloo host ones
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # the slowest rank sets each call's time
        points.append((float(bus), statistics.median(slowest.cpu().tolist())))
    return points


EXTRA_BLOCKS = 2  # the deeper model's blocks beyond the small model's: their difference prices a block


def small_model_config(config: MulaConfig) -> MulaConfig:
    """The small model the training measurements time: the dense first blocks and two more."""
    return dataclasses.replace(config, num_layers=min(config.num_layers, config.num_dense_layers + 2))


def training_loss(net: Any, ids: torch.Tensor) -> torch.Tensor:
    """The training loss of `net` (a `Mula`) on token windows `ids` (micro-batch x (seq_len + 1)):
    cross-entropy plus the router losses at the model's weights."""
    config = net.config
    out = net(ids[:, :-1])
    ce = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), ids[:, 1:].flatten())
    return ce + config.router_aux_loss_coef * out.aux_loss + config.router_z_loss_coef * out.z_loss


def training_tflops(
    config: MulaConfig, micro_batch: int, seq_len: int, dtype: torch.dtype, device: torch.device, reps: int
) -> dict[str, float]:
    """The model's effective TFLOP/s on one micro-batch, counted with `MulaConfig.flops_per_token`'s
    terms, so everything that is not a matmul (norms, rotary, softmax, routing, permutation, the loss) is
    in the rate: `step` (forward + backward) and `forward` (a third of the FLOPs) of the blocks, and
    `head_step` / `head_forward` of the rest (embedding, final norm, LM head and loss, at the LM head's
    FLOPs).

    Two depths are timed: the small model (`small_model_config`) and the same with `EXTRA_BLOCKS` more.
    Their difference is what a block costs; the small model less its blocks at that cost is the rest.
    Timing the rest alone (on hidden states) instead priced a 4-block model about 10 % under its time on
    this repository's CPU host: inside the model the rest costs about twice what it costs alone, while
    a block's cost is flat from 2 to 8 blocks, so a model's time follows the line of the two depths. On
    a host too loaded to tell the depths apart, both at the small model's whole rate. Every rank of the
    job times together (`busy_times`)."""
    from mula.model.transformer import Mula

    tokens = micro_batch * seq_len
    small = small_model_config(config)
    deep_config = dataclasses.replace(small, num_layers=small.num_layers + EXTRA_BLOCKS)
    torch.manual_seed(0)
    model = Mula(small).to(device=device, dtype=dtype)
    deep = Mula(deep_config).to(device=device, dtype=dtype)
    ids = torch.randint(0, small.vocab_size, (micro_batch, seq_len + 1), device=device)

    def loss(net: Any) -> torch.Tensor:
        return training_loss(net, ids)

    def step(net: Any) -> None:
        # the gradients accumulate, as over a step's micro-batches (adding into them costs a pass more
        # than writing fresh ones)
        loss(net).backward()

    # the forward as activation checkpointing reruns it: recording for backward (its graph and saved
    # tensors), not under no_grad
    # the blocks' rate is a difference of two timings: interleaved, and 3x the repetitions, so that
    # neither the host's drift nor one disturbed repetition moves it
    seconds = busy_times(
        {
            "forward": lambda: loss(model), "deep_forward": lambda: loss(deep),
            "step": lambda: step(model), "deep_step": lambda: step(deep),
        },
        device,
        3 * reps,
    )  # fmt: skip
    core = 6 * config.attention_core_width * seq_len
    flops = [(6 * config.layer_matmul_params(i) + core) * tokens for i in range(deep_config.num_layers)]
    blocks, extra = sum(flops[: small.num_layers]), sum(flops[small.num_layers :])
    head = 6 * config.vocab_size * config.hidden_size * tokens
    out = {}
    for name, third in (("step", 1), ("forward", 3)):
        deeper = seconds["deep_" + name] - seconds[name]
        rest = seconds[name] - deeper * blocks / extra if deeper > 0 else 0.0
        if rest > 0:
            out[name], out["head_" + name] = extra / third / deeper / 1e12, head / third / rest / 1e12
        else:  # a loaded host can leave the extra blocks no time of their own: all at the whole rate
            out[name] = out["head_" + name] = (blocks + head) / third / seconds[name] / 1e12
    return out


FUNCTIONAL_CALLS, FUNCTIONAL_NUMEL, FUNCTIONAL_WIDTH = 32, 4096, 256  # `functional_call_seconds`' loop


def functional_call_seconds(
    group: Any,
    device: torch.device,
    reps: int,
    calls: int = FUNCTIONAL_CALLS,
    numel: int = FUNCTIONAL_NUMEL,
    width: int = FUNCTIONAL_WIDTH,
) -> float:
    """Seconds one small functional all-reduce (torch's `_c10d_functional` ops, as DTensor and Ulysses
    issue them: launched, then waited on) adds between two pieces of compute: a loop of `calls` (matmul,
    all-reduce of `numel` fp32) less the same loop without the all-reduces, over `calls`; the median over
    `reps` of the slowest rank's. Unlike the back-to-back calls of `time_collective`, the ranks reach
    each call from their own compute, so the time the call hands to the backend's thread and the ranks'
    skew are in it."""
    ops = c10d_functional_ops()
    a = torch.randn(width, width, device=device)
    x = torch.ones(numel, device=device)

    def loop(communicate: bool) -> None:
        y = a
        for _ in range(calls):
            y = torch.mm(a, a)
            if communicate:
                ops.wait_tensor(ops.all_reduce(x, "sum", group.group_name))
        synchronize(device)
        del y

    out = torch.zeros(reps, dtype=torch.float64)
    for i in range(reps):
        spent = []
        for communicate in (False, True):
            loop(communicate)  # warm-up
            dist.barrier(group=group)
            start = time.perf_counter()
            loop(communicate)
            spent.append(time.perf_counter() - start)
        out[i] = (spent[1] - spent[0]) / calls
    slowest = out.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return max(0.0, statistics.median(slowest.cpu().tolist()))
