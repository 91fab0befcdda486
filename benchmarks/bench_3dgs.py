"""3DGS training, this project's method beside gsplat's, on the same GPU, data and starting Gaussians.

    python benchmarks/bench_3dgs.py --poses lego=<poses out> --poses fern=<dir> --poses fox=<dir> \
        --steps 7000 30000 --json benchmarks/results/gs_H200.json

For every scene and step count both trainers start from the same Gaussians (this project's
``gs.model.init_gaussians`` on the poses out's sparse points, or random in the box), see the
same views in the same order (the method's epoch-shuffled sampler), with the same random
backgrounds for RGBA views, the same hyperparameters (the 3DGS reference's: the learning-rate
table, SH degree every 1000 steps, loss 0.8 L1 + 0.2 (1 - SSIM), densification from step 500
to 15k every 100 steps, opacity reset every 3000: ours skips one that falls in the run's last 3000
steps, ``gs.densify.skip_late_reset``, and gsplat 1.5.3 as installed never resets, see below) and the
same SSIM loss kernel
(``kernels.ssim``: gsplat's example trainer takes fused-ssim, which has no wheel; the same op
in both loops keeps the comparison about the rasterizer, the densification and the loop).

* ours: ``stages.reconstruct.train.train`` with ``reconstruct.method: 3dgs`` (the pipeline's
  own loop: CUDA rasterizer kernels, fused SSIM, DensifyStrategy, fused Adam, each view's forward
  and backward replayed in a CUDA graph, ``gs.cuda_graph: auto``); ``--eager`` adds a row
  ``rayforge-eager`` of the same loop with ``gs.cuda_graph: off``. Ours runs as the pipeline ships
  it: views without alpha (fern, fox) render onto its learned background colour
  (``gs.learn_background: auto``), where gsplat's loop renders them onto black as simple_trainer
  does; ``--set learn_background=off`` gives ours black too (this script's default before
  2026-12-06, and the rows of the results files dated earlier);
* gsplat: ``gsplat.rasterization(..., packed=False)`` and ``gsplat.strategy.DefaultStrategy``
  in a loop written after gsplat's ``examples/simple_trainer.py`` (its library as users call it;
  Adam fused as ours). gsplat 1.5.3 compiles its CUDA on first use (~83 s): that happens before
  any timing.
* with ``--set strategy=mcmc``, both sides train 3DGS as MCMC: ours ``gs/mcmc.py``, gsplat its
  ``MCMCStrategy`` with simple_trainer's opacity and scale regularisers (row ``gsplat-mcmc``), from
  the same start (``gs.mcmc.init_opacity``, ``init_scale``) and with the same ``gs.mcmc`` values;
* with ``--gsplat-reset-fix``, gsplat once more with its opacity reset working. 1.5.3's
  DefaultStrategy never resets opacities (``step % reset_every == 0 & step > 0`` parses as a
  chained comparison ending in ``0 > 0``; fixed upstream after 1.5.3, PR #776): a subclass does
  the reset at the steps the fixed line would (row ``gsplat+reset``). The library as installed
  stays the ``gsplat`` row;
* the random start of a scene without sparse points (lego) is ``gs.init_extent`` on both sides:
  100k Gaussians in a cube of half-side init_extent x the scene extent around the scene box's
  centre; 0.3 by default (the 3DGS reference's cube), ``--set init_extent=3.0`` for gsplat
  simple_trainer's ``init_type="random"`` cube (centred on the cameras' centre there),
  ``--set init_extent=0`` for the scene box. On lego at 7k: 32.8 dB on both sides from 0.3, 31.5
  (ours) and 29.8 (gsplat) from 3.0, 31.8 (ours) and 24.4 (gsplat) from the box.

Both are evaluated by the same code: every test view rendered at its own camera onto the
evaluation background (white for RGBA views, as the evaluate stage composites them),
clamped, scored with ``stages.common.metrics`` (PSNR, SSIM), and timed (render FPS). Training
time is wall time of the loop (CUDA synchronised at the end), peak memory is
``torch.cuda.max_memory_allocated`` over training, counted from a clean start: earlier rows are
collected first (``settle``; before 2026-12-02 a row's peak also held what earlier rows of the
same process had left), and each row's ``left_gb`` is what it left allocated. Prints a table;
``--json`` writes the rows. With ``RAYFORGE_PROFILE=<folder>`` (and ``RAYFORGE_PROFILE_STEPS=a:b``)
both loops are profiled over the same steps: ours into ``<folder>/rank0.txt`` (the pipeline's
``StepProfiler``), gsplat's into ``<folder>/gsplat/rank0.txt``.
Needs only torch, gsplat and this repo on the GPU host.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stages.common import metrics as M  # noqa: E402
from stages.common.params import from_dict  # noqa: E402
from stages.reconstruct.config import ReconstructParams  # noqa: E402
from stages.reconstruct.data import composite, load_scene  # noqa: E402


def our_params(steps: int, over: dict | None = None) -> ReconstructParams:
    d = {"method": "3dgs", "device": "cuda", "steps": steps, "eval_every": 10**9, "tensorboard": False,
         "distributed": {"gpus": 1, "checkpoint_every": 0, "replica_check_every": 0},
         # the pipeline's gs defaults (a learned colour behind RGB views); --set overrides them
         "gs": dict(over or {})}
    return from_dict(ReconstructParams, d, "reconstruct")


def eval_background(scene) -> torch.Tensor:
    if scene.background is not None:
        return torch.tensor(scene.background)
    return torch.ones(3) if scene.train.channels == 4 else torch.zeros(3)


def gt_image(views, i: int, bg: torch.Tensor, device) -> torch.Tensor:
    img = views.image(i).to(device).float() / 255.0
    return composite(img, bg.to(device)) if img.shape[-1] == 4 else img


def evaluate(render, scene, device) -> dict:
    """PSNR / SSIM / FPS over the test views with ``render(intr, c2w) -> [H, W, 3]``."""
    bg = eval_background(scene)
    test = scene.test
    psnrs, ssims, times = [], [], []
    render(test.intr(0), test.c2w[0])  # warm-up
    for i in range(len(test)):
        gt = gt_image(test, i, bg, device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pred = render(test.intr(i), test.c2w[i]).clamp(0, 1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        psnrs.append(M.psnr(pred.cpu(), gt.cpu()))
        ssims.append(M.ssim(pred.cpu(), gt.cpu()))
    return {"psnr": sum(psnrs) / len(psnrs), "ssim": sum(ssims) / len(ssims), "fps": len(times) / sum(times),
            "test_views": len(test)}


def settle(device) -> int:
    """Free what earlier rows left (anything held by a reference cycle waits for the cycle
    collector), restart the peak-memory statistics and return the bytes still allocated: a row's
    peak then counts only what is alive for it."""
    gc.collect()
    torch.cuda.synchronize(device)
    # cuBLAS keeps a workspace per stream it ran on for the process's life: an earlier row's would
    # otherwise count in this one's peak
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


MEMORY_REPORT = False  # --memory-report: allocation sites recorded (slower: not for timing)


def live_memory_by_site(device, top: int = 12) -> list[list]:
    """The live CUDA allocations grouped by the repo's innermost two frames that made them, largest
    first, as [site, GB, blocks]; ``graph pool`` marks blocks in a CUDA graph's private pool."""
    snap = torch.cuda.memory._snapshot(device)
    sites: dict[str, list] = {}
    for seg in snap.get("segments", []):
        private = tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0)
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            ours = [f for f in b.get("frames") or [] if str(REPO) in f.get("filename", "")][:2]
            site = (" < ".join(f"{Path(f['filename']).relative_to(REPO)}:{f['line']}" for f in ours)
                    or "outside the repo")
            entry = sites.setdefault(("graph pool: " if private else "") + site, [0, 0])
            entry[0] += b["size"]
            entry[1] += 1
    return [[k, round(v[0] / 1e9, 4), v[1]] for k, v in sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]]


