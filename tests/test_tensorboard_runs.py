"""TensorBoard run folders (stages/reconstruct/telemetry.py): one per run, named so runs compare."""
from __future__ import annotations

import re
from datetime import datetime

from stages.reconstruct.telemetry import run_name, tensorboard_run_dir


def test_run_name_is_the_experiment_or_time_and_params(monkeypatch):
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    at = datetime(2026, 12, 1, 9, 30, 12)
    a, b = run_name({"steps": 1000}, at), run_name({"steps": 2000}, at)
    assert re.fullmatch(r"20261201-093012-[0-9a-f]{8}", a) and a != b
    assert run_name({"steps": 1000}, at) == a  # the same params, the same hash
    monkeypatch.setenv("DVC_EXP_NAME", "steps-5k")
    assert run_name({"steps": 1000}, at) == "steps-5k"


def test_run_dir_never_reuses_a_folder_and_follows_dvc_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_EXP_NAME", "exp-a")
    monkeypatch.delenv("DVC_ROOT", raising=False)
    first = tensorboard_run_dir("data/reconstruct", {})
    assert first == tmp_path.joinpath("data/reconstruct.tb/exp-a").relative_to(tmp_path)
    first.mkdir(parents=True)
    assert tensorboard_run_dir("data/reconstruct", {}).name == "exp-a-2"  # a rerun under the same name
    # `dvc exp run --temp` runs in a copy; DVC_ROOT names the repository the logs belong to
    repo = tmp_path / "repo"
    monkeypatch.setenv("DVC_ROOT", str(repo))
    assert tensorboard_run_dir("data/reconstruct", {}) == repo / "data/reconstruct.tb/exp-a"
