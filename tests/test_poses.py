"""The poses stage: pycolmap SfM on a small generated scene with known cameras."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stages import poses
from stages.common import cameras as C
from stages.common import params as P

QUIET = logging.getLogger("test.poses.quiet")
QUIET.setLevel(logging.WARNING)


def _make_ingest(root: Path) -> tuple[Path, str]:
    """A 16-view, 2-ring scene in the ingest layout; the project's scene + ingest stages when they
    are there, else the tests' own ray-cast scene."""
    try:
        from stages.ingest import IngestParams
        from stages.ingest import run as ingest_run
        from stages.scene import SceneParams
        from stages.scene import run as scene_run
    except ImportError:
        import _synthetic

        _synthetic.make_ingest(root / "ingest", views=16, rings=2, width=200, height=150)
        return root / "ingest", "tests/_synthetic.py"
    # 240x180 rather than 200x150: at 200x150 the default scene's worst camera is ~2.5% of the
    # radius off, too close to the 2% bound below for a test that must not flake.
    scene_run(SceneParams(width=240, height=180, views=16, rings=2), root / "scene", 0, log=QUIET)
    ingest_run(IngestParams(), root / "scene" / "images", root / "ingest", log=QUIET)
    return root / "ingest", "stages.scene"


@pytest.fixture(scope="module")
def ingest(tmp_path_factory) -> Path:
    path, _ = _make_ingest(tmp_path_factory.mktemp("poses_scene"))
    return path


@pytest.fixture(scope="module")
def sfm(ingest, tmp_path_factory):
    """One SfM run with the default params, shared by the checks of its outs."""
    root = tmp_path_factory.mktemp("poses_out")
    metrics = poses.run(poses.PosesParams(), ingest, root / "poses", root / "metrics" / "poses.json", seed=0)
    return root / "poses", root / "metrics" / "poses.json", metrics


@pytest.mark.slow
def test_sfm_registers_every_view_with_small_pose_error(sfm):
    _, metrics_path, m = sfm
    assert m["num_images"] == 16
    assert m["num_registered"] == 16 and m["registered_fraction"] == 1.0
    assert m["unregistered"] == [] and m["other_models"] == []
    assert m["num_points"] > 100
    assert 0 < m["mean_reprojection_error_px"] < 1.0
    assert m["mean_track_length"] > 2.0
    assert m["gt_matched_images"] == 16
    # bounds from the task: centres within 2% of the scene radius, orientations within 1 degree
    assert m["center_error_max"] < 0.02, m
    assert m["rotation_error_max_deg"] < 1.0, m
    assert m["focal_error_rel"] < 0.02, m
    assert set(m["time_s"]) >= {"extract", "match", "map", "total"}
    assert json.loads(metrics_path.with_name("poses.full.json").read_text()) == json.loads(json.dumps(m))
    assert json.loads(metrics_path.read_text()) == {k: m[k] for k in poses.METRICS_HEADLINE}  # `dvc metrics show`


