"""RAYFORGE_PROFILE: the training loop's step profiler writes its op tables where it is told."""
from __future__ import annotations

import torch

from stages.reconstruct.train import StepProfiler


def _profile(profiler: StepProfiler) -> None:
    x = torch.randn(64, 64)
    for step in range(5):
        profiler.at(step)
        x = torch.tanh(x @ x)


def test_profiles_the_chosen_steps_into_the_folder_and_a_subfolder(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYFORGE_PROFILE", str(tmp_path))
    monkeypatch.setenv("RAYFORGE_PROFILE_STEPS", "1:3")
    ours, second = StepProfiler(0, torch.device("cpu")), StepProfiler(0, torch.device("cpu"), "gsplat")
    _profile(ours)
    _profile(second)
    for path in (tmp_path / "rank0.txt", tmp_path / "gsplat" / "rank0.txt"):
        text = path.read_text()
        assert text.startswith("rank 0: steps 1..3 (2 steps)") and "aten::mm" in text, path
    assert ours.folder is None and second.folder is None  # once per run


def test_does_nothing_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("RAYFORGE_PROFILE", raising=False)
    monkeypatch.chdir(tmp_path)
    profiler = StepProfiler(0, torch.device("cpu"), "gsplat")
    assert profiler.folder is None
    _profile(profiler)
    assert not any(tmp_path.iterdir())
