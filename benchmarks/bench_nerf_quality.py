"""NeRF quality against wall-clock training time (issue 17): test PSNR / SSIM at 15, 30, 60, 120 s.

Not a test: trains each scene once through the training entry point (``stages.reconstruct.train.train``,
the loop the reconstruct stage runs), snapshots the model the first time the training clock passes each
budget, and evaluates every snapshot afterwards (outside the timed region: the clock is paused while a
snapshot is copied, and stops at the last budget). So the four rows of a scene are one model at four
moments, as instant-ngp's 15 s / 60 s numbers are. Per scene it also prints samples/s and rays/s over the
run, the peak GPU memory, and the time to render one view at 800 px on its longest side. ``--method 3dgs``
trains ``reconstruct.method=3dgs`` on the same scenes side by side (skipped, with the reason, where that
method cannot be built here).

    python benchmarks/bench_nerf_quality.py --poses lego=<lego poses> --poses fox=<fox poses> \\
        --poses fern=<fern poses> --method 3dgs --json nerf_quality.json

``--poses`` takes poses-stage outs (``name=dir``). Lego's must keep its alpha channel (``ingest.alpha:
keep``, ``poses.source: transforms``): with images composited on white the field can paint white floaters
for free (see the README), and its test views are scored on white either way. Real captures (no alpha, no
known background) train with scene contraction (``--contraction auto``). Needs a CUDA GPU, torch and this
repository (no DVC, pycolmap or open3d); ``--allow-cpu`` runs it on the CPU with tiny budgets (a smoke test).

``--print-sets`` trains nothing: it prints the profile this script would train one scene with as ``-S``
flags, to train it in the pipeline (``rayforge train $(python benchmarks/bench_nerf_quality.py --poses
scene=data/poses --print-sets)``).

Targets (one H200, issue 17): lego >= 33.4 dB at 15 s and >= 35.7 dB at 60 s; test PSNR never drops by more
than 0.2 dB from one budget to the next; fox and fern within 1 dB of 3DGS at 120 s. Each is printed as
PASS / FAIL / n/a at the end.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import re
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.common import metrics as M  # noqa: E402
from stages.common.params import from_dict  # noqa: E402
from stages.reconstruct.config import ReconstructParams  # noqa: E402
from stages.reconstruct.data import composite, load_scene  # noqa: E402
from stages.reconstruct.nerf.method import viewing_spread_deg  # noqa: E402

train_module = importlib.import_module("stages.reconstruct.train")  # the module (the package exports the function)

BUDGETS = (15.0, 30.0, 60.0, 120.0)

# The GPU profile recommended for the NeRF (params.yaml's reconstruct section, then these): instant-ngp's
# encoding (L=16, T=2^19) with its finest level at one cell per pixel footprint (max_resolution auto:
# lego 375, where instant-ngp's 2048 lost 0.3 dB at 60 s; 4096 with scene contraction) and training
# (2^18 samples a step with the rays adapting, Adam that skips untouched table entries, an average of
# the weights for rendering), march steps of the box diagonal / 1024 as instant-ngp's sqrt(3)/1024 of
# the unit cube, a 128^3 occupancy grid warmed up for 256 steps, TF32 matmuls. Every scene trains as a
# 25k-step run (about what 120 s holds on an H200) whose learning rate decays exponentially to lr_final
# over those steps; the budgets are snapshots of it. With instant-ngp's step-free schedule ("ngp") fox
# lost 1.2 dB and fern 0.7 dB from 30 s to 120 s (2026-12-01 rows of nerf_quality_H200.json), and lego
# in its alpha hull scored 32.35 / 33.32 / 33.72 dB at 15 / 30 / 60 s against 32.50 / 33.51 / 33.88
# with this (H200, 2026-12-04, finest 2048).
GPU_NERF = {
    "levels": 16, "features_per_level": 2, "log2_hashmap_size": 19, "max_resolution": "auto",
    "samples_per_ray": 1400, "occ_resolution": 128, "occ_warmup_steps": 256, "lr": 1e-2, "lr_schedule": "exp",
    "ema_decay": 0.99, "table_optimizer": "sparse", "target_samples": 1 << 18, "mlp_precision": "bfloat16",
    "distortion_loss": 0.0,  # instant-ngp has none; params.yaml's CPU profile does (--set nerf.distortion_loss=...)
    "mlp_init": "tcnn", "cull_occluded": True,
}
# The MLPs in bfloat16 (autocast), not TF32: on lego 34.72 / 35.78 / 36.02 / 36.08 dB at 15 / 30 / 46 / 60 s
# (seed 1: 34.46 / 35.56 / 35.79 / 35.83), TF32 34.22 / 35.17 / 35.38 / 35.43, with 3 % fewer steps (one H100,
# 2026-12-07, gpu_session.sh parts bk and bm). TF32 is torch's process-wide switch, so it presumably also rounded
# the rays' R d matmul (up to 0.3 px on lego, emulated; pixel_rays has no matmul since): not measured apart yet.
# Contracted scenes keep TF32 (CONTRACTED_NERF), as fox and fern were measured (with the rays' matmul then); bf16
# waits for a run there (gpu_session.sh part bn).
# Tiny-cuda-nn's MLP layers (no biases, Glorot-uniform), culling, and the march step of nerfacc's example (5e-3 on
# lego: 1400 across the box diagonal, was 1024), each over the profile before them on lego at 15 / 30 / 46 / 60 s
# (one H100, one call, 2026-12-07, gpu_session.sh part ax): the profile 32.71 / 33.77 / 34.12 / 34.26 dB;
# + tcnn layers 33.39 / 34.17 / 34.39 / 34.49; + culling 33.23 / 34.00 / 34.25 / 34.34; both 33.83 / 34.41 /
# 34.50 / 34.50; both + 1400 steps 33.63 / 34.42 / 34.62 / 34.66. Contracted scenes: CONTRACTED_NERF
# The weight average's decay is 0.99, not instant-ngp's 0.95 (the last ~100 steps, not ~20): on lego it
# gained 0.42 / 0.20 / 0.03 dB at 15 / 30 / 60 s (seed 0) and 0.25 / 0.23 / 0.10 (seed 1), on fern 0.30 /
# 0.69 / 0.62 at 30 / 60 / 120 s, on fox 0.24 / 0.12 / 0.07 (on poses from another SfM run); decays 0.98
# and 0.995 scored within 0.1 dB of 0.99 on lego (one H100, 2026-12-06, gpu_session.sh parts ai-al)
GPU_RECONSTRUCT = {"batch_rays": 8192, "steps": 25_000}
# real captures (no alpha, no known background): the world past the box contracted into a shell around it;
# the box then takes the middle half of the hash grid per axis, so the finest level doubles, and the march
# step is that of instant-ngp's 512 steps across the box. No culling there: with it fox scored 31.56 / 31.73 /
# 31.83 dB at 30 / 60 / 120 s, without 31.62 / 32.11 / 32.38; fern 27.76 / 27.83 / 27.66 with, 27.75 / 28.00 /
# 28.07 without (one H100, 2026-12-07, gpu_session.sh part bb and two runs after it on the same machine).
# The finest level "auto" is 4096 with contraction (2048 over the box), and with --set
# nerf.scene_contraction=cascades (instant-ngp's occupancy cascades instead) 2048 x aabb_scale
CONTRACTED_NERF = {"scene_contraction": "mipnerf360", "max_resolution": "auto", "samples_per_ray": 512,
                   "cull_occluded": False, "mlp_precision": "tf32"}
# captures that go around their subject (the widest angle between two views' axes at least this, fox: 98
# degrees) get mip-NeRF 360's distortion loss at this weight, as mip-NeRF 360 uses it on its 360 scenes;
# forward-facing ones (fern: 19 degrees) none: there it cost fern 3.8 dB at 0.001 and 13 dB at 0.01
# (H200, 2026-12-04), as its rays see leaves in front of a wall and the term pulls their weights together
SURROUNDING_DEG = 45.0
SURROUNDING_DISTORTION = 1e-3
# 3DGS side by side: the 3DGS reference's 30k-step schedule (the clock stops it earlier) and its
# densification (500 / 15000 / every 100, no Gaussian budget: the densify defaults, as bench_3dgs.py
# trains), not params.yaml's CPU profile (a 60k budget, reached on fox at step 151)
GPU_3DGS = {"steps": 30_000}


class _BudgetReached(Exception):
    """Raised from the method's ``after_step`` once the last budget's snapshot is taken (stops training)."""


class Clock:
    """Training time with pauses (snapshots), started at the first step's ``step_pre_forward``."""

    def __init__(self, device: torch.device):
        self.device, self.t0, self.paused = device, None, 0.0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        if self.t0 is None:
            self.sync()
            self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return 0.0 if self.t0 is None else time.perf_counter() - self.t0 - self.paused


