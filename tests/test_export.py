"""The export stage (stages/export.py): a NeRF's mesh and point cloud, a 3DGS model's Gaussians.

The mesh is checked against the field it came from: just outside each vertex (along its normal)
the density is below the iso-level and just inside above it, and its colours are the field's
renders along the normals. The files are read back by trimesh and by open3d (another PLY reader).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from stages import export as E


@pytest.fixture(scope="module")
def nerf(tiny_model):
    from stages.reconstruct.api import load_trained

    poses, model_dir = tiny_model
    method = load_trained(model_dir).module
    sigma, _, _ = E.density_grid(method, 32, 65536, progress=False)
    return poses, model_dir, method, sigma


def test_mesh_lies_on_the_iso_surface_with_the_fields_colours(nerf, tmp_path: Path) -> None:
    import open3d as o3d
    import trimesh

    poses, model_dir, method, sigma = nerf
    level = float(np.median(sigma))  # a barely trained field: its median density surely has a surface
    p = E.ExportParams(resolution=64, density_threshold=level, points=2000, min_opacity=0.2)
    summary = E.run(p, model_dir, poses, tmp_path / "export", progress=False)
    assert json.loads((tmp_path / "export" / "export.json").read_text()) == summary
    info = summary["mesh"]
    assert info["file"] == "mesh.ply" and info["vertices"] > 100 and info["density_min"] < level < info["density_max"]
    mesh = trimesh.load(tmp_path / "export" / "mesh.ply", process=False)
    assert len(mesh.vertices) == info["vertices"] and len(mesh.faces) == info["faces"]
    v = np.asarray(mesh.vertices)
    n = np.asarray(mesh.vertex_normals)
    spacing = (method.field.aabb[1] - method.field.aabb[0]).max().item() / 63
    box = method.field.aabb.numpy()

    def density(x):
        x = torch.as_tensor(x, dtype=torch.float32)
        with torch.no_grad():
            return (method.field.density(x) * method.grid.occupied(x)).numpy()

    # On the surface the field's density is the iso-level, up to marching cubes' linear interpolation
    # between grid samples: median error within 2 % of the grid's density range (measured 0.3 %).
    span = info["density_max"] - info["density_min"]
    assert np.median(np.abs(density(v) - level)) < 0.02 * span
    # Half a grid step out along the normal the density is lower, half a step in higher. This barely
    # trained field is rough at the grid's scale (another crossing within half a step is common):
    # measured 92 % and 87 % of the vertices away from the box's faces, which cut the surface open.
    inner = ((v > box[0] + spacing) & (v < box[1] - spacing)).all(1)
    outside, inside = density(v[inner] + 0.5 * spacing * n[inner]), density(v[inner] - 0.5 * spacing * n[inner])
    assert (outside < level).mean() > 0.8 and (inside > level).mean() > 0.8, ((outside < level).mean(),
                                                                               (inside > level).mean())
    pick = np.linspace(0, len(v) - 1, 20).astype(int)
    want = E.surface_colors(method, v[pick], n[pick], 2 * spacing, 1024, progress=False)
    got = np.asarray(mesh.visual.vertex_colors)[pick, :3]
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1  # float32 normals round-tripped through PLY
    o3_mesh = o3d.io.read_triangle_mesh(str(tmp_path / "export" / "mesh.ply"))
    assert len(o3_mesh.vertices) == len(v) and o3_mesh.has_vertex_colors()

    cloud = summary["point_cloud"]
    assert cloud["file"] == "points.ply" and 0 < cloud["points"] <= 2000
    pts = o3d.io.read_point_cloud(str(tmp_path / "export" / "points.ply"))
    xyz = np.asarray(pts.points)
    assert len(xyz) == cloud["points"] and pts.has_colors()
    # rays terminate inside the box they are marched through (depth / opacity: within the entry-exit span)
    assert ((xyz > box[0] - 1e-4) & (xyz < box[1] + 1e-4)).all()
    cloud_only = E.ExportParams(mesh=False, points=p.points, min_opacity=p.min_opacity)
    again = E.run(cloud_only, model_dir, poses, tmp_path / "again", progress=False)  # seeded: the same points
    assert (tmp_path / "again" / "points.ply").read_bytes() == (tmp_path / "export" / "points.ply").read_bytes()
    assert again["point_cloud"]["points"] == cloud["points"]


def test_glb_and_no_surface(nerf, tmp_path: Path) -> None:
    import trimesh

    poses, model_dir, _, sigma = nerf
    p = E.ExportParams(resolution=24, mesh_format="glb", density_threshold=float(np.median(sigma)), point_cloud=False)
    summary = E.run(p, model_dir, poses, tmp_path / "glb", progress=False)
    scene = trimesh.load(tmp_path / "glb" / "mesh.glb")
    geom = list(scene.geometry.values())[0] if isinstance(scene, trimesh.Scene) else scene
    assert len(geom.vertices) == summary["mesh"]["vertices"] and "point_cloud" not in summary
    high = E.ExportParams(resolution=16, density_threshold=float(sigma.max()) * 10 + 1, point_cloud=False)
    summary = E.run(high, model_dir, poses, tmp_path / "none", progress=False)
    assert summary["mesh"]["file"] is None and sorted(p.name for p in (tmp_path / "none").iterdir()) == ["export.json"]


def test_bad_input_is_refused_and_leaves_no_out(tiny_model, tmp_path: Path) -> None:
    from stages.common.params import ParamsError, from_dict

    poses, model_dir = tiny_model
    with pytest.raises(ParamsError, match="export.resolution"):
        from_dict(E.ExportParams, {"resolution": 4}, "export")
    with pytest.raises(ParamsError, match="export.mesh_format"):
        from_dict(E.ExportParams, {"mesh_format": "obj"}, "export")
    with pytest.raises(ValueError, match="no trained model"):
        E.run(E.ExportParams(), tmp_path, poses, tmp_path / "out")
    with pytest.raises(ValueError, match="holds the model folder"):
        E.run(E.ExportParams(), model_dir, poses, model_dir.parent)
    assert not (tmp_path / "out").exists() and (model_dir / "model.pt").is_file()


def test_3dgs_model_exports_its_gaussians(tmp_path: Path) -> None:
    ply = pytest.importorskip("stages.reconstruct.gs.ply", reason="stages/reconstruct/gs/ply.py (issue 16, "
                              "h-gsmodel) is not merged yet: the 3DGS export calls its save_ply")
    from stages.reconstruct import MODEL_FORMAT

    n, sh_degree = 50, 3
    g = torch.Generator().manual_seed(0)
    params = {"means": torch.randn(n, 3, generator=g), "quats": torch.randn(n, 4, generator=g),
              "scales": torch.randn(n, 3, generator=g) - 3, "opacities": torch.randn(n, generator=g),
              "sh0": torch.randn(n, 1, 3, generator=g), "shN": torch.randn(n, (sh_degree + 1) ** 2 - 1, 3, generator=g)}
    (tmp_path / "model").mkdir()
    torch.save({"format": MODEL_FORMAT, "method": "3dgs", "config": {}, "aabb": torch.tensor([[-1.0] * 3, [1.0] * 3]),
                "state": {"params": params, "sh_degree": sh_degree, "version": 1}}, tmp_path / "model" / "model.pt")
    summary = E.run(E.ExportParams(), tmp_path / "model", tmp_path, tmp_path / "export", progress=False)
    assert summary["gaussians"] == {"file": "gaussians.ply", "count": n, "background": None}
    assert ply.read_background(tmp_path / "export" / "gaussians.ply") is None
    head = (tmp_path / "export" / "gaussians.ply").read_bytes()[:4000]
    assert head.startswith(b"ply") and b"element vertex 50" in head and b"f_dc_0" in head and b"rot_3" in head
    if hasattr(ply, "load_ply"):
        back = ply.load_ply(tmp_path / "export" / "gaussians.ply")
        torch.testing.assert_close(back["means"], params["means"])


def test_a_3dgs_models_background_travels_with_its_gaussians(tmp_path: Path) -> None:
    """The colour the model renders onto (a learned sky) goes into export.json and the PLY header's
    comment, which 3DGS viewers skip; the Gaussians still read back bit-exactly."""
    from stages.reconstruct import MODEL_FORMAT
    from stages.reconstruct.gs import ply

    n = 20
    g = torch.Generator().manual_seed(1)
    params = {"means": torch.randn(n, 3, generator=g), "quats": torch.randn(n, 4, generator=g),
              "scales": torch.randn(n, 3, generator=g) - 3, "opacities": torch.randn(n, generator=g),
              "sh0": torch.randn(n, 1, 3, generator=g), "shN": torch.randn(n, 3, 3, generator=g)}
    bg = torch.tensor([0.8588, 0.902, 0.949])
    (tmp_path / "model").mkdir()
    torch.save({"format": MODEL_FORMAT, "method": "3dgs", "config": {}, "aabb": torch.tensor([[-1.0] * 3, [1.0] * 3]),
                "state": {"params": params, "sh_degree": 1, "version": 1, "background": bg}},
               tmp_path / "model" / "model.pt")
    summary = E.run(E.ExportParams(), tmp_path / "model", tmp_path, tmp_path / "export", progress=False)
    out = tmp_path / "export" / "gaussians.ply"
    assert summary["gaussians"]["background"] == pytest.approx(bg.tolist())
    assert ply.read_background(out) == pytest.approx(bg.tolist(), abs=1e-8)
    back = ply.load_ply(out)
    for k in params:
        assert torch.equal(back[k], params[k]), k
    with pytest.raises(ValueError, match=r"background must be 3 values in \[0, 1\]"):
        ply.save_ply(tmp_path / "bad.ply", params, background=[0.5, 1.5, 0.0])
    assert not (tmp_path / "bad.ply").exists()