@pytest.mark.slow
def test_sfm_writes_every_out(sfm, ingest):
    import open3d as o3d
    import pycolmap

    out, _, m = sfm
    assert sorted(p.name for p in out.iterdir()) == ["images", "points3D.ply", "sparse", "split.json",
                                                      "transforms.json"]
    names = sorted(p.name for p in (ingest / "images").glob("*.png"))
    assert sorted(p.name for p in (out / "images").iterdir()) == names
    assert (out / "images" / names[0]).read_bytes() == (ingest / "images" / names[0]).read_bytes()

    rec = pycolmap.Reconstruction(out / "sparse" / "0")
    assert rec.num_reg_images() == 16 and rec.num_points3D() == m["num_points"]
    assert {c.model_name for c in rec.cameras.values()} == {"PINHOLE"}

    intrs, files, c2w, doc = C.read_transforms(out / "transforms.json")
    assert files == [f"images/{n}" for n in names]
    w, h = Image.open(ingest / "images" / names[0]).size
    assert (doc["w"], doc["h"]) == (w, h) and len(set(intrs)) == 1  # one shared camera: camera_mode auto
    assert doc["camera_model"] == "PINHOLE" and doc["sfm_camera_model"] == "PINHOLE"
    assert m["camera_mode"] == "auto" and m["num_cameras"] == 1
    # nerfstudio's keys: the points' file, the SfM world -> this frame as 3x4, the split, the image ids
    assert doc["ply_file_path"] == "points3D.ply"
    assert doc["test_filenames"] == doc["val_filenames"] == [f"images/{names[i]}" for i in (0, 8)]
    np.testing.assert_allclose(doc["applied_transform"], np.array(doc["normalization"])[:3], atol=0)
    g = m["geometry"]
    assert not g["degenerate"] and g["reasons"] == [] and g["baseline_ratio"] > 0.3 and g["behind_fraction"] == 0
    centres = c2w[:, :3, 3]
    np.testing.assert_allclose(centres.mean(axis=0), 0, atol=1e-9)
    assert np.linalg.norm(centres, axis=1).max() == pytest.approx(1.0)
    up = -c2w[:, :3, 1].mean(axis=0)
    np.testing.assert_allclose(up / np.linalg.norm(up), [0, 0, 1], atol=1e-9)
    # the normalization maps the SfM model's cameras onto transforms.json's
    S = np.array(doc["normalization"])
    by_name = {rec.image(i).name: rec.image(i) for i in rec.reg_image_ids()}
    assert [f["colmap_im_id"] for f in doc["frames"]] == [by_name[n].image_id for n in names]
    w2c0 = np.vstack([by_name[names[0]].cam_from_world().matrix(), [0, 0, 0, 1]])
    np.testing.assert_allclose(C.apply_similarity_to_c2w(S, C.w2c_to_c2w(w2c0)), c2w[0], atol=1e-9)
    # the box holds most of the points, which sit among (below) the cameras
    aabb = np.array(doc["aabb"])
    pcd = o3d.io.read_point_cloud(str(out / "points3D.ply"))
    pts = np.asarray(pcd.points)
    assert len(pts) == m["num_points"] and pcd.has_colors()
    inside = np.all((pts >= aabb[0]) & (pts <= aabb[1]), axis=1)
    assert inside.mean() > 0.9
    assert np.all(aabb[1] > aabb[0]) and np.all(np.abs(aabb) < 2.0)

    split = json.loads((out / "split.json").read_text())
    assert split == {"test": [names[i] for i in (0, 8)], "train": [n for i, n in enumerate(names) if i % 8]}


@pytest.mark.slow
def test_rerun_is_deterministic_and_undistorts_radial(ingest, tmp_path):
    """Same inputs, params and seed -> the same model; SIMPLE_RADIAL + sequential matching path:
    the images are undistorted and the written camera is PINHOLE."""
    p = poses.PosesParams(camera_model="SIMPLE_RADIAL", matcher="sequential", sequential_overlap=16)
    runs = [poses.run(p, ingest, tmp_path / f"out{i}", tmp_path / f"m{i}.json", seed=3) for i in (0, 1)]
    for r in runs:
        assert r["num_registered"] == 16 and "undistort" in r["time_s"]
        assert r["center_error_max"] < 0.03 and r["rotation_error_max_deg"] < 1.0, r
    a, b = (json.loads((tmp_path / f"out{i}" / "transforms.json").read_text()) for i in (0, 1))
    assert a == b
    for f in ("images.bin", "points3D.bin", "cameras.bin"):
        assert (tmp_path / "out0/sparse/0" / f).read_bytes() == (tmp_path / "out1/sparse/0" / f).read_bytes()
    assert a["camera_model"] == "PINHOLE" and a["sfm_camera_model"] == "SIMPLE_RADIAL"
    import pycolmap

    rec = pycolmap.Reconstruction(tmp_path / "out0" / "sparse" / "0")
    cam = next(iter(rec.cameras.values()))
    assert cam.model_name == "PINHOLE"
    img = Image.open(tmp_path / "out0" / "images" / "view_000.png")
    assert img.size == (cam.width, cam.height) == (a["w"], a["h"])


