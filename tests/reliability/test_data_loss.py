"""No stage deletes its inputs: an out that is an input, a folder above one or inside one is refused
before anything is touched, by every stage's command, by ``atomic_dir`` and by ``remove``."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from reliability._faults import tree_digest, write_params

AREA = "data loss"


@pytest.fixture
def sandbox(tmp_path, tiny_poses):
    """A project folder: photos (and a file beside them), an ingest out, poses, a model folder, params."""
    root = tmp_path / "project"
    photos = root / "shoot" / "photos"
    photos.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(photos / f"p{i}.png")
    (root / "shoot" / "notes.txt").write_text("a file beside the photos")
    shutil.copytree(tiny_poses, root / "scenes" / "poses")
    (root / "model").mkdir()
    (root / "model" / "summary.json").write_text("{}")
    (root / "evaluate").mkdir()
    (root / "evaluate" / "per_view.json").write_text("[]")
    params = write_params(root / "params.yaml", ingest={"photos": str(photos)}, poses={}, evaluate={},
                          report={"max_views": 1, "scaling": []}, scene={})
    from stages import ingest

    assert ingest.main(["--photos", str(photos), "--out", str(root / "ingest"), "--params", str(params)]) == 0
    return root


def _cases(r: Path) -> list[tuple[str, str, list[str]]]:
    """(case, stage module, argv): every stage's outs pointed at its inputs."""
    p = str(r / "params.yaml")
    photos, ing, poses, model, ev = (str(r / x) for x in ("shoot/photos", "ingest", "scenes/poses", "model",
                                                          "evaluate"))
    return [
        ("ingest --out = --photos", "ingest", ["--photos", photos, "--out", photos, "--params", p]),
        ("ingest --out = the folder above the photos (a file beside them)", "ingest",
         ["--photos", photos, "--out", str(r / "shoot"), "--params", p]),
        ("ingest --out inside the photos", "ingest", ["--photos", photos, "--out", photos + "/out", "--params", p]),
        ("ingest --out = a symlink to the photos", "ingest",
         ["--photos", photos, "--out", str(r / "link"), "--params", p]),
        ("poses --ingest D --out D", "poses", ["--ingest", ing, "--out", ing, "--metrics", str(r / "m.json"),
                                              "--params", p]),
        ("poses --metrics = the ingest manifest", "poses",
         ["--ingest", ing, "--out", str(r / "p2"), "--metrics", ing + "/manifest.json", "--params", p]),
        ("poses --metrics = the params file", "poses",
         ["--ingest", ing, "--out", str(r / "p2"), "--metrics", p, "--params", p]),
        ("reconstruct --out = --poses", "reconstruct", ["--poses", poses, "--out", poses, "--params", p]),
        ("reconstruct --checkpoint-dir = --poses (removed on success)", "reconstruct",
         ["--poses", poses, "--out", str(r / "rec"), "--checkpoint-dir", poses, "--params", p]),
        ("reconstruct --metrics = poses/transforms.json", "reconstruct",
         ["--poses", poses, "--out", str(r / "rec"), "--metrics", poses + "/transforms.json", "--params", p]),
        ("evaluate --out = --model", "evaluate", ["--poses", poses, "--model", model, "--out", model,
                                                  "--metrics", str(r / "e.json"), "--params", p]),
        ("evaluate --out = the folder above the poses", "evaluate",
         ["--poses", poses, "--model", model, "--out", str(r / "scenes"), "--metrics", str(r / "e.json"),
          "--params", p]),
        ("evaluate --metrics = poses/split.json", "evaluate",
         ["--poses", poses, "--model", model, "--out", str(r / "ev2"), "--metrics", poses + "/split.json",
          "--params", p]),
        ("report --out = --evaluate", "report", ["--evaluate", ev, "--metrics-dir", str(r / "metrics"), "--plots",
                                                 str(r / "t.csv"), "--poses", poses, "--out", ev, "--params", p]),
        ("scene --out . (the working directory)", "scene", ["--out", ".", "--params", p]),
        ("compare --out = --repo", "compare", ["--out", str(r / "repo"), "--repo", str(r / "repo"), "--from-json",
                                               str(r / "x.json")]),
    ]


def test_every_stage_refuses_outs_that_overlap_its_inputs(sandbox, reliability, monkeypatch, capsys):
    import importlib

    (sandbox / "link").symlink_to(sandbox / "shoot" / "photos")
    (sandbox / "x.json").write_text("{}")
    (sandbox / "repo").mkdir()
    (sandbox / "repo" / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(sandbox)
    before = tree_digest(sandbox)
    for case, module, argv in _cases(sandbox):
        main = importlib.import_module(f"stages.{module}" + (".__main__" if module == "reconstruct" else "")).main
        rc = main(argv)
        err = capsys.readouterr().err
        line = next((ln for ln in err.splitlines() if "error:" in ln), err.strip()[-300:])
        assert rc == 1 and "would delete" in line, (case, rc, err[-2000:])
        assert tree_digest(sandbox) == before, case  # every input byte for byte, the file beside the photos too
        reliability(AREA, case, "refused before anything is touched; inputs intact",
                    f"all {len(before)} files intact; exit 1: {line.split('error: ', 1)[-1]}")


def test_atomic_dir_and_remove_refuse_an_input_for_every_caller(tmp_path, reliability):
    from stages.common.io import OverlapError, atomic_dir, check_outs, remove

    data = tmp_path / "photos"
    data.mkdir()
    (data / "a.png").write_bytes(b"x")
    with pytest.raises(OverlapError, match="holds the input"):
        with atomic_dir(tmp_path, inputs={"--photos": data}):
            pass
    check_outs({"--photos": data}, {"--out": tmp_path / "out"})  # the running stage's inputs
    for bad in (data, tmp_path, data / "sub"):
        with pytest.raises(OverlapError):
            with atomic_dir(bad):
                pass
    with pytest.raises(OverlapError, match="is the input"):
        remove(data)
    with pytest.raises(OverlapError, match="working directory"):
        remove(Path(os.getcwd()))
    assert (data / "a.png").read_bytes() == b"x"
    with atomic_dir(tmp_path / "out") as tmp:  # a real out still works
        (tmp / "f").write_text("ok")
    assert (tmp_path / "out" / "f").read_text() == "ok"
    reliability(AREA, "atomic_dir / remove called on an input, its parent, inside it, the working directory",
                "OverlapError; nothing removed", "OverlapError each time; the input file intact; a real out written")
