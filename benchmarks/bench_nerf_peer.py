"""The NeRF beside an instant-ngp-class peer, same GPU, same data, same call (issue 17).

The peer is nerfacc's instant-ngp example (``examples/train_ngp_nerf_occ.py`` of nerfacc 0.5.3: a
tiny-cuda-nn hash grid and fully fused MLPs, nerfacc's occupancy grid, 2^18 samples a step, 20k steps),
installed from its own packages: nerfacc's wheel from PyPI and tiny-cuda-nn's PyTorch bindings built
from source on the GPU host (they have no wheel; ``benchmarks/prepare_peer_ngp.sh`` packs what they need).
instant-ngp's own testbed would need its CMake build with OptiX and GUI libraries; this example is the
instant-ngp recipe in PyTorch that nerfstudio's users run.

The peer trains for a number of steps, with its learning-rate milestones at 1/2, 3/4 and 9/10 of them, so
each ``--steps`` value is one run of the example as written, timed by its own clock (``elapsed_time``, from
the first step to the last, without loading or scoring). Three things are changed, in memory, never in its
files: ``max_steps`` (20000 in the file), the progress line also printed at the last step (so every run
reports its time, not only multiples of 10000), and the image size of its Blender loader (800 x 800 in the
class; our lego is 400 x 400). LPIPS needs VGG weights from the network, so a stand-in returns 0 (the peer
still prints its PSNR, mean over the test views on white, as ours is scored). A first short run fills
tiny-cuda-nn's kernel cache and nerfacc's JIT build, untimed.

Ours then trains once on the same views (``bench_nerf_quality.py``, the GPU profile) with snapshots at the
peer's times, so every peer row has ours at the same training time beside it.

    bash benchmarks/prepare_peer_ngp.sh <tiny-cuda-nn checkout> <nerfacc checkout>       # once, here
    python benchmarks/bench_nerf_peer.py --peer .gpu/peer --poses .gpu/data/lego \\
        --steps 5000,10000,20000 --wheel-out $OUT --json $OUT/nerf_peer.json              # on the GPU host

``--wheel-out`` keeps the built tiny-cuda-nn wheel (135 s to build on an H100 host's 16 cores); put it in
the ``--peer`` folder and the next machine installs it instead of building.
"""
from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = Path("/tmp/site")  # where the peer's packages go on the GPU host (gpu_session.sh's gsplat too)

# Runs the peer's example (patched in memory by :func:`patch_example`, handed over as a file outside
# the peer's folder) as its own __main__, with its loader at the images' size and LPIPS stood in.
# tiny-cuda-nn's modules are made to take an empty batch: the example's test renderer queries the field
# with whatever its march found, and where that was no sample (a view whose remaining rays all miss the
# occupancy grid) tiny-cuda-nn failed with "CUDA error: invalid argument" (H100, 2026-12-06: the
# 200-step run; 2026-12-07: the 5000-step run, after 24 of its 25 test views).
RUNNER = r"""
import sys, types, imageio.v2 as imageio, glob, os, torch
examples, script, patched, root, scene = sys.argv[1:6]
stub = types.ModuleType("lpips")
class LPIPS(torch.nn.Module):
    def __init__(self, *a, **k):
        super().__init__()
    def forward(self, x, y):
        return torch.zeros((), device=x.device)
stub.LPIPS = LPIPS
sys.modules["lpips"] = stub
sys.path[:0] = [examples, os.path.dirname(examples)]
import tinycudann as tcnn
def empty_ok(forward):
    def call(self, x):  # an empty batch: a one-row pass cut to zero rows (its dtype and graph kept)
        return forward(self, x) if x.shape[0] else forward(self, x.new_zeros((1, *x.shape[1:])))[:0]
    return call
for cls in (tcnn.Encoding, tcnn.Network, tcnn.NetworkWithInputEncoding):
    cls.forward = empty_ok(cls.forward)
if len(sys.argv) > 6 and sys.argv[6]:  # --field ours: the example's field replaced by ours (json: its NerfParams)
    import json
    FIELD = json.loads(sys.argv[6])  # read now: sys.argv is the example's by the time the field is built
    sys.path.append(sys.argv[7])  # after the examples: their own modules win
    import radiance_fields.ngp as ngp
    from stages.reconstruct.config import NerfParams
    from stages.reconstruct.nerf.field import NerfField
    class OurField(torch.nn.Module):
        def __init__(self, aabb, **_):
            super().__init__()
            box = torch.as_tensor(aabb, dtype=torch.float32).reshape(2, 3).cpu()
            self.field = NerfField(NerfParams(**FIELD), box)
            print(f"peer runner: our field in the example: {self.field.encoding}", flush=True)
        def query_density(self, x, return_feat=False):
            return self.field.density(x)[:, None]
        def forward(self, positions, directions=None):
            sigma, rgb = self.field(positions, directions)
            return rgb, sigma[:, None]
    ngp.NGPRadianceField = OurField
import datasets.nerf_synthetic as ns
h, w = imageio.imread(sorted(glob.glob(os.path.join(root, scene, "train", "*.png")))[0]).shape[:2]
ns.SubjectLoader.WIDTH, ns.SubjectLoader.HEIGHT = w, h
print(f"peer runner: {script} ({patched}), images {w}x{h}", flush=True)
sys.argv = [script, "--data_root", root, "--scene", scene]
exec(compile(open(patched).read(), script, "exec"), {"__name__": "__main__", "__file__": script})
"""
# (text in the example, its replacement): the run's length, and the progress line at the last step too
EDITS = (("max_steps = 20000", "max_steps = {steps}"),
         ("if step % 10000 == 0:", "if step % 10000 == 0 or step == max_steps:"))