def _gt_intrinsics(ingest: Path) -> dict:
    return json.loads((ingest / "ground_truth.json").read_text())["intrinsics"]


def _sparse_cameras(out: Path) -> list:
    import pycolmap

    rec = pycolmap.Reconstruction(out / "sparse" / "0")
    return [rec.cameras[k] for k in sorted(rec.cameras)]


@pytest.mark.slow
def test_global_mapper_registers_every_view(ingest, tmp_path):
    import open3d as o3d

    m = poses.run(poses.PosesParams(mapper="global"), ingest, tmp_path / "out", tmp_path / "m.json", seed=0)
    assert m["mapper"] == "global" and m["num_registered"] == 16 and m["other_models"] == []
    assert m["num_points"] > 100 and m["mean_reprojection_error_px"] < 1.0
    assert m["center_error_max"] < 0.03 and m["rotation_error_max_deg"] < 1.0, m
    assert m["focal_error_rel"] < 0.02, m
    pcd = o3d.io.read_point_cloud(str(tmp_path / "out" / "points3D.ply"))
    assert np.asarray(pcd.colors).std() > 0.05  # the global pipeline's points are coloured too


@pytest.mark.slow
def test_sift_downscale_keeps_keypoints_in_full_size_pixels(ingest, sfm, tmp_path):
    """SIFT on images shrunk to 200 px: fewer points, yet a focal length right for the 240 px
    images, which holds only when the keypoints are scaled back to the full size."""
    m = poses.run(poses.PosesParams(sift_max_size=200), ingest, tmp_path / "out", tmp_path / "m.json", seed=0)
    assert m["num_registered"] == 16
    assert m["num_points"] < sfm[2]["num_points"]
    assert m["focal_error_rel"] < 0.02 and m["center_error_max"] < 0.03, m
    assert _sparse_cameras(tmp_path / "out")[0].width == 240


