"""NCCL all-reduce bus bandwidth, as nccl-tests reports it: busbw = size / time * 2 (n - 1) / n.

Run under torchrun on a GPU host:  python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/bench_allreduce.py
Set NCCL_ALGO=Ring or Tree to compare algorithms (leave NVLink multicast off: NCCL_NVLS_ENABLE=0).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def main() -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    for mib in (64, 256, 1024):
        x = torch.ones(mib * 2**20 // 4, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 10
        start.record()
        for _ in range(reps):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        t = start.elapsed_time(end) / 1e3 / reps
        size = x.numel() * 4
        busbw = size / t * 2 * (world - 1) / world / 1e9
        if rank == 0:
            algo = os.environ.get("NCCL_ALGO", "default")
            print(f"all_reduce {mib:5d} MiB  world {world}  algo {algo:7s}  {t * 1e3:8.3f} ms  busbw {busbw:7.1f} GB/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
