"""Collectives among the processes of a run, as nccl-tests measures them: all-reduce,
all-gather, reduce-scatter and broadcast of float32 data from 1 KiB to 256 MiB, each
result checked against the values it must hold, with latency, algorithm bandwidth (size /
time) and bus bandwidth (what each link carried: all-reduce algbw x 2(n-1)/n, all-gather
and reduce-scatter x (n-1)/n, broadcast x 1). Sizes are nccl-tests': the tensor for
all-reduce and broadcast, the gathered output for all-gather, the scattered input for
reduce-scatter. The time of a size is the slowest rank's mean over its iterations.

Runs in every process of a torchrun group (`frugality doctor --nproc N` starts them).
`FRUGALITY_INJECT_FAULT=all_reduce_value` corrupts one rank's all-reduce results, to see the
check fail (the fault-injection tests).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from frugality.backends import backend
from frugality.health import FAIL, PASS, Check, at_least, at_most

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def sizes(largest: int) -> list[int]:
    """1 KiB, 4 KiB, ... up to `largest` bytes."""
    out, size = [], 1024
    while size <= largest:
        out.append(size)
        size *= 4
    return out


def _iterations(size: int) -> int:
    # the same on every rank (a count agreed by measurement could differ and hang)
    return 20 if size <= 1 << 20 else 5 if size <= 16 << 20 else 2


def _sync(device: torch.device) -> None:
    backend(device).synchronize()


def run_collective(op: str, size: int, device: torch.device) -> tuple[float, int]:
    """(mean seconds per call on this rank, wrong elements on this rank) for `op` at `size` bytes."""
    rank, n = dist.get_rank(), dist.get_world_size()
    count = max(n, size // 4 // n * n)  # float32 elements, a multiple of the ranks
    chunk = count // n
    pattern = torch.arange(count, device=device, dtype=torch.float32) % 7 + 1
    if op == "all_reduce":
        data = pattern * (rank + 1)
        expected = pattern * (n * (n + 1) / 2)
        call = lambda: dist.all_reduce(data)  # noqa: E731
        reset = lambda: data.copy_(pattern * (rank + 1))  # noqa: E731
        result = lambda: data  # noqa: E731
    elif op == "all_gather":
        mine = torch.full((chunk,), float(rank + 1), device=device)
        out = torch.empty(count, device=device)
        expected = torch.arange(1, n + 1, device=device, dtype=torch.float32).repeat_interleave(chunk)
        call = lambda: dist.all_gather_single(out, mine)  # noqa: E731
        reset, result = (lambda: None), (lambda: out)
    elif op == "reduce_scatter":
        inp = pattern * (rank + 1)
        out = torch.empty(chunk, device=device)
        expected = pattern[rank * chunk : (rank + 1) * chunk] * (n * (n + 1) / 2)
        call = lambda: dist.reduce_scatter_single(out, inp)  # noqa: E731
        reset, result = (lambda: None), (lambda: out)
    else:
        data = pattern.clone() if rank == 0 else torch.zeros(count, device=device)
        expected = pattern
        call = lambda: dist.broadcast(data, src=0)  # noqa: E731
        reset, result = (lambda: None), (lambda: data)
    call()  # warm-up, and the call whose values are checked
    got = result()
    if op == "all_reduce" and os.environ.get("FRUGALITY_INJECT_FAULT") == "all_reduce_value" and rank == n - 1:
        got = got + 1  # a corrupted result, as from a bad link or device
    wrong = int((got != expected).sum().item())
    iterations = _iterations(size)
    total = 0.0
    for _ in range(iterations):
        reset()  # outside the timing: all-reduce works in place
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        call()
        _sync(device)
        total += time.perf_counter() - t0
    return total / iterations, wrong


def collective_checks(device: torch.device, limits: dict[str, float], largest: int = 256 << 20) -> list[Check]:
    """Every op at every size (called on every rank; the rows are complete on rank 0)."""
    n = dist.get_world_size()
    checks = []
    small: tuple[float, int] | None = None  # (seconds, bytes) of the smallest all-reduce
    large: tuple[float, int] | None = None  # (bus bandwidth, bytes) of the largest
    for op in OPS:
        for size in sizes(largest):
            seconds, wrong = run_collective(op, size, device)
            numbers = torch.tensor([seconds, float(wrong)], dtype=torch.float64, device=device)
            slowest = numbers.clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest rank's time
            dist.all_reduce(numbers)  # wrong elements over all ranks
            seconds, wrong = slowest[0].item(), int(numbers[1].item())
            algbw = size / seconds / 1e9
            busbw = algbw * BUS_FACTOR[op](n)
            shown = f"{seconds * 1e6:,.0f} us, algbw {algbw:.3f} GB/s, busbw {busbw:.3f} GB/s"
            checks.append(
                Check(
                    "collectives",
                    f"{op} {_human(size)}",
                    PASS if wrong == 0 else FAIL,
                    shown,
                    "values checked" if wrong == 0 else f"{wrong} wrong values across the ranks",
                    {
                        "op": op,
                        "bytes": size,
                        "ranks": n,
                        "time_us": seconds * 1e6,
                        "algbw_gb_s": algbw,
                        "busbw_gb_s": busbw,
                        "wrong_values": wrong,
                    },
                )
            )
            if op == "all_reduce":
                small = small or (seconds, size)
                large = (busbw, size)
    assert small is not None and large is not None  # all_reduce is one of OPS, timed at each size
    checks.append(
        at_most(
            "collectives",
            f"all_reduce latency at {_human(small[1])}",
            small[0] * 1e3,
            limits["max_small_latency_ms"],
            f"{small[0] * 1e3:.3f} ms",
            "max_small_latency_ms",
        )
    )
    checks.append(
        at_least(
            "collectives",
            f"all_reduce bus bandwidth at {_human(large[1])}",
            large[0],
            limits["min_bus_bandwidth_gb_s"],
            f"{large[0]:.3f} GB/s",
            "min_bus_bandwidth_gb_s",
        )
    )
    return checks


def _human(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"