@pytest.fixture(scope="module")
def mixed_ingest(ingest, tmp_path_factory) -> Path:
    """The 16-view ingest with every odd view shrunk to 216x162 (0.9 size). At 3/4 size (180x135) the
    mapper's registration hung on the RANSAC seed (the byte-identical scene: seeds 0, 1, 2 registered
    7, 9 and 16 of 16 views); at 0.9 each of those seeds registers all 16."""
    dst = tmp_path_factory.mktemp("poses_mixed") / "ingest"
    shutil.copytree(ingest, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    for i, e in enumerate(manifest["images"]):
        if i % 2:
            img = Image.open(dst / e["file"])
            img.resize((216, 162), Image.Resampling.LANCZOS).save(dst / e["file"])
            e["width"], e["height"] = 216, 162
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_single_camera_rejects_mixed_sizes(mixed_ingest, tmp_path):
    with pytest.raises(ValueError, match=r"different sizes.*camera_mode: auto or per_size"):
        poses.run(poses.PosesParams(camera_mode="single"), mixed_ingest, tmp_path / "out", tmp_path / "m.json")
    assert not (tmp_path / "out").exists()


def test_import_keeps_sorted_ids_with_one_camera_per_size(mixed_ingest, tmp_path):
    import pycolmap

    names, gt = poses.read_ingest(mixed_ingest, allow_mixed_sizes=True)
    sizes = poses.image_sizes(mixed_ingest / "images", names)
    db_path = tmp_path / "db.db"
    poses.import_sorted(pycolmap, db_path, mixed_ingest / "images", names, sizes,
                        poses.PosesParams(camera_mode="per_size"), gt)
    db = pycolmap.Database.open(db_path)
    try:
        images = sorted(db.read_all_images(), key=lambda im: im.image_id)
        cams = {c.camera_id: c for c in db.read_all_cameras()}
    finally:
        db.close()
    assert [im.name for im in images] == names and [im.image_id for im in images] == list(range(1, 17))
    assert len(cams) == 2
    for im in images:
        assert (cams[im.camera_id].width, cams[im.camera_id].height) == sizes[im.name]


@pytest.mark.slow
def test_per_size_cameras_on_mixed_sizes(mixed_ingest, tmp_path):
    m = poses.run(poses.PosesParams(camera_mode="per_size"), mixed_ingest, tmp_path / "out", tmp_path / "m.json")
    assert m["num_registered"] == 16 and m["num_cameras"] == 2
    assert m["center_error_max"] < 0.05 and m["rotation_error_max_deg"] < 1.5, m
    assert m["focal_error_rel"] < 0.03, m
    doc = json.loads((tmp_path / "out" / "transforms.json").read_text())
    by_file = {f["file_path"]: f for f in doc["frames"]}
    big, small = by_file["images/view_000.png"], by_file["images/view_001.png"]
    assert (big["w"], big["h"], small["w"], small["h"]) == (240, 180, 216, 162)
    assert small["fl_x"] == pytest.approx(0.9 * big["fl_x"], rel=0.03)
    assert "w" not in doc and "fl_x" not in doc  # several cameras: none at the top level (nerfstudio)
    for f in doc["frames"]:
        assert Image.open(tmp_path / "out" / f["file_path"]).size == (f["w"], f["h"])


@pytest.mark.slow
def test_fixed_ground_truth_intrinsics_stay_exact(ingest, tmp_path):
    gi = _gt_intrinsics(ingest)
    p = poses.PosesParams(known_intrinsics="ground_truth", fix_intrinsics=True)
    m = poses.run(p, ingest, tmp_path / "out", tmp_path / "m.json", seed=0)
    assert m["num_registered"] == 16 and m["center_error_max"] < 0.02, m
    (cam,) = _sparse_cameras(tmp_path / "out")
    np.testing.assert_allclose(cam.params, [gi["fx"], gi["fy"], gi["cx"], gi["cy"]], rtol=1e-12)
    assert m["focal_error_rel"] < 1e-9


@pytest.mark.slow
def test_fixed_params_intrinsics_with_the_global_mapper(ingest, tmp_path):
    gi = _gt_intrinsics(ingest)
    f = (gi["fx"] + gi["fy"]) / 2
    p = poses.PosesParams(mapper="global", camera_model="SIMPLE_RADIAL", known_intrinsics="params",
                          camera_params=(f, gi["cx"], gi["cy"], 0.0), fix_intrinsics=True)
    m = poses.run(p, ingest, tmp_path / "out", tmp_path / "m.json", seed=0)
    assert m["num_registered"] == 16 and m["center_error_max"] < 0.03, m
    assert m["focal_error_rel"] < 1e-9  # held fixed through global positioning and bundle adjustment
    (cam,) = _sparse_cameras(tmp_path / "out")  # undistorted with k = 0: the same pinhole camera
    assert cam.model_name == "PINHOLE"
    np.testing.assert_allclose(cam.params, [f, f, gi["cx"], gi["cy"]], rtol=1e-6)


@pytest.mark.slow
def test_largest_model_kept_and_the_others_reported(ingest, tmp_path):
    """A second, unrelated scene among the photos makes a separate model: the 16-view one is
    kept, the other is listed with its images and each of them says why it is missing."""
    from stages.scene import SceneParams
    from stages.scene import run as scene_run

    dst = tmp_path / "ingest"
    shutil.copytree(ingest, dst)
    scene_run(SceneParams(width=240, height=180, views=12, rings=1), tmp_path / "other", 7, log=QUIET)
    manifest = json.loads((dst / "manifest.json").read_text())
    extra = []
    for src in sorted((tmp_path / "other" / "images").glob("*.png")):
        name = f"zz_{src.name}"
        shutil.copy(src, dst / "images" / name)
        manifest["images"].append({"file": f"images/{name}", "source": name, "width": 240, "height": 180})
        extra.append(name)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    m = poses.run(poses.PosesParams(min_registered_fraction=0.5), dst, tmp_path / "out", tmp_path / "m.json")
    assert m["num_registered"] == 16 and m["registered"] == sorted(p.name for p in (ingest / "images").iterdir())
    assert [(o["num_registered"]) for o in m["other_models"]] == [12]
    assert {u["file"] for u in m["unregistered"]} == set(extra)
    assert all("smaller separate model" in u["reason"] for u in m["unregistered"])


def test_device_cuda_without_cuda_is_a_clear_error(ingest, tmp_path):
    import pycolmap

    if pycolmap.has_cuda:
        pytest.skip("this pycolmap has CUDA; the error is for CPU-only builds")
    assert poses.use_gpu(pycolmap, poses.PosesParams()) is False  # auto falls back to the CPU
    with pytest.raises(ValueError, match="has_cuda"):
        poses.run(poses.PosesParams(device="cuda"), ingest, tmp_path / "out", tmp_path / "m.json")
    assert not (tmp_path / "out").exists()


def test_mapping_options_follow_the_params():
    import pycolmap

    inc = poses.mapping_options(pycolmap, 5, poses.PosesParams(refine_principal_point=True))
    assert isinstance(inc, pycolmap.IncrementalPipelineOptions)
    assert inc.random_seed == 5 and inc.num_threads == 1
    assert inc.ba_refine_principal_point and inc.ba_refine_focal_length and inc.ba_refine_extra_params
    glob = poses.mapping_options(pycolmap, 5, poses.PosesParams(mapper="global", known_intrinsics="ground_truth",
                                                                fix_intrinsics=True))
    assert isinstance(glob, pycolmap.GlobalPipelineOptions)
    assert glob.random_seed == 5 and glob.mapper.random_seed == 5
    ba = glob.mapper.bundle_adjustment
    assert not (ba.refine_focal_length or ba.refine_extra_params or ba.refine_principal_point)


def test_known_camera_params_rescale_and_check():
    p = poses.PosesParams(camera_model="OPENCV", known_intrinsics="params",
                          camera_params=(400.0, 410.0, 200.0, 150.0, 0.1, -0.02, 0.001, 0.002))
    got = poses.known_camera_params(p, None, (200, 150), (400, 300))
    assert got == pytest.approx([200.0, 205.0, 100.0, 75.0, 0.1, -0.02, 0.001, 0.002])
    with pytest.raises(ValueError, match="aspect ratio"):
        poses.known_camera_params(p, None, (200, 200), (400, 300))
    gt = {"intrinsics": {"width": 400, "height": 300, "fx": 380.0, "fy": 390.0, "cx": 201.0, "cy": 149.0}}
    q = poses.PosesParams(camera_model="SIMPLE_RADIAL", known_intrinsics="ground_truth")
    assert poses.known_camera_params(q, gt, (800, 600), (1, 1)) == pytest.approx([770.0, 402.0, 298.0, 0.0])
    with pytest.raises(ValueError, match="no ground_truth.json"):
        poses.known_camera_params(q, None, (800, 600), (1, 1))
    assert poses.known_camera_params(poses.PosesParams(), gt, (800, 600), (1, 1)) is None


def _junk_ingest(ingest: Path, dst: Path) -> list[str]:
    """``ingest`` plus three images SfM cannot register: a blank one and two of pure noise."""
    shutil.copytree(ingest, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    w, h = Image.open(next((dst / "images").glob("*.png"))).size
    rng = np.random.default_rng(0)
    junk = ["zz_blank.png", "zz_noise_0.png", "zz_noise_1.png"]
    Image.new("RGB", (w, h), (128, 128, 128)).save(dst / "images" / junk[0])
    for n in junk[1:]:  # blocky noise: features, but nothing another view could match
        blocks = rng.integers(0, 256, (h // 6 + 1, w // 6 + 1, 3), dtype=np.uint8)
        Image.fromarray(blocks.repeat(6, 0).repeat(6, 1)[:h, :w]).save(dst / "images" / n)
    manifest["images"] += [{"file": f"images/{n}", "source": n, "width": w, "height": h} for n in junk]
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return junk


@pytest.mark.slow
def test_too_few_registered_raises_and_leaves_no_out(ingest, tmp_path):
    junk = _junk_ingest(ingest, tmp_path / "ingest")
    out, metrics = tmp_path / "poses", tmp_path / "poses.json"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier run")
    metrics.write_text("{}")
    with pytest.raises(ValueError, match=r"registered 16 of 19 images") as exc:
        poses.run(poses.PosesParams(min_registered_fraction=0.9), tmp_path / "ingest", out, metrics)
    msg = str(exc.value)
    assert all(n in msg for n in junk)
    assert "zz_blank.png: no SIFT features" in msg
    assert "min_registered_fraction" in msg
    assert not out.exists() and not metrics.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".poses")], "temporary out left behind"


def test_no_model_at_all_raises(tmp_path):
    ing = tmp_path / "ingest"
    (ing / "images").mkdir(parents=True)
    rng = np.random.default_rng(1)
    entries = []
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(ing / "images" / f"n{i}.png")
        entries.append({"file": f"images/n{i}.png", "source": f"n{i}.png", "width": 80, "height": 60})
    (ing / "manifest.json").write_text(json.dumps({"images": entries, "skipped": []}))
    with pytest.raises(ValueError, match="registered 0 of 4"):
        poses.run(poses.PosesParams(max_features=512), ing, tmp_path / "out", tmp_path / "m.json")
    assert not (tmp_path / "out").exists()


def test_bad_ingest_is_a_clear_error(tmp_path, capsys):
    rc = poses.main(["--ingest", str(tmp_path / "missing"), "--out", str(tmp_path / "out"),
                     "--metrics", str(tmp_path / "m.json"), "--params", str(_params_file(tmp_path, {}))])
    err = capsys.readouterr().err
    assert rc == 1 and "manifest" in err and "Traceback" not in err


def _params_file(tmp_path: Path, poses_section: dict) -> Path:
    import yaml

    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"seed": 0, "poses": poses_section}))
    return path