def _clone(state):
    """A copy of a state dict's tensors on the CPU (a snapshot that later training cannot change)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_clone(v) for v in state)
    return state


def train_with_snapshots(params: ReconstructParams, scene, device: torch.device, budgets, seed: int = 0) -> dict:
    """Train through ``train.train`` until the clock passes the last budget; returns the snapshots (state,
    time, steps, work) and the run's figures. The method is wrapped where the loop calls it (its
    ``step_pre_forward`` starts the clock, ``forward_backward`` counts the work on the device without a
    sync, ``after_step`` takes the snapshots), so any registered method runs the same way."""
    clock = Clock(device)
    todo = sorted(budgets)
    out = {"snapshots": [], "method": None}
    steps_done, work_done = [0], [None]  # the last step and the work counters, for a run that ends early
    real_build = train_module.build_method

    def build(*a, **kw):
        method = real_build(*a, **kw)
        out["method"] = method
        work = torch.zeros(2, dtype=torch.float64, device=device)  # samples, rays
        steps = steps_done
        work_done[0] = work
        pre, fb, after = method.step_pre_forward, method.forward_backward, method.after_step

        def step_pre_forward(step, generator):
            clock.start()
            return pre(step, generator)

        def forward_backward(batch, generator, before_backward=None):
            info = fb(batch, generator, before_backward)
            units = batch[0].shape[0] if isinstance(batch, (tuple, list)) else len(getattr(batch, "indices", ()))
            work[0] += torch.as_tensor(info["num_samples"], device=device).double()
            work[1] += units
            return info

        def after_step(step, strategy):
            changed = after(step, strategy)
            steps[0] = step + 1
            if todo and clock.elapsed() >= todo[0]:
                clock.sync()
                t = clock.elapsed()  # the GPU has finished every step queued up to here
                mark = time.perf_counter()
                while todo and t >= todo[0]:
                    out["snapshots"].append({"budget": todo.pop(0), "time_s": t, "steps": steps[0],
                                             "samples": float(work[0]), "units": float(work[1]),
                                             "state": _clone(method.state_dict())})
                clock.paused += time.perf_counter() - mark
                if not todo:
                    raise _BudgetReached
            return changed

        method.step_pre_forward, method.forward_backward, method.after_step = (
            step_pre_forward, forward_backward, after_step)
        return method

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    train_module.build_method = build
    try:
        train_module.train(params, scene, device, seed, progress=False)
        out["stopped"] = "ran out of steps (reconstruct.steps) before the last budget"
        # a run that finished early is its final model at every later budget (3DGS's 30k steps take
        # about 60 s of fox on an H200): those rows say so, with the time it really trained
        if todo and out["method"] is not None:
            clock.sync()
            state, elapsed = _clone(out["method"].state_dict()), clock.elapsed()
            for budget in todo:  # (a budget the last step ran past is an ordinary snapshot of it)
                out["snapshots"].append({"budget": budget, "time_s": elapsed, "steps": steps_done[0],
                                         "samples": float(work_done[0][0]), "units": float(work_done[0][1]),
                                         "finished": elapsed < budget, "state": state})
    except _BudgetReached:
        out["stopped"] = "budget"
    finally:
        train_module.build_method = real_build
    out["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return out


def evaluate(method, scene, max_views: int = 0, split: str = "test") -> tuple[float, float, list[float]]:
    """Mean PSNR and SSIM over the test views (RGBA ground truth composited on the scene's known colour,
    else white, as the evaluate stage does) and the per-view PSNRs. ``split="train"``: as many training
    views as test views are scored (at most ``max_views``), spread evenly over the training set, for
    the gap between what the field fits and what it predicts."""
    views = scene.test if split == "test" else scene.train
    bg = scene.background or (1.0, 1.0, 1.0)
    if split == "test":
        idx = list(range(len(views)))[: max_views or None]
    else:
        n = max(1, min(len(views), len(scene.test), max_views or len(views)))
        idx = sorted({round(k * (len(views) - 1) / max(1, n - 1)) for k in range(n)})
    psnrs, ssims = [], []
    for i in idx:
        gt = composite(views.image(i).float() / 255.0, bg).cpu()
        pred = method.render_image(views.intr(i), views.c2w[i].float()).float().cpu().clamp(0, 1)
        psnrs.append(M.psnr(pred, gt))
        ssims.append(M.ssim(pred, gt))
    return sum(psnrs) / len(psnrs), sum(ssims) / len(ssims), psnrs


def render_time(method, scene, device: torch.device, side: int = 800) -> dict:
    """Seconds to render the first test view with its camera scaled to ``side`` px on its longest side
    (best of 3 after a warm-up)."""
    views = scene.test if len(scene.test) else scene.train
    intr = views.intr(0)
    intr = intr.scaled(side / max(intr.width, intr.height))
    c2w = views.c2w[0].float()
    method.render_image(intr, c2w)
    best = math.inf
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        method.render_image(intr, c2w)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return {"size": f"{intr.width}x{intr.height}", "seconds": best}


def profile(method: str, scene, contraction: str = "auto") -> dict:
    """This script's GPU profile of ``method`` for ``scene``: the keys it lays on params.yaml's reconstruct
    section (``nerf`` and ``gs`` are merged key by key), with the rules that read the scene (contraction and
    the distortion loss for captures without alpha)."""
    if method != "nerf":
        return {"method": method, **GPU_3DGS, "gs": {"densify": {}}}
    nerf = dict(GPU_NERF)
    real = scene.background is None and scene.train.channels == 3
    if contraction == "on" or (contraction == "auto" and real):
        nerf.update(CONTRACTED_NERF)
        if viewing_spread_deg(scene.train.c2w) >= SURROUNDING_DEG:
            nerf["distortion_loss"] = SURROUNDING_DISTORTION
    return {"method": method, **GPU_RECONSTRUCT, "nerf": nerf}


def profile_sets(prof: dict) -> list[str]:
    """``prof`` as ``reconstruct.<key>=<value>`` overrides for ``rayforge train -S`` or ``dvc exp run -S``
    (values in YAML flow style; strings bare where YAML reads them back as the same string)."""
    out = []

    def value_text(v) -> str:
        if isinstance(v, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", v) and yaml.safe_load(v) == v:
            return v
        return json.dumps(v)

    for key, value in prof.items():
        if isinstance(value, dict) and value:
            out += [f"reconstruct.{key}.{k}={value_text(v)}" for k, v in value.items()]
        else:
            out.append(f"reconstruct.{key}={value_text(value)}")
    return out


def make_params(method: str, scene, contraction: str, sets: list[str], device: torch.device) -> ReconstructParams:
    """params.yaml's reconstruct section with this script's profile and the --set overrides."""
    data = yaml.safe_load((ROOT / "params.yaml").read_text())["reconstruct"]
    data.update(device=device.type, eval_every=10**9, tensorboard=False)
    data["distributed"].update(gpus=1, checkpoint_every=0, replica_check_every=0)
    for key, value in profile(method, scene, contraction).items():
        if isinstance(value, dict) and value:
            data[key].update(value)
        else:
            data[key] = value
    for kv in sets:
        key, _, value = kv.partition("=")
        *path, last = key.split(".")
        obj = data
        for k in path:
            obj = obj.setdefault(k, {})
        obj[last] = yaml.safe_load(value)
    return from_dict(ReconstructParams, data, "reconstruct")


def run_scene(name: str, poses: Path, method: str, args, device: torch.device) -> dict:
    from stages.reconstruct.data import working_side

    scene = load_scene(poses, max_side=working_side(device))
    params = make_params(method, scene, args.contraction, args.set if method == "nerf" else args.set_3dgs, device)
    print(f"{name}: {method}, {len(scene.train)} train / {len(scene.test)} test views, "
          f"{'RGBA' if scene.train.channels == 4 else 'RGB'}, budgets {args.budgets} s", flush=True)
    run = train_with_snapshots(params, scene, device, args.budgets, args.seed)
    fresh = importlib.import_module("stages.reconstruct.methods").build_method(
        params, scene.aabb, device, scene.background, scene)
    rows = []
    train_views = scene.train.to(device) if method == "nerf" else None  # for the occlusion census
    for snap in run["snapshots"]:
        fresh.load_state_dict(snap.pop("state"))
        if snap.get("finished"):
            print(f"  {snap['budget']:6g} s: (finished at {snap['time_s']:.1f} s, step {snap['steps']})", flush=True)
        psnr, ssim, per_view = evaluate(fresh, scene, args.max_views)
        train_psnr = evaluate(fresh, scene, args.max_views, split="train")[0]
        t = snap["time_s"]
        rows.append({**snap, "psnr": psnr, "ssim": ssim, "worst_view_psnr": min(per_view), "train_psnr": train_psnr,
                     "samples_per_s": snap["samples"] / t, "units_per_s": snap["units"] / t})
        if train_views is not None:  # the step's samples behind opaque surfaces (NerfMethod.occlusion_census)
            census = fresh.occlusion_census(train_views)
            rows[-1]["occlusion"] = census
            print(f"  {snap['budget']:6g} s: {census['samples_per_ray']:.1f} samples a ray, "
                  f"{100 * census['occluded_share']:.1f} % behind T < 1e-4", flush=True)
        print(f"  {snap['budget']:6g} s: step {snap['steps']:6d}, {psnr:6.2f} dB, SSIM {ssim:.4f} "
              f"(worst view {min(per_view):.2f} dB; training views {train_psnr:.2f} dB)", flush=True)
    timing = render_time(fresh, scene, device, args.render_side) if rows else None
    summary = run["method"].summary() if run["method"] is not None else {}
    poses_md5 = hashlib.md5((Path(poses) / "transforms.json").read_bytes()).hexdigest()  # which SfM result
    return {"scene": name, "method": method, "poses": str(poses), "poses_md5": poses_md5, "rows": rows,
            "stopped": run["stopped"],
            "peak_memory_bytes": run["peak_memory_bytes"], "render_800": timing,
            "params": {k: v for k, v in vars(params).items() if k in ("batch_rays", "steps")},
            "nerf": vars(params.nerf) if method == "nerf" else None, "summary": summary}


def targets(results: list[dict]) -> list[tuple[str, str]]:
    """(target, PASS | FAIL | n/a with the figures) for issue 17's targets."""
    judged = [r for r in results if "rows" in r and not r.get("variant")]  # a variant (--merge FILE=label): none
    by = {(r["scene"], r["method"]): {row["budget"]: row["psnr"] for row in r["rows"]} for r in judged}
    md5 = {(r["scene"], r["method"]): r.get("poses_md5") for r in judged}
    out = []

    def verdict(ok: bool | None, text: str) -> str:
        return ("n/a" if ok is None else "PASS" if ok else "FAIL") + f" ({text})"

    lego = by.get(("lego", "nerf"), {})
    for budget, want in ((15.0, 33.4), (60.0, 35.7)):
        got = lego.get(budget)
        out.append((f"lego >= {want} dB at {budget:g} s", verdict(None if got is None else got >= want,
                                                                  "no run" if got is None else f"{got:.2f} dB")))
    for (scene, method), rows in by.items():
        if method != "nerf":
            continue
        b = sorted(rows)
        drops = [rows[x] - rows[y] for x, y in zip(b, b[1:])]
        worst = max(drops, default=0.0)
        out.append((f"{scene}: no drop > 0.2 dB between budgets", verdict(worst <= 0.2, f"largest drop {worst:.2f} dB")))
    for scene in ("fox", "fern"):
        nerf, gs = by.get((scene, "nerf"), {}).get(120.0), by.get((scene, "3dgs"), {}).get(120.0)
        # merged runs of one scene may have trained on different poses outs (SfM again): not comparable
        apart = nerf is not None and gs is not None and md5[(scene, "nerf")] != md5[(scene, "3dgs")]
        ok = None if nerf is None or gs is None or apart else nerf >= gs - 1.0
        out.append((f"{scene} within 1 dB of 3DGS at 120 s",
                    verdict(ok, "no 3DGS run" if gs is None else "no NeRF run" if nerf is None
                            else f"NeRF {nerf:.2f} dB, 3DGS {gs:.2f} dB" + (", on different poses" if apart else ""))))
    return out


