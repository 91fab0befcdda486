"""Distributed training: gradient-sync cost, overhead of the distributed path, GPU scaling.

Not a test: prints tables. Subcommands:

    # CPU (gloo): dense all-reduce against the sparse row exchange of a hash-table gradient,
    # in 2 processes it starts itself under torchrun
    python benchmarks/bench_distributed.py sync
    # the same on N GPUs (NCCL)
    python -m torch.distributed.run --nproc-per-node N benchmarks/bench_distributed.py sync

    # a world of 1 through torchrun + the process group against the plain in-process path
    python benchmarks/bench_distributed.py overhead

    # GPU host: stage throughput at 1 and N GPUs, compute / communication per step
    python benchmarks/bench_distributed.py scaling --gpus 1,2,4,8 [--poses data/poses] [--steps 500]

    python benchmarks/bench_distributed.py all       # sync + overhead on the CPU, then the GPU commands
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------- helpers


def make_poses(root: Path, width: int = 96, height: int = 72, views: int = 12) -> Path:
    """A poses-stage folder from the scene generator's ground truth (no SfM)."""
    from stages.scene import SceneParams, poses_from_ground_truth, run as scene_run

    scene_run(SceneParams(width=width, height=height, views=views, rings=2, objects=4), root / "scene", 0)
    return poses_from_ground_truth(root / "scene" / "images", root / "poses")


def table(rows: list[list], head: list[str]) -> str:
    cols = [head] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cols) for i in range(len(head))]
    fmt = lambda r: "| " + " | ".join(c.rjust(w[i]) for i, c in enumerate(r)) + " |"  # noqa: E731
    return "\n".join([fmt(head), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [fmt(r) for r in cols[1:]])


# ---------------------------------------------------------------- sync: dense vs sparse


def real_row_density(levels: int, log2_t: int, max_res: int, rays: int, keep: float, seed: int) -> float:
    """Fraction of hash-table rows one step's samples touch (samples along ``rays`` rays of
    a generated scene at march step diagonal/128, a fraction ``keep`` of them surviving
    the occupancy grid: 1.0 early in training, less later)."""
    from kernels import HashGrid
    from stages.reconstruct.data import RaySampler, load_scene
    from stages.reconstruct.nerf.render import ray_aabb

    scene = load_scene(_POSES)
    g = torch.Generator().manual_seed(seed)
    o, d, _ = RaySampler(scene.train, g).sample(rays)
    aabb = scene.aabb
    tmin, tmax = ray_aabb(o, d, aabb, 0.02)
    step = float((aabb[1] - aabb[0]).norm()) / 128
    t = tmin[:, None] + (torch.arange(128)[None, :] + torch.rand(rays, 1, generator=g)) * step
    valid = t < tmax[:, None]
    pts = (o[:, None] + t[..., None] * d[:, None])[valid]
    if keep < 1.0:
        pts = pts[torch.rand(len(pts), generator=g) < keep]
    xn = ((pts - aabb[0]) / (aabb[1] - aabb[0])).clamp(0, 1)
    enc = HashGrid(levels=levels, log2_hashmap_size=log2_t, base_resolution=16, max_resolution=max_res,
                   use_kernels=False)
    enc(xn).sum().backward()
    rows = enc.table.grad.reshape(-1, enc.table.shape[-1])
    return float(rows.ne(0).any(dim=1).float().mean())


_POSES: Path | None = None


def sync_worker(args) -> None:
    import torch.distributed as dist

    from stages.reconstruct.distributed import DistContext, GradReducer, init_from_env

    ctx = init_from_env("cuda" if args.backend == "nccl" else "cpu")
    if args.backend == "gloo" and ctx.backend != "gloo":
        ctx = DistContext(ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size, torch.device("cpu"), "gloo")
    dev = ctx.device
    L, T, F = args.levels, 2**args.log2_hashmap_size, 2
    rows = L * T
    densities = [float(x) for x in args.densities.split(",")]
    labels = [f"{x:.1%} rows" for x in densities]
    if args.real and ctx.rank == 0:
        global _POSES
        tmp = Path(tempfile.mkdtemp(prefix="bench_dist_"))
        _POSES = make_poses(tmp)
        for rays, keep in ((4096, 1.0), (4096, 0.25), (1024, 0.25)):
            dens = real_row_density(L, args.log2_hashmap_size, args.max_resolution, rays, keep, 0)
            densities.append(dens)
            labels.append(f"{dens:.1%} (real: {rays} rays, {keep:.0%} samples kept)")
        shutil.rmtree(tmp, ignore_errors=True)
    from stages.reconstruct.distributed import broadcast_object

    densities, labels = broadcast_object(ctx, (densities, labels))
    out = []
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    for dens, label in zip(densities, labels):
        grad = torch.zeros(rows, F)
        n = int(rows * dens)
        if n:
            grad[torch.randperm(rows, generator=g)[:n]] = torch.randn(n, F, generator=g)
        grad = grad.view(L, T, F).to(dev)
        times = {}
        for mode in ("dense", "sparse", "auto"):
            p = torch.nn.Parameter(torch.zeros(L, T, F, device=dev))
            red = GradReducer([p], ctx, mode)
            ts = []
            for rep in range(args.reps + 1):
                p.grad = grad.clone()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                dist.barrier()
                t0 = time.perf_counter()
                red.reduce(1.0 / ctx.world_size)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                if rep:  # the first is a warm-up
                    ts.append(time.perf_counter() - t0)
            times[mode] = statistics.median(ts)
        out.append([label, f"{times['dense'] * 1e3:.2f}", f"{times['sparse'] * 1e3:.2f}",
                    f"{times['auto'] * 1e3:.2f}", "sparse" if times["sparse"] < times["dense"] else "dense"])
    if ctx.rank == 0:
        mb = rows * F * 4 / 2**20
        print(f"\ngradient sync of a hash table [{L}, 2^{args.log2_hashmap_size}, {F}] float32 ({mb:.0f} MB), "
              f"{ctx.world_size} ranks, {ctx.backend} on {dev.type}; median of {args.reps} (ms per step)")
        print(table(out, ["non-zero rows", "dense all-reduce", "sparse all-gather", "auto", "faster"]))
    dist.destroy_process_group()


def sync(args) -> None:
    if "WORLD_SIZE" in os.environ:
        return sync_worker(args)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
           str(Path(__file__).resolve()), "sync", "--backend", "gloo", "--reps", str(args.reps),
           "--levels", str(args.levels), "--log2-hashmap-size", str(args.log2_hashmap_size),
           "--max-resolution", str(args.max_resolution),
           "--densities", args.densities] + (["--real"] if args.real else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)