def test_params_file_section_loads():
    p = P.load_section(poses.PosesParams, "poses", Path(__file__).resolve().parents[1] / "params.yaml")
    assert p.source == "auto" and p.test_every == 8  # auto: SfM unless the ingest found a Blender folder


def test_unknown_params_key_rejected(tmp_path, capsys):
    with pytest.raises(P.ParamsError, match=r"poses\.max_feature\b"):
        P.load_section(poses.PosesParams, "poses", data={"poses": {"max_feature": 1000}})
    rc = poses.main(["--ingest", str(tmp_path), "--out", str(tmp_path / "out"), "--metrics", str(tmp_path / "m.json"),
                     "--params", str(_params_file(tmp_path, {"matchr": "exhaustive"}))])
    err = capsys.readouterr().err
    assert rc == 1 and "poses.matchr" in err and "Traceback" not in err


@pytest.mark.parametrize("section, key", [
    ({"max_features": 100}, "poses.max_features"),
    ({"test_every": 1}, "poses.test_every"),
    ({"min_registered_fraction": 0.0}, "poses.min_registered_fraction"),
    ({"min_registered_fraction": 1.5}, "poses.min_registered_fraction"),
    ({"camera_model": "FISHEYE"}, "poses.camera_model"),
    ({"matcher": "vocabtree"}, "poses.matcher"),
    ({"align_up": 1}, "poses.align_up"),
    ({"mapper": "hierarchical"}, "poses.mapper"),
    ({"sift_max_size": 32}, "poses.sift_max_size"),
    ({"device": "gpu"}, "poses.device"),
    ({"camera_mode": "per_exif"}, "poses.camera_mode"),
    ({"allow_degenerate": "yes"}, "poses.allow_degenerate"),
    ({"known_intrinsics": "exif"}, "poses.known_intrinsics"),
    ({"known_intrinsics": "params", "camera_params": [300.0, 200.0, 150.0]}, "poses.camera_params"),
    ({"known_intrinsics": "params", "camera_params": [-1.0, 300.0, 200.0, 150.0]}, "poses.camera_params"),
    ({"camera_params": [300.0, 300.0, 200.0, 150.0]}, "poses.camera_params"),
    ({"fix_intrinsics": True}, "poses.fix_intrinsics"),
    ({"known_intrinsics": "ground_truth", "fix_intrinsics": True, "refine_principal_point": True},
     "poses.refine_principal_point"),
])
def test_params_ranges(section, key):
    with pytest.raises(P.ParamsError, match=key.replace(".", r"\.")):
        P.load_section(poses.PosesParams, "poses", data={"poses": section})