def label(r: dict) -> str:
    """A run's method, with its variant (``--merge FILE=label``) when it has one."""
    return r["method"] + (f" ({r['variant']})" if r.get("variant") else "")


def table(results: list[dict]) -> str:
    head = ["scene", "method", "budget", "steps", "PSNR", "SSIM", "worst view", "train views", "samples/s",
            "rays|views/s", "peak mem", "render 800"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["scene"], r["method"], "skipped", "", "", "", "", "", "", "", "", r["error"][:60]])
            continue
        mem = "" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.1f} GiB"
        ren = "" if r["render_800"] is None else f"{r['render_800']['seconds'] * 1e3:.0f} ms ({r['render_800']['size']})"
        for row in r["rows"]:
            rows.append([r["scene"], label(r), f"{row['budget']:g} s" + (" (ended)" if row.get("finished") else ""),
                         row["steps"], f"{row['psnr']:.2f}",
                         f"{row['ssim']:.4f}", f"{row['worst_view_psnr']:.2f}",
                         "" if row.get("train_psnr") is None else f"{row['train_psnr']:.2f}",
                         f"{row['samples_per_s'] / 1e6:.1f} M",
                         f"{row['units_per_s'] / 1e6:.3f} M" if r["method"] == "nerf" else f"{row['units_per_s']:.0f}",
                         mem, ren])
    cols = [head] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cols) for i in range(len(head))]
    fmt = lambda r: "| " + " | ".join(c.rjust(w[i]) for i, c in enumerate(r)) + " |"  # noqa: E731
    return "\n".join([fmt(head), "|" + "|".join("-" * (x + 2) for x in w) + "|"] + [fmt(r) for r in cols[1:]])


