"""Throwaway git + DVC projects for tests: a toy one for the flow tests, and copies of this
project's own pipeline (stages, kernels, dvc.yaml, params) for the end-to-end tests."""
from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A NeRF small enough for a 2-core CI machine (tens of steps in seconds).
TINY_NERF = {"levels": 4, "log2_hashmap_size": 12, "max_resolution": 64, "hidden_dim": 16,
             "samples_per_ray": 32, "occ_resolution": 16}
# The end-to-end tests' pipeline: a small generated scene, few steps, a token orbit.
TINY_PIPELINE = {
    "scene": {"width": 200, "height": 150, "views": 24, "rings": 2, "fov_deg": 55.0, "objects": 5},
    "poses": {"max_features": 2048},
    "reconstruct": {"steps": 40, "batch_rays": 512, "eval_every": 20, "nerf": TINY_NERF},
    "evaluate": {"chunk_rays": 4096, "orbit_frames": 4, "orbit_size": 24},  # a token orbit: CI time matters
    "report": {"max_views": 2},
    "export": {"resolution": 32, "points": 2000},  # a token mesh and point cloud
}
# Keys that newer params.yaml files have: turned off where present (CI time), left alone where not.
OPTIONAL_OFF = {"evaluate": {"orbit_frames": 0}, "reconstruct": {"tensorboard": False},
                "export": {"mesh": False, "point_cloud": False}}


def optional_off(params: dict) -> dict:
    """``params`` with the :data:`OPTIONAL_OFF` keys it has turned off (in place; returned)."""
    for section, keys in OPTIONAL_OFF.items():
        if section in params:
            params[section].update({k: v for k, v in keys.items() if k in params[section]})
    return params


def make_dvc_project(root: Path, stage_py: str, dvc_yaml: str, params_yaml: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "stage.py").write_text(stage_py)
    (root / "dvc.yaml").write_text(dvc_yaml)
    (root / "params.yaml").write_text(params_yaml)
    dvc = [sys.executable, "-m", "dvc"]
    for cmd in (["git", "init", "-q"], dvc + ["init", "-q"], dvc + ["config", "core.analytics", "false"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
    return root


def merge(base: dict, over: dict) -> dict:
    """``base`` with ``over`` laid on top, nested sections merged key by key (inputs untouched)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return out


def run(cmd: list[str], cwd: Path) -> str:
    """Run ``cmd`` in ``cwd`` with this venv's tools first on PATH; its output, or AssertionError."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DVC_NO_ANALYTICS"] = "1"
    env["PYTHONPATH"] = str(cwd)
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p.stdout + p.stderr


def ran_stages(output: str) -> list[str]:
    """The stages a `dvc repro` / `dvc exp run` output says it ran, in order."""
    return [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")]


def copy_pipeline(repo: Path, params: dict, message: str) -> Path:
    """This project's pipeline (stages, kernels, dvc.yaml, .gitignore, DVC's config and plot templates,
    the measured scaling runs the report shows) with ``params`` as params.yaml, in a fresh git + DVC repo at ``repo``, committed
    with ``message``."""
    for name in ("stages", "kernels", "benchmarks/results"):
        shutil.copytree(ROOT / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("dvc.yaml", ".gitignore", "scripts/dvc_plots_offline.html"):  # metrics stay git-tracked
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, repo / name)
    (repo / "params.yaml").write_text(yaml_dump(params))
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "t@t"], ["git", "config", "user.name", "t"],
                ["dvc", "init", "-q"], ["dvc", "config", "core.analytics", "false"]):
        run(cmd, repo)
    shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")  # the offline plots page, as here
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots")  # dvc.yaml's plot template
    run(["git", "add", "-A"], repo)
    run(["git", "commit", "-qm", message], repo)
    return repo


def yaml_dump(doc: dict) -> str:
    import yaml

    return yaml.safe_dump(doc, sort_keys=False)
