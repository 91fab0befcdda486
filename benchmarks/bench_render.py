"""The NeRF renderer's marching + compositing: packed CUDA kernels (kernels/render.py) against the
dense PyTorch renderer, per training batch (forward and backward through a real field).

Not a test: prints a table. Meant for a CUDA GPU (``--device cpu`` runs the references: a smoke test).

    python benchmarks/bench_render.py                 # 8192 and 32768 rays, the GPU profile's field
    python benchmarks/bench_render.py --rays 8192 --json out.json

Timing: wall time per batch (host and device, synchronised at the end of each batch, median of
repeats after warm-up), which is what a host-bound training step pays, and the kernel launches per
batch counted by torch.profiler.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from stages.reconstruct.config import NerfParams  # noqa: E402
from stages.reconstruct.nerf.field import NerfField  # noqa: E402
from stages.reconstruct.nerf.occupancy import OccupancyGrid  # noqa: E402
from stages.reconstruct.nerf.render import render_rays  # noqa: E402

AABB = [[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]]


def setup(n_rays: int, dev: str, occ_res: int = 128, samples: int = 256):
    torch.manual_seed(0)
    cfg = NerfParams(levels=16, log2_hashmap_size=19, max_resolution=2048)
    field = NerfField(cfg, torch.tensor(AABB), use_kernels=dev == "cuda").to(dev)
    grid = OccupancyGrid(field.aabb, resolution=occ_res).to(dev)
    g = torch.Generator(device=dev).manual_seed(1)
    # a ball of occupied cells (about the fraction a trained scene keeps)
    c = (torch.arange(occ_res, device=dev) + 0.5) / occ_res * 2 - 1
    x, y, z = torch.meshgrid(c, c, c, indexing="ij")
    grid.mask.copy_(((x**2 + y**2 + z**2) < 0.5**2).reshape(-1))
    o = torch.tensor([0.0, 0.0, -3.0], device=dev) + 0.2 * torch.randn(n_rays, 3, device=dev, generator=g)
    d = torch.nn.functional.normalize(torch.tensor([0.0, 0.0, 1.0], device=dev)
                                      + 0.2 * torch.randn(n_rays, 3, device=dev, generator=g), dim=-1)
    step = float((field.aabb[1] - field.aabb[0]).norm()) / samples
    return field, grid, o, d, step, samples


def batch(field, grid, o, d, step, samples, fused, gen):
    out = render_rays(field, grid, o, d, step, samples, near=0.02, perturb=True, generator=gen, fused=fused)
    out["rgb"].square().mean().backward()
    return int(out["num_samples"])


def measure(n_rays: int, fused: bool, dev: str, reps: int = 30) -> dict:
    field, grid, o, d, step, samples = setup(n_rays, dev)
    gen = torch.Generator(device=dev).manual_seed(2)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    for _ in range(5):
        n = batch(field, grid, o, d, step, samples, fused, gen)
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        batch(field, grid, o, d, step, samples, fused, gen)
        sync()
        times.append(time.perf_counter() - t0)
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        batch(field, grid, o, d, step, samples, fused, gen)
        sync()
    launches = sum(e.count for e in prof.key_averages() if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                      "cudaLaunchKernelExC", "cuLaunchKernelEx"))
    return {"rays": n_rays, "renderer": "packed kernels" if fused else "dense PyTorch", "samples": n,
            "ms": 1e3 * statistics.median(times), "launches": launches}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rays", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_render needs a CUDA GPU")
        return 1
    rows = [measure(n, fused, args.device, args.reps) for n in args.rays for fused in (False, True)]
    print(f"{'rays':>7} {'renderer':<16} {'samples':>9} {'ms/batch':>9} {'launches':>9}")
    for r in rows:
        print(f"{r['rays']:>7} {r['renderer']:<16} {r['samples']:>9} {r['ms']:9.2f} {r['launches']:>9}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
