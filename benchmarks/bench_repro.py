"""Reproducibility: two full, independent `dvc repro` runs of the default scene with the same params.

Prints a table (not a test). Each run is a fresh copy of the project (code, ``dvc.yaml``,
``params.yaml`` with the overrides) in its own folder with its own DVC cache, so nothing is
shared or cached between them; every stage runs: scene, ingest, poses (SfM), reconstruct,
evaluate, report. Then stage by stage it compares what the two runs wrote:

* scene / ingest: the images, byte for byte;
* poses: registered images, sparse points, the largest difference between the two runs'
  camera centres and rotations (in the normalized frame of transforms.json);
* reconstruct: every tensor of model.pt (how many values differ, the largest difference);
* evaluate: PSNR, SSIM, the renders byte for byte; the verdict against ``--tolerance-db``
  (0.1 dB, the target on any machine; on a CPU the runs are bit-identical, see
  tests/test_reproducibility.py).

    python benchmarks/bench_repro.py                                  # params.yaml as it is
    python benchmarks/bench_repro.py -S reconstruct.steps=5000 -S reconstruct.batch_rays=8192   # GPU profile
    python benchmarks/bench_repro.py --threads 1 --json repro.json    # OMP_NUM_THREADS=1 in the stages

Exit status 1 when the PSNRs differ by ``--tolerance-db`` or more. Takes twice a `make repro`
(about 2 x 11 min on a 2-core CPU with the default params; about 2 x 2 min on one H200 with
the GPU profile above).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.common.metrics_files import read_metrics  # noqa: E402


def set_key(params: dict, assignment: str) -> None:
    """Apply ``a.b.c=value`` (value parsed as YAML, as `dvc exp run -S` does)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise SystemExit(f"-S {assignment!r}: expected KEY=VALUE")
    node = params
    *parents, leaf = key.split(".")
    for p in parents:
        if not isinstance(node.get(p), dict):
            raise SystemExit(f"-S {assignment!r}: {p!r} is not a section of params.yaml")
        node = node[p]
    if leaf not in node:
        raise SystemExit(f"-S {assignment!r}: no key {key!r} in params.yaml")
    node[leaf] = yaml.safe_load(raw)


def make_copy(dst: Path, params: dict) -> None:
    for name in ("stages", "kernels"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", dst / "dvc.yaml")
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def run_repro(repo: Path, threads: int | None) -> float:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PYTHONPATH": str(repo),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    dvc = [sys.executable, "-m", "dvc"]
    for cmd in (dvc + ["init", "--no-scm", "-q"], dvc + ["config", "core.analytics", "false"]):
        subprocess.run(cmd, cwd=repo, env=env, check=True, capture_output=True)
    t0 = time.perf_counter()
    with open(repo / "repro.log", "w") as logf:
        p = subprocess.run(dvc + ["repro"], cwd=repo, env=env, stdout=logf, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise SystemExit(f"dvc repro failed in {repo} (see {repo / 'repro.log'}):\n"
                         + (repo / "repro.log").read_text()[-3000:])
    return time.perf_counter() - t0


def _digests(folder: Path, pattern: str = "*.png") -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob(pattern))}


def _same_files(a: Path, b: Path, pattern: str = "*.png") -> str:
    da, db = _digests(a, pattern), _digests(b, pattern)
    if set(da) != set(db):
        return f"different files ({len(da)} vs {len(db)})"
    same = sum(da[k] == db[k] for k in da)
    return f"{same}/{len(da)} identical"


def _cameras(poses: Path) -> dict[str, np.ndarray]:
    doc = json.loads((poses / "transforms.json").read_text())
    return {Path(f["file_path"]).name: np.array(f["transform_matrix"], dtype=np.float64) for f in doc["frames"]}


def compare_poses(a: Path, b: Path) -> str:
    ca, cb = _cameras(a), _cameras(b)
    common = sorted(set(ca) & set(cb))
    if not common:
        return "no camera in common"
    dc = max(float(np.linalg.norm(ca[k][:3, 3] - cb[k][:3, 3])) for k in common)
    rot = []
    for k in common:
        r = ca[k][:3, :3].T @ cb[k][:3, :3]
        rot.append(float(np.degrees(np.arccos(np.clip((np.trace(r) - 1) / 2, -1.0, 1.0)))))
    return f"{len(common)} cameras in both; max centre diff {dc:.3g}, max rotation diff {max(rot):.3g} deg"


