"""The project's default scene: a few textured objects on a ground disc, ray cast on the CPU.

Writes ``<out>/images/view_000.png ...`` (8-bit RGB) and ``<out>/images/ground_truth.json`` (see
``docs/contracts.md``): the photos the rest of the pipeline reconstructs when the user
brings none, with the exact cameras that took them. Nothing is downloaded.

How it is made: open3d's ``RaycastingScene`` (Embree) finds the triangle each pixel's ray
hits first (one cast per view, pixel centres at +0.5) and a second ray from each hit towards
the light decides the hard shadow; numpy shades the hits. The textures are functions of the
3D hit point, so every view sees the same surface pattern: a mosaic of randomly valued
cells at two scales (corners everywhere for SIFT, no repeats to confuse matching), a
soft-edged 3D checker and smooth sums of sinusoids, over a per-object base colour. Cell
edges are blurred over a few hundredths of a unit so the pictures are not aliased noise
a NeRF could not fit. Lighting is Lambertian (one directional light plus ambient), so
every surface point has one colour whatever the view: what a NeRF assumes.

Byte-identical on every machine, so that ``dvc.lock``'s hash of the scene holds on a fresh
clone: Embree says only which triangle a ray hits (its float32 distances and normals depend
on the CPU's instruction set), the hit point, barycentrics and normal are recomputed in
float64 from that triangle; products of vectors are written out element by element rather
than with ``@`` (BLAS kernels, chosen per CPU, round differently); the BVH is built on one
thread; and the PNGs are stored uncompressed (:func:`png_bytes`), since deflate's output
depends on the zlib build. Only a ray that grazes a triangle edge or a shadow boundary to
within float32 rounding could still go either way.

World frame: z up, the ground's top face at z = 0, objects within radius ~1.2 of the
origin, cameras on ``rings`` elevation rings looking at ``SCENE_CENTER``.

Usage::

    python -m stages.scene --out data/scene [--params params.yaml]
"""
from __future__ import annotations

import argparse
import colorsys
import io
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .common import params as P
from .common.cameras import Intrinsics
from .common.entry import cli, run_stage
from .common.io import atomic_dir, atomic_write_json, check_outs
from .common.log import setup

SCENE_CENTER = np.array([0.0, 0.0, 0.3])  # cameras look here; objects are at most ~1 high
GROUND_RADIUS = 2.5
GROUND_THICKNESS = 0.05
OBJECT_RADIUS = 1.2  # every object's footprint lies within this radius of the z axis
CAMERA_DISTANCE = 3.7
ELEVATIONS_DEG = (22.0, 52.0)  # lowest and highest ring
LIGHT_DIR = np.array([np.cos(np.radians(55)) * np.cos(np.radians(35)),
                      np.cos(np.radians(55)) * np.sin(np.radians(35)),
                      np.sin(np.radians(55))])  # towards the light
AMBIENT = 0.35
DIFFUSE = 0.75
SKY = np.array([0.86, 0.90, 0.95])  # constant: rays that miss everything, any view
SHADOW_EPS = 2e-3  # shadow-ray origins move this far along the face normal
EDGE_SOFTNESS = 5.0  # texture cell edges blur over 1/EDGE_SOFTNESS of a cell
OBJECT_KINDS = ("box", "sphere", "cylinder", "torus", "cone")
PNG_STORED_BLOCK = 65535  # bytes of one stored (uncompressed) deflate block, the format's maximum


@dataclass(frozen=True)
class SceneParams:
    """``scene`` section of params.yaml."""

    width: int = 400
    height: int = 300
    views: int = 48
    rings: int = 3
    fov_deg: float = 55.0  # horizontal field of view
    objects: int = 5

    def __post_init__(self) -> None:
        P.check(self.width >= 16, "width", "must be >= 16", self.width)
        P.check(self.height >= 16, "height", "must be >= 16", self.height)
        P.check(self.width <= 8192, "width", "must be <= 8192", self.width)
        P.check(self.height <= 8192, "height", "must be <= 8192", self.height)
        P.check(self.views >= 3, "views", "must be >= 3", self.views)
        P.check(1 <= self.rings <= self.views, "rings", f"must be between 1 and views ({self.views})", self.rings)
        P.check(10.0 < self.fov_deg < 150.0, "fov_deg", "must be between 10 and 150 degrees", self.fov_deg)
        P.check(1 <= self.objects <= 64, "objects", "must be between 1 and 64", self.objects)


