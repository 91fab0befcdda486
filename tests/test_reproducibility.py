"""Two independent runs of reconstruct + evaluate on the CPU with the same params give the same model.

A tiny generated scene with its ground-truth cameras (no SfM: that is the poses stage's
business, and benchmarks/bench_repro.py covers it) is trained and evaluated twice, each stage
in its own process through its CLI as DVC runs it, the two runs with different
``PYTHONHASHSEED`` so that nothing may depend on the order of a hashed set. Compared: every
tensor of the model and of the optimizer state, the training curve (all columns but the
timings), the per-view and summary metrics, and the rendered PNGs byte for byte.

What we found: with one CPU thread the runs were bit-identical, with several threads (the
default: one per core) they were not: the hash grid's PyTorch path gathered features with
advanced indexing (``table[level][rows]``), whose backward ``index_put_(accumulate=True)`` adds
the gradients of rows hit more than once in thread order (one of the ops PyTorch lists as
nondeterministic). ``kernels/_reference.py`` now gathers with ``index_select`` (backward
``index_add_``, deterministic on the CPU and faster), and threaded runs are bit-identical too.

``benchmarks/bench_repro.py`` does two full runs of the default scene (SfM included), on a GPU
too, where the target is agreement within 0.1 dB.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from stages import scene
from _dvc_project import TINY_NERF, merge, optional_off

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.integration]

PARAMS = {
    "seed": 3,
    "reconstruct": {
        "method": "nerf", "device": "cpu", "steps": 100, "batch_rays": 512, "eval_every": 50,
        "nerf": {**TINY_NERF, "occ_update_every": 16},
        "distributed": {"gpus": "auto", "cpu_workers": 1, "checkpoint_every": 0},
    },
    "evaluate": {"chunk_rays": 4096},
}
TIMING_COLUMNS = {"elapsed_s", "samples_per_s"}  # wall-clock figures: never expected to repeat
MULTI_THREADED = torch.get_num_threads() > 1  # what a stage process gets by default on this machine


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(root, poses folder, params.yaml) of a 96x72, 12-view scene with ground-truth cameras."""
    root = tmp_path_factory.mktemp("repro")
    tiny = scene.SceneParams(width=96, height=72, views=12, rings=2, fov_deg=55.0, objects=3)
    scene.run(tiny, root / "scene", seed=0)
    poses = scene.poses_from_ground_truth(root / "scene" / "images", root / "poses", test_every=6)
    project = yaml.safe_load((ROOT / "params.yaml").read_text())
    doc = {"seed": PARAMS["seed"]}
    for section in ("reconstruct", "evaluate"):
        doc[section] = merge(project[section], PARAMS[section])
    optional_off(doc)
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump(doc, sort_keys=False))
    return root, poses, params


def _two_runs(setup, tag: str, threads: int | None) -> tuple[Path, Path]:
    """reconstruct + evaluate twice, every stage a fresh process; ``threads`` sets OMP_NUM_THREADS."""
    root, poses, params = setup
    runs = []
    for k, hashseed in enumerate(("1", "2")):
        out = root / f"{tag}{k}"
        env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(ROOT)}
        env.pop("OMP_NUM_THREADS", None)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        for cmd in (
            ["-m", "stages.reconstruct", "--poses", str(poses), "--out", str(out / "reconstruct"),
             "--metrics", str(out / "metrics" / "reconstruct.json"), "--plots", str(out / "train.csv"),
             "--params", str(params), "--launch", "inline"],
            ["-m", "stages.evaluate", "--poses", str(poses), "--model", str(out / "reconstruct"),
             "--out", str(out / "evaluate"), "--metrics", str(out / "metrics" / "evaluate.json"),
             "--params", str(params)],
        ):
            p = subprocess.run([sys.executable, *cmd], cwd=root, env=env, capture_output=True, text=True,
                               timeout=600)
            assert p.returncode == 0, f"{cmd[1]} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        runs.append(out)
    return runs[0], runs[1]


@pytest.fixture(scope="module")
def one_thread(setup) -> tuple[Path, Path]:
    return _two_runs(setup, "one_thread", 1)


