"""Device timing shared by the benchmarks: copy bandwidth (the ceiling every kernel is compared
with, measured in the same run) and per-call time from CUDA-graph replay."""

from __future__ import annotations

import time

import torch


def copy_bandwidth_gbps(device: str | torch.device | None = None, numel: int | None = None) -> float:
    """Bytes read + written per second (GB/s) of a large device-to-device copy (1 GiB of bf16 on a
    GPU; a small one on the CPU, where the number only keeps smoke runs going)."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    dev = "cuda" if cuda else "cpu"
    numel = numel or ((1 << 29) if cuda else (1 << 20))
    src = torch.randn(numel, device=dev).to(torch.bfloat16)  # random data: zeros can run faster
    dst = torch.empty_like(src)
    if cuda:
        import triton

        us = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median") * 1e3
    else:
        dst.copy_(src)
        t0 = time.perf_counter()
        dst.copy_(src)
        us = (time.perf_counter() - t0) * 1e6
    gbps = 2 * numel * src.element_size() / (us * 1e-6) / 1e9
    del src, dst
    return gbps


def time_graph(fn, calls: int = 1, replays: int = 20) -> float:
    """Microseconds per fn() call from replaying a CUDA graph of ``calls`` back-to-back calls, after
    a warm-up outside the capture (compiles, cuBLAS workspaces, allocator). NaN without CUDA."""
    if not torch.cuda.is_available():
        return float("nan")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / (replays * calls)
    del graph
    return us