def load_seed(path: str | Path = P.DEFAULT_PARAMS, data: dict | None = None) -> int:
    """The top-level ``seed`` of params.yaml (0 when absent), checked like a params key."""
    data = P.read_yaml(path) if data is None else data
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise P.ParamsError(f"seed: expected an integer, got {seed!r}")
    P.check(seed >= 0, "seed", "must be >= 0", seed)
    return seed


# ---------------------------------------------------------------- arithmetic that rounds alike everywhere


def rows_times(a: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``a @ m.T`` for ``a`` [..., 3] and ``m`` [K, 3], summed in a fixed order (x, y, then z).

    numpy's ``@`` calls BLAS, whose kernels are picked per CPU and round differently.
    """
    m = np.asarray(m, dtype=np.float64)
    return a[..., 0:1] * m[:, 0] + a[..., 1:2] * m[:, 1] + a[..., 2:3] * m[:, 2]


def dot3(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Dot products [...] of 3-vectors ``a`` [..., 3] and ``b`` [..., 3] (or [3]), in a fixed order."""
    return a[..., 0] * b[..., 0] + a[..., 1] * b[..., 1] + a[..., 2] * b[..., 2]


def cross3(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cross products [..., 3] of ``a`` and ``b`` [..., 3], element by element."""
    return np.stack([a[..., 1] * b[..., 2] - a[..., 2] * b[..., 1],
                     a[..., 2] * b[..., 0] - a[..., 0] * b[..., 2],
                     a[..., 0] * b[..., 1] - a[..., 1] * b[..., 0]], axis=-1)


def unit(v: np.ndarray) -> np.ndarray:
    """``v`` [..., 3] scaled to unit length (sqrt is exactly rounded everywhere)."""
    return v / np.sqrt(dot3(v, v))[..., None]


# ---------------------------------------------------------------- cameras


def intrinsics(p: SceneParams) -> Intrinsics:
    """Pinhole camera with horizontal field of view ``fov_deg``, principal point at the centre."""
    f = 0.5 * p.width / np.tan(np.radians(p.fov_deg) / 2)
    return Intrinsics(p.width, p.height, float(f), float(f), p.width / 2, p.height / 2)


def look_at_w2c(eye: np.ndarray, target: np.ndarray, up=(0.0, 0.0, 1.0)) -> np.ndarray:
    """World-to-camera 4x4 (OpenCV: x right, y down, z forward) of a camera at ``eye`` facing ``target``."""
    f = unit(target - eye)
    r = unit(cross3(f, np.asarray(up, dtype=np.float64)))
    d = cross3(f, r)  # image down
    R_c2w = np.stack([r, d, f], axis=1)
    w2c = np.eye(4)
    w2c[:3, :3] = R_c2w.T
    w2c[:3, 3] = -rows_times(eye, R_c2w.T)
    return w2c


def camera_poses(p: SceneParams) -> np.ndarray:
    """World-to-camera [views, 4, 4]: ring by ring (low to high), azimuth increasing in each ring.

    Views are shared as evenly as possible between rings; each ring's azimuths are shifted by
    a fraction of its spacing, so the rings interleave rather than stack.
    """
    counts = [p.views // p.rings + (1 if i < p.views % p.rings else 0) for i in range(p.rings)]
    if p.rings == 1:
        elevations = [float(np.mean(ELEVATIONS_DEG))]
    else:
        elevations = np.linspace(*ELEVATIONS_DEG, p.rings).tolist()
    poses = []
    for ring, (n, elev) in enumerate(zip(counts, elevations)):
        offset = ring * (360.0 / n) / p.rings + 7.0 * ring  # degrees
        for j in range(n):
            az, el = np.radians(offset + 360.0 * j / n), np.radians(elev)
            eye = SCENE_CENTER + CAMERA_DISTANCE * np.array(
                [np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)])
            poses.append(look_at_w2c(eye, SCENE_CENTER))
    return np.stack(poses)


def pixel_rays(intr: Intrinsics, w2c: np.ndarray) -> np.ndarray:
    """Rays [H, W, 6] float64 (origin, unit direction) through the pixel centres of one camera."""
    u, v = np.meshgrid(np.arange(intr.width) + 0.5, np.arange(intr.height) + 0.5)
    d_cam = np.stack([(u - intr.cx) / intr.fx, (v - intr.cy) / intr.fy, np.ones_like(u)], axis=-1)
    R_c2w = w2c[:3, :3].T
    d = unit(rows_times(d_cam, R_c2w))
    o = np.broadcast_to(-rows_times(w2c[:3, 3], R_c2w), d.shape)
    return np.concatenate([o, d], axis=-1)


# ---------------------------------------------------------------- geometry


@dataclass
class SceneObject:
    """One mesh of the scene and how to texture it."""

    kind: str
    vertices: np.ndarray  # [V, 3] float64
    triangles: np.ndarray  # [T, 3] int
    vertex_normals: np.ndarray | None  # [V, 3] for smooth shading, None for flat faces
    texture: dict[str, Any]


def _hsv_to_rgb(h: float, s: float, v: float) -> np.ndarray:
    return np.array(colorsys.hsv_to_rgb(h % 1.0, s, v))


def _rot_z(a: float) -> np.ndarray:
    c, s = np.cos(a), np.sin(a)
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1.0]])


def _random_rotation(rng: np.random.Generator) -> np.ndarray:
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q *= np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] *= -1
    return q


def _texture(rng: np.random.Generator, base: np.ndarray) -> dict[str, Any]:
    """Random texture parameters: lattice rotations, cell sizes, salts, sinusoids."""
    n_sin = 6
    dirs = rng.normal(size=(n_sin, 3))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    return {
        "base": base,
        "rot": _random_rotation(rng),
        "offset": rng.uniform(0, 10, size=3),
        "cell_small": rng.uniform(0.065, 0.085),
        "cell_large": rng.uniform(0.18, 0.24),
        "checker": rng.uniform(0.11, 0.14),
        "salt": int(rng.integers(1, 2**31 - 1)),
        "sin_dirs": dirs,
        "sin_freq": rng.uniform(1.0 / 0.6, 1.0 / 0.25, size=n_sin),  # cycles per unit
        "sin_phase": rng.uniform(0, 2 * np.pi, size=n_sin),
        "hue_shift": rng.normal(0, 1, size=3),
    }


def _mesh_arrays(mesh) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(mesh.vertices, dtype=np.float64), np.asarray(mesh.triangles, dtype=np.int64)


def build_objects(rng: np.random.Generator, n_objects: int) -> list[SceneObject]:
    """The ground disc and ``n_objects`` primitives resting on it, placed without overlap where possible."""
    import open3d as o3d

    TM = o3d.geometry.TriangleMesh
    objs: list[SceneObject] = []

    ground = TM.create_cylinder(radius=GROUND_RADIUS, height=GROUND_THICKNESS, resolution=96)
    v, t = _mesh_arrays(ground)
    v = v + [0, 0, -GROUND_THICKNESS / 2]  # top face at z = 0
    base = _hsv_to_rgb(rng.uniform(0.05, 0.15), rng.uniform(0.25, 0.4), 0.8)
    objs.append(SceneObject("ground", v, t, None, _texture(rng, base)))

    kinds = list(rng.permutation(OBJECT_KINDS))
    placed: list[tuple[np.ndarray, float]] = []
    hue0 = rng.uniform(0, 1)
    for i in range(n_objects):
        kind = kinds[i % len(kinds)]
        yaw = rng.uniform(0, 2 * np.pi)
        smooth = False
        if kind == "box":
            w, d, h = rng.uniform(0.35, 0.65), rng.uniform(0.35, 0.65), rng.uniform(0.3, 0.95)
            mesh = TM.create_box(w, d, h)
            mesh.translate((-w / 2, -d / 2, 0))
            footprint = 0.5 * np.hypot(w, d)
        elif kind == "sphere":
            r = rng.uniform(0.22, 0.38)
            mesh = TM.create_sphere(radius=r, resolution=40)
            mesh.translate((0, 0, r))
            footprint, smooth = r, True
        elif kind == "cylinder":
            r, h = rng.uniform(0.14, 0.26), rng.uniform(0.5, 1.0)
            mesh = TM.create_cylinder(radius=r, height=h, resolution=48)
            mesh.translate((0, 0, h / 2))
            footprint = r
        elif kind == "torus":
            R, r = rng.uniform(0.26, 0.34), rng.uniform(0.08, 0.12)
            mesh = TM.create_torus(torus_radius=R, tube_radius=r, radial_resolution=48, tubular_resolution=24)
            mesh.rotate(np.array([[1, 0, 0], [0, 0, -1], [0, 1, 0.0]]), center=(0, 0, 0))  # stand it up
            mesh.translate((0, 0, R + r))
            footprint = R + r
        else:  # cone
            r, h = rng.uniform(0.2, 0.32), rng.uniform(0.5, 0.95)
            mesh = TM.create_cone(radius=r, height=h, resolution=48)
            footprint = r
        mesh.rotate(_rot_z(yaw), center=(0, 0, 0))
        # Place: rejection sampling inside the object disc, keeping a gap between footprints.
        limit = max(OBJECT_RADIUS - footprint, 0.0)
        xy = np.zeros(2)
        for _ in range(200):
            rad, ang = limit * np.sqrt(rng.uniform()), rng.uniform(0, 2 * np.pi)
            xy = np.array([rad * np.cos(ang), rad * np.sin(ang)])
            if all(np.linalg.norm(xy - c) > footprint + fr + 0.08 for c, fr in placed):
                break
        placed.append((xy, footprint))
        mesh.translate((xy[0], xy[1], 0))
        vn = None
        if smooth:
            mesh.compute_vertex_normals()
            vn = np.asarray(mesh.vertex_normals, dtype=np.float64)
        v, t = _mesh_arrays(mesh)
        base = _hsv_to_rgb(hue0 + i / max(n_objects, 1) + rng.uniform(-0.05, 0.05),
                           rng.uniform(0.45, 0.75), rng.uniform(0.75, 0.95))
        objs.append(SceneObject(str(kind), v, t, vn, _texture(rng, base)))
    return objs


def scene_radius(objs: list[SceneObject]) -> float:
    """Radius around ``SCENE_CENTER`` of a sphere holding every object (not the ground)."""
    pts = np.concatenate([o.vertices for o in objs if o.kind != "ground"])
    return float(np.ceil(np.linalg.norm(pts - SCENE_CENTER, axis=1).max() * 100) / 100)


# ---------------------------------------------------------------- textures and shading


def _hash01(ijk: np.ndarray, salt: int) -> np.ndarray:
    """Deterministic pseudo-random value in [0, 1) for every integer lattice point [..., 3]."""
    x = ijk.astype(np.int64).astype(np.uint64)
    h = np.uint64((salt * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
    for k, m in enumerate((0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93)):
        h = h ^ (x[..., k] * np.uint64(m))
        h = (h ^ (h >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(29))
    return (h >> np.uint64(11)).astype(np.float64) / float(2**53)


def _soft_step(t: np.ndarray) -> np.ndarray:
    """0 below 0.5 - 0.5/k, 1 above 0.5 + 0.5/k, smooth in between (k = EDGE_SOFTNESS)."""
    x = np.clip((t - 0.5) * EDGE_SOFTNESS + 0.5, 0.0, 1.0)
    return x * x * (3 - 2 * x)


def mosaic(q: np.ndarray, salt: int, channels: int = 1) -> np.ndarray:
    """Random value per unit lattice cell of ``q`` [N, 3], soft edges; returns [N, channels] in [0, 1].

    Trilinear blend between the cell values of the 8 nearest cell centres, with a blend weight
    that stays 0 or 1 except near the cell faces.
    """
    u = q - 0.5
    i0 = np.floor(u)
    w = _soft_step(u - i0)
    out = np.zeros((q.shape[0], channels))
    for corner in range(8):
        off = np.array([(corner >> k) & 1 for k in range(3)])
        wc = np.prod(np.where(off == 1, w, 1 - w), axis=1)
        idx = (i0 + off).astype(np.int64)
        for c in range(channels):
            out[:, c] += wc * _hash01(idx, salt + 7919 * c)
    return out


def albedo(points: np.ndarray, tex: dict[str, Any]) -> np.ndarray:
    """Surface colour [N, 3] in [0, 1] at world points [N, 3]; depends on the point only."""
    q = rows_times(points, tex["rot"]) + tex["offset"]
    small = mosaic(q / tex["cell_small"], tex["salt"])[:, 0]
    large = mosaic(q / tex["cell_large"], tex["salt"] + 1, channels=3)
    sq = np.tanh(EDGE_SOFTNESS * np.sin(np.pi * (q / tex["checker"] + 0.25)))  # soft square waves
    checker = np.prod(sq, axis=1)
    waves = np.sin(2 * np.pi * rows_times(points, tex["sin_dirs"]) * tex["sin_freq"] + tex["sin_phase"])
    smooth = waves.mean(axis=1)  # ~[-0.6, 0.6], wavelengths 0.25-0.6 units
    color = tex["base"] * (0.62 + 0.38 * small[:, None])
    color = color * (0.75 + 0.5 * large)  # large cells tint the colour
    color = color * (1.0 + 0.12 * checker[:, None])
    color = color * (1.0 + 0.25 * smooth[:, None] * np.tanh(tex["hue_shift"]))
    return np.clip(color, 0.0, 1.0)


class Renderer:
    """Ray casts and shades views of a list of :class:`SceneObject`."""

    def __init__(self, objs: list[SceneObject]):
        import open3d as o3d

        self.objs = objs
        self.scene = o3d.t.geometry.RaycastingScene(nthreads=1)  # one BVH, whatever the core count
        self.ids = []
        for o in objs:
            mesh = o3d.t.geometry.TriangleMesh()
            mesh.vertex.positions = o3d.core.Tensor(o.vertices.astype(np.float32))
            mesh.triangle.indices = o3d.core.Tensor(o.triangles.astype(np.int32))
            self.ids.append(self.scene.add_triangles(mesh))
        self.index = {gid: i for i, gid in enumerate(self.ids)}
        self.vertices32 = [o.vertices.astype(np.float32).astype(np.float64) for o in objs]  # what Embree sees

    def _hits(self, rays: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For rays [N, 6] float64: (hit mask [N], object index [M], triangle [M], hit in float64).

        Embree picks the triangle; the hit is recomputed from that triangle's float32 vertices
        (Moller-Trumbore, float64) as (t [M], barycentrics [M, 2], face normal [M, 3]).
        """
        import open3d as o3d

        hit = self.scene.cast_rays(o3d.core.Tensor(rays.astype(np.float32)))
        ok = np.isfinite(hit["t_hit"].numpy())
        gid = hit["geometry_ids"].numpy()[ok]
        prim = hit["primitive_ids"].numpy()[ok].astype(np.int64)
        obj = np.empty(len(gid), dtype=np.int64)
        tri = np.empty((len(gid), 3, 3))
        for gi, i in self.index.items():
            sel = gid == gi
            obj[sel] = i
            tri[sel] = self.vertices32[i][self.objs[i].triangles[prim[sel]]]
        o, d = rays[ok, :3], rays[ok, 3:]
        e1, e2 = tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]
        p = cross3(d, e2)
        det = dot3(e1, p)
        s = o - tri[:, 0]
        q = cross3(s, e1)
        inv = 1.0 / np.where(det == 0.0, 1.0, det)  # Embree reported a hit, so det is not 0 in practice
        b1, b2, t = dot3(s, p) * inv, dot3(d, q) * inv, dot3(e2, q) * inv
        return ok, obj, prim, (t, np.stack([b1, b2], axis=1), unit(cross3(e1, e2)))

    def render(self, rays: np.ndarray) -> np.ndarray:
        """Colours [H, W, 3] in [0, 1] for rays [H, W, 6] (float64, unit directions)."""
        import open3d as o3d

        shape = rays.shape[:-1]
        flat = rays.reshape(-1, 6).astype(np.float64)
        ok, obj_idx, prim, (t, uv, n_face) = self._hits(flat)
        out = np.broadcast_to(SKY, (flat.shape[0], 3)).copy()
        if not ok.any():
            return out.reshape(*shape, 3)
        d = flat[ok, 3:]
        pts = flat[ok, :3] + t[:, None] * d
        flip = dot3(n_face, d) > 0  # face the camera
        n_face[flip] *= -1
        normal = n_face.copy()
        color = np.empty_like(pts)
        for i, obj in enumerate(self.objs):
            sel = obj_idx == i
            if not sel.any():
                continue
            color[sel] = albedo(pts[sel], obj.texture)
            if obj.vertex_normals is not None:  # barycentric interpolation of vertex normals
                tri = obj.triangles[prim[sel]]
                b1, b2 = uv[sel, 0:1], uv[sel, 1:2]
                vn = obj.vertex_normals
                n = unit((1 - b1 - b2) * vn[tri[:, 0]] + b1 * vn[tri[:, 1]] + b2 * vn[tri[:, 2]])
                n[dot3(n, n_face[sel]) < 0] *= -1
                normal[sel] = n
        # Hard shadows: is the light visible from just above the surface?
        origins = pts + SHADOW_EPS * n_face
        shadow_rays = np.concatenate([origins, np.broadcast_to(LIGHT_DIR, origins.shape)], axis=1)
        lit = ~self.scene.test_occlusions(o3d.core.Tensor(shadow_rays.astype(np.float32))).numpy()
        lit &= dot3(n_face, LIGHT_DIR) > 0
        ndl = np.clip(dot3(normal, LIGHT_DIR), 0.0, 1.0) * lit
        out[ok] = color * (AMBIENT + DIFFUSE * ndl[:, None])
        return np.clip(out, 0.0, 1.0).reshape(*shape, 3)


def png_bytes(rgb: np.ndarray) -> bytes:
    """8-bit RGB PNG [H, W, 3] whose bytes depend on the pixels alone: no metadata, no compression.

    The rows go into stored deflate blocks (RFC 1951, 3.2.4), so no compressor is involved: a
    compressor's output depends on its build (zlib, zlib-ng, their CPU-specific paths), and the
    same pixels would make different files on different machines.
    """
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    h, w, _ = rgb.shape
    rows = np.zeros((h, 1 + 3 * w), dtype=np.uint8)  # each row: filter type 0 (none), then its pixels
    rows[:, 1:] = rgb.reshape(h, 3 * w)
    raw = rows.tobytes()
    blocks = []
    for start in range(0, len(raw), PNG_STORED_BLOCK):
        block = raw[start:start + PNG_STORED_BLOCK]
        final = start + PNG_STORED_BLOCK >= len(raw)
        blocks.append(struct.pack("<BHH", int(final), len(block), len(block) ^ 0xFFFF) + block)
    stream = b"\x78\x01" + b"".join(blocks) + struct.pack(">I", zlib.adler32(raw))  # zlib wrapper

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB, deflate, adaptive filters, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", stream) + chunk(b"IEND", b"")


def to_uint8(img: np.ndarray) -> np.ndarray:
    return np.clip(np.round(img * 255.0), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------- stage


def run(params: SceneParams, out_dir: str | Path, seed: int, log=None, params_path: str | Path | None = None) -> dict:
    """Generate the scene's views and ground truth into ``out_dir`` (replaced atomically).

    Returns a summary: number of views, intrinsics, scene centre and radius, seconds taken.
    """
    from tqdm import tqdm

    check_outs({"--params": params_path}, {"--out": out_dir})
    log = log or setup("scene")
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    objs = build_objects(rng, params.objects)
    intr = intrinsics(params)
    poses = camera_poses(params)
    renderer = Renderer(objs)
    radius = scene_radius(objs)
    log.info("scene: %s on a ground disc of radius %.1f; %d views of %dx%d on %d rings (seed %d)",
             ", ".join(o.kind for o in objs[1:]), GROUND_RADIUS, len(poses), params.width, params.height,
             params.rings, seed)
    frames = []
    with atomic_dir(out_dir) as tmp:
        images = tmp / "images"
        images.mkdir()
        for k, w2c in enumerate(tqdm(poses, desc="scene", unit="view", disable=None)):
            tv = time.perf_counter()
            name = f"view_{k:03d}.png"
            img = to_uint8(renderer.render(pixel_rays(intr, w2c)))
            (images / name).write_bytes(png_bytes(img))
            frames.append({"file": name, "world_to_camera": w2c.tolist()})
            log.info("view %d/%d %s rendered in %.2f s", k + 1, len(poses), name, time.perf_counter() - tv)
        gt = {
            "intrinsics": intr.to_dict(),
            "frames": frames,
            "scene": {"center": SCENE_CENTER.tolist(), "radius": radius},
        }
        atomic_write_json(images / "ground_truth.json", gt)
    seconds = time.perf_counter() - t0
    log.info("wrote %d views and ground_truth.json to %s in %.1f s", len(frames), Path(out_dir) / "images", seconds)
    return {"out": str(out_dir), "views": len(frames), "intrinsics": intr.to_dict(),
            "scene": gt["scene"], "seconds": seconds}


def poses_from_ground_truth(images_dir: str | Path, out_dir: str | Path, test_every: int = 8) -> Path:
    """A poses-stage folder made straight from the generated scene's ground truth (no SfM).

    For tests and benchmarks of the stages after poses: the exact cameras, normalized like
    the poses stage does (``normalization_transform``), the scene box (ground disc and
    objects) as ``aabb``, and the ``llffhold`` split. Returns ``out_dir``.
    """
    import json
    import shutil

    from .common.cameras import (apply_similarity_to_c2w, apply_similarity_to_points, normalization_transform,
                                 w2c_to_c2w, write_transforms)

    src, dst = Path(images_dir), Path(out_dir)
    gt = json.loads((src / "ground_truth.json").read_text())
    i = gt["intrinsics"]
    intr = Intrinsics(i["width"], i["height"], i["fx"], i["fy"], i["cx"], i["cy"])
    by_file = {f["file"]: np.array(f["world_to_camera"]) for f in gt["frames"]}
    files = sorted(by_file)
    c2w = np.stack([w2c_to_c2w(by_file[f]) for f in files])
    S = normalization_transform(c2w)
    r = GROUND_RADIUS + 0.1
    corners = np.array(np.meshgrid([-r, r], [-r, r], [-0.1, 1.4])).reshape(3, -1).T
    box = apply_similarity_to_points(S, corners)
    (dst / "images").mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copy(src / f, dst / "images" / f)
    write_transforms(dst / "transforms.json", intr, [f"images/{f}" for f in files], apply_similarity_to_c2w(S, c2w),
                     {"aabb": [box.min(0).tolist(), box.max(0).tolist()], "normalization": S.tolist()})
    split = {"train": [f for k, f in enumerate(files) if k % test_every],
             "test": [f for k, f in enumerate(files) if k % test_every == 0]}
    atomic_write_json(dst / "split.json", split)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.scene", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="out folder; images/view_*.png and images/ground_truth.json go in it")
    ap.add_argument("--params", default=P.DEFAULT_PARAMS, type=Path, help="params file (default: params.yaml)")
    args = ap.parse_args(argv)
    log = setup("scene")

    def body() -> None:
        data = P.read_yaml(args.params)
        params = P.load_section(SceneParams, "scene", args.params, data=data)
        run(params, args.out, load_seed(data=data), log=log, params_path=args.params)

    return run_stage("scene", body)


if __name__ == "__main__":
    cli(main)
