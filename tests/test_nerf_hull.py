"""The NeRF's box tightened to the visual hull of alpha masks (stages/reconstruct/nerf/hull.py)."""
from __future__ import annotations

import logging

import numpy as np
import torch

from stages.common.cameras import Intrinsics
from stages.reconstruct.config import ReconstructParams
from stages.reconstruct.data import Cameras, PosedImages, Scene
from stages.reconstruct.methods import build_method
from stages.reconstruct.nerf.hull import alpha_hull_box
from stages.reconstruct.nerf.method import viewing_spread_deg

CENTRE = np.array([0.2, -0.1, 0.05])
RADIUS = 0.3
BOX = torch.tensor([[-2.0, -2.0, -2.0], [2.0, 2.0, 2.0]])
SIDE, F = 96, 70.0


def _look_at(eye: np.ndarray, target: np.ndarray) -> np.ndarray:
    z = (target - eye) / np.linalg.norm(target - eye)
    up = np.array([0.0, 0.0, 1.0]) if abs(z[2]) < 0.9 else np.array([0.0, 1.0, 0.0])
    x = np.cross(z, up)
    x /= np.linalg.norm(x)
    y = np.cross(z, x)
    T = np.eye(4)
    T[:3, :3] = np.stack([x, y, z], 1)
    T[:3, 3] = eye
    return T


def _sphere_views(eyes: list[np.ndarray], alpha_of=None) -> PosedImages:
    """RGBA views of a sphere: alpha 255 where the pixel's ray passes within RADIUS of CENTRE."""
    intr = Intrinsics(SIDE, SIDE, F, F, SIDE / 2, SIDE / 2)
    c2ws, images = [], []
    v, u = np.meshgrid(np.arange(SIDE) + 0.5, np.arange(SIDE) + 0.5, indexing="ij")
    for eye in eyes:
        T = _look_at(eye, CENTRE)
        d = np.stack([(u - intr.cx) / F, (v - intr.cy) / F, np.ones_like(u)], -1) @ T[:3, :3].T
        d /= np.linalg.norm(d, axis=-1, keepdims=True)
        w = CENTRE - eye
        along = d @ w
        miss = np.linalg.norm(w[None, None] - along[..., None] * d, axis=-1)
        hit = (miss < RADIUS) & (along > 0)
        img = np.full((SIDE, SIDE, 4), 128, np.uint8)
        img[..., 3] = np.where(hit, 255, 0) if alpha_of is None else alpha_of(hit)
        c2ws.append(T)
        images.append(img)
    return PosedImages.from_images([f"v{i}.png" for i in range(len(eyes))], images,
                                   torch.tensor(np.stack(c2ws), dtype=torch.float32),
                                   Cameras.from_intrinsics([intr] * len(eyes)))


def _axis_eyes(dist: float = 6.0) -> list[np.ndarray]:
    eyes = []
    for axis in range(3):
        for sign in (1.0, -1.0):
            e = np.zeros(3)
            e[axis] = sign * dist
            eyes.append(CENTRE + e + 0.01 * np.array([1.0, 2.0, 3.0]))  # not exactly on the axis
    return eyes


def test_the_hull_box_bounds_the_object_and_little_else():
    box = alpha_hull_box(_sphere_views(_axis_eyes()), BOX, resolution=64)
    assert box is not None
    lo, hi = torch.tensor(CENTRE - RADIUS, dtype=torch.float32), torch.tensor(CENTRE + RADIUS, dtype=torch.float32)
    # contains the sphere: nothing of the object is cut off
    assert bool((box[0] <= lo).all()) and bool((box[1] >= hi).all()), (box, lo, hi)
    # and not much more: the padding (2.5 cells) and the masks' dilation, at most 2 px for these cells at
    # ~6 units (their 1.6 px footprint rounded up to the pyramid's radii) plus the pixel they fall in
    slack = 2.5 * 4.0 / 64 + 3 * 6.0 / F
    assert bool((box[0] >= lo - slack).all()) and bool((box[1] <= hi + slack).all()), box
    assert float(torch.prod(box[1] - box[0])) < 0.03 * 4.0 ** 3  # 2 % of the box here


def test_masks_that_say_nothing_keep_the_box(caplog):
    # every pixel opaque: nothing is carved, so there is no tighter box
    assert alpha_hull_box(_sphere_views(_axis_eyes(), lambda hit: np.full(hit.shape, 255)), BOX, resolution=32) is None
    # every pixel transparent (masks that do not match the poses): everything is carved; the box stays,
    # with a warning that names the problem
    with caplog.at_level(logging.WARNING):
        assert alpha_hull_box(_sphere_views(_axis_eyes(), lambda hit: np.zeros(hit.shape)), BOX, resolution=32) is None
    assert "carve the whole box away" in caplog.text


def test_a_thin_part_survives_the_carving():
    # a soft, faint silhouette (alpha 20 of 255, antialiased edges) still counts as the object
    box = alpha_hull_box(_sphere_views(_axis_eyes(), lambda hit: np.where(hit, 20, 0)), BOX, resolution=48)
    assert box is not None and bool((box[0] <= torch.tensor(CENTRE - RADIUS)).all())


