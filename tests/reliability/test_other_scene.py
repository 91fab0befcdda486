"""Another scene's data is never used silently: a checkpoint of scene A is not resumed on scene B, and a
model of scene A is not evaluated with scene B's poses; both are refused naming the two."""
from __future__ import annotations

import json

import torch

from reliability._faults import write_params


def test_checkpoint_of_another_scene_is_refused(tiny_poses, other_poses, tmp_path, reliability, capsys):
    from stages.common.fingerprint import data_fingerprint, short
    from stages.common.params import load_section
    from stages.reconstruct import ReconstructParams
    from stages.reconstruct.__main__ import main
    from stages.reconstruct.checkpoint import CheckpointStore, default_dir
    from stages.reconstruct.data import load_scene
    from stages.reconstruct.train import train

    params = write_params(tmp_path / "params.yaml", {"steps": 20, "distributed": {"checkpoint_every": 5}})
    p = load_section(ReconstructParams, "reconstruct", params)
    out = tmp_path / "out"
    fa = data_fingerprint(tiny_poses)
    store = CheckpointStore(default_dir(out), data={"fingerprint": fa, "poses": str(tiny_poses)})
    train(p, load_scene(tiny_poses), torch.device("cpu"), 0, progress=False, checkpoints=store)  # a run cut short
    left = sorted(store.candidates())
    assert left

    rc = main(["--poses", str(other_poses), "--out", str(out), "--params", str(params)])
    err = capsys.readouterr().err
    fb = data_fingerprint(other_poses)
    assert rc == 1 and "trained on other data" in err, err[-2000:]
    for name in (str(tiny_poses), str(other_poses), short(fa), short(fb)):
        assert name in err, (name, err[-2000:])
    assert not out.exists() and sorted(store.candidates()) == left  # nothing trained, nothing removed
    reliability("wrong checkpoint", "rerun on scene B with scene A's checkpoint (same params)",
                "refused before training, naming both scenes",
                f"exit 1, names {tiny_poses.name}/{short(fa)} and {other_poses.name}/{short(fb)}; "
                "checkpoints untouched")

    rc = main(["--poses", str(tiny_poses), "--out", str(out), "--params", str(params)])
    assert rc == 0, capsys.readouterr().err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == left[-1][0] and summary["data_fingerprint"] == fa
    reliability("wrong checkpoint", "rerun on scene A with its own checkpoint", "resumes",
                f"resumed from step {summary['resumed_from_step']}")

    from stages.evaluate import main as evaluate

    ev = write_params(tmp_path / "ev.yaml", evaluate={"orbit_frames": 0, "chunk_rays": 4096})
    args = ["--model", str(out), "--out", str(tmp_path / "ev"), "--metrics", str(tmp_path / "ev.json"),
            "--params", str(ev)]
    rc = evaluate(["--poses", str(other_poses), *args])
    err = capsys.readouterr().err
    assert rc == 1 and "trained on other data" in err and short(fa) in err and short(fb) in err, err[-2000:]
    assert not (tmp_path / "ev.json").exists() and not (tmp_path / "ev").exists()
    reliability("silently wrong", "evaluate a model of scene A with scene B's poses",
                "refused, naming both fingerprints (was: 11.8 dB and no warning)",
                f"exit 1: {err.strip().splitlines()[-1][len('evaluate: error: '):]}")
    assert evaluate(["--poses", str(tiny_poses), *args]) == 0
    m = json.loads((tmp_path / "ev.json").read_text())
    reliability("silently wrong", "evaluate the same model with its own poses", "evaluated",
                f"exit 0, PSNR {m['psnr']:.2f} dB")
