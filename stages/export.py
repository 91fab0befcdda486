"""Export stage: the trained model as files that other tools open (MeshLab, Blender, 3DGS viewers).

    python -m stages.export --model data/reconstruct --poses data/poses --out data/export [--params params.yaml]

What it writes to ``--out`` (the folder is replaced as a whole when the stage succeeds), all in the
normalized frame of ``<poses>/transforms.json``:

* NeRF, ``mesh.ply`` or ``mesh.glb`` (``export.mesh_format``): marching cubes (Lewiner, scikit-image)
  over the density sampled on a grid spanning the scene box, ``export.resolution`` samples along its
  longest side, at ``export.density_threshold``; density in cells the occupancy grid marks empty is
  taken as zero (the renderer skips them too). Vertex normals point out of the surface (towards
  lower density). Vertex colours are the field's: a ray starting two grid steps outside the surface
  along the normal and looking back along it is volume-rendered, as a camera facing the surface
  head-on would see it (not the colour of the nearest training camera's pixel);
* NeRF, ``points.ply``: ``export.points`` rays drawn at random from the training cameras (seeded by
  ``seed``), rendered, and those with opacity >= ``export.min_opacity`` kept as the point where the
  ray terminates (origin + direction x depth / opacity) with the rendered colour;
* 3DGS, ``gaussians.ply``: the Gaussians in the layout 3DGS viewers read
  (``stages.reconstruct.gs.ply.save_ply``), with the colour the model renders onto (a learned sky,
  white for RGBA scenes) as a header comment and in ``export.json``;
* ``export.json``: what was written, with counts, the density range of the grid and timings.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from stages.common.io import atomic_dir, atomic_write_json, read_json
from stages.common.params import DEFAULT_PARAMS, check, load_section, read_yaml

log = logging.getLogger("export")


@dataclass
class ExportParams:
    """Section ``export`` of params.yaml."""

    mesh: bool = True  # NeRF: a marching-cubes mesh
    mesh_format: Literal["ply", "glb"] = "ply"
    resolution: int = 128  # grid samples along the scene box's longest side
    density_threshold: float = 25.0  # the iso-level (field density, 1 / normalized-frame units)
    point_cloud: bool = True  # NeRF: points where training rays terminate
    points: int = 50_000  # rays drawn from the training cameras for the point cloud
    min_opacity: float = 0.5  # rays less opaque than this give no point
    chunk: int = 65536  # points (or rays) per forward pass

    def __post_init__(self) -> None:
        check(16 <= self.resolution <= 1024, "resolution", "must be in 16..1024", self.resolution)
        check(self.density_threshold > 0, "density_threshold", "must be > 0", self.density_threshold)
        check(1 <= self.points <= 50_000_000, "points", "must be in 1..50000000", self.points)
        check(0 < self.min_opacity <= 1, "min_opacity", "must be in (0, 1]", self.min_opacity)
        check(self.chunk >= 1024, "chunk", "must be >= 1024", self.chunk)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="pt", unit_scale=True, disable=not enabled)


# ---------------------------------------------------------------- NeRF: density grid and mesh


def grid_shape(aabb: np.ndarray, resolution: int) -> tuple[int, int, int]:
    """Samples per axis: ``resolution`` along the longest side of the box, the same spacing elsewhere."""
    ext = aabb[1] - aabb[0]
    return tuple(max(2, int(round(resolution * e / ext.max()))) for e in ext)


@torch.no_grad()
def density_grid(method, resolution: int, chunk: int, progress: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(density [nx, ny, nz] float32, origin [3], spacing [3]) of the NeRF's field on a lattice
    spanning the scene box, corners included; zero in cells the occupancy grid marks empty."""
    aabb = method.field.aabb.detach().cpu().double().numpy()
    shape = grid_shape(aabb, resolution)
    axes = [torch.linspace(float(aabb[0, i]), float(aabb[1, i]), shape[i], dtype=torch.float32) for i in range(3)]
    yy, zz = torch.meshgrid(axes[1], axes[2], indexing="ij")
    plane = torch.stack([yy.reshape(-1), zz.reshape(-1)], 1)  # [ny * nz, 2], z fastest
    sigma = torch.empty(int(np.prod(shape)), dtype=torch.float32)
    with _progress(sigma.numel(), "density grid", progress) as bar:
        for start in range(0, sigma.numel(), chunk):
            idx = torch.arange(start, min(start + chunk, sigma.numel()))
            pts = torch.cat([axes[0][idx // len(plane), None], plane[idx % len(plane)]], 1).to(method.device)
            sigma[idx] = (method.field.density(pts) * method.grid.occupied(pts)).float().cpu()
            bar.update(len(idx))
    spacing = (aabb[1] - aabb[0]) / (np.array(shape) - 1)
    return sigma.view(shape).numpy(), aabb[0], spacing


def marching_cubes(sigma: np.ndarray, origin: np.ndarray, spacing: np.ndarray, level: float):
    """(vertices [V, 3], faces [F, 3], outward unit normals [V, 3]) of the ``level`` iso-surface, or
    None when the grid's densities never cross it."""
    from skimage import measure

    if not sigma.min() < level < sigma.max():
        return None
    # "ascent": the density grows into the objects, so faces are wound and normals point outwards
    v, f, n, _ = measure.marching_cubes(sigma, level=level, spacing=tuple(spacing), gradient_direction="ascent")
    n = n / np.maximum(np.linalg.norm(n, axis=1, keepdims=True), 1e-12)
    return v + origin, f.astype(np.int64), n


@torch.no_grad()
def surface_colors(method, verts: np.ndarray, normals: np.ndarray, offset: float, chunk: int,
                   progress: bool = True) -> np.ndarray:
    """uint8 [V, 3]: the volume-rendered colour of a ray from ``offset`` outside each vertex along its
    normal, looking back along it."""
    o = torch.as_tensor(verts + offset * normals, dtype=torch.float32)
    d = torch.as_tensor(-normals, dtype=torch.float32)
    out = torch.empty((len(verts), 3))
    with _progress(len(verts), "mesh colours", progress) as bar:
        for i in range(0, len(verts), chunk):
            r = method.render_ray_outputs(o[i:i + chunk].to(method.device), d[i:i + chunk].to(method.device))
            out[i:i + chunk] = r["rgb"].float().cpu()
            bar.update(len(o[i:i + chunk]))
    return (out.clamp(0, 1) * 255).round().to(torch.uint8).numpy()


# ---------------------------------------------------------------- NeRF: point cloud


def training_cameras(poses_dir: Path):
    """(one Intrinsics per view, [N, 4, 4] OpenCV camera-to-world) of the training views of ``poses_dir``."""
    from stages.common.cameras import read_transforms

    intrs, files, c2w, _ = read_transforms(poses_dir / "transforms.json")
    train = set(read_json(poses_dir / "split.json").get("train", []))
    keep = [k for k, f in enumerate(files) if Path(f).name in train]
    if not keep:
        raise ValueError(f"{poses_dir}/split.json names no training view of transforms.json")
    return [intrs[k] for k in keep], c2w[keep]


@torch.no_grad()
def ray_points(method, intrs, c2w: np.ndarray, n: int, min_opacity: float, chunk: int, seed: int,
               progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(points [P, 3], uint8 colours [P, 3]) where ``n`` random training rays terminate (``intrs``:
    each view's camera)."""
    from stages.reconstruct.data import pixel_rays

    g = torch.Generator().manual_seed(seed)
    c2w_t = torch.as_tensor(c2w, dtype=torch.float32)
    cam = {k: torch.tensor([getattr(i, k) for i in intrs], dtype=torch.float32)
           for k in ("fx", "fy", "cx", "cy", "width", "height")}
    pts, cols = [], []
    with _progress(n, "ray points", progress) as bar:
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            view = torch.randint(0, len(c2w_t), (m,), generator=g)
            u = (torch.rand(m, generator=g) * cam["width"][view]).floor()  # a pixel of each ray's own view
            v = (torch.rand(m, generator=g) * cam["height"][view]).floor()
            o, d = pixel_rays(tuple(cam[k][view] for k in ("fx", "fy", "cx", "cy")), c2w_t[view], u, v)
            r = method.render_ray_outputs(o.to(method.device), d.to(method.device))
            alpha, depth = r["alpha"].float().cpu(), r["depth"].float().cpu()
            keep = alpha >= min_opacity
            pts.append((o + d * (depth / alpha.clamp_min(1e-6))[:, None])[keep])
            cols.append(r["rgb"].float().cpu()[keep])
            bar.update(m)
    p, c = torch.cat(pts), torch.cat(cols)
    return p.numpy().astype(np.float32), (c.clamp(0, 1) * 255).round().to(torch.uint8).numpy()


# ---------------------------------------------------------------- writers


def _rgba(rgb: np.ndarray) -> np.ndarray:
    return np.concatenate([rgb, np.full((len(rgb), 1), 255, np.uint8)], 1)


def write_mesh(path: Path, verts: np.ndarray, faces: np.ndarray, normals: np.ndarray, rgb: np.ndarray) -> None:
    import trimesh

    mesh = trimesh.Trimesh(vertices=verts, faces=faces, vertex_normals=normals, vertex_colors=_rgba(rgb),
                           process=False)
    path.write_bytes(mesh.export(file_type=path.suffix[1:]))


def write_points(path: Path, pts: np.ndarray, rgb: np.ndarray) -> None:
    import trimesh

    path.write_bytes(trimesh.PointCloud(pts, colors=_rgba(rgb)).export(file_type="ply"))


# ---------------------------------------------------------------- the stage


def export_nerf(method, params: ExportParams, poses_dir: Path, tmp: Path, seed: int, progress: bool) -> dict:
    facts: dict = {}
    if params.mesh:
        t0 = time.perf_counter()
        sigma, origin, spacing = density_grid(method, params.resolution, params.chunk, progress)
        found = marching_cubes(sigma, origin, spacing, params.density_threshold)
        mesh = {"grid": list(sigma.shape), "density_min": float(sigma.min()), "density_max": float(sigma.max()),
                "density_threshold": params.density_threshold}
        if found is None:
            log.warning("no surface: the grid's densities (%.3g .. %.3g) never cross export.density_threshold=%g; "
                        "no mesh written", sigma.min(), sigma.max(), params.density_threshold)
            mesh.update(file=None, vertices=0, faces=0)
        else:
            verts, faces, normals = found
            rgb = surface_colors(method, verts, normals, 2 * float(spacing.max()), params.chunk, progress)
            name = f"mesh.{params.mesh_format}"
            write_mesh(tmp / name, verts, faces, normals, rgb)
            mesh.update(file=name, vertices=len(verts), faces=len(faces), colors="field, along the normal")
        mesh["seconds"] = round(time.perf_counter() - t0, 3)
        facts["mesh"] = mesh
    if params.point_cloud:
        t0 = time.perf_counter()
        intr, c2w = training_cameras(poses_dir)
        pts, rgb = ray_points(method, intr, c2w, params.points, params.min_opacity, params.chunk, seed, progress)
        if len(pts):
            write_points(tmp / "points.ply", pts, rgb)
        else:
            log.warning("no point cloud: none of %d rays reached export.min_opacity=%g", params.points,
                        params.min_opacity)
        facts["point_cloud"] = {"file": "points.ply" if len(pts) else None, "rays": params.points, "points": len(pts),
                                "min_opacity": params.min_opacity, "seconds": round(time.perf_counter() - t0, 3)}
    return facts


def export_gaussians(state: dict, tmp: Path) -> dict:
    try:
        from stages.reconstruct.gs.ply import save_ply
    except ImportError as exc:
        raise ValueError(f"exporting a 3DGS model needs stages.reconstruct.gs.ply.save_ply ({exc})") from None
    bg = state.get("background")  # the colour the model renders onto; -1s (or absent): black, none stored
    rgb = None if bg is None or float(torch.as_tensor(bg).min()) < 0 else [float(v) for v in torch.as_tensor(bg)]
    save_ply(tmp / "gaussians.ply", state["params"], background=rgb)
    return {"gaussians": {"file": "gaussians.ply", "count": int(state["params"]["means"].shape[0]),
                          "background": rgb}}


def run(params: ExportParams, model_dir: str | Path, poses_dir: str | Path, out_dir: str | Path, seed: int = 0,
        progress: bool = True) -> dict:
    """Export the model of ``model_dir`` into ``out_dir`` (replaced on success); returns export.json."""
    from stages.reconstruct.api import load_trained, read_model

    model_dir, poses_dir = Path(model_dir), Path(poses_dir)
    out = Path(out_dir).resolve()
    for name, src in (("model", model_dir), ("poses", poses_dir)):  # atomic_dir replaces the out folder
        if out == src.resolve() or out in src.resolve().parents:
            raise ValueError(f"the out folder {out_dir} holds the {name} folder {src}; give the export its own")
    blob = read_model(model_dir)
    t0 = time.perf_counter()
    with atomic_dir(out_dir) as tmp:
        if blob["method"] == "3dgs":  # the tensors are the export: no renderer needed
            facts = export_gaussians(blob["state"], tmp)
        else:
            facts = export_nerf(load_trained(model_dir).module, params, poses_dir, tmp, seed, progress)
        summary = {"method": blob["method"], "model": str(model_dir), "frame": "normalized (transforms.json)",
                   **facts, "seconds": round(time.perf_counter() - t0, 3)}
        atomic_write_json(tmp / "export.json", summary)
    written = [v["file"] for v in facts.values() if isinstance(v, dict) and v.get("file")]
    log.info("wrote %s: %s", out_dir, ", ".join(written) or "nothing but export.json")
    return summary


def main(argv: list[str] | None = None) -> int:
    from stages.common.log import setup

    ap = argparse.ArgumentParser(prog="python -m stages.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the reconstruct stage's out folder")
    ap.add_argument("--poses", type=Path, required=True, help="the poses stage's out folder (training cameras)")
    ap.add_argument("--out", type=Path, required=True, help="this stage's out folder (replaced)")
    ap.add_argument("--params", type=Path, default=DEFAULT_PARAMS, help="params file (default: params.yaml)")
    args = ap.parse_args(argv)
    setup("export")
    try:
        data = read_yaml(args.params)
        params = load_section(ExportParams, "export", data=data)
        summary = run(params, args.model, args.poses, args.out, seed=int(data.get("seed", 0)))
    except ValueError as exc:
        print(f"export: error: {exc}", file=sys.stderr)
        return 1
    parts = [f"{k} {v['file']}" for k, v in summary.items() if isinstance(v, dict) and v.get("file")]
    print(f"export -> {args.out}: {', '.join(parts) or 'nothing exported (see the warnings)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