def _scene(views: PosedImages) -> Scene:
    return Scene(views, views, BOX.clone(), None, None, None)


def test_the_nerf_trains_in_the_hull_box_of_rgba_views_unless_told_not_to():
    scene = _scene(_sphere_views(_axis_eyes()))
    params = ReconstructParams(device="cpu")
    params.nerf.occ_resolution = 16
    method = build_method(params, scene.aabb, torch.device("cpu"), None, scene)
    aabb = method.field.aabb
    assert float(torch.prod(aabb[1] - aabb[0])) < 0.05 * 4.0 ** 3
    assert torch.equal(method.grid.aabb, aabb)
    # the march keeps the box's step, and a model loaded to render (built without its scene) takes the
    # hull and that step from the saved state
    box_step = (BOX[1] - BOX[0]).norm().item() / params.nerf.samples_per_ray
    assert method.step_size == box_step
    fresh = build_method(params, scene.aabb, torch.device("cpu"))
    assert torch.equal(fresh.field.aabb, BOX) and fresh.step_size == box_step
    fresh.field.aabb.mul_(0.5)  # so that a step taken from the loaded box would differ
    fresh.load_state_dict(method.state_dict())
    assert torch.equal(fresh.field.aabb, aabb) and fresh.step_size == box_step
    params.nerf.alpha_box = "off"
    method = build_method(params, scene.aabb, torch.device("cpu"), None, scene)
    assert torch.equal(method.field.aabb, BOX)


def test_viewing_spread_tells_forward_facing_from_surrounding():
    around = [CENTRE + 3 * np.array([np.cos(a), np.sin(a), 0.3]) for a in np.linspace(0, 2 * np.pi, 12, endpoint=False)]
    ahead = [np.array([x, y, -3.0]) for x in (-0.3, 0.0, 0.3) for y in (-0.2, 0.2)]
    c2w = lambda eyes: torch.tensor(np.stack([_look_at(e, e + np.array([0.05 * e[0], 0.05 * e[1], 1.0]))  # noqa: E731
                                              if e[2] < 0 else _look_at(e, CENTRE) for e in eyes]))
    assert viewing_spread_deg(c2w(ahead)) < 10
    assert viewing_spread_deg(c2w(around)) > 120  # 180 - 2 x its 17 degree tilt


def test_an_object_that_leaves_every_frame_keeps_all_of_itself_in_the_box(caplog):
    # a rod along x from -1.5 to 1.5 (radius 0.1), 60 close views each seeing 0.2 of it: no view has the
    # whole object in frame, so its ends are seen by only a few views and must not be dropped for that
    side, f, r = 64, 640.0, 0.1
    intr = Intrinsics(side, side, f, f, side / 2, side / 2)
    seg = np.stack([np.linspace(-1.5, 1.5, 301), np.zeros(301), np.zeros(301)], 1)
    v, u = np.meshgrid(np.arange(side) + 0.5, np.arange(side) + 0.5, indexing="ij")
    c2ws, images = [], []
    for x in np.linspace(-1.7, 1.7, 60):
        eye = np.array([x, -2.0, 0.3])
        T = _look_at(eye, np.array([x, 0.0, 0.0]))
        d = (np.stack([(u - intr.cx) / f, (v - intr.cy) / f, np.ones_like(u)], -1) @ T[:3, :3].T).reshape(-1, 3)
        d /= np.linalg.norm(d, axis=-1, keepdims=True)
        w = seg - eye  # [S, 3]
        along = d @ w.T  # [P, S]
        dist2 = (w ** 2).sum(-1)[None] - along ** 2
        hit = ((dist2 < r * r) & (along > 0)).any(1).reshape(side, side)
        img = np.full((side, side, 4), 90, np.uint8)
        img[..., 3] = np.where(hit, 255, 0)
        c2ws.append(T)
        images.append(img)
    views = PosedImages.from_images([f"r{i}.png" for i in range(60)], images,
                                    torch.tensor(np.stack(c2ws), dtype=torch.float32),
                                    Cameras.from_intrinsics([intr] * 60))
    with caplog.at_level(logging.INFO, logger="stages.reconstruct.nerf.hull"):
        box = alpha_hull_box(views, BOX, resolution=64)
    assert "cells seen by >= 1 views" in caplog.text
    assert box is not None
    rod = torch.tensor([[-1.5, -r, -r], [1.5, r, r]])
    assert bool((box[0] <= rod[0]).all()) and bool((box[1] >= rod[1]).all()), box
    assert float(torch.prod(box[1] - box[0])) < 0.5 * 4.0 ** 3, box  # still tighter than the box


def test_views_with_the_whole_object_in_frame_drop_what_only_a_few_views_see(caplog):
    # 6 views far off, every silhouette inside its frame: the box needs cells seen by all 6
    with caplog.at_level(logging.INFO, logger="stages.reconstruct.nerf.hull"):
        alpha_hull_box(_sphere_views(_axis_eyes()), BOX, resolution=32)
    assert "cells seen by >= 6 views" in caplog.text
