"""A tiny textured test scene, ray cast with open3d, written in the ingest stage's layout.

The scene is a ground plane with a few boxes and spheres, every surface painted with a
solid (3D) value-noise texture so that SIFT finds plenty of view-independent blobs, lit
with a fixed Lambertian light. Cameras sit on elevation rings around the objects and
look at the scene centre; world up is +z. Used by the poses tests; the real default
scene is ``stages/scene.py``.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

SCENE_CENTER = np.array([0.0, 0.0, 0.3])
SCENE_RADIUS = 1.5  # bounding sphere of the objects, as ground_truth.json's scene.radius


def look_at_w2c(eye: np.ndarray, target: np.ndarray, up=(0.0, 0.0, 1.0)) -> np.ndarray:
    """OpenCV world-to-camera [4, 4] of a camera at ``eye`` looking at ``target``."""
    z = target - eye
    z = z / np.linalg.norm(z)
    x = np.cross(z, np.asarray(up, dtype=np.float64))
    x = x / np.linalg.norm(x)
    y = np.cross(z, x)
    c2w = np.eye(4)
    c2w[:3, 0], c2w[:3, 1], c2w[:3, 2], c2w[:3, 3] = x, y, z, eye
    return np.linalg.inv(c2w)


def ring_poses(views: int, rings: int, distance: float = 3.2, elevations=(35.0, 60.0)) -> list[np.ndarray]:
    """``views`` cameras spread evenly over ``rings`` elevation rings (azimuths offset per ring)."""
    per_ring = [views // rings + (1 if r < views % rings else 0) for r in range(rings)]
    elev = np.linspace(elevations[0], elevations[-1], rings)
    poses = []
    for r, n in enumerate(per_ring):
        for k in range(n):
            az = 2 * np.pi * (k + 0.5 * r) / n
            el = np.deg2rad(elev[r])
            eye = SCENE_CENTER + distance * np.array([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)])
            poses.append(look_at_w2c(eye, SCENE_CENTER))
    return poses


def _build_scene():
    import open3d as o3d

    meshes = []
    ground = o3d.geometry.TriangleMesh.create_box(4.0, 4.0, 0.02).translate((-2.0, -2.0, -0.02))
    meshes.append(ground)
    meshes.append(o3d.geometry.TriangleMesh.create_box(0.6, 0.5, 0.8).translate((-0.8, -0.5, 0.0)))
    meshes.append(o3d.geometry.TriangleMesh.create_box(0.4, 0.7, 0.4).rotate(
        o3d.geometry.get_rotation_matrix_from_xyz((0, 0, 0.5)), center=(0, 0, 0)).translate((0.5, 0.4, 0.0)))
    meshes.append(o3d.geometry.TriangleMesh.create_sphere(0.35, resolution=24).translate((0.3, -0.6, 0.35)))
    meshes.append(o3d.geometry.TriangleMesh.create_sphere(0.25, resolution=24).translate((-0.4, 0.7, 0.25)))
    meshes.append(o3d.geometry.TriangleMesh.create_cylinder(0.2, 1.0, resolution=24).translate((0.9, -0.1, 0.5)))
    scene = o3d.t.geometry.RaycastingScene()
    for m in meshes:
        scene.add_triangles(o3d.t.geometry.TriangleMesh.from_legacy(m))
    return scene


def _hash01(ix: np.ndarray, iy: np.ndarray, iz: np.ndarray, channel: int, seed: int) -> np.ndarray:
    """Integer lattice -> pseudo-random values in [0, 1) (a SplitMix-style integer hash)."""
    h = (ix.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ (iy.astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F))
    h ^= iz.astype(np.uint64) * np.uint64(0x165667B19E3779F9)
    h ^= np.uint64((channel * 0x27D4EB2F + seed * 0x85EBCA77) & 0xFFFFFFFF)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _value_noise(p: np.ndarray, freq: float, channel: int, seed: int) -> np.ndarray:
    """Smooth 3D value noise [N] in [0, 1] on a lattice of spacing ``1 / freq``."""
    q = p * freq + 1000.0  # keep lattice indices positive
    i0 = np.floor(q).astype(np.int64)
    f = q - i0
    f = f * f * (3 - 2 * f)  # smoothstep between lattice values
    acc = np.zeros(len(p))
    for dx in (0, 1):
        for dy in (0, 1):
            for dz in (0, 1):
                w = (f[:, 0] if dx else 1 - f[:, 0]) * (f[:, 1] if dy else 1 - f[:, 1]) * (f[:, 2] if dz else 1 - f[:, 2])
                acc += w * _hash01(i0[:, 0] + dx, i0[:, 1] + dy, i0[:, 2] + dz, channel, seed)
    return acc


def solid_texture(p: np.ndarray, seed: int = 0) -> np.ndarray:
    """RGB [N, 3] in [0, 1] at points ``p`` [N, 3]: multi-octave luminance noise (what SIFT
    sees) times a blocky pastel tint (so colours are not all grey)."""
    with np.errstate(over="ignore"):
        lum = sum(w * _value_noise(p, f, 0, seed) for f, w in ((5.0, 0.3), (10.0, 0.35), (20.0, 0.35)))
        lum = np.clip((lum - 0.5) * 3.0 + 0.5, 0.0, 1.0)  # value noise clusters around 0.5
        cell = np.floor(p * 1.5 + 1000.0).astype(np.int64)
        tint = 0.6 + 0.4 * np.stack([_hash01(cell[:, 0], cell[:, 1], cell[:, 2], c, seed + 7) for c in range(3)], 1)
    return lum[:, None] * tint


def render(scene, K: np.ndarray, w2c: np.ndarray, width: int, height: int, supersample: int = 2) -> np.ndarray:
    """Render an RGB uint8 image [H, W, 3] (pixel centres at +0.5, box-filtered supersampling)."""
    import open3d as o3d

    s = supersample
    u, v = np.meshgrid((np.arange(width * s) + 0.5) / s, (np.arange(height * s) + 0.5) / s)
    d_cam = np.stack([(u - K[0, 2]) / K[0, 0], (v - K[1, 2]) / K[1, 1], np.ones_like(u)], -1).reshape(-1, 3)
    c2w = np.linalg.inv(w2c)
    d = d_cam @ c2w[:3, :3].T
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    o = np.broadcast_to(c2w[:3, 3], d.shape)
    rays = o3d.core.Tensor(np.concatenate([o, d], 1).astype(np.float32))
    ans = scene.cast_rays(rays)
    t = ans["t_hit"].numpy().astype(np.float64)
    n = ans["primitive_normals"].numpy().astype(np.float64)
    hit = np.isfinite(t)
    img = np.empty((len(d), 3))
    img[~hit] = np.array([0.78, 0.84, 0.92])  # plain sky: no features
    p = o[hit] + t[hit, None] * d[hit]
    light = np.array([0.4, -0.3, 0.87])
    light /= np.linalg.norm(light)
    shade = 0.45 + 0.55 * np.abs(n[hit] @ light)
    img[hit] = solid_texture(p) * shade[:, None]
    img = img.reshape(height, s, width, s, 3).mean(axis=(1, 3))
    return np.clip(np.round(img * 255), 0, 255).astype(np.uint8)


def make_ingest(out: str | Path, views: int = 12, rings: int = 2, width: int = 200, height: int = 150,
                fov_deg: float = 55.0) -> dict:
    """Write ``out/images/view_XXX.png``, ``out/manifest.json`` and ``out/ground_truth.json``.

    Returns the ground-truth document.
    """
    from PIL import Image

    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    f = 0.5 * width / np.tan(np.deg2rad(fov_deg) / 2)
    K = np.array([[f, 0, width / 2], [0, f, height / 2], [0, 0, 1.0]])
    scene = _build_scene()
    frames, entries = [], []
    for i, w2c in enumerate(ring_poses(views, rings)):
        name = f"view_{i:03d}.png"
        Image.fromarray(render(scene, K, w2c, width, height)).save(out / "images" / name)
        frames.append({"file": name, "world_to_camera": w2c.tolist()})
        entries.append({"file": f"images/{name}", "source": name, "width": width, "height": height,
                        "sha256": hashlib.sha256((out / "images" / name).read_bytes()).hexdigest(),
                        "exif_orientation": 1})
    gt = {"intrinsics": {"width": width, "height": height, "fx": f, "fy": f, "cx": width / 2, "cy": height / 2},
          "frames": frames,
          "scene": {"center": SCENE_CENTER.tolist(), "radius": SCENE_RADIUS}}
    (out / "ground_truth.json").write_text(json.dumps(gt, indent=2))
    (out / "manifest.json").write_text(json.dumps(
        {"images": entries, "skipped": [], "ground_truth": "ground_truth.json"}, indent=2))
    return gt


def make_mixed_ingest(out: str | Path, views: int = 8, rings: int = 1, size: tuple[int, int] = (96, 72),
                      fov_deg: float = 55.0, focal_spread: float = 0.03) -> list[dict]:
    """An ingest folder of ``views`` ray-cast views, every odd one in portrait (``size`` turned
    on its side), each with its own pinhole camera: a horizontal field of view of ``fov_deg`` for
    the landscape ones (the same focal length for the portrait ones), times 1 + up to
    ``focal_spread`` (COLMAP's one camera per image, focal lengths a few per cent apart).
    No ground_truth.json (its one camera cannot say this). Returns per view ``{"file", "K"
    [3, 3], "w2c" [4, 4], "width", "height"}``."""
    from PIL import Image

    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    scene = _build_scene()
    f0 = 0.5 * size[0] / np.tan(np.deg2rad(fov_deg) / 2)
    spread = np.linspace(-focal_spread, focal_spread, views)
    frames, entries = [], []
    for i, w2c in enumerate(ring_poses(views, rings)):
        w, h = size if i % 2 == 0 else size[::-1]
        f = f0 * (1 + spread[(i * 5) % views])
        K = np.array([[f, 0, w / 2], [0, f, h / 2], [0, 0, 1.0]])
        name = f"view_{i:03d}.png"
        Image.fromarray(render(scene, K, w2c, w, h)).save(out / "images" / name)
        frames.append({"file": name, "K": K, "w2c": w2c, "width": w, "height": h})
        entries.append({"file": f"images/{name}", "source": name, "width": w, "height": h,
                        "sha256": hashlib.sha256((out / "images" / name).read_bytes()).hexdigest(),
                        "exif_orientation": 1})
    (out / "manifest.json").write_text(json.dumps({"images": entries, "skipped": [], "ground_truth": None}))
    return frames
