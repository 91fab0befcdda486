"""Training checkpoints: the folder's rules (atomic, latest two, digests), falling back
from a corrupt newest checkpoint, refusing another config's, and an in-process resume
that continues exactly where the interrupted run was."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from stages.common.params import from_dict, to_dict
from stages.reconstruct.checkpoint import (
    CKPT_FORMAT, CheckpointMismatch, CheckpointStore, Expectation, config_differences, default_dir,
)
from stages.reconstruct.config import ReconstructParams

from _dvc_project import merge
from test_distributed import TINY, make_poses, write_params


def params(over: dict | None = None) -> ReconstructParams:
    return from_dict(ReconstructParams, merge(TINY, over or {}), "reconstruct")


def blob(step: int, p: ReconstructParams | None = None) -> dict:
    p = p or params()
    return {"format": CKPT_FORMAT, "method": "nerf", "config": to_dict(p), "seed": 0, "world_size": 1,
            "step": step, "state": {"w": torch.full((3,), float(step))}, "optimizers": {}, "schedulers": {},
            "rng": [{"torch": torch.get_rng_state()}], "progress": {"rows": [{"step": step, "test_psnr": None}]}}


def expect(p: ReconstructParams | None = None, world: int = 1) -> Expectation:
    p = p or params()
    return Expectation("nerf", to_dict(p), 0, world)


def test_a_v1_checkpoint_reads_back_in_the_v2_layout(tmp_path):
    old = blob(7)
    del old["optimizers"], old["schedulers"]
    old.update(format="rayforge-train-checkpoint-v1", optimizer={"state": {}, "param_groups": []}, scheduler={"x": 1})
    store = CheckpointStore(tmp_path / "ck")
    store.save(old)
    got = store.load_latest(expect())
    assert got["format"] == CKPT_FORMAT and got["method_version"] == 1
    assert got["optimizers"] == {"field": {"state": {}, "param_groups": []}} and got["schedulers"] == {"field": {"x": 1}}


def test_another_method_version_is_a_mismatch(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    store.save({**blob(5), "method_version": 1})
    p = params()
    with pytest.raises(CheckpointMismatch, match="nerf version: 1 -> 2"):
        store.load_latest(Expectation("nerf", to_dict(p), 0, 1, version=2))


def test_default_dir_is_beside_the_out():
    assert default_dir("data/reconstruct") == Path("data/reconstruct.ckpt")


def test_keeps_the_latest_two_atomically(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    for s in (5, 10, 15, 20):
        store.save(blob(s))
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["step_00000015.json", "step_00000015.pt", "step_00000020.json", "step_00000020.pt"]
    got = store.load_latest(expect())
    assert got["step"] == 20 and torch.equal(got["state"]["w"], torch.full((3,), 20.0))
    # tensors and plain types only
    torch.load(tmp_path / "ck" / "step_00000020.pt", weights_only=True)


@pytest.mark.parametrize("damage", ["flip", "truncate", "truncate_no_digest", "garbage"])
def test_corrupt_latest_falls_back_to_the_previous_with_a_warning(tmp_path, caplog, damage):
    store = CheckpointStore(tmp_path / "ck")
    store.save(blob(10))
    latest = store.save(blob(20))
    data = bytearray(latest.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage.startswith("truncate"):
        data = data[: len(data) // 3]
        if damage == "truncate_no_digest":
            latest.with_suffix(".json").unlink()
    else:
        data = bytearray(b"not a checkpoint")
        latest.with_suffix(".json").unlink()
    latest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="stages.reconstruct.checkpoint"):
        got = store.load_latest(expect())
    assert got["step"] == 10
    assert "checkpoint of step 20 is corrupt" in caplog.text and "falling back to step 10" in caplog.text


def test_nothing_intact_starts_fresh_with_a_warning(tmp_path, caplog):
    store = CheckpointStore(tmp_path / "ck")
    store.save(blob(10)).write_bytes(b"x")
    with caplog.at_level(logging.WARNING, logger="stages.reconstruct.checkpoint"):
        assert store.load_latest(expect()) is None
    assert "training starts from step 0" in caplog.text
    assert CheckpointStore(tmp_path / "none").load_latest(expect()) is None


def test_another_config_is_an_error_naming_the_keys(tmp_path):
    store = CheckpointStore(tmp_path / "ck")
    store.save(blob(10))
    other = params({"nerf": {"hidden_dim": 16}, "distributed": {"checkpoint_every": 3, "max_restarts": 9}})
    with pytest.raises(CheckpointMismatch, match=r"reconstruct\.nerf\.hidden_dim: 8 -> 16") as e:
        store.load_latest(expect(other))
    assert str(tmp_path / "ck") in str(e.value) and "checkpoint_every" not in str(e.value)
    with pytest.raises(CheckpointMismatch, match="world size: 1 -> 2 processes"):
        store.load_latest(expect(world=2))
    # operational knobs may change between a run and its resume
    ok = params({"eval_every": 7, "distributed": {"checkpoint_every": 3, "metrics_port": 9100, "grad_sync": "sparse"}})
    assert config_differences(to_dict(params()), to_dict(ok)) == []


def test_a_key_added_since_the_checkpoint_is_no_difference_at_its_default():
    """A checkpoint written before ``nerf.grid_offset`` existed resumes while it is 0 (the behaviour
    then); set to anything else, the run would train another model, which is named."""
    old = to_dict(params())
    del old["nerf"]["grid_offset"]
    assert config_differences(old, to_dict(params())) == []
    assert config_differences(old, to_dict(params({"nerf": {"grid_offset": 0.5}}))) == [
        "reconstruct.nerf.grid_offset: '<absent>' -> 0.5"]


# ---------------------------------------------------------------- in-process training


@pytest.fixture(scope="module")
def poses(tmp_path_factory) -> Path:
    return make_poses(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only contend on a shared 2-core box
    yield
    torch.set_num_threads(n)


def _train(p: ReconstructParams, poses: Path, store: CheckpointStore):
    from stages.reconstruct.data import load_scene
    from stages.reconstruct.train import train

    return train(p, load_scene(poses), torch.device("cpu"), 0, progress=False, checkpoints=store)


def _flat(method) -> dict[str, torch.Tensor]:
    return {f"{a}.{k}": v.clone() for a, sd in method.state_dict().items() for k, v in sd.items()}


def test_resume_from_the_previous_checkpoint_continues_exactly(poses, tmp_path, caplog, one_thread):
    p = params({"steps": 20, "distributed": {"checkpoint_every": 5}})
    store = CheckpointStore(tmp_path / "ck")
    full = _train(p, poses, store)  # train() leaves its checkpoints; run() removes them on success
    assert [s for s, _ in store.candidates()] == [15, 10]
    want = _flat(full.method)
    latest = store.candidates()[0][1]
    latest.write_bytes(latest.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="stages.reconstruct.checkpoint"):
        again = _train(p, poses, store)
    assert "falling back to step 10" in caplog.text
    assert again.resumed_from_step == 10
    got = _flat(again.method)
    for k in want:  # every generator restored: bitwise the uninterrupted run
        assert torch.equal(want[k], got[k]), k
    assert [r["step"] for r in again.rows] == [r["step"] for r in full.rows]


def test_stage_refuses_another_configs_checkpoint_before_training(poses, tmp_path, capsys, one_thread):
    from stages.reconstruct import run
    from stages.reconstruct.__main__ import main

    out = tmp_path / "out"
    store = CheckpointStore(default_dir(out))
    _train(params({"steps": 10, "distributed": {"checkpoint_every": 5}}), poses, store)
    assert store.candidates()
    changed = {"steps": 10, "nerf": {"levels": 3}, "distributed": {"checkpoint_every": 5}}
    yaml_path = write_params(tmp_path / "p.yaml", changed)
    assert main(["--poses", str(poses), "--out", str(out), "--params", str(yaml_path)]) == 1
    err = capsys.readouterr().err
    assert "reconstruct.nerf.levels: 2 -> 3" in err and f"remove {default_dir(out)}" in err
    with pytest.raises(CheckpointMismatch):
        run(params(changed), poses, out, progress=False)
    assert not out.exists()


def test_successful_run_writes_outs_and_removes_its_checkpoints(poses, tmp_path, one_thread):
    from stages.reconstruct import run

    out = tmp_path / "out"
    summary = run(params({"steps": 12, "distributed": {"checkpoint_every": 4}}), poses, out,
                  plots_path=tmp_path / "train.csv", progress=False)
    assert (out / "model.pt").is_file() and (out / "checkpoint.pt").is_file() and (out / "summary.json").is_file()
    assert not default_dir(out).exists()
    assert summary["world_size"] == 1 and summary["lr_scale"] == 1.0 and summary["resumed_from_step"] is None
    final = torch.load(out / "checkpoint.pt", weights_only=True)
    assert final["step"] == 12 and set(final["optimizers"]) == {"field"} and final["method_version"] == 1
