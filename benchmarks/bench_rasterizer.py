"""3DGS rasterizer: our kernels (kernels.rasterization) beside gsplat's rasterization(..., packed=False)
in the same run, on the same GPU, on identical inputs (same Gaussians, camera, image size).

Not a test: prints a table (ours | gsplat | ratio) and writes JSON. Needs a CUDA GPU, torch, gsplat
(pip install gsplat==1.5.3) and this repository, nothing else.

    python benchmarks/bench_rasterizer.py --json benchmarks/results/rasterizer_H200.json
    python benchmarks/bench_rasterizer.py --ply point_cloud.ply --json out.json    # a trained scene too
    python benchmarks/bench_rasterizer.py --sizes 100000 --repeats 5               # a quick look
    python benchmarks/bench_rasterizer.py --sizes 3000000 --profile 10             # GPU time per kernel

Scenes: N random Gaussians (seeded) in the view frustum of a 1920 x 1080 pinhole camera (fx = fy =
1200), depths 2..12, anisotropic log-normal scales (median 0.01, like a trained scene's), random
rotations, opacities sigmoid(N(0, 1.5)), SH degree 3; and with --ply a trained scene's Gaussians
(the 3DGS PLY layout: x y z ... f_dc_* f_rest_* opacity scale_* rot_*) seen from a camera placed
--distance x its radius from its centre.

Figures per scene and rasterizer: forward, backward and forward+backward in ms (CUDA events,
--warmup iterations, then the median of --repeats >= 20), peak memory of a forward+backward above
what the inputs hold, and the image difference; for ours also the first-use NVRTC compile and load
of the rasterizer's programs (an empty kernel cache) and the stage times of our pipeline. Ours runs
once per way of sorting the M camera|tile keys (after a depth sort of the N Gaussians):
torch.sort (stable, all 32 bits, an int64 permutation), torch.sort of the keys narrowed to int16
(``torch16``: fewer than 2^15 camera|tile ids, half the radix passes) and our own radix sort (only
the keys' bits, key/value pairs; kernels/_gs_cuda.py SORT picks the default), and once more with validate=False, as
the training loop calls it (the public default checks the values: one kernel and a host read that
waits for the GPU, which gsplat does not do). Two more rows of ours: with a fixed budget of tile
intersections (``capacity``, 30 % above the count: no host read at all), and that call's forward
and backward captured in a CUDA graph and replayed, as the 3DGS training step runs them (forward
+ backward only). gsplat 1.5.3 compiles its CUDA on first use (~83 s on the H200): that is done,
and reported, before any timing.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

WIDTH, HEIGHT, FOCAL = 1920, 1080, 1200.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 3_000_000], help="random scene sizes")
    p.add_argument("--ply", type=Path, help="a trained scene's Gaussians (3DGS PLY layout)")
    p.add_argument("--distance", type=float, default=2.5, help="--ply camera distance in scene radii")
    p.add_argument("--sh-degree", type=int, default=3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=int, default=0, metavar="ITERS",
                   help="also profile ITERS forward+backward calls of ours and of gsplat (torch.profiler, "
                        "CUPTI): GPU time per kernel, to show where a gap comes from")
    p.add_argument("--json", type=Path, help="write the results here (atomically)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


# ---------------------------------------------------------------------------- scenes


def camera(device, eye=None, target=None):
    """(viewmats [1, 4, 4], Ks [1, 3, 3]): identity pose, or OpenCV look-at from eye to target."""
    view = torch.eye(4)
    if eye is not None:
        z = torch.nn.functional.normalize(target - eye, dim=0)
        up = torch.tensor([0.0, -1.0, 0.0]) if abs(float(z[1])) < 0.99 else torch.tensor([0.0, 0.0, 1.0])
        x = torch.nn.functional.normalize(torch.linalg.cross(-up, z), dim=0)  # OpenCV: x right, y down
        y = torch.linalg.cross(z, x)
        R = torch.stack([x, y, z])
        view[:3, :3], view[:3, 3] = R, -R @ eye
    K = torch.tensor([[FOCAL, 0.0, WIDTH / 2], [0.0, FOCAL, HEIGHT / 2], [0.0, 0.0, 1.0]])
    return view[None].to(device), K[None].to(device)


def random_scene(n: int, seed: int, sh_degree: int, device):
    g = torch.Generator().manual_seed(seed)
    z = 2.0 + 10.0 * torch.rand(n, generator=g)
    x = (torch.rand(n, generator=g) - 0.5) * WIDTH / FOCAL * z
    y = (torch.rand(n, generator=g) - 0.5) * HEIGHT / FOCAL * z
    means = torch.stack([x, y, z], -1)
    quats = torch.randn(n, 4, generator=g)
    scales = torch.exp(math.log(0.01) + 0.5 * torch.randn(n, 3, generator=g))
    opacities = torch.sigmoid(1.5 * torch.randn(n, generator=g))
    K = (sh_degree + 1) ** 2
    sh = 0.2 * torch.randn(n, K, 3, generator=g)
    sh[:, 0] = 0.5 * torch.randn(n, 3, generator=g)
    view, Ks = camera(device)
    return [t.to(device) for t in (means, quats, scales, opacities, sh)] + [view, Ks]


def ply_scene(path: Path, sh_degree: int, distance: float, device):
    """Gaussians of a 3DGS PLY (binary little endian, float properties) and a camera looking at them."""
    with open(path, "rb") as f:
        header = []
        while True:
            line = f.readline()
            if not line:
                raise SystemExit(f"{path}: no end_header: not a PLY file")
            line = line.decode("ascii", "replace").strip()
            header.append(line)
            if line == "end_header":
                break
        data = f.read()
    if "format binary_little_endian 1.0" not in header:
        raise SystemExit(f"{path}: only binary little-endian PLY is read, header says {header[1]!r}")
    count = next(int(h.split()[2]) for h in header if h.startswith("element vertex"))
    props = [h.split()[2] for h in header if h.startswith("property")]
    if any(h.split()[1] != "float" for h in header if h.startswith("property")):
        raise SystemExit(f"{path}: expected float properties only")
    table = torch.frombuffer(bytearray(data[:count * 4 * len(props)]), dtype=torch.float32).view(count, len(props))
    col = {name: i for i, name in enumerate(props)}
    missing = [n for n in ("x", "y", "z", "opacity", "scale_0", "rot_0", "f_dc_0") if n not in col]
    if missing:
        raise SystemExit(f"{path}: not the 3DGS layout (missing {missing})")

    def cols(names):
        return table[:, [col[n] for n in names]]

    means = cols(["x", "y", "z"])
    quats = cols([f"rot_{i}" for i in range(4)])
    scales = torch.exp(cols([f"scale_{i}" for i in range(3)]))
    opacities = torch.sigmoid(table[:, col["opacity"]])
    rest = sorted((n for n in props if n.startswith("f_rest_")), key=lambda n: int(n[7:]))
    k_file = 1 + len(rest) // 3
    sh = torch.zeros(count, (sh_degree + 1) ** 2, 3)
    sh[:, 0] = cols(["f_dc_0", "f_dc_1", "f_dc_2"])
    if rest:  # stored channel-major: all of red's coefficients, then green's, then blue's
        fr = cols(rest).view(count, 3, k_file - 1).transpose(1, 2)
        k = min(k_file, sh.shape[1])
        sh[:, 1:k] = fr[:, :k - 1]
    centre = means.median(0).values
    radius = float((means - centre).norm(dim=-1).quantile(0.9))
    eye = centre + torch.tensor([0.0, -0.3, -1.0]) / math.sqrt(1.09) * distance * radius
    view, Ks = camera(device, eye, centre)
    return [t.contiguous().to(device) for t in (means, quats, scales, opacities, sh)] + [view, Ks]


# ---------------------------------------------------------------------------- timing


def timed(fn_forward, params, cotangent, warmup, repeats):
    """Median forward, backward and forward+backward ms (CUDA events), peak MiB above the inputs."""
    fwd, bwd, both = [], [], []
    for i in range(warmup + repeats):
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        e[0].record()
        img = fn_forward()
        e[1].record()
        (img * cotangent).sum().backward()
        e[2].record()
        torch.cuda.synchronize()
        if i >= warmup:
            fwd.append(e[0].elapsed_time(e[1]))
            bwd.append(e[1].elapsed_time(e[2]))
            both.append(e[0].elapsed_time(e[2]))
        del img
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    (fn_forward() * cotangent).sum().backward()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    for p in params:
        p.grad = None
    return {"forward_ms": statistics.median(fwd), "backward_ms": statistics.median(bwd),
            "fwd_bwd_ms": statistics.median(both), "peak_mib": peak}


def timed_graph(fn_forward, params, cotangent, warmup, repeats):
    """Median forward+backward ms of ``fn_forward`` (no host reads) captured once in a CUDA graph and
    replayed, as the 3DGS training step runs it (stages/reconstruct/gs/graph.py)."""
    for p in params:
        p.grad = torch.zeros_like(p)  # the graph adds into these

    def body():
        (fn_forward() * cotangent).sum().backward()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    times = []
    for i in range(warmup + repeats):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(a.elapsed_time(b))
    del graph
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    return {"forward_ms": None, "backward_ms": None, "fwd_bwd_ms": statistics.median(times), "peak_mib": None}


def stage_times(params, view, Ks, sh_degree, repeats):
    """Median ms of our pipeline's stages (forward), each run to completion alone; the binning with
    each sort."""
    from kernels import _gs_cuda
    from kernels.gaussians import _check_budget

    means, quats, scales, opac, sh = (p.detach() for p in params)

    def ms(fn):
        out, times = None, []
        for _ in range(max(3, repeats // 2)):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        return out, statistics.median(times[1:])

    tw, th = -(-WIDTH // 16), -(-HEIGHT // 16)
    proj, t_proj = ms(lambda: _gs_cuda.project(means, quats, scales, view, Ks, WIDTH, HEIGHT, 0.3, 0.01, 1e10, 0.0,
                                               False, opac, True))
    campos = torch.linalg.inv_ex(view).inverse[:, :3, 3]
    dirs = (means[None] - campos[:, None]).contiguous()
    rgb, t_sh = ms(lambda: torch.clamp_min(_gs_cuda.spherical_harmonics(sh_degree, dirs, sh) + 0.5, 0.0))
    op = opac[None].contiguous()
    t_bin = {}
    for sort in ("torch", "torch16", "radix"):
        _gs_cuda.SORT = sort
        bins, t_bin[sort] = ms(lambda: _gs_cuda.bin_tiles(proj.means2d, proj.radii, proj.depths, 16, tw, th,
                                                          _check_budget, WIDTH, HEIGHT, proj.conics, op))
    _, t_raster = ms(lambda: _gs_cuda.rasterize_to_pixels(proj.means2d, proj.conics, rgb.contiguous(), op, WIDTH,
                                                         HEIGHT, 16, bins[3], bins[2], None, False))
    return {"projection_ms": t_proj, "sh_ms": t_sh, "binning_torch_sort_ms": t_bin["torch"],
            "binning_torch16_sort_ms": t_bin["torch16"], "binning_radix_sort_ms": t_bin["radix"],
            "rasterize_fwd_ms": t_raster, "intersections": int(bins[2].numel())}


def first_use_compile(device) -> dict:
    """Seconds to compile (NVRTC, empty cache) and load each rasterizer program on this GPU;
    first_rgb_call_s: what a first RGB rasterization compiles (projection + SH, tiles, 3 channels)."""
    from kernels import _gs_cuda, loader

    out = {}
    with tempfile.TemporaryDirectory() as cache:
        os.environ[loader.CACHE_ENV] = cache  # nothing compiled before
        for prog in _gs_cuda.default_programs():
            name = next(k for k, v in _gs_cuda._programs.items() if v is prog)
            t = time.perf_counter()
            prog.load(device)
            out[f"{name}_s"] = time.perf_counter() - t
        del os.environ[loader.CACHE_ENV]
    out["first_rgb_call_s"] = out["project_s"] + out["tiles_s"] + out["raster<3>_s"]
    out["all_s"] = sum(v for k, v in out.items() if k != "first_rgb_call_s")
    return out


# ---------------------------------------------------------------------------- main


def kernel_profile(fn_forward, params, cotangent, iters: int, top: int = 25) -> dict:
    """GPU time per kernel over ``iters`` forward+backward calls (torch.profiler with CUPTI sees our
    cuLaunchKernel launches too): ``{"total_ms", "kernels": [[name, ms per call, launches per call]]}``."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):  # warm
        (fn_forward() * cotangent).sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            for p in params:
                p.grad = None
            (fn_forward() * cotangent).sum().backward()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = e.self_device_time_total
        if us > 0:
            rows.append([e.key[:90], us / 1e3 / iters, e.count / iters])
    rows.sort(key=lambda r: -r[1])
    for p in params:
        p.grad = None
    return {"total_ms": sum(r[1] for r in rows), "kernels": rows[:top]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_rasterizer: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    try:
        import gsplat
    except ImportError as exc:
        print(f"bench_rasterizer: gsplat is not installed ({exc}); pip install gsplat==1.5.3", file=sys.stderr)
        return 2
    import kernels

    if not kernels.available():
        print(f"bench_rasterizer: our CUDA kernels cannot run here: {kernels.unavailable_reason()}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(device)}; torch {torch.__version__}; gsplat {gsplat.__version__}")
    compile_s = first_use_compile(device)
    print(f"ours, first-use NVRTC compile + load of an RGB rasterization: {compile_s['first_rgb_call_s']:.2f} s "
          f"(projection + SH {compile_s['project_s']:.2f}, tiles {compile_s['tiles_s']:.2f}, blending of 3 "
          f"channels {compile_s['raster<3>_s']:.2f}); all programs (1..4 channels) {compile_s['all_s']:.2f} s")
    print("building gsplat's CUDA extension (first use JIT-compiles it, ~1.5 min) ...", flush=True)
    t = time.perf_counter()
    tiny = random_scene(1000, 1, args.sh_degree, device)
    gsplat.rasterization(*tiny[:7], WIDTH, HEIGHT, sh_degree=args.sh_degree, packed=False)
    torch.cuda.synchronize()
    gsplat_build_s = time.perf_counter() - t
    print(f"gsplat ready after {gsplat_build_s:.1f} s")

    scenes = [(f"random-{n / 1e6:g}M" if n >= 1e6 else f"random-{n}", lambda n=n: random_scene(
        n, args.seed, args.sh_degree, device)) for n in args.sizes]
    if args.ply is not None:
        scenes.append((f"ply:{args.ply.name}", lambda: ply_scene(args.ply, args.sh_degree, args.distance, device)))
    results = []
    for name, make in scenes:
        means, quats, scales, opac, sh, view, Ks = make()
        params = [t.requires_grad_() for t in (means, quats, scales, opac, sh)]
        cot = torch.randn(1, HEIGHT, WIDTH, 3, generator=torch.Generator().manual_seed(7)).to(device)

        def ours():
            return kernels.rasterization(*params, view, Ks, WIDTH, HEIGHT, sh_degree=args.sh_degree)[0]

        def ours_unchecked():  # as the training loop calls it: no value check, so no host read
            return kernels.rasterization(*params, view, Ks, WIDTH, HEIGHT, sh_degree=args.sh_degree,
                                         validate=False)[0]

        with torch.no_grad():  # a budget 30 % above this view's count, as the training step sizes it
            budget = int(1.3 * kernels.rasterization(*params, view, Ks, WIDTH, HEIGHT, sh_degree=args.sh_degree,
                                                     validate=False)[2]["n_intersections"]) + 1

        def ours_budget():  # no host read at all: buffers of a fixed size (kernels.rasterization(capacity=...))
            return kernels.rasterization(*params, view, Ks, WIDTH, HEIGHT, sh_degree=args.sh_degree,
                                         validate=False, capacity=budget)[0]

        def theirs():
            return gsplat.rasterization(*params, view, Ks, WIDTH, HEIGHT, sh_degree=args.sh_degree, packed=False)[0]

        with torch.no_grad():
            a, b = ours(), theirs()
            diff = (a - b).abs()
            image = {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
                     "p999_abs_diff": float(diff.flatten().float().quantile(0.999)) if diff.numel() < 2**24 else None}
            # with gsplat's alpha clamp (0.999; ours is the reference's 0.99 unless asked)
            diff = (kernels.rasterization(*params, view, Ks, WIDTH, HEIGHT, sh_degree=args.sh_degree,
                                          alpha_max=0.999)[0] - b).abs()
            image["max_abs_diff_alpha_max_0.999"] = float(diff.max())
            image["mean_abs_diff_alpha_max_0.999"] = float(diff.mean())
            del a, b, diff
        from kernels import _gs_cuda

        default_sort = _gs_cuda.SORT
        row = {"scene": name, "gaussians": int(means.shape[0]), "image": image, "default_sort": default_sort}
        for sort in ("torch", "torch16", "radix"):
            _gs_cuda.SORT = sort
            row[f"ours_{sort}_sort"] = timed(ours, params, cot, args.warmup, args.repeats)
        row["ours_torch_sort_unvalidated"] = timed(ours_unchecked, params, cot, args.warmup, args.repeats)
        row["ours_budget"] = timed(ours_budget, params, cot, args.warmup, args.repeats)
        row["ours_cuda_graph"] = timed_graph(ours_budget, params, cot, args.warmup, args.repeats)
        row["gsplat"] = timed(theirs, params, cot, args.warmup, args.repeats)
        row["ours_stages"] = stage_times(params, view, Ks, args.sh_degree, args.repeats)
        _gs_cuda.SORT = default_sort
        if args.profile:
            row["profile"] = {"ours": kernel_profile(ours_unchecked, params, cot, args.profile),
                              "gsplat": kernel_profile(theirs, params, cot, args.profile)}
            for impl, prof in row["profile"].items():
                print(f"  {impl}: GPU kernels {prof['total_ms']:.3f} ms per forward+backward")
                for name, ms, calls in prof["kernels"][:12]:
                    print(f"    {ms:7.3f} ms  x{calls:4.1f}  {name}")
        for key in ("torch_sort", "torch16_sort", "radix_sort", "torch_sort_unvalidated", "budget", "cuda_graph"):
            ours_t = row[f"ours_{key}"]
            row[f"ratio_{key}"] = {k: ours_t[k] / row["gsplat"][k] for k in ours_t
                                   if ours_t[k] is not None and row["gsplat"][k]}
        results.append(row)
        _print_row(row)
        del params, means, quats, scales, opac, sh
        torch.cuda.empty_cache()

    report = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "gsplat": gsplat.__version__,
              "width": WIDTH, "height": HEIGHT, "sh_degree": args.sh_degree, "warmup": args.warmup,
              "repeats": args.repeats, "timing": "CUDA events, median",
              "compile": compile_s, "gsplat_first_call_s": gsplat_build_s, "scenes": results}
    if args.json is not None:
        from stages.common.io import atomic_write_json

        atomic_write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