def run_ours(scene, steps: int, device, over: dict | None = None, ply: Path | None = None, seed: int = 0) -> dict:
    from stages.reconstruct.train import train

    params = our_params(steps, over)
    settle(device)
    res = train(params, scene, device, seed, progress=False)
    peak = torch.cuda.max_memory_allocated(device)
    m = res.method
    live = live_memory_by_site(device) if MEMORY_REPORT else None
    if ply is not None:  # the trained Gaussians, e.g. for bench_rasterizer.py --ply
        from stages.reconstruct.gs.ply import save_ply

        save_ply(ply, m.state_dict()["params"])
    out = {"impl": "rayforge" + ("-mcmc" if params.gs.strategy == "mcmc" else ""), "train_s": res.train_time_s,
           "gaussians": m.n, "peak_gb": peak / 1e9,
           "skipped_steps": res.skipped_steps, "cuda_graph": m.summary().get("cuda_graph")}
    if live is not None:
        out["memory_live_after_training"] = live
    out.update(evaluate(lambda intr, c2w: m.render_image(intr, c2w), scene, device))
    return out


def _viewmat(c2w: torch.Tensor) -> torch.Tensor:
    R, t = c2w[:3, :3], c2w[:3, 3]
    v = torch.eye(4, device=c2w.device)
    v[:3, :3] = R.T
    v[:3, 3] = -R.T @ t
    return v


