"""Camera conventions (stages/common/cameras.py): OpenCV <-> OpenGL, projection, normalization,
transforms.json, Umeyama alignment and pose errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.common import cameras as C


def random_rotation(rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q = q @ np.diag(np.sign(np.diag(r)))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def random_c2w(rng: np.random.Generator, n: int) -> np.ndarray:
    out = np.tile(np.eye(4), (n, 1, 1))
    for i in range(n):
        out[i, :3, :3] = random_rotation(rng)
        out[i, :3, 3] = rng.normal(size=3) * 3
    return out


def look_at_c2w_cv(eye, target, up=(0.0, 0.0, 1.0)) -> np.ndarray:
    z = np.asarray(target, float) - eye
    z /= np.linalg.norm(z)
    x = np.cross(z, up)
    x /= np.linalg.norm(x)
    c2w = np.eye(4)
    c2w[:3, 0], c2w[:3, 1], c2w[:3, 2], c2w[:3, 3] = x, np.cross(z, x), z, eye
    return c2w


def test_opencv_opengl_round_trip():
    rng = np.random.default_rng(0)
    c2w = random_c2w(rng, 10)
    gl = C.opencv_to_opengl(c2w)
    np.testing.assert_allclose(C.opengl_to_opencv(gl), c2w, atol=1e-12)
    # same centre; OpenGL looks down -z and has y up where OpenCV looks down +z with y down
    np.testing.assert_allclose(gl[:, :3, 3], c2w[:, :3, 3])
    np.testing.assert_allclose(-gl[:, :3, 2], c2w[:, :3, 2], atol=1e-12)
    np.testing.assert_allclose(-gl[:, :3, 1], c2w[:, :3, 1], atol=1e-12)
    np.testing.assert_allclose(gl[:, :3, 0], c2w[:, :3, 0], atol=1e-12)
    np.testing.assert_allclose(C.c2w_to_w2c(C.w2c_to_c2w(c2w)), c2w, atol=1e-12)


def test_known_camera_projects_known_point_in_both_conventions():
    K = np.array([[100.0, 0, 50.0], [0, 100.0, 40.0], [0, 0, 1]])
    # camera at the origin looking along +z (OpenCV identity pose): (1, 2, 10) -> (60, 60)
    uv = C.project(K, np.eye(4), np.array([[1.0, 2.0, 10.0]]))
    np.testing.assert_allclose(uv, [[60.0, 60.0]])

    # a camera at (0, -5, 0) looking at the origin with z up: the origin projects to the
    # principal point, a point 1 unit up (+z world) lands fx / 5 = 20 px above it (smaller v)
    c2w_cv = look_at_c2w_cv(np.array([0.0, -5.0, 0.0]), [0, 0, 0])
    w2c = C.c2w_to_w2c(c2w_cv)
    pts = np.array([[0.0, 0, 0], [0, 0, 1.0], [1.0, 0, 0]])
    np.testing.assert_allclose(C.project(K, w2c, pts), [[50, 40], [50, 20], [70, 40]], atol=1e-9)

    # the same camera through the OpenGL transform_matrix: x right, y up, looking down -z
    c2w_gl = C.opencv_to_opengl(c2w_cv)
    p = (np.linalg.inv(c2w_gl) @ np.c_[pts, np.ones(3)].T).T[:, :3]
    assert np.all(p[:, 2] < 0), "points in front of an OpenGL camera have negative z"
    u = K[0, 2] + K[0, 0] * p[:, 0] / -p[:, 2]
    v = K[1, 2] - K[1, 1] * p[:, 1] / -p[:, 2]
    np.testing.assert_allclose(np.c_[u, v], [[50, 40], [50, 20], [70, 40]], atol=1e-9)


def ring_c2w(n: int = 12, radius: float = 4.0, height: float = 2.0, center=(1.0, -2.0, 0.5)) -> np.ndarray:
    center = np.asarray(center)
    eyes = [center + [radius * np.cos(a), radius * np.sin(a), height] for a in np.linspace(0, 2 * np.pi, n, False)]
    return np.stack([look_at_c2w_cv(e, center) for e in eyes])


def test_normalization_centres_scales_and_turns_up_to_z():
    rng = np.random.default_rng(1)
    # a ring of cameras in a frame that is rotated, scaled and shifted arbitrarily (like SfM's)
    S0 = C.similarity_matrix(0.37, random_rotation(rng), rng.normal(size=3) * 5)
    c2w = C.apply_similarity_to_c2w(S0, ring_c2w())
    S = C.normalization_transform(c2w, align_up=True)
    out = C.apply_similarity_to_c2w(S, c2w)
    centres = out[:, :3, 3]
    np.testing.assert_allclose(centres.mean(axis=0), 0, atol=1e-12)
    assert np.linalg.norm(centres, axis=1).max() == pytest.approx(1.0)
    up = -out[:, :3, 1].mean(axis=0)  # OpenCV y is down
    np.testing.assert_allclose(up / np.linalg.norm(up), [0, 0, 1], atol=1e-9)
    # rotations stay orthonormal and projections do not change (points go through S as well)
    np.testing.assert_allclose(out[:, :3, :3] @ np.swapaxes(out[:, :3, :3], 1, 2), np.tile(np.eye(3), (12, 1, 1)),
                               atol=1e-12)
    K = np.array([[80.0, 0, 40], [0, 80.0, 30], [0, 0, 1]])
    pts = C.apply_similarity_to_points(S0, rng.normal(size=(20, 3)) * 0.5 + [1.0, -2.0, 0.5])
    for i in (0, 5):
        np.testing.assert_allclose(C.project(K, C.c2w_to_w2c(out[i]), C.apply_similarity_to_points(S, pts)),
                                   C.project(K, C.c2w_to_w2c(c2w[i]), pts), atol=1e-8)
    # without align_up only centre and scale change
    S_plain = C.normalization_transform(c2w, align_up=False)
    np.testing.assert_allclose(S_plain[:3, :3] / np.cbrt(np.linalg.det(S_plain[:3, :3])), np.eye(3), atol=1e-12)


def test_write_read_transforms_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    intr = C.Intrinsics(200, 150, 190.5, 191.0, 99.5, 75.25)
    c2w = random_c2w(rng, 4)
    files = [f"images/view_{i:03d}.png" for i in range(4)]
    C.write_transforms(tmp_path / "transforms.json", intr, files, c2w,
                       extra={"camera_model": "PINHOLE", "aabb": [[-1, -1, -1], [1, 1, 1]]})
    intr2, files2, c2w2, doc = C.read_transforms(tmp_path / "transforms.json")
    assert intr2 == [intr] * 4
    assert files2 == files
    np.testing.assert_allclose(c2w2, c2w, atol=1e-12)
    assert doc["camera_model"] == "PINHOLE" and doc["aabb"] == [[-1, -1, -1], [1, 1, 1]]
    # the file holds OpenGL matrices, and one shared camera at the top level only
    raw = json.loads((tmp_path / "transforms.json").read_text())
    np.testing.assert_allclose(raw["frames"][1]["transform_matrix"], C.opencv_to_opengl(c2w[1]), atol=1e-12)
    assert (raw["w"], raw["h"], raw["fl_x"]) == (200, 150, 190.5) and "fl_x" not in raw["frames"][0]


def test_per_frame_intrinsics_round_trip_in_nerfstudios_layout(tmp_path):
    """Cameras that differ (portrait and landscape) go in the frames, none at the top level; a
    frame without its own keys falls back to the top level (a hand-edited or instant-ngp file)."""
    c2w = random_c2w(np.random.default_rng(3), 3)
    cams = [C.Intrinsics(200, 150, 190.5, 191.0, 99.5, 75.25), C.Intrinsics(150, 200, 191.0, 190.5, 75.25, 99.5),
            C.Intrinsics(200, 150, 190.5, 191.0, 99.5, 75.25)]
    files = [f"images/{k}.png" for k in range(3)]
    C.write_transforms(tmp_path / "transforms.json", cams, files, c2w, extra={"ply_file_path": "points3D.ply"})
    raw = json.loads((tmp_path / "transforms.json").read_text())
    assert not {"w", "h", "fl_x", "fl_y", "cx", "cy"} & set(raw) and raw["ply_file_path"] == "points3D.ply"
    assert [set(f) for f in raw["frames"]] == [{"file_path", "transform_matrix", *C.FRAME_CAMERA_KEYS}] * 3
    assert (raw["frames"][1]["w"], raw["frames"][1]["h"], raw["frames"][1]["fl_x"]) == (150, 200, 191.0)
    got, files2, c2w2, _ = C.read_transforms(tmp_path / "transforms.json")
    assert got == cams and files2 == files
    np.testing.assert_allclose(c2w2, c2w, atol=1e-12)
    raw.update(w=200, h=150, fl_x=100.0)
    for k in C.FRAME_CAMERA_KEYS:
        del raw["frames"][2][k]
    (tmp_path / "mixed.json").write_text(json.dumps(raw))
    assert C.read_transforms(tmp_path / "mixed.json")[0][2] == C.Intrinsics(200, 150, 100.0, 100.0, 100.0, 75.0)
    with pytest.raises(ValueError, match="write_transforms: 2 cameras for 3 frames"):
        C.write_transforms(tmp_path / "bad.json", cams[:2], files, c2w)


@pytest.mark.parametrize("frame, match", [
    ({"fl_x": 0.0}, r"frame images/1.png: focal length must be > 0, got fl_x=0"),
    ({"fl_y": -5.0}, r"frame images/1.png: focal length must be > 0"),
    ({"w": 0}, r"frame images/1.png: image size must be whole positive pixels"),
    ({"h": 10.5}, r"frame images/1.png: image size must be whole positive pixels"),
    ({"cx": "1"}, r"frame images/1.png: cx must be a finite number"),
])
def test_read_transforms_names_the_frame_with_a_bad_camera(tmp_path, frame, match):
    cams = [C.Intrinsics(20, 10, 9.0, 9.0, 10.0, 5.0), C.Intrinsics(10, 20, 9.0, 9.0, 5.0, 10.0)]
    doc = C.write_transforms(tmp_path / "t.json", cams, ["images/0.png", "images/1.png"],
                             random_c2w(np.random.default_rng(4), 2))
    doc["frames"][1].update(frame)
    (tmp_path / "t.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match):
        C.read_transforms(tmp_path / "t.json")
    doc = C.write_transforms(tmp_path / "t.json", cams, ["images/0.png", "images/1.png"],
                             random_c2w(np.random.default_rng(4), 2))
    del doc["frames"][1]["fl_x"]  # and no top-level camera to fall back on
    (tmp_path / "t.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="frame images/1.png: no 'fl_x' in the frame or at the top level"):
        C.read_transforms(tmp_path / "t.json")


def test_read_transforms_rejects_malformed(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"w": 10, "frames": []}))
    with pytest.raises(ValueError, match="malformed"):
        C.read_transforms(tmp_path / "t.json")


def test_umeyama_recovers_known_similarity():
    rng = np.random.default_rng(3)
    src = rng.normal(size=(30, 3))
    R = random_rotation(rng)
    t = np.array([1.0, -2.0, 3.0])
    dst = 2.5 * src @ R.T + t
    s, R2, t2 = C.umeyama(src, dst)
    assert s == pytest.approx(2.5)
    np.testing.assert_allclose(R2, R, atol=1e-10)
    np.testing.assert_allclose(t2, t, atol=1e-10)
    assert np.linalg.det(R2) == pytest.approx(1.0)
    # with noise: still close
    s3, R3, _ = C.umeyama(src, dst + rng.normal(scale=1e-3, size=dst.shape))
    assert s3 == pytest.approx(2.5, rel=1e-3)
    assert C.rotation_angle_deg(R3, R) < 0.1


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), scale=st.floats(0.01, 100.0), n=st.integers(3, 40))
def test_umeyama_property(seed, scale, n):
    rng = np.random.default_rng(seed)
    src = rng.normal(size=(n, 3))
    R, t = random_rotation(rng), rng.normal(size=3) * 10
    s, R2, t2 = C.umeyama(src, scale * src @ R.T + t)
    assert s == pytest.approx(scale, rel=1e-6)
    np.testing.assert_allclose(s * src @ R2.T + t2, scale * src @ R.T + t, atol=1e-6 * max(1.0, scale))


def test_umeyama_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 3"):
        C.umeyama(np.zeros((2, 3)), np.zeros((2, 3)))
    with pytest.raises(ValueError, match="same shape"):
        C.umeyama(np.zeros((4, 3)), np.zeros((5, 3)))
    with pytest.raises(ValueError, match="coincide"):
        C.umeyama(np.ones((4, 3)), np.zeros((4, 3)))


def test_pose_errors_zero_after_similarity_and_measure_perturbations():
    rng = np.random.default_rng(4)
    gt = ring_c2w(n=10)
    S = C.similarity_matrix(0.2, random_rotation(rng), rng.normal(size=3))
    est = C.apply_similarity_to_c2w(S, gt)  # SfM frame: arbitrary similarity of the truth
    err = C.pose_errors(est, gt, ref_scale=2.0)
    assert err["center_error_max"] < 1e-9 and err["rotation_error_max_deg"] < 1e-6
    # turn one camera by 2 degrees about its optical axis: only the rotation error sees it
    a = np.radians(2.0)
    roll = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
    est[3, :3, :3] = est[3, :3, :3] @ roll
    err = C.pose_errors(est, gt, ref_scale=2.0)
    assert err["rotation_error_max_deg"] == pytest.approx(2.0, abs=1e-6)
    assert err["center_error_max"] < 1e-9