def _print_row(row: dict) -> None:
    print(f"\n{row['scene']}: {row['gaussians']} Gaussians at {WIDTH}x{HEIGHT}, "
          f"{row['ours_stages']['intersections']} intersections (ours)")
    print(f"  {'':16s} {'ours':>10s} {'gsplat':>10s} {'ratio':>7s}   {'ours, int16':>11s} {'ratio':>7s}"
          f"   {'ours, radix':>11s} {'ratio':>7s}")
    t, t16, r, g = row["ours_torch_sort"], row["ours_torch16_sort"], row["ours_radix_sort"], row["gsplat"]
    for key, label in (("forward_ms", "forward ms"), ("backward_ms", "backward ms"), ("fwd_bwd_ms", "fwd+bwd ms"),
                       ("peak_mib", "peak MiB")):
        print(f"  {label:16s} {t[key]:10.3f} {g[key]:10.3f} {row['ratio_torch_sort'][key]:7.2f}   "
              f"{t16[key]:11.3f} {row['ratio_torch16_sort'][key]:7.2f}   "
              f"{r[key]:11.3f} {row['ratio_radix_sort'][key]:7.2f}")
    u, ru = row["ours_torch_sort_unvalidated"], row["ratio_torch_sort_unvalidated"]
    print(f"  ours with validate=False (the training loop's call, no host read): fwd {u['forward_ms']:.3f} / "
          f"fwd+bwd {u['fwd_bwd_ms']:.3f} ms, {ru['fwd_bwd_ms']:.2f}x gsplat")
    u, ru = row["ours_budget"], row["ratio_budget"]
    print(f"  ours with a fixed budget (no host read): fwd {u['forward_ms']:.3f} / fwd+bwd {u['fwd_bwd_ms']:.3f} ms, "
          f"{ru['fwd_bwd_ms']:.2f}x gsplat")
    u, ru = row["ours_cuda_graph"], row["ratio_cuda_graph"]
    print(f"  ours, fwd+bwd replayed in a CUDA graph (the training step's way): {u['fwd_bwd_ms']:.3f} ms, "
          f"{ru['fwd_bwd_ms']:.2f}x gsplat's eager call")
    s = row["ours_stages"]
    print(f"  ours, forward stages ms: projection {s['projection_ms']:.3f}, SH {s['sh_ms']:.3f}, binning "
          f"{s['binning_torch_sort_ms']:.3f} (torch.sort) / {s['binning_torch16_sort_ms']:.3f} (int16) / "
          f"{s['binning_radix_sort_ms']:.3f} (radix), "
          f"blending {s['rasterize_fwd_ms']:.3f}")
    im = row["image"]
    print(f"  image vs gsplat: max |diff| {im['max_abs_diff']:.2e}, mean {im['mean_abs_diff']:.2e}; with "
          f"alpha_max 0.999 (gsplat's clamp) max {im['max_abs_diff_alpha_max_0.999']:.2e}, "
          f"mean {im['mean_abs_diff_alpha_max_0.999']:.2e}")


if __name__ == "__main__":
    sys.exit(main())