# ---------------------------------------------------------------- overhead: world 1 through torchrun


OVERHEAD_PARAMS = {
    "device": "cpu", "steps": 60, "batch_rays": 1024, "eval_every": 1000,
    "nerf": {"levels": 8, "log2_hashmap_size": 14, "base_resolution": 8, "max_resolution": 128, "hidden_dim": 32,
             "samples_per_ray": 48, "occ_resolution": 32},
    "distributed": {"checkpoint_every": 20, "replica_check_every": 10},
}


def _stage(poses: Path, out: Path, params: dict, launch: str) -> tuple[dict, float]:
    import yaml

    pfile = out.parent / f"{out.name}.yaml"
    pfile.write_text(yaml.safe_dump({"seed": 0, "reconstruct": params}))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "stages.reconstruct", "--poses", str(poses), "--out", str(out),
                    "--params", str(pfile), "--launch", launch], check=True, env=env, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return json.loads((out / "summary.json").read_text()), wall


def overhead(args) -> None:
    import copy

    tmp = Path(tempfile.mkdtemp(prefix="bench_dist_"))
    try:
        poses = make_poses(tmp)
        p1 = copy.deepcopy(OVERHEAD_PARAMS)
        p1["steps"] = args.steps
        res: dict[str, list] = {"inline": [], "torchrun": []}
        for rep in range(args.reps):
            for launch in ("inline", "torchrun"):
                s, wall = _stage(poses, tmp / f"{launch}{rep}", p1, launch)
                res[launch].append((s["train_time_s"], wall))
        p2 = copy.deepcopy(p1)
        p2["distributed"]["cpu_workers"] = 2
        s2, wall2 = _stage(poses, tmp / "w2", p2, "auto")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    best = {k: (min(t for t, _ in v), min(w for _, w in v)) for k, v in res.items()}
    (ti, wi), (tt, wt) = best["inline"], best["torchrun"]
    rows = [["plain, in-process", f"{ti:.2f}", f"{1e3 * ti / args.steps:.1f}", f"{wi:.1f}", ""],
            ["torchrun, world 1 (gloo group)", f"{tt:.2f}", f"{1e3 * tt / args.steps:.1f}", f"{wt:.1f}",
             f"{100 * (tt / ti - 1):+.1f}%"],
            ["torchrun, world 2 (gloo, CPU)", f"{s2['train_time_s']:.2f}",
             f"{1e3 * s2['train_time_s'] / args.steps:.1f}", f"{wall2:.1f}", f"comm {1e3 * s2['step_comm_s']:.1f} ms/step ({s2['comm_fraction']:.0%})"]]
    print(f"\n{args.steps} steps, {p1['batch_rays']} rays per process per step, CPU, 1 thread per process; "
          f"best of {args.reps}")
    print(table(rows, ["path", "train s", "ms/step", "wall s (with start-up)", "overhead / comm"]))
    print("target: <= 3% training-time overhead for a world of 1 through the distributed path "
          f"({'met' if tt / ti - 1 <= 0.03 else 'NOT met'} here; a shared, loaded CPU is noisy)")