def patch_example(src: str, steps: int, edits: list[tuple[str, str]] = ()) -> str:
    """The example's source set to ``steps`` steps, printing its clock at the last one, then with each of
    ``edits`` (text, its replacement; ``--edit``: one of the example's settings changed to ours, a
    diagnostic) applied; refused (another version of the example) where a text to replace is missing,
    and an edit also where its text is there more than once."""
    for old, new in EDITS:
        if old not in src:
            raise ValueError(f"{old!r} is not in the example: another version of nerfacc's examples?")
        src = src.replace(old, new.format(steps=steps))
    for old, new in edits:
        if src.count(old) != 1:
            raise ValueError(f"--edit: {old!r} is in the example {src.count(old)} times, not once "
                             "(another version of nerfacc's examples, or a text too short to place)")
        src = src.replace(old, new)
    return src


# Our profile's settings as edits of the example (``--ours NAME``), for moving the peer's pipeline toward ours
# one setting at a time (with ``--field ours``, the field is ours already): where it falls to our pipeline's
# score, that setting is part of what loses. hull_box is our hull box of lego (poses out e73cb32e, 2026-12-07)
# in the Blender frame: the bounding box of its corners.
OURS_EDITS = {
    "random_background": 'train_dataset_kwargs = {}=>train_dataset_kwargs = {"color_bkgd_aug": "random"}',
    "beta2": "lr=1e-2, eps=1e-15, weight_decay=weight_decay=>lr=1e-2, eps=1e-15, weight_decay=weight_decay, "
             "betas=(0.9, 0.99)",
    "tf32": 'device = "cuda:0"=>device = "cuda:0"; torch.backends.cuda.matmul.allow_tf32 = True',
    # its weight decay (1e-6, every parameter, added to the gradient inside Adam) meets gradients 1024 times the
    # loss's (its GradScaler; Adam's steps do not depend on the scale otherwise), so it is ~1000 times weaker than
    # ours (1e-6 on the MLPs' unscaled gradients). Scale 1 gives it ours (the example never calls the scaler's
    # update, so the scale stays what it is built with)
    "unscaled_weight_decay": "GradScaler(2**10)=>GradScaler(1.0)",
    "hull_box": "aabb = torch.tensor([-1.5, -1.5, -1.5, 1.5, 1.5, 1.5], device=device)=>"
                "aabb = torch.tensor([-0.857, -1.335, -0.813, 0.942, 1.331, 1.251], device=device)",
}


def parse_edit(text: str) -> tuple[str, str]:
    """``OLD=>NEW`` of ``--edit`` as (old, new)."""
    old, sep, new = text.partition("=>")
    if not sep or not old:
        raise ValueError(f"--edit takes OLD=>NEW, got {text!r}")
    return old, new