def test_seed_is_checked():
    assert poses.load_seed(data={"seed": 7}) == 7
    assert poses.load_seed(data={}) == 0
    with pytest.raises(P.ParamsError, match="seed"):
        poses.load_seed(data={"seed": True})


def test_split_every_nth_sorted_name():
    names = [f"view_{i:03d}.png" for i in range(17)][::-1]
    split = poses.make_split(names, 8)
    assert split["test"] == ["view_000.png", "view_008.png", "view_016.png"]
    assert len(split["train"]) == 14 and split["train"] == sorted(split["train"])
    assert not set(split["train"]) & set(split["test"])


def test_robust_aabb_ignores_outliers_and_pads():
    rng = np.random.default_rng(0)
    pts = np.concatenate([rng.uniform(-1, 1, (1000, 3)), [[50.0, 50.0, 50.0], [-40.0, 0, 0]]])
    box = poses.robust_aabb(pts, np.zeros((1, 3)))
    assert np.all(box[1] < 1.5) and np.all(box[0] > -1.5)
    assert np.all(box[1] > 1.0) and np.all(box[0] < -1.0)  # padded past the 0.5th-99.5th percentiles


def test_robust_aabb_keeps_the_height_of_a_flat_capture():
    # Sparse points of a capture are mostly ground; the few on object tops must stay inside.
    rng = np.random.default_rng(1)
    ground = np.c_[rng.uniform(-1, 1, (2000, 2)), np.zeros(2000)]
    tops = np.c_[rng.uniform(-0.3, 0.3, (20, 2)), rng.uniform(0.0, 0.3, 20)]
    box = poses.robust_aabb(np.concatenate([ground, tops]), np.zeros((1, 3)))
    assert box[1][2] >= 0.3 and box[0][2] < 0.0