def report_rows(results: list[dict]) -> list[dict]:
    """One row per (scene, method, budget) in the layout the report's benchmark appendix reads
    (``stages.report.read_benchmark``: scene, steps, impl, train_s, psnr, ...)."""
    out = []
    for r in results:
        mem = r.get("peak_memory_bytes")
        for row in r.get("rows", []):
            out.append({"scene": r["scene"], "steps": row["steps"], "impl": f"rayforge {label(r)}",
                        "budget_s": row["budget"], "train_s": row["time_s"], "psnr": row["psnr"], "ssim": row["ssim"],
                        "worst_view_psnr": row["worst_view_psnr"], "train_views_psnr": row.get("train_psnr"),
                        "peak_gb": None if mem is None else mem / 1e9, "poses_md5": r.get("poses_md5")})
    return out


PEER = "rayforge 3dgs"  # what the report sets each row beside: the 3DGS method at the same budget
PROTOCOL = ("in one run per scene (bench_nerf_quality.py): the model snapshotted as its training clock passed each "
            "budget; 'train s' is that budget's training time, every test view scored.")


def document(gpu: str, budgets, results: list[dict], sets: dict | None = None, torch_version: str | None = None) -> dict:
    """The JSON this script writes (the report's benchmark appendix reads ``rows``); ``torch_version``:
    the runs' (default: this process's)."""
    tv = torch_version or torch.__version__
    return {"gpu": gpu, "torch": tv, "budgets": budgets,
            "environment": {"gpu": gpu, "torch": tv}, "protocol": PROTOCOL, "sets": sets or {}, "peer": PEER,
            "rows": report_rows(results), "results": results, "targets": dict(targets(results))}