def _K(intr, device) -> torch.Tensor:
    return torch.tensor([[intr.fx, 0.0, intr.cx], [0.0, intr.fy, intr.cy], [0.0, 0.0, 1.0]], device=device)


def _reset_fixed_strategy():
    """gsplat's DefaultStrategy with the opacity reset its 1.5.3 predicate never reaches."""
    from gsplat.strategy import DefaultStrategy
    from gsplat.strategy.ops import reset_opa

    class ResetFixed(DefaultStrategy):
        def step_post_backward(self, params, optimizers, state, step, info, packed=False):
            super().step_post_backward(params, optimizers, state, step, info, packed=packed)
            if 0 < step < self.refine_stop_iter and step % self.reset_every == 0:
                reset_opa(params=params, optimizers=optimizers, state=state, value=self.prune_opa * 2.0)

    return ResetFixed(verbose=False)


def run_gsplat(scene, steps: int, device, over: dict | None = None, reset_fix: bool = False, seed: int = 0) -> dict:
    """gsplat's library in a loop after its examples/simple_trainer.py, with our shared pieces."""
    import gsplat
    from gsplat.strategy import DefaultStrategy, MCMCStrategy

    from kernels.ssim import ssim as fused_ssim
    from stages.reconstruct.gs.method import ViewSampler, _Views
    from stages.reconstruct.gs.model import init_box, init_gaussians, scene_extent
    from stages.reconstruct.train import StepProfiler, seeded_generator

    cfg = our_params(steps, over).gs  # the --set values too: the same initialisation and rates
    torch.manual_seed(seed * 1_000_003)  # what the pipeline's loop seeds before building the method
    g0 = torch.Generator().manual_seed(torch.initial_seed())
    pts = None if scene.points is None else scene.points.to(device)
    rgb = None if scene.point_rgb is None else scene.point_rgb.to(device)
    mcmc = cfg.strategy == "mcmc"  # gsplat's MCMCStrategy beside ours, with the mcmc preset's start
    extent = scene_extent(scene.train.c2w)
    box = init_box(scene.aabb.to(device), scene.train.c2w, cfg.init_extent)  # ours: the same start
    init = init_gaussians(pts, rgb, box, sh_degree=cfg.sh_degree,
                          init_opacity=cfg.mcmc.init_opacity if mcmc else cfg.init_opacity,
                          init_scale=cfg.mcmc.init_scale if mcmc else cfg.init_scale, n_random=cfg.init_random,
                          generator=g0, device=device)
    splats = torch.nn.ParameterDict({k: torch.nn.Parameter(v.detach().clone()) for k, v in init.items()})
    lrs = {"means": cfg.means_lr * extent, "scales": cfg.scales_lr, "quats": cfg.quats_lr,
           "opacities": cfg.opacities_lr, "sh0": cfg.sh0_lr, "shN": cfg.shN_lr}
    optimizers = {k: torch.optim.Adam([{"params": splats[k], "lr": lr, "name": k}], eps=1e-15, fused=True)
                  for k, lr in lrs.items()}
    sched = torch.optim.lr_scheduler.ExponentialLR(optimizers["means"], (cfg.means_lr_final / cfg.means_lr) ** (1 / steps))
    if mcmc:
        mc = cfg.mcmc
        strategy = MCMCStrategy(cap_max=mc.cap_max, noise_lr=mc.noise_lr, refine_start_iter=mc.refine_start,
                                refine_stop_iter=mc.refine_stop, refine_every=mc.refine_every,
                                min_opacity=mc.min_opacity)
        strategy.check_sanity(splats, optimizers)
        state = strategy.initialize_state()
    else:
        strategy = _reset_fixed_strategy() if reset_fix else DefaultStrategy(verbose=False)
        strategy.check_sanity(splats, optimizers)
        state = strategy.initialize_state(scene_scale=extent)

    shard = seeded_generator(seed, 0, device)  # the pipeline's shard 0 stream: same view order, same backgrounds
    views = _Views(scene.train.to(device), ViewSampler(len(scene.train), shard), device)  # as ours reads them
    rgba = views.channels == 4
    eval_bg = eval_background(scene).to(device)
    profiler = StepProfiler(0, device, "gsplat")  # RAYFORGE_PROFILE: gsplat's steps beside ours, in <folder>/gsplat
    settle(device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for step in range(steps):
        profiler.at(step)
        (i,) = views.order.sample(1)
        img = views.image(i).float() / 255.0
        intr = views.intrs[i]
        if rgba:
            bg = torch.rand(3, generator=shard, device=shard.device).to(device)
            gt = composite(img, bg)
        else:
            bg, gt = (eval_bg if scene.background is not None else torch.zeros(3, device=device)), img
        sh_degree = min(step // cfg.sh_degree_every, cfg.sh_degree)
        colors, alphas, info = gsplat.rasterization(
            splats["means"], splats["quats"], torch.exp(splats["scales"]), torch.sigmoid(splats["opacities"]),
            torch.cat([splats["sh0"], splats["shN"]], 1), views.viewmats[i:i + 1], views.Ks[i:i + 1],
            intr.width, intr.height, sh_degree=sh_degree, packed=False,
            backgrounds=bg[None], near_plane=cfg.near, far_plane=cfg.far)
        if not mcmc:
            strategy.step_pre_backward(splats, optimizers, state, step, info)
        pred = colors[0]
        l1 = (pred - gt).abs().mean()
        ssim = fused_ssim(pred.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None])
        loss = (1 - cfg.ssim_lambda) * l1 + cfg.ssim_lambda * (1 - ssim)
        if mcmc:  # simple_trainer's regularisers for MCMC
            loss = (loss + cfg.mcmc.opacity_reg * torch.sigmoid(splats["opacities"]).mean()
                    + cfg.mcmc.scale_reg * torch.exp(splats["scales"]).mean())
        loss.backward()
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        sched.step()
        if mcmc:
            strategy.step_post_backward(splats, optimizers, state, step, info, lr=sched.get_last_lr()[0])
        else:
            strategy.step_post_backward(splats, optimizers, state, step, info, packed=False)
    torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device)

    @torch.no_grad()
    def render(intr, c2w):
        out, _, _ = gsplat.rasterization(
            splats["means"], splats["quats"], torch.exp(splats["scales"]), torch.sigmoid(splats["opacities"]),
            torch.cat([splats["sh0"], splats["shN"]], 1), _viewmat(c2w.to(device).float())[None],
            _K(intr, device)[None], intr.width, intr.height, sh_degree=cfg.sh_degree, packed=False,
            backgrounds=eval_bg[None], near_plane=cfg.near, far_plane=cfg.far)
        return out[0]

    out = {"impl": ("gsplat+reset" if reset_fix else "gsplat") + ("-mcmc" if mcmc else ""), "train_s": train_s,
           "gaussians": int(splats["means"].shape[0]), "peak_gb": peak / 1e9}
    out.update(evaluate(render, scene, device))
    return out