def test_camera_groups_follow_the_exif_bodies_and_the_image_sizes():
    names = ["a.png", "b.png", "c.png", "d.png"]
    sizes = {"a.png": (40, 30), "b.png": (30, 40), "c.png": (40, 30), "d.png": (40, 30)}
    pixel = {"make": "Google", "model": "Pixel 7a", "focal_length_mm": 4.38, "focal_length_35mm": 26.0}
    exif = {"a.png": pixel, "b.png": pixel, "c.png": {**pixel, "focal_length_mm": 6.9}, "d.png": None}

    def count(mode, ex=None):
        return len(set(poses.camera_groups(mode, names, sizes, ex).values()))

    assert count("single") == 1 and count("per_image") == 4 and count("per_size", exif) == 2
    assert count("auto") == 2  # no EXIF: one camera per image size (portrait and landscape)
    one_body = {n: pixel for n in names}
    assert count("auto", one_body) == 2  # one phone, both orientations
    g = poses.camera_groups("auto", names, sizes, exif)  # two focal lengths and a photo without EXIF
    assert len(set(g.values())) == 4 and g["a.png"] != g["c.png"] != g["d.png"]
    assert poses.exif_body(pixel) == ("Google", "Pixel 7a", 4.38) and poses.exif_body(None) is None