# ---------------------------------------------------------------- scaling on GPUs


def scaling(args) -> None:
    import copy

    import yaml

    if not torch.cuda.is_available():
        sys.exit("scaling needs CUDA GPUs; run it on the GPU host (see the commands `all` prints)")
    tmp = Path(tempfile.mkdtemp(prefix="bench_dist_"))
    base = yaml.safe_load((ROOT / "params.yaml").read_text())
    poses = Path(args.poses) if args.poses else make_poses(tmp, 400, 300, 48)
    rows = []
    try:
        for n in [int(x) for x in args.gpus.split(",")]:
            data = copy.deepcopy(base)
            r = data["reconstruct"]
            r["steps"], r["device"], r["eval_every"] = args.steps, "cuda", max(args.steps, 1)
            r.setdefault("distributed", {}).update({"gpus": n, "checkpoint_every": 0, "grad_sync": args.grad_sync})
            pfile = tmp / f"p{n}.yaml"
            pfile.write_text(yaml.safe_dump(data))
            out = tmp / f"out{n}"
            subprocess.run([sys.executable, "-m", "stages.reconstruct", "--poses", str(poses), "--out", str(out),
                            "--params", str(pfile)], check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            s = json.loads((out / "summary.json").read_text())
            rows.append([n, s["global_batch_rays"], f"{s['rays_per_s']:,}", f"{s['samples_per_s']:,}",
                         f"{1e3 * s['step_compute_s']:.2f}", f"{1e3 * s['step_comm_s']:.2f}",
                         f"{s['comm_fraction']:.1%}", s["final_test_psnr_sampled"]])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n{args.steps} steps, batch_rays per GPU from params.yaml, grad_sync {args.grad_sync}")
    print(table(rows, ["GPUs", "rays/step", "rays/s", "samples/s", "compute ms/step", "comm ms/step", "comm",
                       "test PSNR"]))
    r1 = rows[0]
    for r in rows[1:]:
        eff = float(r[2].replace(",", "")) / (float(r1[2].replace(",", "")) * r[0] / r1[0])
        print(f"scaling efficiency at {r[0]} GPUs: {eff:.0%} of linear (rays/s)")


GPU_COMMANDS = """
On a GPU host (not run here), from the repo root:
  # dense vs sparse gradient sync with NCCL, 2 and N GPUs, at the params.yaml table size:
  .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_distributed.py sync --backend nccl --real
  .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 8 benchmarks/bench_distributed.py sync --backend nccl --real
  # stage throughput at 1..N GPUs (compute / comm per step from summary.json):
  .venv/bin/python benchmarks/bench_distributed.py scaling --gpus 1,2,4,8 --steps 500 --grad-sync dense
  .venv/bin/python benchmarks/bench_distributed.py scaling --gpus 1,8 --steps 500 --grad-sync auto
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("sync", "overhead", "scaling", "all"))
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--levels", type=int, default=16)
    ap.add_argument("--log2-hashmap-size", type=int, default=17)
    ap.add_argument("--max-resolution", type=int, default=1024)
    ap.add_argument("--densities", default="0.001,0.01,0.05,0.2,0.5,1.0")
    ap.add_argument("--real", action="store_true", help="add the row density of real samples of a generated scene")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--poses")
    ap.add_argument("--grad-sync", default="dense", choices=("dense", "sparse", "auto"))
    args = ap.parse_args(argv)
    if args.what in ("sync", "all"):
        if args.what == "all":
            args.real = True
        sync(args)
    if args.what in ("overhead", "all"):
        args.reps = min(args.reps, 3)
        overhead(args)
    if args.what == "scaling":
        scaling(args)
    if args.what == "all":
        print(GPU_COMMANDS)


if __name__ == "__main__":
    main()