@pytest.fixture(scope="module")
def default_threads(setup) -> tuple[Path, Path]:
    return _two_runs(setup, "default_threads", None)


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor inside a (nested) checkpoint dict or list, by its dotted path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    out = {}
    for k, v in items:
        out.update(_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    diffs = [f"{k}: only in one run" for k in sorted(set(a) ^ set(b))]
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            diffs.append(f"{k}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif not torch.equal(x, y):
            d = (x.double() - y.double()).abs()
            diffs.append(f"{k}: {int((d > 0).sum())} of {d.numel()} values differ, max |diff| {float(d.max()):.3g}")
    return diffs


def state_differences(runs: tuple[Path, Path]) -> list[str]:
    a, b = (torch.load(r / "reconstruct" / "checkpoint.pt", weights_only=True) for r in runs)
    assert a["step"] == b["step"] == PARAMS["reconstruct"]["steps"]
    assert a["config"] == b["config"]
    return (_differences(_tensors(a["state"]), _tensors(b["state"]))
            + _differences(_tensors(a["optimizers"]), _tensors(b["optimizers"])))


def _curves(runs: tuple[Path, Path]) -> list[list[dict]]:
    rows = []
    for r in runs:
        with open(r / "train.csv", newline="") as f:
            rows.append([{k: v for k, v in row.items() if k not in TIMING_COLUMNS} for row in csv.DictReader(f)])
    return rows


def _metrics(runs: tuple[Path, Path]) -> list[dict]:
    return [json.loads((r / "metrics" / "evaluate.full.json").read_text()) for r in runs]


def assert_bit_identical(runs: tuple[Path, Path]) -> None:
    diffs = state_differences(runs)
    assert not diffs, "the two CPU runs differ:\n" + "\n".join(diffs[:20])
    curves = _curves(runs)
    assert len(curves[0]) == len(curves[1]) > 3 and any(row["test_psnr"] for row in curves[0])
    for ra, rb in zip(*curves):
        assert ra == rb, f"training curves differ at step {ra['step']}: {ra} vs {rb}"
    ev = _metrics(runs)
    for key in ("psnr", "psnr_std", "ssim", "ssim_std", "num_params", "steps", "num_test_views"):
        assert ev[0][key] == ev[1][key], f"{key}: {ev[0][key]!r} vs {ev[1][key]!r}"
    per_view = [[{k: v for k, v in row.items() if k != "render_time_s"}
                 for row in json.loads((r / "evaluate" / "per_view.json").read_text())] for r in runs]
    assert per_view[0] == per_view[1]
    renders = [sorted((r / "evaluate" / "renders").glob("*.png")) for r in runs]
    assert [p.name for p in renders[0]] == [p.name for p in renders[1]] and renders[0]
    for pa, pb in zip(*renders):
        assert pa.read_bytes() == pb.read_bytes(), f"render {pa.name} differs between the runs"


def test_one_thread_runs_are_bit_identical(one_thread):
    assert_bit_identical(one_thread)
    ev = _metrics(one_thread)
    assert ev[0]["psnr"] > 8.0  # a real, if short, training run
    # what the report needs to rerun it exactly is recorded, and the same for both runs
    env = [e["environment"] for e in ev]
    for key in ("params_sha256", "code_revision", "torch_version", "python_version"):
        assert env[0].get(key) == env[1].get(key), key
    assert env[0]["params_sha256"] and env[0]["torch_version"] == torch.__version__


def test_default_thread_runs_agree_within_0_1_db(default_threads):
    """The issue's target for any machine: the same params give PSNR within 0.1 dB."""
    ev = _metrics(default_threads)
    assert abs(ev[0]["psnr"] - ev[1]["psnr"]) < 0.1, (ev[0]["psnr"], ev[1]["psnr"])
    assert abs(ev[0]["ssim"] - ev[1]["ssim"]) < 1e-3, (ev[0]["ssim"], ev[1]["ssim"])
    assert ev[0]["num_params"] == ev[1]["num_params"]


def test_default_thread_runs_are_bit_identical(default_threads):
    assert_bit_identical(default_threads)