def test_auto_cameras_in_the_database_follow_the_exif(tmp_path):
    """The database import (image ids in name order) makes one camera per EXIF body here."""
    import pycolmap

    (tmp_path / "images").mkdir()
    names = [f"{k}.png" for k in range(4)]
    for k, n in enumerate(names):
        Image.fromarray(np.random.default_rng(k).integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(
            tmp_path / "images" / n)
    bodies = [{"make": "A", "model": "x", "focal_length_mm": 4.0}, {"make": "B", "model": "y", "focal_length_mm": 4.0}]
    exif = {n: bodies[k % 2] for k, n in enumerate(names)}
    sizes = poses.image_sizes(tmp_path / "images", names)
    poses.import_sorted(pycolmap, tmp_path / "db.db", tmp_path / "images", names, sizes, poses.PosesParams(), None,
                        exif)
    db = pycolmap.Database.open(tmp_path / "db.db")
    try:
        images = sorted(db.read_all_images(), key=lambda im: im.image_id)
        assert len(db.read_all_cameras()) == 2
    finally:
        db.close()
    assert [im.name for im in images] == names
    assert images[0].camera_id == images[2].camera_id != images[1].camera_id == images[3].camera_id


def _geometry(**kw) -> dict:
    g = {"num_registered": 20, "camera_spread": 5.2, "median_point_depth": 29.4, "baseline_ratio": 0.177,
         "collinearity": 0.33, "behind_fraction": 0.0, "mean_reprojection_error_px": 1.15,
         "focal_per_side": [0.81, 0.81]}  # fern's COLMAP model (a forward-facing capture), measured
    return {**g, **kw}


@pytest.mark.parametrize("change, reason", [
    ({}, None),
    ({"baseline_ratio": 0.004}, "the cameras barely move"),
    ({"collinearity": 2e-4}, "on one line"),
    ({"behind_fraction": 0.4}, "40% of the point observations are behind"),
    ({"mean_reprojection_error_px": 6.0}, "mean reprojection error 6.00 px"),
    ({"focal_per_side": [0.05, 0.8]}, "implausible focal lengths"),
    ({"focal_per_side": [0.8, 40.0]}, "implausible focal lengths"),
    ({"num_registered": 2, "baseline_ratio": 0.0}, None),  # too few to judge
])
def test_degenerate_reasons(change, reason):
    got = poses.degenerate_reasons(_geometry(**change))
    assert got == [] if reason is None else (len(got) == 1 and reason in got[0]), got


def test_model_geometry_of_a_rotation_only_model_with_points_behind():
    """Cameras all at one spot turning about it (a panorama), half the points behind them."""
    import pycolmap

    rec = pycolmap.Reconstruction()
    rec.add_camera_with_trivial_rig(pycolmap.Camera(camera_id=1, model="PINHOLE", width=40, height=30,
                                                    params=[30.0, 30.0, 20.0, 15.0]))
    rng = np.random.default_rng(0)
    for k in range(6):
        a = 0.2 * k
        R = np.array([[np.cos(a), 0, np.sin(a)], [0, 1, 0], [-np.sin(a), 0, np.cos(a)]])
        rec.add_image_with_trivial_frame(pycolmap.Image(name=f"{k}.png", camera_id=1, image_id=k + 1,
                                                        keypoints=np.zeros((10, 2))),
                                         pycolmap.Rigid3d(pycolmap.Rotation3d(R), np.zeros(3)))
    for j in range(10):
        track = pycolmap.Track()
        track.add_element(1 + j % 6, j)
        track.add_element(1 + (j + 1) % 6, j)
        rec.add_point3D(np.r_[rng.uniform(-1, 1, 2), 5.0 if j % 2 else -5.0], track, np.zeros(3, np.uint8))
    g = poses.model_geometry(rec)
    assert g["num_registered"] == 6 and g["camera_spread"] == pytest.approx(0.0, abs=1e-9)
    assert g["median_point_depth"] > 4 and 0.3 < g["behind_fraction"] < 0.7
    reasons = poses.degenerate_reasons(g)
    assert any("barely move" in r for r in reasons) and any("behind their camera" in r for r in reasons)
