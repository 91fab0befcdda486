"""A throwaway git + DVC project for flow tests: a stage script, dvc.yaml and params.yaml."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def make_dvc_project(root: Path, stage_py: str, dvc_yaml: str, params_yaml: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "stage.py").write_text(stage_py)
    (root / "dvc.yaml").write_text(dvc_yaml)
    (root / "params.yaml").write_text(params_yaml)
    dvc = [sys.executable, "-m", "dvc"]
    for cmd in (["git", "init", "-q"], dvc + ["init", "-q"], dvc + ["config", "core.analytics", "false"]):
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
    return root
