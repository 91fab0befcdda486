"""The data layer (stages/reconstruct/data.py): one camera per image, images of any sizes in one
flat pixel buffer, rays drawn from it, the poses out read back (RGBA, sparse points, a working
resolution), and the shared-size draw that must stay what it always was."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import requires_gpu
from stages.common import cameras as C
from stages.reconstruct.data import (Cameras, PosedImages, RaySampler, composite, image_rays, load_scene, pixel_rays,
                                     read_points_ply, sizes_text, working_size)

# landscape, portrait and a square image, each with its own camera
INTRS = [C.Intrinsics(12, 8, 10.0, 11.0, 6.5, 4.0), C.Intrinsics(8, 12, 9.0, 9.5, 3.75, 6.25),
         C.Intrinsics(5, 5, 4.0, 4.0, 2.5, 2.5)]


def _coded(intr: C.Intrinsics, k: int) -> np.ndarray:
    """An image whose pixel (row, col) holds (k, row, col): every draw says where it came from."""
    rows, cols = np.meshgrid(np.arange(intr.height), np.arange(intr.width), indexing="ij")
    return np.stack([np.full_like(rows, k), rows, cols], -1).astype(np.uint8)


def _c2w(n: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        q = rng.normal(size=4)
        q /= np.linalg.norm(q)
        w, x, y, z = q
        T = np.eye(4)
        T[:3, :3] = [[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                     [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                     [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]]
        T[:3, 3] = rng.normal(size=3)
        out.append(T)
    return torch.tensor(np.stack(out), dtype=torch.float32)


def _views() -> PosedImages:
    return PosedImages.from_images([f"{k}.png" for k in range(3)], [_coded(c, k) for k, c in enumerate(INTRS)],
                                   _c2w(3), Cameras.from_intrinsics(INTRS))


def test_flat_buffer_holds_images_of_any_size_with_their_cameras():
    v = _views()
    assert len(v) == 3 and v.channels == 3 and v.offsets.tolist() == [0, 96, 192, 217]
    assert v.pixels.shape == (217, 3) and v.pixels.dtype == torch.uint8
    for k, intr in enumerate(INTRS):
        assert torch.equal(v.image(k), torch.from_numpy(_coded(intr, k)))
        assert v.intr(k) == intr == v.cameras.intrinsics(k)  # these values are exact in float32
    K = v.cameras.K()
    assert K.shape == (3, 3, 3) and K.dtype == torch.float32
    torch.testing.assert_close(K[1], torch.tensor(INTRS[1].K(), dtype=torch.float32), rtol=0, atol=0)
    moved = v.to("cpu").pin_memory() if torch.cuda.is_available() else v.to("cpu")
    assert torch.equal(moved.pixels, v.pixels) and moved.cameras.width.tolist() == [12, 8, 5]
    assert sizes_text(v) == "12x8 (1), 8x12 (1), 5x5 (1)"
    with pytest.raises(ValueError, match=r"1.png: image is 12x8, its camera says 8x12"):
        PosedImages.from_images(["0.png", "1.png"], [_coded(INTRS[0], 0)] * 2, _c2w(2),
                                Cameras.from_intrinsics(INTRS[:2]))
    with pytest.raises(ValueError, match="all be RGB or all RGBA"):
        PosedImages.from_images(["0.png", "1.png"], [_coded(INTRS[0], 0), np.zeros((12, 8, 4), np.uint8)],
                                _c2w(2), Cameras.from_intrinsics(INTRS[:2]))


def test_sampler_draws_every_pixel_alike_with_its_own_camera():
    v = _views()
    o, d, rgb = RaySampler(v, torch.Generator().manual_seed(0)).sample(20000)
    assert o.shape == d.shape == rgb.shape == (20000, 3)
    k, row, col = (rgb * 255).round().long().unbind(-1)
    for i, intr in enumerate(INTRS):  # each ray is its pixel's ray through that image's camera
        m = k == i
        o_ref, d_ref = pixel_rays(intr, v.c2w[i].expand(int(m.sum()), 4, 4), col[m], row[m])
        torch.testing.assert_close(d[m], d_ref, rtol=0, atol=0)
        torch.testing.assert_close(o[m], o_ref, rtol=0, atol=0)
        assert int(row[m].max()) == intr.height - 1 and int(col[m].max()) == intr.width - 1
    # every pixel is equally likely: images are drawn in proportion to their pixel counts
    counts = torch.bincount(k, minlength=3).double()
    expected = 20000 * torch.tensor([96, 96, 25], dtype=torch.float64) / 217
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 13.8  # chi-square with 2 degrees of freedom: p = 0.001


def test_jittered_rays_cross_their_own_pixel_and_cover_it():
    """nerf.pixel_jitter: the same pixels and colours as without it (the pixel draw comes first),
    each ray through a point of its own pixel, spread over the whole pixel rather than its centre."""
    v = _views()
    o0, d0, rgb0 = RaySampler(v, torch.Generator().manual_seed(3)).sample(20000)
    o, d, rgb = RaySampler(v, torch.Generator().manual_seed(3), jitter=True).sample(20000)
    assert torch.equal(rgb, rgb0) and torch.equal(o, o0) and not torch.allclose(d, d0)
    k, row, col = (rgb * 255).round().long().unbind(-1)
    offsets = []
    for i, intr in enumerate(INTRS):  # back through the camera: the image point the ray crosses
        m = k == i
        cam = d[m] @ v.c2w[i, :3, :3]  # world -> camera (R orthonormal)
        x = cam[:, 0] / cam[:, 2] * intr.fx + intr.cx - col[m]
        y = cam[:, 1] / cam[:, 2] * intr.fy + intr.cy - row[m]
        offsets.append(torch.stack([x, y], -1))
    off = torch.cat(offsets)
    assert bool((off > -1e-4).all()) and bool((off < 1 + 1e-4).all())  # inside the pixel [col, col + 1)
    # uniform over it: mean 0.5, variance 1/12 per axis, and the corners reached
    torch.testing.assert_close(off.mean(0), torch.full((2,), 0.5), atol=0.01, rtol=0)
    torch.testing.assert_close(off.var(0), torch.full((2,), 1 / 12), atol=0.005, rtol=0)
    assert float(off.min()) < 0.01 and float(off.max()) > 0.99


def test_shared_size_draws_are_what_they_always_were():
    """The draw of images that share one size, bit for bit as before per-image cameras (the
    formula of d4da802's RaySampler), so the CPU `dvc repro` model does not change."""
    intr = C.Intrinsics(16, 12, 14.3, 14.7, 8.1, 5.9)
    imgs = [np.random.default_rng(k).integers(0, 256, (12, 16, 3), dtype=np.uint8) for k in range(4)]
    c2w = _c2w(4, seed=1)
    v = PosedImages.from_images([f"{k}" for k in range(4)], imgs, c2w, Cameras.from_intrinsics([intr] * 4))
    o, d, rgb = RaySampler(v, torch.Generator().manual_seed(5)).sample(4096)
    stack = torch.from_numpy(np.stack(imgs))
    idx = torch.randint(0, 4 * 12 * 16, (4096,), generator=torch.Generator().manual_seed(5))
    img, pix = idx // (12 * 16), idx % (12 * 16)
    rows, cols = pix // 16, pix % 16
    o_old, d_old = pixel_rays(intr, c2w[img], cols, rows)  # the old call: one Intrinsics, Python floats
    assert torch.equal(o, o_old) and torch.equal(d, d_old)
    assert torch.equal(rgb, stack[img, rows, cols].float() / 255.0)


@requires_gpu
@pytest.mark.gpu
def test_views_pinned_and_moved_to_the_gpu_draw_what_the_cpu_draws():
    """Per-image cameras on the GPU (pinned, non-blocking copy): the same rays as on the CPU from
    the same CPU generator (the pixel draw itself is the generator's)."""
    v = _views()
    gpu = v.pin_memory().to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert gpu.pixels.is_cuda and gpu.cameras.fx.is_cuda and gpu.offsets.is_cuda
    oc, dc, rc = RaySampler(v, torch.Generator().manual_seed(0)).sample(8192)
    og, dg, rg = RaySampler(gpu, torch.Generator().manual_seed(0)).sample(8192)
    assert og.is_cuda and torch.equal(og.cpu(), oc)  # origins are gathered, not computed: bit-equal
    # the same pixels: x / 255 is a division on the CPU and a product with 1/255 in CUDA's
    # scalar kernel, one ulp apart for some bytes (the H200 run saw it)
    torch.testing.assert_close(rg.cpu(), rc, rtol=0, atol=1e-7)
    assert torch.equal((rg * 255).round().cpu(), (rc * 255).round())
    torch.testing.assert_close(dg.cpu(), dc, rtol=0, atol=1e-6)  # float32 matmul and norm on another device
    torch.testing.assert_close(gpu.cameras.K().cpu(), v.cameras.K(), rtol=0, atol=0)


def _ray_angle_error(device: str) -> float:
    """The largest angle (radians) between pixel_rays' directions on ``device`` and float64's, over 4096
    rays of per-ray cameras and of one shared camera (lego-like: 400 px, focal 556)."""
    g = torch.Generator().manual_seed(7)
    c2w = _c2w(64, seed=3)
    img = torch.randint(0, 64, (4096,), generator=g)
    u, v = torch.rand(4096, generator=g) * 400, torch.rand(4096, generator=g) * 400
    intr = C.Intrinsics(400, 400, 555.5555, 555.5555, 200.0, 200.0)
    worst = 0.0
    x, y = (u.double() + 0.5 - intr.cx) / intr.fx, (v.double() + 0.5 - intr.cy) / intr.fy
    d_cam = torch.stack([x, y, torch.ones_like(x)], -1)[..., None]  # [N, 3, 1]
    for cam in (c2w[img], c2w[5]):  # [N, 4, 4] and [4, 4] (broadcast in the reference's matmul)
        _, d = pixel_rays(intr, cam.to(device), u.to(device), v.to(device))
        ref = (cam.double()[..., :3, :3] @ d_cam)[..., 0]
        ref = ref / ref.norm(dim=-1, keepdim=True)
        d = d.cpu().double()
        d = d / d.norm(dim=-1, keepdim=True)  # the angle alone (acos of a float32 unit vector's dot is 5e-4 off)
        worst = max(worst, float(2 * torch.asin((d - ref).norm(dim=-1) / 2).max()))
    return worst


def test_pixel_rays_are_float32_exact():
    """Directions within float32 rounding of the float64 rotation (1e-6 rad; a lego pixel is 1.8e-3)."""
    assert _ray_angle_error("cpu") < 1e-6


@requires_gpu
@pytest.mark.gpu
def test_pixel_rays_ignore_the_tf32_switch():
    """nerf.mlp_precision tf32 turns torch's process-wide TF32 matmuls on for the MLPs. The rays must not
    follow it: R d as a matmul with R and d rounded to TF32's 10-bit mantissas (emulated on the CPU) is 3.7e-4 rad
    off here, and bends lego's rays by up to 0.3 px."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert _ray_angle_error("cuda") < 1e-6
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_image_rays_are_row_major_through_pixel_centres():
    intr = INTRS[1]
    c2w = torch.eye(4)
    o, d = image_rays(intr, c2w)
    assert o.shape == d.shape == (intr.width * intr.height, 3)
    centre = d[int(intr.cy) * intr.width + int(intr.cx)]  # (3.75, 6.25) lies in pixel (row 6, col 3)
    torch.testing.assert_close(centre, torch.nn.functional.normalize(torch.tensor(
        [(3.5 - 3.75) / 9.0, (6.5 - 6.25) / 9.5, 1.0]), dim=0))


def _poses_folder(root: Path, rgba: tuple[int, ...] = ()) -> tuple[list[C.Intrinsics], list[np.ndarray]]:
    """A poses out with a portrait/landscape mix (one camera each) and coloured points."""
    from stages.poses import write_ply

    (root / "images").mkdir(parents=True)
    cams = [C.Intrinsics(40, 30, 36.0, 36.0, 20.0, 15.0), C.Intrinsics(30, 40, 35.0, 35.5, 15.0, 20.0),
            C.Intrinsics(40, 30, 37.0, 37.0, 20.5, 15.0)]
    imgs = []
    for k, c in enumerate(cams):
        img = np.random.default_rng(k).integers(0, 256, (c.height, c.width, 4 if k in rgba else 3), dtype=np.uint8)
        Image.fromarray(img).save(root / "images" / f"v{k}.png")
        imgs.append(img)
    c2w = _c2w(3).double().numpy()
    C.write_transforms(root / "transforms.json", cams, [f"images/v{k}.png" for k in range(3)], c2w,
                       extra={"aabb": [[-1, -1, -1], [1, 1, 1]], "ply_file_path": "points3D.ply"})
    (root / "split.json").write_text(json.dumps({"train": ["v0.png", "v1.png"], "test": ["v2.png"]}))
    write_ply(root / "points3D.ply", np.arange(12.0).reshape(4, 3) / 10, np.arange(12).reshape(4, 3) * 20)
    return cams, imgs


def test_load_scene_reads_per_image_cameras_rgba_and_points(tmp_path):
    cams, imgs = _poses_folder(tmp_path / "poses", rgba=(1,))
    scene = load_scene(tmp_path / "poses")
    assert scene.train.names == ["v0.png", "v1.png"] and scene.test.names == ["v2.png"]
    assert scene.train.channels == scene.test.channels == 4  # one RGBA image: all RGBA, opaque ones at 255
    assert [scene.train.intr(i) for i in range(2)] == cams[:2] and scene.test.intr(0) == cams[2]
    assert torch.equal(scene.train.image(1), torch.from_numpy(imgs[1]))
    assert torch.equal(scene.train.image(0)[..., :3], torch.from_numpy(imgs[0]))
    assert bool((scene.train.image(0)[..., 3] == 255).all())
    torch.testing.assert_close(scene.points, torch.arange(12.0).reshape(4, 3) / 10)
    assert scene.point_rgb.dtype == torch.uint8 and scene.point_rgb.tolist() == (np.arange(12).reshape(4, 3) * 20).tolist()
    _, _, rgba = RaySampler(scene.train, torch.Generator().manual_seed(0)).sample(64)
    assert rgba.shape == (64, 4)
    on_white = composite(rgba, (1.0, 1.0, 1.0))
    torch.testing.assert_close(on_white, rgba[:, :3] * rgba[:, 3:] + (1 - rgba[:, 3:]))


def test_load_scene_working_resolution_shrinks_images_and_cameras(tmp_path, caplog):
    cams, imgs = _poses_folder(tmp_path / "poses")
    with caplog.at_level(logging.INFO, logger="stages.reconstruct.data"):
        scene = load_scene(tmp_path / "poses", max_side=20)
    assert "shrunk to a longest side of 20 px" in caplog.text
    small = [working_size(c, 20) for c in cams]
    assert [(c.width, c.height) for c in small] == [(20, 15), (15, 20), (20, 15)]
    assert scene.train.intr(1) == C.Intrinsics(15, 20, 17.5, 17.75, 7.5, 10.0)
    box = np.asarray(Image.fromarray(imgs[1]).resize((15, 20), Image.Resampling.BOX))
    assert torch.equal(scene.train.image(1), torch.from_numpy(box.copy()))
    assert load_scene(tmp_path / "poses", max_side=40).train.intr(0) == cams[0]  # no larger than that: as is


def test_load_scene_names_the_image_that_does_not_match_its_camera(tmp_path):
    _poses_folder(tmp_path / "poses")
    Image.new("RGB", (40, 30)).save(tmp_path / "poses" / "images" / "v1.png")  # its camera is portrait
    with pytest.raises(ValueError, match=r"v1.png: image is 40x30, its camera in transforms.json says 30x40"):
        load_scene(tmp_path / "poses")


def test_point_ply_readers_agree_and_an_empty_file_gives_no_points(tmp_path):
    from stages.importers.stage import write_empty_ply
    from stages.poses import write_ply

    xyz = np.random.default_rng(0).normal(size=(50, 3))
    rgb = np.random.default_rng(1).integers(0, 256, (50, 3))
    write_ply(tmp_path / "bin.ply", xyz, rgb)  # open3d: binary little-endian doubles
    lines = ["ply", "format ascii 1.0", "element vertex 50", "property float x", "property float y",
             "property float z", "property uint8 red", "property uint8 green", "property uint8 blue",
             "end_header"] + [f"{a:8f} {b:8f} {c:8f} {r} {g} {bl}" for (a, b, c), (r, g, bl) in zip(xyz, rgb)]
    (tmp_path / "ascii.ply").write_text("\n".join(lines) + "\n")  # nerfstudio's sparse_pc.ply layout
    for name, atol in (("bin.ply", 0.0), ("ascii.ply", 5e-7)):  # ascii: 6 decimals
        got_xyz, got_rgb = read_points_ply(tmp_path / name)
        np.testing.assert_allclose(got_xyz, xyz, rtol=0, atol=atol)
        np.testing.assert_array_equal(got_rgb, rgb)
    write_empty_ply(tmp_path / "empty.ply")
    assert read_points_ply(tmp_path / "empty.ply")[0].shape == (0, 3)
    (tmp_path / "bad.ply").write_text("ply\nformat binary_big_endian 1.0\nelement vertex 1\nproperty float x\n"
                                      "property float y\nproperty float z\nend_header\n")
    with pytest.raises(ValueError, match="binary_big_endian.*not supported"):
        read_points_ply(tmp_path / "bad.ply")