def sh(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> int:
    """Runs ``cmd`` with its output appended to ``log``; its exit status."""
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode


@functools.lru_cache(maxsize=None)
def system_libstdcxx() -> str | None:
    """The C++ runtime of the compiler that builds the bindings (``g++ -print-file-name``), or None."""
    try:
        path = subprocess.run(["g++", "-print-file-name=libstdc++.so.6"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


def peer_env() -> dict:
    """The peer's environment: its packages first on the path, and the compiler's libstdc++ preloaded.

    On the GPU host (torch 2.11, 2026-12-06) the bindings' first forward crashed (SIGSEGV) in
    ``tcnn::bytes_to_string`` while the memory arena formatted a size, inside the C++ runtime's
    stream code (apparently bound to another library's copy of it, loaded earlier in the process).
    With libstdc++ preloaded the same build ran."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/ext")
    env["PYTHONUNBUFFERED"] = "1"
    lib = system_libstdcxx()
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = os.pathsep.join(filter(None, [lib, env.get("LD_PRELOAD")]))
    return env


def importable(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], env=peer_env(),
                          capture_output=True).returncode == 0


def pip_install(wheel: str, log: Path) -> None:
    rc = sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
             "--no-cache-dir", "--upgrade", "--target", str(SITE), wheel], log)
    if rc:
        raise SystemExit(f"bench_nerf_peer: installing {wheel} failed (see {log})")


def ensure_tcnn(peer: Path, wheel_out: Path | None, log: Path) -> dict:
    """tiny-cuda-nn's bindings importable: already, from a wheel in ``peer``, or built from its sources."""
    if importable("tinycudann"):
        return {"tcnn": "already installed"}
    wheels = sorted(glob.glob(str(peer / "tinycudann-*.whl")))
    if wheels:
        pip_install(wheels[-1], log)
        if importable("tinycudann"):
            return {"tcnn": f"installed {Path(wheels[-1]).name}"}
        print(f"{Path(wheels[-1]).name} does not import here: building tiny-cuda-nn", flush=True)
    import torch

    major, minor = torch.cuda.get_device_capability()
    build = Path("/tmp/peer-build")
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    with tarfile.open(peer / "tiny-cuda-nn.tgz") as tar:
        tar.extractall(build, filter="data")
    setup = build / "tiny-cuda-nn" / "bindings" / "torch" / "setup.py"
    if not importable("pkg_resources"):  # setuptools >= 82 dropped it; setup.py wants only parse_version
        text = setup.read_text().replace("from pkg_resources import parse_version",
                                         "from packaging.version import parse as parse_version")
        setup.write_text(text)
    env = peer_env()
    env.update(TCNN_CUDA_ARCHITECTURES=f"{major}{minor}", MAX_JOBS=str(os.cpu_count() or 8))
    dist = wheel_out or build / "dist"
    dist.mkdir(parents=True, exist_ok=True)
    t = time.time()
    rc = sh([sys.executable, "setup.py", "bdist_wheel", "-d", str(dist)], log, env=env, cwd=setup.parent)
    took = time.time() - t
    built = sorted(glob.glob(str(dist / "tinycudann-*.whl")))
    if rc or not built:
        raise SystemExit(f"bench_nerf_peer: building tiny-cuda-nn failed after {took:.0f} s (see {log})")
    pip_install(built[-1], log)
    print(f"tiny-cuda-nn built for sm_{major}{minor} in {took:.0f} s: {Path(built[-1]).name}", flush=True)
    return {"tcnn": f"built {Path(built[-1]).name} in {took:.0f} s"}


def ensure_nerfacc(peer: Path, log: Path) -> dict:
    if not importable("nerfacc"):
        pip_install(str(next(iter(sorted(peer.glob("nerfacc-*.whl"))))), log)
    t = time.time()  # nerfacc compiles its CUDA code at first use (JIT); do it now, outside any clock
    rc = sh([sys.executable, "-c", "from nerfacc.cuda._backend import _C; assert _C is not None"], log, env=peer_env())
    if rc:
        raise SystemExit(f"bench_nerf_peer: nerfacc's CUDA build failed (see {log})")
    return {"nerfacc_jit_s": round(time.time() - t, 1)}


def parse_peer(text: str, steps: int) -> dict:
    """The peer's training time at its last step and its mean test PSNR, from its printed lines."""
    times = re.findall(r"elapsed_time=([0-9.]+)s \| step=(\d+) \|.*?psnr=([0-9.]+)", text)
    last = [t for t in times if int(t[1]) == steps]
    psnr = re.findall(r"evaluation: psnr_avg=([0-9.]+)", text)
    if not last or not psnr:
        raise ValueError("the peer printed no time or PSNR for its last step")
    return {"steps": steps, "train_seconds": float(last[-1][0]), "psnr": float(psnr[-1]),
            "train_batch_psnr": float(last[-1][2])}


def run_peer(peer: Path, scene: str, steps: int, log: Path, field: dict | None = None,
             edits: list[tuple[str, str]] = ()) -> dict:
    """One run of the example for ``steps`` steps; ``field``: NerfParams of our field to train in its
    place (``--field ours``), None for the example's own; ``edits``: see :func:`patch_example`."""
    examples = peer / "nerfacc-examples" / "examples"
    script = examples / "train_ngp_nerf_occ.py"
    patched = Path(f"/tmp/peer_{script.stem}_{steps}.py")
    patched.write_text(patch_example(script.read_text(), steps, edits))
    t = time.time()
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(examples), str(script), str(patched),
                           str((peer / "data").resolve()), scene, json.dumps(field) if field is not None else "",
                           str(ROOT)], env=peer_env(), capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    with open(log, "a") as f:
        f.write(f"== peer {scene} {steps} steps, field {field or 'its own'} (rc {proc.returncode}, "
                f"{time.time() - t:.0f} s wall)\n{out}\n")
    if proc.returncode:
        raise SystemExit(f"bench_nerf_peer: the peer failed at {steps} steps (see {log}):\n{out[-2000:]}")
    row = parse_peer(out, steps)
    row["wall_seconds"] = round(time.time() - t, 1)
    if field is not None:
        row["field"] = {"ours": field}
    if edits:
        row["edits"] = [f"{old}=>{new}" for old, new in edits]
    return row


def run_ours(poses: Path, budgets: list[float], seed: int, sets: list[str], out: Path, log: Path) -> dict:
    """bench_nerf_quality.py's document of one lego run snapshotted at ``budgets``."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_nerf_quality.py"), "--poses", f"lego={poses}",
           "--budgets", ",".join(f"{b:g}" for b in budgets), "--seed", str(seed), "--json", str(out)]
    for kv in sets:
        cmd += ["--set", kv]
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    if sh(cmd, log, env=env):
        raise SystemExit(f"bench_nerf_peer: our run failed (see {log})")
    return json.loads(out.read_text())


def nerf_result(doc: dict) -> dict:
    """The NeRF run of a bench_nerf_quality.py document."""
    return next(r for r in doc["results"] if r["method"] == "nerf")


PEER = "nerfacc 0.5.3 ngp example"
PROTOCOL = ("bench_nerf_peer.py: the peer is nerfacc's examples/train_ngp_nerf_occ.py on tiny-cuda-nn, one run per "
            "step count (its own schedule); 'train s' is its own clock. Ours is one run of bench_nerf_quality.py's "
            "GPU profile snapshotted at the peer's times, on the same views and GPU, in the same call.")


def report_rows(scene: str, rows: list[dict], ours_doc: dict | None) -> list[dict]:
    """The layout the report's benchmark appendix reads (``stages.report.read_benchmark``): the peer's
    runs, then ours at the same training times as bench_nerf_quality.py wrote them. Their poses md5 is
    left out: the peer reads the Blender folder itself, not a poses out, so the report would pair
    nothing; both use that folder's cameras and views."""
    out = [{"scene": scene, "steps": r["steps"], "impl": PEER, "budget_s": round(r["train_seconds"], 1),
            "train_s": r["train_seconds"], "psnr": r["psnr"]} for r in rows]
    out += [{k: v for k, v in row.items() if k != "poses_md5"} for row in (ours_doc or {}).get("rows", [])]
    return out


def table(rows: list[dict]) -> str:
    head = ["peer steps", "peer time", "peer PSNR", "ours at that time", "ours steps", "ours - peer"]
    body = [[str(r["steps"]), f"{r['train_seconds']:.1f} s", f"{r['psnr']:.2f}",
             "" if r.get("ours_psnr") is None else f"{r['ours_psnr']:.2f}",
             "" if r.get("ours_steps") is None else str(r["ours_steps"]),
             "" if r.get("ours_psnr") is None else f"{r['ours_psnr'] - r['psnr']:+.2f}"] for r in rows]
    w = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "| " + " | ".join(c.ljust(n) for c, n in zip(cells, w)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (n + 2) for n in w) + "|", *map(line, body)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", type=Path, default=ROOT / ".gpu" / "peer", help="prepare_peer_ngp.sh's out")
    ap.add_argument("--poses", type=Path, help="our lego poses out (prepare_scenes.sh); none: the peer alone")
    ap.add_argument("--scene", default="lego", help="the Blender scene under <peer>/data")
    ap.add_argument("--steps", default="5000,10000,20000", help="the peer's runs: max_steps of each")
    ap.add_argument("--seed", type=int, default=0, help="our run's seed (the peer seeds itself with 42)")
    ap.add_argument("--set", action="append", default=[], help="reconstruct.<key>=<yaml value> for our run")
    ap.add_argument("--wheel-out", type=Path, help="keep the tiny-cuda-nn wheel built here")
    ap.add_argument("--warmup-steps", type=int, default=200,
                    help="an untimed first run (0: none, where this machine ran the peer before)")
    ap.add_argument("--build-only", action="store_true", help="install (or build) the peer, run nothing")
    ap.add_argument("--field", choices=["its", "ours"], default="its",
                    help="ours: the example trains our NerfField in place of its own (a diagnostic: with its "
                         "sampler, occupancy grid, loss and schedule, is our field the difference?)")
    ap.add_argument("--field-set", action="append", default=[],
                    help="key=<yaml value> of our field's NerfParams with --field ours (repeatable)")
    ap.add_argument("--edit", action="append", default=[], type=parse_edit, metavar="OLD=>NEW",
                    help="replace a text of the example that is there once (repeatable; a diagnostic: one of "
                         "its settings made ours, e.g. its background or Adam's betas)")
    ap.add_argument("--ours", action="append", default=[], choices=sorted(OURS_EDITS),
                    help="one of our profile's settings in the example (OURS_EDITS; repeatable)")
    ap.add_argument("--log-dir", type=Path, default=Path("."), help="build and run logs")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_nerf_peer needs a CUDA GPU (the peer's tiny-cuda-nn has no CPU path)")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    log = args.log_dir / "peer_build.log"
    setup = {**ensure_tcnn(args.peer, args.wheel_out, log), **ensure_nerfacc(args.peer, log)}
    runs = args.log_dir / "peer_runs.log"
    if args.warmup_steps:  # untimed: tiny-cuda-nn compiles its kernels at first use
        try:
            run_peer(args.peer, args.scene, args.warmup_steps, runs)
        except SystemExit as exc:
            # its training compiled the kernels even where its scoring fails: at 200 steps the example's
            # test renderer stopped on "CUDA error: invalid argument" (H100, 2026-12-06; 5000 steps scored)
            print(f"warm-up run failed after training ({str(exc).splitlines()[0]}); going on", flush=True)
    print(f"peer ready: {setup}", flush=True)
    if args.build_only:
        return 0
    gpu = torch.cuda.get_device_name()
    commit = args.peer / "tiny-cuda-nn.commit"
    setup["tiny_cuda_nn"] = commit.read_text().strip() if commit.exists() else "unknown"

    def write(rows: list[dict], ours_doc: dict | None) -> None:  # after every run: a cut-off call keeps what ran
        if args.json:
            doc = {"gpu": gpu, "torch": torch.__version__, "scene": args.scene,
                   "environment": {"gpu": gpu, "torch": torch.__version__}, "protocol": PROTOCOL, "peer": PEER,
                   "peer_setup": setup, "pairs": rows, "rows": report_rows(args.scene, rows, ours_doc),
                   "ours": None if ours_doc is None else nerf_result(ours_doc),
                   "ours_sets": args.set, "seed": args.seed, "complete": ours_doc is not None or args.poses is None}
            tmp = args.json.with_suffix(".part")
            tmp.write_text(json.dumps(doc, indent=2, default=str))
            tmp.replace(args.json)

    field = None
    if args.field == "ours":
        import yaml

        field = {k: yaml.safe_load(v) for k, _, v in (kv.partition("=") for kv in args.field_set)}
    edits = [*args.edit, *(parse_edit(OURS_EDITS[name]) for name in args.ours)]
    rows = []
    for steps in (int(s) for s in args.steps.split(",")):
        rows.append(run_peer(args.peer, args.scene, steps, runs, field, edits))
        print(f"peer {steps} steps: {rows[-1]['psnr']:.2f} dB after {rows[-1]['train_seconds']:.1f} s", flush=True)
        write(rows, None)
    if args.poses is not None:
        budgets = [round(r["train_seconds"], 1) for r in rows]
        ours_doc = run_ours(args.poses, budgets, args.seed, args.set, args.log_dir / "ours.json",
                            args.log_dir / "ours.log")
        by_budget = {row["budget"]: row for row in nerf_result(ours_doc)["rows"]}
        for r in rows:
            got = by_budget.get(round(r["train_seconds"], 1))
            r["ours_psnr"] = None if got is None else got["psnr"]
            r["ours_steps"] = None if got is None else got["steps"]
        write(rows, ours_doc)
    print(f"\n{args.scene}: nerfacc's instant-ngp example against ours ({gpu}, torch {torch.__version__})")
    print(table(rows))
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
