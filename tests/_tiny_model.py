"""A trained model small enough for the tools' tests: a generated scene's ground-truth poses (no
SfM) and a few CPU steps of a tiny hash-grid NeRF, with a handful of
sparse points as the poses stage would write them, for the viewer and the exports."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# A hash grid of 2 levels x 1024 rows and MLPs of width 8 (as tests/test_distributed.py): a few ms a step.
TRAIN = {"device": "cpu", "steps": 20, "batch_rays": 256, "eval_every": 10, "tensorboard": False,
         "nerf": {"levels": 2, "log2_hashmap_size": 10, "base_resolution": 4, "max_resolution": 16, "hidden_dim": 8,
                  "geo_feat_dim": 3, "samples_per_ray": 32, "occ_resolution": 8, "occ_update_every": 8},
         "distributed": {"checkpoint_every": 0}}


def make_poses(root: Path, width: int = 64, height: int = 48, views: int = 8) -> Path:
    """``root/poses``: a poses-stage folder from the scene generator's ground truth, plus a
    ``points3D.ply`` of 200 random coloured points in the scene box (what the viewer shows)."""
    from stages.poses import write_ply
    from conftest import generated_scene
    from stages.scene import poses_from_ground_truth

    generated_scene(root, width, height, views)
    poses = poses_from_ground_truth(root / "scene" / "images", root / "poses")
    box = np.array(json.loads((poses / "transforms.json").read_text())["aabb"])
    rng = np.random.default_rng(0)
    pts = box[0] + rng.random((200, 3)) * (box[1] - box[0])
    rgb = rng.integers(0, 256, (200, 3))
    try:
        write_ply(poses / "points3D.ply", pts, rgb)  # the poses stage's writer (open3d)
    except ImportError:  # the GPU machine has no open3d: trimesh, as the export stage writes points
        import trimesh

        cloud = trimesh.PointCloud(pts, colors=rgb.astype(np.uint8))
        (poses / "points3D.ply").write_bytes(cloud.export(file_type="ply"))
    return poses


def train_tiny(poses: Path, out: Path, **over) -> Path:
    """Train :data:`TRAIN` (with ``over`` laid on top) on ``poses``; returns the model folder."""
    from _dvc_project import merge
    from stages.common.params import from_dict
    from stages.reconstruct import ReconstructParams, run

    params = from_dict(ReconstructParams, merge(TRAIN, over), "reconstruct")
    run(params, poses, out, progress=False)
    return out
