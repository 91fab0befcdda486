"""A failed stage leaves no outs that look complete: reconstruct and evaluate remove their previous outs
and metrics when they start, as ``dvc repro`` does before it runs a stage's command (DVC then sees
them as missing and reruns the stage), so a failure from the command line leaves none behind."""
from __future__ import annotations

import shutil

from reliability._faults import write_params


def _stale(*paths) -> None:
    for p in paths:
        if p.suffix:
            p.write_text("{}")
        else:
            p.mkdir()
            (p / "model.pt").write_bytes(b"old")
            (p / "summary.json").write_text("{}")


def test_failed_reconstruct_and_evaluate_leave_no_stale_outs(tiny_poses, tmp_path, reliability, capsys):
    from stages.evaluate import main as evaluate
    from stages.reconstruct.__main__ import main as reconstruct

    poses = shutil.copytree(tiny_poses, tmp_path / "poses")
    victim = sorted((poses / "images").iterdir())[0]
    victim.unlink()  # the stage fails after it started: an image of the split is gone
    out, metrics, plots = tmp_path / "rec", tmp_path / "rec.json", tmp_path / "train.csv"
    _stale(out, metrics, plots)
    params = write_params(tmp_path / "p.yaml", evaluate={"orbit_frames": 0})
    rc = reconstruct(["--poses", str(poses), "--out", str(out), "--metrics", str(metrics), "--plots", str(plots),
                      "--params", str(params)])
    err = capsys.readouterr().err
    assert rc == 1 and victim.name in err, err[-2000:]
    assert not out.exists() and not metrics.exists() and not plots.exists()
    reliability("stale outs", "reconstruct fails (an image is missing) over a previous out, metrics and plots",
                "all three removed, as dvc repro removes outs before it runs a stage",
                f"none left; exit 1: {err.strip().splitlines()[-1].split('error: ')[-1]}")

    model, ev, ev_metrics = tmp_path / "model", tmp_path / "ev", tmp_path / "ev.json"
    _stale(model, ev, ev_metrics)
    (model / "model.pt").unlink()
    rc = evaluate(["--poses", str(tiny_poses), "--model", str(model), "--out", str(ev), "--metrics", str(ev_metrics),
                   "--params", str(params)])
    err = capsys.readouterr().err
    assert rc == 1 and "model.pt" in err, err[-2000:]
    assert not ev.exists() and not ev_metrics.exists()
    reliability("stale outs", "evaluate fails (model.pt missing) over a previous out and metrics", "both removed",
                "exit 1; none left")