def merge(specs: list[str]) -> dict:
    """One document from several of this script's JSONs (``FILE`` or ``FILE=label``), e.g. one run per
    scene. A label marks a variant (other ``--set`` values): its rows are named ``rayforge nerf
    (label)`` and it is left out of the targets, which judge the unlabelled runs. The runs must come
    from one kind of GPU."""
    results, gpus, torches, budgets = [], set(), set(), set()
    for spec in specs:
        path, _, label = spec.partition("=")
        doc = json.loads(Path(path).read_text())
        gpus.add(doc["gpu"])
        torches.add(doc.get("torch", "unknown"))
        budgets.update(doc["budgets"])
        for r in doc["results"]:
            results.append({**r, "variant": label} if label else r)
    if len(gpus) != 1:
        raise SystemExit(f"bench_nerf_quality --merge: runs from different GPUs ({', '.join(sorted(gpus))})")
    doc = document(gpus.pop(), sorted(budgets), results, torch_version=", ".join(sorted(torches)))
    doc["merged_from"] = [Path(path).name + (f"={label}" if label else "")
                          for path, _, label in (spec.partition("=") for spec in specs)]
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--poses", action="append", default=[], help="name=poses-stage out (repeatable)")
    ap.add_argument("--method", action="append", choices=["3dgs"], default=[],
                    help="also train this method on every scene (reconstruct.method=3dgs), side by side")
    ap.add_argument("--no-nerf", action="store_true",
                    help="train only the --method runs (their rows, to set beside an earlier NeRF run's)")
    ap.add_argument("--budgets", default=",".join(f"{b:g}" for b in BUDGETS),
                    help="wall-clock training budgets in seconds, comma separated")
    ap.add_argument("--set", action="append", default=[], help="reconstruct.<key>=<yaml value> for the NeRF runs")
    ap.add_argument("--set-3dgs", action="append", default=[], help="reconstruct.<key>=<yaml value> for 3DGS runs")
    ap.add_argument("--contraction", choices=["auto", "on", "off"], default="auto",
                    help="scene contraction for the NeRF: auto = for scenes without alpha or a known background")
    ap.add_argument("--max-views", type=int, default=0, help="evaluate at most this many test views (0: all)")
    ap.add_argument("--render-side", type=int, default=800, help="longest side of the timed render (px)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU (a smoke test with tiny budgets)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--print-sets", action="store_true",
                    help="train nothing: print the NeRF profile this script would train the one --poses scene with, "
                         "as -S flags for rayforge train or dvc exp run (the --set values included)")
    ap.add_argument("--merge", nargs="+", metavar="FILE[=label]",
                    help="train nothing: merge earlier --json files (one GPU kind) into --json; a label marks a "
                         "variant run, named in its rows and left out of the targets")
    args = ap.parse_args(argv)
    if args.merge:
        if not args.json:
            ap.error("--merge needs --json")
        doc = merge(args.merge)
        args.json.write_text(json.dumps(doc, indent=2, default=str))
        print(table(doc["results"]))
        for what, verdict in doc["targets"].items():
            print(f"  {verdict.split(' ')[0]:5s} {what} {verdict[verdict.find('('):]}")
        print(f"wrote {args.json}")
        return 0
    if not args.poses:
        ap.error("--poses is required (or --merge)")
    if args.print_sets:
        if len(args.poses) != 1:
            ap.error("--print-sets takes one --poses")
        from stages.common.params import ParamsError
        from stages.reconstruct.data import load_scene

        scene = load_scene(Path(args.poses[0].partition("=")[2] or args.poses[0]), max_side=64)
        try:
            make_params("nerf", scene, args.contraction, args.set, torch.device("cpu"))  # a bad --set fails here
        except ParamsError as exc:
            raise SystemExit(f"bench_nerf_quality --print-sets: {exc}") from None
        sets = profile_sets(profile("nerf", scene, args.contraction)) + [f"reconstruct.{kv}" for kv in args.set]
        print(" ".join(f"-S {kv}" for kv in sets))
        return 0
    args.budgets = sorted(float(b) for b in args.budgets.split(","))
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        import kernels

        if kernels.available():  # compiled (or read from the disk cache) and loaded before any clock runs
            for prog in kernels.default_programs():
                prog.load(device)
    elif args.allow_cpu:
        device = torch.device("cpu")
    else:
        sys.exit("bench_nerf_quality needs a CUDA GPU (--allow-cpu for a CPU smoke test)")
    results = []
    for spec in args.poses:
        name, _, path = spec.rpartition("=")
        poses = Path(path)
        name = name or poses.parent.name or poses.name
        for method in [*([] if args.no_nerf else ["nerf"]), *dict.fromkeys(args.method)]:
            try:
                results.append(run_scene(name, poses, method, args, device))
            except Exception as exc:  # noqa: BLE001 -- a method that cannot be built here is skipped, not fatal
                if method == "nerf":
                    raise
                print(f"{name}: {method} skipped: {type(exc).__name__}: {exc}", flush=True)
                results.append({"scene": name, "method": method, "error": f"{type(exc).__name__}: {exc}"})
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\nNeRF quality against training time ({gpu}, torch {torch.__version__})")
    print(table(results))
    checks = targets(results)
    print("\nTargets (issue 17):")
    for what, verdict in checks:
        print(f"  {verdict.split(' ')[0]:5s} {what} {verdict[verdict.find('('):]}")
    if args.json:
        doc = document(gpu, args.budgets, results, {"nerf": args.set, "3dgs": args.set_3dgs})
        args.json.write_text(json.dumps(doc, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