def warm_gsplat(device) -> float:
    """Build gsplat's CUDA extension (JIT on first call) before anything is timed."""
    import gsplat

    t0 = time.perf_counter()
    means = torch.randn(64, 3, device=device) * 0.1 + torch.tensor([0, 0, 2.0], device=device)
    quats = torch.randn(64, 4, device=device)
    scales = torch.full((64, 3), 0.05, device=device, requires_grad=True)
    K = torch.tensor([[[50.0, 0, 32], [0, 50.0, 32], [0, 0, 1]]], device=device)
    colors, _, _ = gsplat.rasterization(means, quats, scales, torch.full((64,), 0.5, device=device),
                                        torch.rand(64, 16, 3, device=device), torch.eye(4, device=device)[None], K,
                                        64, 64, sh_degree=3, packed=False)
    colors.sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--poses", action="append", required=True, metavar="NAME=DIR", help="a scene's poses out")
    ap.add_argument("--steps", type=int, nargs="+", default=[7000])
    ap.add_argument("--only", choices=("rayforge", "gsplat", "gsplat+reset"),
                    help="run one side only (gsplat+reset: that row alone, e.g. to finish a run cut short)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="reconstruct.gs override (ours)")
    ap.add_argument("--gsplat-reset-fix", action="store_true",
                    help="also train gsplat with its opacity reset working (1.5.3 never resets; row gsplat+reset)")
    ap.add_argument("--eager", action="store_true",
                    help="also train ours without the CUDA-graph views (gs.cuda_graph: off; row rayforge-eager)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="train every row once per seed (the start, view order and backgrounds follow it), "
                         "to tell a difference from run-to-run spread")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--save-ply", type=Path, help="folder: our trained Gaussians as <scene>_<steps>.ply")
    ap.add_argument("--memory-report", action="store_true",
                    help="record CUDA allocation sites and list the live ones after our training and after each row "
                         "(slows training: its times are not comparable)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_3dgs: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)  # a CUDA context before the memory-statistics calls (--only rayforge has no warm-up)
    if args.memory_report:
        global MEMORY_REPORT
        MEMORY_REPORT = True
        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=100_000)
    over = {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        import yaml

        over[k] = yaml.safe_load(v)
    if args.only == "gsplat+reset" and over.get("strategy") == "mcmc":
        ap.error("--only gsplat+reset is DefaultStrategy's reset: MCMC has no opacity reset")
    have_gsplat = args.only != "rayforge"
    build_s = None
    if have_gsplat:
        try:
            import gsplat

            print(f"gsplat {gsplat.__version__}: building its CUDA extension (first use)...", flush=True)
            build_s = warm_gsplat(device)
            print(f"gsplat ready in {build_s:.1f} s", flush=True)
        except Exception as exc:  # the wheel is missing or does not build here
            print(f"gsplat unavailable ({type(exc).__name__}: {exc}); our rows only", flush=True)
            have_gsplat = False
    rows = []
    env = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "python": platform.python_version(),
           "gsplat_build_s": build_s}
    if have_gsplat:
        env["gsplat"] = gsplat.__version__
    if over:
        env["set"] = over  # the --set values: our rows' reconstruct.gs overrides
    if args.memory_report:
        env["memory_report"] = "allocation sites recorded: training times are not comparable"

    def save() -> None:  # after every row: a run cut short by a time limit keeps what it finished
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(args.json).with_suffix(".part")
            peer = "gsplat-mcmc" if over.get("strategy") == "mcmc" else "gsplat"  # what the report times rows against
            tmp.write_text(json.dumps({"environment": env, "peer": peer, "rows": rows}, indent=1))
            tmp.replace(args.json)

    # the rows of every scene and step count, then --only's side of them (MCMC resets nothing)
    reset_row = (args.gsplat_reset_fix or args.only == "gsplat+reset") and over.get("strategy") != "mcmc"
    sides = ["rayforge"] + (["rayforge-eager"] if args.eager else [])
    if have_gsplat:
        sides += ["gsplat"] + (["gsplat+reset"] if reset_row else [])
    if args.only:
        keep = {"rayforge": ("rayforge", "rayforge-eager"), "gsplat": ("gsplat", "gsplat+reset"),
                "gsplat+reset": ("gsplat+reset",)}[args.only]
        sides = [impl for impl in sides if impl in keep]

    for spec in args.poses:
        name, _, path = spec.partition("=")
        scene = load_scene(path)
        # which SfM result the rows stand on: poses outs made on other days or machines can differ
        poses_md5 = hashlib.md5((Path(path) / "transforms.json").read_bytes()).hexdigest()
        print(f"== {name}: {len(scene.train)} train / {len(scene.test)} test views, "
              f"{0 if scene.points is None else len(scene.points)} sparse points, transforms.json md5 "
              f"{poses_md5[:12]}", flush=True)
        for steps, seed, impl in [(st, sd, im) for st in args.steps for sd in args.seeds for im in sides]:
            tail = f"_s{seed}" if len(args.seeds) > 1 else ""
            ply = None if args.save_ply is None else args.save_ply / f"{name}_{steps}{tail}.ply"
            if impl == "rayforge":
                row = run_ours(scene, steps, device, over, ply, seed=seed)
            elif impl == "rayforge-eager":
                row = run_ours(scene, steps, device, {**over, "cuda_graph": "off"}, seed=seed)
                row["impl"] += "-eager"
            else:
                row = run_gsplat(scene, steps, device, over, reset_fix=impl == "gsplat+reset", seed=seed)
            # what the row left allocated once its objects are gone (should be ~0: the scene's tensors
            # are on the CPU); a leak would otherwise show up as the next row's peak
            row.update(scene=name, steps=steps, seed=seed, poses_md5=poses_md5, left_gb=settle(device) / 1e9)
            if MEMORY_REPORT and row["left_gb"] > 0.001:
                row["memory_left"] = live_memory_by_site(device)
            for key in ("memory_live_after_training", "memory_left"):
                for site, gb, blocks in row.get(key, [])[:6]:
                    print(f"   {key}: {gb:7.3f} GB in {blocks:5d} blocks at {site}", flush=True)
            rows.append(row)
            save()
            print(f"   {impl:14s} {steps:6d} steps: {row['train_s']:7.1f} s, PSNR {row['psnr']:.2f}, SSIM "
                  f"{row['ssim']:.4f}, {row['gaussians']:,} Gaussians, {row['peak_gb']:.2f} GB, "
                  f"{row['fps']:.0f} FPS", flush=True)
    print("\n| scene | steps | impl | train s | time vs gsplat | PSNR | SSIM | Gaussians | peak GB | FPS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = next((x for x in rows if x["impl"] in ("gsplat", "gsplat-mcmc") and x["scene"] == r["scene"]
                    and x["steps"] == r["steps"] and x["seed"] == r["seed"]),
                   None)
        ratio = f"{r['train_s'] / ref['train_s']:.2f}x" if ref else ""
        scene_cell = r["scene"] + (f" (seed {r['seed']})" if len(args.seeds) > 1 else "")
        print(f"| {scene_cell} | {r['steps']} | {r['impl']} | {r['train_s']:.1f} | {ratio} | {r['psnr']:.2f} | "
              f"{r['ssim']:.4f} | {r['gaussians']:,} | {r['peak_gb']:.2f} | {r['fps']:.0f} |")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