def compare_models(a: Path, b: Path) -> str:
    sa = torch.load(a / "model.pt", weights_only=True)["state"]
    sb = torch.load(b / "model.pt", weights_only=True)["state"]
    if set(sa) != set(sb):
        return "different tensors"
    n = differ = 0
    worst = 0.0
    for k in sa:
        x, y = sa[k], sb[k]
        if not isinstance(x, torch.Tensor):
            continue
        n += x.numel()
        if x.shape != y.shape:
            return f"{k}: shapes {tuple(x.shape)} vs {tuple(y.shape)}"
        if not torch.equal(x, y):
            d = (x.double() - y.double()).abs()
            differ += int((d > 0).sum())
            worst = max(worst, float(d.max()))
    return "bit-identical" if differ == 0 else f"{differ:,} of {n:,} values differ, max |diff| {worst:.3g}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=ROOT / "params.yaml", help="base params (default: params.yaml)")
    ap.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a param, as `dvc exp run -S` (repeatable)")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the stages (default: torch's, one per core)")
    ap.add_argument("--tolerance-db", type=float, default=0.1, help="largest PSNR difference accepted (0.1)")
    ap.add_argument("--work", type=Path, help="folder for the two runs (default: a temporary one, removed)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    params = yaml.safe_load(args.params.read_text())
    for s in args.set:
        set_key(params, s)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_repro_"))
    runs, times = [work / "run_a", work / "run_b"], []
    try:
        for r in runs:
            if r.exists():
                shutil.rmtree(r)
            make_copy(r, params)
            print(f"dvc repro in {r} ...", flush=True)
            times.append(run_repro(r, args.threads))
        a, b = (r / "data" for r in runs)
        ev = [read_metrics(d / "metrics" / "evaluate.json") for d in (a, b)]  # the full records
        po = [read_metrics(d / "metrics" / "poses.json") for d in (a, b)]
        dpsnr = abs(ev[0]["psnr"] - ev[1]["psnr"])
        rows = [
            ("wall time (dvc repro)", f"{times[0]:.0f} s", f"{times[1]:.0f} s", ""),
            ("scene images", "", "", _same_files(a / "scene", b / "scene")),
            ("ingest images", "", "", _same_files(a / "ingest", b / "ingest")),
            ("poses: registered", str(po[0].get("num_registered")), str(po[1].get("num_registered")), ""),
            ("poses: sparse points", str(po[0].get("num_points")), str(po[1].get("num_points")), ""),
            ("poses: cameras", "", "", compare_poses(a / "poses", b / "poses")),
            ("reconstruct: model.pt", "", "", compare_models(a / "reconstruct", b / "reconstruct")),
            ("evaluate: PSNR (dB)", f"{ev[0]['psnr']:.4f}", f"{ev[1]['psnr']:.4f}", f"|diff| {dpsnr:.4f}"),
            ("evaluate: SSIM", f"{ev[0]['ssim']:.5f}", f"{ev[1]['ssim']:.5f}",
             f"|diff| {abs(ev[0]['ssim'] - ev[1]['ssim']):.5f}"),
            ("evaluate: renders", "", "", _same_files(a / "evaluate", b / "evaluate")),
        ]
        ok = dpsnr < args.tolerance_db
        device = ev[0].get("gpu_name") or ev[0].get("device") or "?"
        print(f"\nTwo runs of the default scene; device {device}, world size {ev[0].get('world_size')}, "
              f"torch {torch.__version__}, threads {args.threads or torch.get_num_threads()}, "
              f"{platform.node()}; overrides: {' '.join(args.set) or 'none'}\n")
        w = max(len(r[0]) for r in rows)
        print(f"{'':{w}}  {'run A':>12}  {'run B':>12}  comparison")
        for name, x, y, c in rows:
            print(f"{name:{w}}  {x:>12}  {y:>12}  {c}")
        print(f"\nPSNR difference {dpsnr:.4f} dB: {'within' if ok else 'NOT within'} {args.tolerance_db} dB")
        if args.json:
            args.json.write_text(json.dumps({
                "overrides": args.set, "threads": args.threads, "device": device, "torch": torch.__version__,
                "psnr": [ev[0]["psnr"], ev[1]["psnr"]], "ssim": [ev[0]["ssim"], ev[1]["ssim"]],
                "psnr_abs_diff": dpsnr, "within_tolerance": ok, "tolerance_db": args.tolerance_db,
                "wall_s": times, "table": [dict(zip(("what", "run_a", "run_b", "comparison"), r)) for r in rows],
            }, indent=1) + "\n")
        return 0 if ok else 1
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
