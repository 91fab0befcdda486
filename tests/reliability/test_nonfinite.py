"""NaN and Inf in the loss or the gradients: the step is skipped (no optimizer update), counted in the
summary and logged; the model and every checkpoint stay finite; a run that keeps producing them stops
with one line instead of training on garbage. Faults are injected into the real training step (the
method's ``forward_backward``), so they pass through the gradient reduction like a real one would."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from reliability._faults import write_params

AREA = "fault: non-finite values"


@pytest.fixture
def faults(monkeypatch):
    """``faults[step] = "grad" | "loss"``: poison that training step (1-based) of the next run."""
    from stages.reconstruct.nerf.method import NerfMethod

    plan: dict[int, str] = {}
    calls = {"forward_backward": 0, "optimizer_step": 0}
    fb, step_fn = NerfMethod.forward_backward, NerfMethod.optimizer_step

    def forward_backward(self, *args, **kwargs):
        calls["forward_backward"] += 1
        info = fb(self, *args, **kwargs)
        kind = plan.get(calls["forward_backward"])
        if kind is not None:
            bad = float("nan") if kind == "grad" else float("inf")
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.view(-1)[0] = bad
            if kind == "loss":
                info = {**info, "mse": info["mse"] * bad}
        return info

    def optimizer_step(self, step, skip):
        calls["optimizer_step"] += int(float(skip) == 0)  # the steps that update (a skipped one changes nothing)
        return step_fn(self, step, skip)

    monkeypatch.setattr(NerfMethod, "forward_backward", forward_backward)
    monkeypatch.setattr(NerfMethod, "optimizer_step", optimizer_step)
    return plan, calls


def _all_finite(tree) -> bool:
    from stages.reconstruct.guards import nonfinite_entries

    return not nonfinite_entries(tree)


def test_nonfinite_steps_are_skipped_counted_and_never_saved(tiny_poses, tmp_path, faults, caplog, reliability):
    from stages.common.params import load_section
    from stages.reconstruct import ReconstructParams, run

    plan, calls = faults
    plan.update({4: "grad", 9: "loss"})
    p = load_section(ReconstructParams, "reconstruct", write_params(tmp_path / "p.yaml", {
        "steps": 20, "distributed": {"checkpoint_every": 5}}))
    with caplog.at_level(logging.WARNING, logger="stages.reconstruct.guards"):
        summary = run(p, tiny_poses, tmp_path / "out", progress=False)
    assert summary["nonfinite_steps_skipped"] == 2 and summary["nonfinite_steps"] == [4, 9]
    assert calls["optimizer_step"] == 18
    assert "step 4: non-finite gradients" in caplog.text and "step 9: non-finite loss" in caplog.text
    model = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    final = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    assert _all_finite(model["state"]) and _all_finite(final["optimizers"])
    steps = {int(s["step"]) for s in final["optimizers"]["field"]["state"].values()}
    assert steps == {18}, steps  # Adam took 18 of the 20 steps
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["nonfinite_steps_skipped"] == 2
    reliability(AREA, "NaN in the gradients at step 4", "step skipped, counted, logged; model finite",
                "skipped (optimizer not stepped), logged as a warning, summary nonfinite_steps [4, 9]")
    reliability(AREA, "Inf in the loss at step 9", "step skipped, counted, logged; model finite",
                "skipped; Adam took 18 of 20 steps; model.pt and optimizer state finite")


def test_a_run_that_keeps_diverging_stops_and_keeps_its_finite_checkpoint(tiny_poses, tmp_path, faults, capsys,
                                                                           reliability):
    from stages.reconstruct.__main__ import main
    from stages.reconstruct.checkpoint import CheckpointStore, default_dir

    plan, _ = faults
    plan.update({s: "grad" for s in range(3, 200)})
    params = write_params(tmp_path / "p.yaml", {"steps": 40, "distributed": {"checkpoint_every": 5}})
    out = tmp_path / "out"
    assert main(["--poses", str(tiny_poses), "--out", str(out), "--params", str(params)]) == 1
    err = capsys.readouterr().err
    line = next(ln for ln in err.splitlines() if ln.startswith("reconstruct: error:"))
    assert "training diverged: 20 steps in a row (up to step 22)" in line and "Traceback" not in err
    blob = CheckpointStore(default_dir(out)).load_latest()
    assert blob["step"] == 20 and _all_finite(blob["state"]) and not out.exists()
    reliability(AREA, "NaN gradients at every step from step 3 on", "stops with one line; checkpoints finite",
                f"checkpoint of step 20 finite; exit 1: {line[len('reconstruct: error: '):]}")


def test_a_nonfinite_state_is_never_written(tmp_path, reliability):
    from stages.reconstruct.checkpoint import CKPT_FORMAT, CheckpointStore
    from stages.reconstruct.guards import NonFiniteTraining

    store = CheckpointStore(tmp_path / "ck")
    blob = {"format": CKPT_FORMAT, "method": "nerf", "config": {}, "seed": 0, "world_size": 1, "step": 5,
            "state": {"field": {"w": torch.ones(3)}}, "optimizers": {}, "rng": []}
    store.save(blob)
    bad = {**blob, "step": 10, "state": {"field": {"w": torch.tensor([1.0, float("nan"), 2.0])}}}
    with pytest.raises(NonFiniteTraining, match=r"checkpoint of step 10 not written: non-finite values in "
                                                r"state\.field\.w"):
        store.save(bad)
    assert [s for s, _ in store.candidates()] == [5] and store.load(store.candidates()[0][1])["step"] == 5
    reliability(AREA, "a checkpoint with a NaN parameter", "refused; the previous checkpoint kept",
                "NonFiniteTraining naming state.field.w; step 5 still the newest and loadable")
