"""Partitioned 3DGS against replicated 3DGS: the cost of sharding, and its communication.

    python benchmarks/bench_partitioned.py --poses <poses out> --steps 2000 [--gpus 1 2 4] \
        [--modes replicated partitioned] [--gs densify.refine_stop=1500 ...] \
        [--json benchmarks/results/partitioned_H200.json]

For every GPU count and mode the pipeline's own loop (``stages.reconstruct.train.train``) trains
``reconstruct.method: 3dgs`` on the poses out for the same number of steps from the same initial
Gaussians. With one GPU both modes render the same view each step (the same sampler), so the
difference is what partitioned mode costs: the projection kept apart from the blending, the binning
of what arrived, the image assembled from tiles, host reads of the split sizes. With N GPUs a
replicated step trains N views (one per GPU) and a partitioned step one view (every GPU draws its
tiles of it); the table gives views per second for that reason. GPU counts above one run under
torchrun (this script in ``--worker`` mode, one process per GPU, NCCL); on a CPU host
``--device cpu`` runs gloo processes instead.

Printed per run: wall time of training, ms per step, views/s, test PSNR (every test view rendered
onto the evaluation background by rank 0 after the shards are gathered), Gaussians in all and per
rank, peak GPU memory per rank, and in partitioned mode the bytes sent per step (measured, and
``gs.partition.comm_model``'s prediction from the measured visible Gaussians), the load
imbalance and the rasterization time per rank. ``--json`` writes the rows. Needs only torch and
this repository (no DVC, pycolmap or open3d).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.common.params import from_dict  # noqa: E402
from stages.reconstruct.config import ReconstructParams  # noqa: E402
from stages.reconstruct.data import composite, load_scene  # noqa: E402

SEED = 0


def parse_value(text: str):
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def gs_overrides(pairs: list[str]) -> dict:
    """``densify.refine_stop=1500`` -> {"densify": {"refine_stop": 1500}}."""
    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--gs {pair!r}: expected KEY=VALUE")
        node = out
        *path, last = key.split(".")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = parse_value(value)
    return out


def make_params(spec: dict) -> ReconstructParams:
    d = {"method": "3dgs", "device": spec["device"], "steps": spec["steps"], "eval_every": 10**9,
         "tensorboard": False, "gs": spec["gs"],
         "distributed": {"mode": spec["mode"], "checkpoint_every": 0, "replica_check_every": 0,
                         "cpu_workers": spec["gpus"] if spec["device"] == "cpu" else 1,
                         "gpus": spec["gpus"] if spec["device"] == "cuda" else "auto"}}
    return from_dict(ReconstructParams, d, "reconstruct")


@torch.no_grad()
def test_psnr(method, scene, device) -> float:
    """Mean PSNR over the test views, rendered onto the evaluation background (white for RGBA)."""
    bg = torch.tensor(scene.background) if scene.background is not None else (
        torch.ones(3) if scene.test.channels == 4 else torch.zeros(3))
    values = []
    for i in range(len(scene.test)):
        img = scene.test.image(i).to(device).float() / 255.0
        gt = composite(img, bg.to(device)) if img.shape[-1] == 4 else img
        pred = method.render_image(scene.test.intr(i), scene.test.c2w[i].float()).clamp(0, 1)
        values.append(-10.0 * math.log10(max(float(((pred - gt) ** 2).mean()), 1e-10)))
    return sum(values) / max(len(values), 1)


def train_once(spec: dict, ctx=None) -> dict | None:
    """Train one configuration in this process (a rank of it under torchrun); rank 0 returns the row."""
    from stages.reconstruct.distributed import DistContext
    from stages.reconstruct.train import train

    if ctx is None:
        device = torch.device("cuda", torch.cuda.current_device()) if spec["device"] == "cuda" else torch.device("cpu")
        ctx = DistContext(device=device)
    device = ctx.device
    scene = load_scene(spec["poses"])
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    res = train(make_params(spec), scene, device, SEED, progress=False, ctx=ctx)
    if not ctx.is_main:
        return None
    m, steps = res.method, spec["steps"]
    views_per_step = m.batch_size() * (ctx.world_size if spec["mode"] == "replicated" else 1)
    row = {"gpus": ctx.world_size, "mode": spec["mode"], "steps": steps, "views_per_step": views_per_step,
           "train_s": round(res.train_time_s, 3), "ms_per_step": round(1e3 * res.train_time_s / steps, 3),
           "views_per_s": round(steps * views_per_step / res.train_time_s, 2), "gaussians": m.n,
           "peak_gb_per_rank": [round(r[4], 3) for r in res.per_rank], "skipped_steps": res.skipped_steps,
           "test_psnr": round(test_psnr(m, scene, device), 3)}
    part = res.parallel or {}
    if part:
        row.update({"gaussians_per_rank": part["gaussians_per_rank"],
                    "comm_bytes_per_step": part["comm_bytes_per_step"]["total"],
                    "comm_model_bytes_per_step": part["comm_model_bytes_per_step"],
                    "comm_bytes_per_step_split": part["comm_bytes_per_step"],
                    "visible_per_step": part["visible_per_step"], "mean_imbalance": part["mean_imbalance"],
                    "render_ms_per_rank": part["render_ms_per_rank"], "tile_resplits": part["tile_resplits"],
                    "shard_moves": part["shard_moves"]})
    else:  # a ring all-reduce of every gradient: 2 (N - 1) / N of the parameters' bytes per rank
        n = ctx.world_size
        row["comm_bytes_per_step"] = round(2 * (n - 1) * 4 * m.num_params) if n > 1 else 0
        row["comm_model_bytes_per_step"] = row["comm_bytes_per_step"]
    return row


def run_torchrun(spec: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "row.json"
        spec_path.write_text(json.dumps({**spec, "out": str(out)}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(spec["gpus"]), str(Path(__file__).resolve()), "--worker", str(spec_path)]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        p = subprocess.run(cmd, cwd=ROOT, env=env)
        if p.returncode != 0 or not out.is_file():
            raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode})")
        return json.loads(out.read_text())


def worker(spec_path: str) -> int:
    from stages.reconstruct import distributed as D

    spec = json.loads(Path(spec_path).read_text())
    ctx = D.init_from_env(spec["device"])
    try:
        row = train_once(spec, ctx)
        if row is not None:
            Path(spec["out"]).write_text(json.dumps(row))
    finally:
        D.shutdown()
    return 0


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def table(rows: list[dict]) -> str:
    head = ["GPUs", "mode", "train s", "ms/step", "views/s", "test PSNR", "Gaussians", "per rank", "peak GB/rank",
            "comm/step", "model", "imbalance", "raster ms/rank"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(" | ".join(str(v) for v in (
            r["gpus"], r["mode"], f"{r['train_s']:.1f}", f"{r['ms_per_step']:.2f}", f"{r['views_per_s']:.1f}",
            f"{r['test_psnr']:.2f}", f"{r['gaussians']:,}", r.get("gaussians_per_rank", "-"),
            ", ".join(f"{g:.2f}" for g in r["peak_gb_per_rank"]), fmt_bytes(r["comm_bytes_per_step"]),
            fmt_bytes(r["comm_model_bytes_per_step"]),
            "-" if r.get("mean_imbalance") is None else f"{r['mean_imbalance']:.3f}",
            ", ".join(f"{t:.2f}" for t in r.get("render_ms_per_rank", [])) or "-")))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--poses", help="a poses-stage out folder (transforms.json, split.json, images)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--gpus", type=int, nargs="+", default=[1])
    ap.add_argument("--modes", nargs="+", default=["replicated", "partitioned"],
                    choices=["replicated", "partitioned"])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--gs", action="append", default=[], metavar="KEY=VALUE",
                    help="a reconstruct.gs setting, e.g. densify.max_gaussians=2000000 (repeatable)")
    ap.add_argument("--json", help="write the rows (and the machine) here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if not args.poses:
        ap.error("--poses is required")
    if args.device == "cuda" and max(args.gpus) > torch.cuda.device_count():
        raise SystemExit(f"--gpus {max(args.gpus)}: only {torch.cuda.device_count()} GPU(s) visible")
    rows = []
    for gpus in args.gpus:
        for mode in args.modes:
            spec = {"poses": str(Path(args.poses).resolve()), "steps": args.steps, "gpus": gpus, "mode": mode,
                    "device": args.device, "gs": gs_overrides(args.gs)}
            t0 = time.perf_counter()
            row = train_once(spec) if gpus == 1 else run_torchrun(spec)
            row["wall_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            print(f"{gpus} GPU(s) {mode}: {row['train_s']:.1f} s, test PSNR {row['test_psnr']:.2f}", flush=True)
    base = {r["gpus"]: r for r in rows if r["mode"] == "replicated"}
    for r in rows:
        if r["mode"] == "partitioned" and r["gpus"] in base:
            r["time_vs_replicated"] = round(r["train_s"] / base[r["gpus"]]["train_s"], 3)
    print(table(rows))
    for r in rows:
        if "time_vs_replicated" in r:
            print(f"{r['gpus']} GPU(s): partitioned takes {r['time_vs_replicated']:.2f}x replicated's training time "
                  f"for the same steps")
    if args.json:
        machine = {"device": args.device, "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                   "torch": torch.__version__, "python": platform.python_version(),
                   "date": time.strftime("%Y-%m-%d")}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": machine, "poses": args.poses, "steps": args.steps,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
