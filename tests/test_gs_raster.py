"""The 3DGS rasterizer's PyTorch twins (kernels/_gs_reference.py) and public ops (kernels/gaussians.py)
on the CPU: hand-computed cases, a dense autograd formulation, gradcheck, and the input checks."""
from __future__ import annotations

import math

import pytest
import torch

import kernels
from kernels import _gs_reference as ref
from kernels import gaussians

from _gs_scenes import camera, dense_rasterize, gaussians as random_gaussians

EYE = torch.eye(4)[None]


def _K(fx, fy, cx, cy):
    return torch.tensor([[[fx, 0.0, cx], [0.0, fy, cy], [0.0, 0.0, 1.0]]])


def _lists(means2d, radii, depths, width, height, tile_size=16):
    tw, th = -(-width // tile_size), -(-height // tile_size)
    _, isect_ids, flatten_ids = kernels.intersect_tiles(means2d, radii, depths, tile_size, tw, th)
    return kernels.isect_offset_encode(isect_ids, means2d.shape[0], tw, th), flatten_ids


# ---------------------------------------------------------------------------- projection


def test_one_gaussian_projects_to_the_ellipse_derived_by_hand():
    # mean (0.2, -0.1, 2) before an identity camera, fx = fy = 100, principal point (16, 12):
    # pixel = f x / z + c = (26, 7); J = [[f/z, 0, -f x/z^2], [0, f/z, -f y/z^2]] = [[50, 0, -5], [0, 50, 2.5]];
    # Sigma = diag(0.02^2, 0.04^2, 0.01^2), so J Sigma J^T = [[1.0025, -0.00125], [-0.00125, 4.000625]].
    a, b, c = 1.0025 + 0.3, -0.00125, 4.000625 + 0.3  # + eps2d on the diagonal
    det = a * c - b * b
    means = torch.tensor([[0.2, -0.1, 2.0]])
    quats = torch.tensor([[2.0, 0.0, 0.0, 0.0]])  # identity rotation, not unit: normalised inside
    scales = torch.tensor([[0.02, 0.04, 0.01]])
    K = _K(100.0, 100.0, 16.0, 12.0)
    p = kernels.project_gaussians(means, quats, scales, EYE, K, 32, 24, antialiased=True)
    torch.testing.assert_close(p.means2d, torch.tensor([[[26.0, 7.0]]]))
    torch.testing.assert_close(p.depths, torch.tensor([[2.0]]))
    torch.testing.assert_close(p.conics, torch.tensor([[[c / det, -b / det, a / det]]]))
    det_orig = 1.0025 * 4.000625 - b * b
    torch.testing.assert_close(p.compensations, torch.tensor([[math.sqrt(det_orig / det)]]))
    # box half-sizes ceil(3.33 sqrt(Sigma_ii)): ceil(3.8004) = 4, ceil(6.9057) = 7
    assert p.radii.tolist() == [[7]]
    per_axis = kernels.project_gaussians(means, quats, scales, EYE, K, 32, 24, radii_per_axis=True)
    assert per_axis.radii.tolist() == [[[4, 7]]] and per_axis.compensations is None
    # opacity 0.05: the box shrinks to alpha's 1/255 contour, sqrt(2 ln(0.05 * 255)) = 2.2563 sigmas
    tight = kernels.project_gaussians(means, quats, scales, EYE, K, 32, 24, radii_per_axis=True,
                                      opacities=torch.tensor([0.05]))
    assert tight.radii.tolist() == [[[math.ceil(2.2563 * math.sqrt(a)), math.ceil(2.2563 * math.sqrt(c))]]] == [[[3, 5]]]
    # a quarter turn about z (w = cos 45, z = sin 45) swaps the x and y extents
    turn = torch.tensor([[math.cos(math.pi / 4), 0.0, 0.0, math.sin(math.pi / 4)]])
    q = kernels.project_gaussians(means, turn, scales, EYE, K, 32, 24)
    ca, cc = 4.0 + 0.0025 + 0.3, 1.0 + 0.000625 + 0.3
    cb = 0.00125  # the xz and yz terms: -5 * 2.5 * 0.01^2 has the same magnitude, Sigma_xy = 0 still
    torch.testing.assert_close(q.conics[0, 0, [0, 2]], torch.tensor([cc, ca]) / (ca * cc - cb * cb), rtol=1e-5, atol=0)


def test_culling_near_far_offscreen_clip_opacity_degenerate():
    K = _K(100.0, 100.0, 16.0, 12.0)
    means = torch.tensor([[0.0, 0.0, 0.005],   # in front of the camera but before near = 0.01
                          [0.0, 0.0, -1.0],    # behind
                          [0.0, 0.0, 5.0],     # beyond far = 4
                          [2.0, 0.0, 2.0],     # projects to x = 116, far right of a 32 px image
                          [0.0, 0.0, 2.0],     # visible
                          [0.0, 0.0, 2.0],     # opacity below 1/255
                          [0.1, 0.0, 2.0]])    # zero scale: a point, det = 0 without the low-pass
    quats = torch.tensor([[1.0, 0.0, 0.0, 0.0]]).repeat(7, 1)
    scales = torch.full((7, 3), 0.02)
    scales[6] = 0.0
    opac = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 0.003, 0.5])
    p = kernels.project_gaussians(means, quats, scales, EYE, K, 32, 24, far=4.0, eps2d=0.0, opacities=opac)
    # visible: 1 px sigma, box ceil(sqrt(2 ln(0.5 * 255)) * 1) = ceil(3.114) = 4
    assert p.radii[0].tolist() == [0, 0, 0, 0, 4, 0, 0]
    assert (p.means2d[0, p.radii[0] == 0] == 0).all() and (p.conics[0, p.radii[0] == 0] == 0).all()
    # radius_clip culls boxes no bigger than it
    assert kernels.project_gaussians(means[4:5], quats[:1], scales[:1], EYE, K, 32, 24,
                                     radius_clip=4.0).radii.tolist() == [[0]]
    # a Gaussian whose box only grazes the image is kept; one whose box ends at the border is not
    p = kernels.project_gaussians(torch.tensor([[-0.36, 0.0, 2.0], [-0.38, 0.0, 2.0]]), quats[:2],
                                  torch.full((2, 3), 0.02), EYE, K, 32, 24, radii_per_axis=True)
    # means2d x = 100 * -0.36 / 2 + 16 = -2 and -3; the box, ceil(3.33 sqrt(1.3)) = 4 px, reaches 2 and 1 > 0
    assert (p.radii[0, :, 0] > 0).tolist() == [True, True]
    far_left = kernels.project_gaussians(torch.tensor([[-0.40, 0.0, 2.0]]), quats[:1], torch.full((1, 3), 0.02),
                                         EYE, K, 32, 24, radii_per_axis=True)
    assert far_left.means2d.sum() == 0 and far_left.radii.tolist() == [[[0, 0]]]  # x = -4, box ends at 0


def test_projection_gradcheck_float64():
    means, quats, scales, *_ = random_gaussians(4, seed=3, depth=(2.0, 3.0), fov=0.3, log_scale=(-3.0, 0.3),
                                                dtype=torch.float64)
    views, Ks = camera(40, 30, 40.0, n=2, seed=1, spread=0.2)
    views, Ks = views.double(), Ks.double()

    def f(m, q, s):
        p = ref.project_gaussians_reference(m, q, s, views, Ks, 40, 30, antialiased=True)
        assert (p.radii > 0).all()
        return p.means2d, p.depths, p.conics, p.compensations

    inputs = tuple(t.clone().requires_grad_() for t in (means, quats, scales))
    assert torch.autograd.gradcheck(f, inputs, fast_mode=True)


# ---------------------------------------------------------------------------- spherical harmonics


def _legendre(l, m, x):
    """Associated Legendre P_l^m(x), m >= 0, with the Condon-Shortley phase (recurrence in l)."""
    pmm = (-1) ** m * math.prod(range(1, 2 * m, 2)) * (1 - x * x) ** (m / 2)
    if l == m:
        return pmm
    pm1 = x * (2 * m + 1) * pmm
    for ll in range(m + 2, l + 1):
        pmm, pm1 = pm1, ((2 * ll - 1) * x * pm1 - (ll + m - 1) * pmm) / (ll - m)
    return pm1


def _real_sh(l, m, theta, phi):
    """Real SH (Condon-Shortley phase, the 3DGS convention) from spherical coordinates."""
    n = math.sqrt((2 * l + 1) / (4 * math.pi) * math.factorial(l - abs(m)) / math.factorial(l + abs(m)))
    p = _legendre(l, abs(m), torch.cos(theta))
    if m == 0:
        return n * p
    trig = torch.cos(m * phi) if m > 0 else torch.sin(-m * phi)
    return math.sqrt(2) * n * p * trig


@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_spherical_harmonics_match_the_legendre_formula(degree):
    g = torch.Generator().manual_seed(degree)
    dirs = torch.randn(64, 3, generator=g, dtype=torch.float64) * 3  # any length: normalised inside
    coeffs = torch.randn(64, 16, 3, generator=g, dtype=torch.float64)
    dirs[0] = torch.tensor([0.0, 0.0, -2.0])  # a pole
    u = dirs / dirs.norm(dim=-1, keepdim=True)
    theta, phi = torch.acos(u[:, 2]), torch.atan2(u[:, 1], u[:, 0])
    basis = torch.stack([_real_sh(l, m, theta, phi) for l in range(degree + 1) for m in range(-l, l + 1)], -1)
    want = (basis[..., None] * coeffs[:, :basis.shape[1]]).sum(1)
    torch.testing.assert_close(ref.spherical_harmonics_reference(degree, dirs, coeffs), want)
    got = kernels.spherical_harmonics(degree, dirs.float(), coeffs.float())
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    d, c = dirs[:6].clone().requires_grad_(), coeffs[:6].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda d, c: ref.spherical_harmonics_reference(degree, d, c), (d, c),
                                    fast_mode=True)


# ---------------------------------------------------------------------------- tiles


def test_intersections_keys_and_offsets_by_hand():
    # 64 x 48 image, 16 px tiles: 4 x 3 tiles (12 -> 4 tile bits), 2 cameras (2 camera bits)
    means2d = torch.tensor([[[20.0, 20.0], [20.0, 20.0], [0.0, 0.0]],
                            [[-30.0, 10.0], [8.0, 8.0], [32.0, 24.0]]])
    radii = torch.tensor([[[5, 5], [1, 1], [0, 0]], [[3, 3], [8, 8], [1, 1]]], dtype=torch.int32)
    depths = torch.tensor([[3.0, 2.0, 1.0], [1.0, 1.5, 2.5]])
    tiles_per_gauss, isect_ids, flatten_ids = kernels.intersect_tiles(means2d, radii, depths, 16, 4, 3)
    # camera 0: Gaussian 0 covers tiles x 0..1, y 0..1 = {0, 1, 4, 5}; Gaussian 1 tile 5 only; 2 culled.
    # camera 1: Gaussian 0 is off the left edge (0 tiles although radius > 0); 1 covers tile 0 (box
    # [0, 16] ends on the tile border); 2 covers tiles x 1..2 of row 1 = {5, 6}.
    assert tiles_per_gauss.tolist() == [[4, 1, 0], [0, 1, 2]]

    def key(cam, tile, depth):
        bits = torch.tensor([depth], dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF
        return (cam << 36) | (tile << 32) | bits

    want = [(0, 0, 3.0, 0), (0, 1, 3.0, 0), (0, 4, 3.0, 0), (0, 5, 2.0, 1), (0, 5, 3.0, 0),  # nearer first
            (1, 0, 1.5, 4), (1, 5, 2.5, 5), (1, 6, 2.5, 5)]
    assert isect_ids.tolist() == [key(c, t, d) for c, t, d, _ in want]
    assert flatten_ids.tolist() == [g for *_, g in want]
    assert flatten_ids.dtype == torch.int32 and isect_ids.dtype == torch.int64
    offsets = kernels.isect_offset_encode(isect_ids, 2, 4, 3)
    assert offsets.tolist() == [[[0, 1, 2, 2], [2, 3, 5, 5], [5, 5, 5, 5]],
                                [[5, 6, 6, 6], [6, 6, 7, 8], [8, 8, 8, 8]]]
    # square radii [C, N] give the same boxes as equal per-axis ones
    square = kernels.intersect_tiles(means2d, radii[..., 0].contiguous(), depths, 16, 4, 3)
    assert all(torch.equal(a, b) for a, b in zip(square, (tiles_per_gauss, isect_ids, flatten_ids)))
    empty = kernels.intersect_tiles(means2d, torch.zeros_like(radii), depths, 16, 4, 3)
    assert empty[1].numel() == 0 and kernels.isect_offset_encode(empty[1], 2, 4, 3).abs().sum() == 0


# ---------------------------------------------------------------------------- blending by hand


def _two_gaussians(depth_a, depth_b):
    means2d = torch.tensor([[[5.5, 7.5], [7.5, 7.5]]])
    conics = torch.tensor([[[0.5, 0.0, 0.5], [0.25, 0.1, 0.5]]])
    colors = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])
    opac = torch.tensor([[0.6, 0.8]])
    radii = torch.tensor([[8, 8]], dtype=torch.int32)
    offsets, flat = _lists(means2d, radii, torch.tensor([[depth_a, depth_b]]), 16, 16)
    return means2d, conics, colors, opac, offsets, flat


def test_two_overlapping_gaussians_composite_in_depth_order():
    bg = torch.tensor([[0.0, 1.0, 0.0]])
    # pixel (x 6, y 8), centre (6.5, 8.5): a is 1 px off in x and y, b is at d = (1, -1):
    # sigma_a = 0.5 (0.5 + 0.5) = 0.5; sigma_b = 0.5 (0.25 + 0.5) + 0.1 * (1)(-1) = 0.275
    al_a, al_b = 0.6 * math.exp(-0.5), 0.8 * math.exp(-0.275)
    for depth_a, depth_b, first, second in ((1.0, 2.0, "a", "b"), (2.0, 1.0, "b", "a")):
        means2d, conics, colors, opac, offsets, flat = _two_gaussians(depth_a, depth_b)
        img, alpha = kernels.rasterize_to_pixels(means2d, conics, colors, opac, 16, 16, 16, offsets, flat,
                                                 backgrounds=bg)
        al = {"a": al_a, "b": al_b}
        col = {"a": torch.tensor([1.0, 0, 0]), "b": torch.tensor([0, 0, 1.0])}
        T = (1 - al[first]) * (1 - al[second])
        want = al[first] * col[first] + (1 - al[first]) * al[second] * col[second] + T * bg[0]
        torch.testing.assert_close(img[0, 8, 6], want)
        torch.testing.assert_close(alpha[0, 8, 6, 0], torch.tensor(1 - T))


def test_transmittance_stop_clamp_and_skip():
    # four flat (conic 0: sigma 0, alpha = opacity) Gaussians over one pixel, opacity 0.95, nearest first:
    # T goes 0.05, 0.0025, 1.25e-4; the fourth would bring it to 6.25e-6 <= 1e-4, so the pixel stops
    n = 4
    means2d = torch.full((1, n, 2), 8.0)
    conics = torch.zeros(1, n, 3)
    colors = torch.eye(n)[None]
    radii = torch.full((1, n), 8, dtype=torch.int32)
    offsets, flat = _lists(means2d, radii, torch.arange(1.0, n + 1)[None], 16, 16)
    img, alpha = kernels.rasterize_to_pixels(means2d, conics, colors, torch.full((1, n), 0.95), 16, 16, 16,
                                             offsets, flat)
    torch.testing.assert_close(img[0, 3, 3], torch.tensor([0.95, 0.05 * 0.95, 0.0025 * 0.95, 0.0]))
    torch.testing.assert_close(alpha[0, 3, 3, 0], torch.tensor(1 - 1.25e-4))
    # opacity 1 clamps alpha at 0.99; 0.0039 < 1/255 is skipped; 0.004 is blended
    for o, want in ((1.0, 0.99), (0.0039, 0.0), (0.004, 0.004)):
        img, alpha = kernels.rasterize_to_pixels(means2d[:, :1], conics[:, :1], colors[:, :1, :1],
                                                 torch.tensor([[o]]), 16, 16, 16, *_lists(means2d[:, :1], radii[:, :1],
                                                                                          torch.ones(1, 1), 16, 16),
                                                 backgrounds=torch.tensor([[0.25]]))
        torch.testing.assert_close(img[0, 0, 0, 0], torch.tensor(want + (1 - want) * 0.25))
        torch.testing.assert_close(alpha[0, 0, 0, 0], torch.tensor(want))


def test_the_alpha_clamp_is_a_choice():
    """alpha_max: 0.99 by default (the 3DGS reference), 0.999 renders as gsplat clamps; a clamped
    alpha is a constant, so the opacity gets no gradient there, and an unclamped one does."""
    means2d, conics, colors = torch.full((1, 1, 2), 8.0), torch.zeros(1, 1, 3), torch.ones(1, 1, 1)
    radii = torch.full((1, 1), 8, dtype=torch.int32)
    lists = _lists(means2d, radii, torch.ones(1, 1), 16, 16)
    bg = torch.tensor([[0.25]])
    for opacity, alpha_max, want in ((1.0, 0.99, 0.99), (1.0, 0.999, 0.999), (0.995, 0.99, 0.99),
                                     (0.995, 0.999, 0.995)):
        o = torch.tensor([[opacity]], requires_grad=True)
        img, alpha = kernels.rasterize_to_pixels(means2d, conics, colors, o, 16, 16, 16, *lists, backgrounds=bg,
                                                 alpha_max=alpha_max)
        torch.testing.assert_close(img[0, 0, 0, 0], torch.tensor(want + (1 - want) * 0.25))
        torch.testing.assert_close(alpha[0, 0, 0, 0], torch.tensor(want))
        (g,) = torch.autograd.grad(img[0, 0, 0, 0], o)
        # d colour / d alpha = colour - background = 0.75 where alpha = opacity, 0 where clamped
        torch.testing.assert_close(g[0, 0], torch.tensor(0.0 if want == alpha_max else 0.75))
    for bad in (1.0, 0.003, True, float("nan")):
        with pytest.raises(ValueError, match=r"alpha_max must be a number in \(1/255, 1\)"):
            kernels.rasterize_to_pixels(means2d, conics, colors, torch.ones(1, 1), 16, 16, 16, *lists,
                                        alpha_max=bad)


def test_render_modes_and_background():
    # one Gaussian 3 units ahead; with a flat conic every pixel of the tile sees alpha = opacity
    means = torch.tensor([[0.0, 0.0, 3.0]])
    quats = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    scales = torch.full((1, 3), 10.0)  # huge: alpha ~ opacity over the whole 16 x 16 image
    K = _K(20.0, 20.0, 8.0, 8.0)
    rgb = torch.tensor([[0.2, 0.4, 0.6]])
    bg = torch.tensor([[1.0, 0.0, 0.5]])
    common = dict(backgrounds=bg)
    args = (means, quats, scales, torch.tensor([0.5]), rgb, EYE, K, 16, 16)
    img, alpha, meta = kernels.rasterization(*args, render_mode="RGB", **common)
    a = alpha[0, 5, 7, 0]
    assert 0.49 < a <= 0.5
    torch.testing.assert_close(img[0, 5, 7], a * rgb[0] + (1 - a) * bg[0])
    d, _, _ = kernels.rasterization(*args, render_mode="D", **common)
    torch.testing.assert_close(d[0, 5, 7, 0], a * 3.0)  # depth channel: background 0
    ed, _, _ = kernels.rasterization(*args, render_mode="ED", **common)
    torch.testing.assert_close(ed[0, 5, 7, 0], torch.tensor(3.0))
    both, _, _ = kernels.rasterization(*args, render_mode="RGB+D", **common)
    torch.testing.assert_close(both[0, 5, 7], torch.cat([img[0, 5, 7], a[None] * 3.0]))
    both_e, _, _ = kernels.rasterization(*args, render_mode="RGB+ED", **common)
    torch.testing.assert_close(both_e[0, 5, 7], torch.cat([img[0, 5, 7], torch.tensor([3.0])]))
    assert meta["n_intersections"] == 1 and meta["isect_offsets"].shape == (1, 1, 1)


def test_sh_colours_in_rasterization():
    # degree 0: colour = C0 * coeff + 0.5, clamped at 0
    means = torch.tensor([[0.0, 0.0, 3.0]])
    args = (means, torch.tensor([[1.0, 0, 0, 0]]), torch.full((1, 3), 10.0), torch.tensor([0.5]))
    sh = torch.tensor([[[1.0, -3.0, 0.0]]])
    img, alpha, _ = kernels.rasterization(*args, sh, EYE, _K(20.0, 20.0, 8.0, 8.0), 16, 16, sh_degree=0)
    want = torch.clamp(ref.SH_C0 * sh[0, 0] + 0.5, min=0)
    torch.testing.assert_close(img[0, 5, 7], alpha[0, 5, 7, 0] * want)


# ---------------------------------------------------------------------------- against the dense formula


def _projected_scene(n, width, height, n_cams, seed, dtype=torch.float32, tile_size=16):
    means, quats, scales, opac, _ = random_gaussians(n, seed=seed, log_scale=(-2.5, 0.6))
    opac[::7] = 0.999  # clamped at 0.99
    means[:3] = torch.tensor([[0.05, 0.0, 2.0], [0.0, 0.04, 2.2], [-0.03, 0.0, 2.4]])  # three opaque
    scales[:3], opac[:3] = 0.12, 0.999  # Gaussians stacked on the optical axis: pixels there stop
    views, Ks = camera(width, height, 0.9 * width, n=n_cams, seed=seed, spread=0.2)
    p = kernels.project_gaussians(means, quats, scales, views, Ks, width, height, opacities=opac, radii_per_axis=True)
    offsets, flat = _lists(p.means2d, p.radii, p.depths, width, height, tile_size)
    g = torch.Generator().manual_seed(seed + 100)
    colors = torch.rand(n_cams, n, 3, generator=g)
    bg = torch.rand(n_cams, 3, generator=g)
    opacs = opac[None].expand(n_cams, n).contiguous()
    return [t.to(dtype) for t in (p.means2d, p.conics, colors, opacs, bg)], offsets, flat


@pytest.mark.parametrize("tile_size", [8, 16, 32])
def test_blending_twin_matches_the_dense_formula(tile_size):
    """Forward (float32) and gradients (float64, random cotangents) of the twin, which culls lists
    to 4x4 sub-tiles, pads them into chunks and has an analytic backward, against autograd through
    the plain per-pixel formula. 2 cameras, 300 Gaussians, a 45 x 37 image (partial tiles)."""
    W, H = 45, 37
    (m, q, c, o, bg), offsets, flat = _projected_scene(300, W, H, 2, seed=tile_size, tile_size=tile_size)
    img, alpha = ref.rasterize_to_pixels_reference(m, q, c, o, W, H, tile_size, offsets, flat, bg)
    stopped = []
    want_img, want_alpha = dense_rasterize(m, q, c, o, W, H, tile_size, offsets, flat, bg, stopped=stopped)
    assert 0.2 < want_alpha.mean() < 0.95  # a scene with both covered and open pixels
    assert torch.stack(stopped).any()  # and pixels that stopped before the end of their list
    # float32: the twin's sigma is a moment expansion around the sub-tile centre, so it rounds
    # differently; the difference stays within a few float32 ulps of values <= 1
    torch.testing.assert_close(img, want_img, rtol=0, atol=2e-6)
    torch.testing.assert_close(alpha, want_alpha, rtol=0, atol=2e-6)
    inputs64 = [t.double().requires_grad_() for t in (m, q, c, o, bg)]
    g = torch.Generator().manual_seed(7)
    g_img, g_alpha = torch.randn(img.shape, generator=g, dtype=torch.float64), torch.randn(alpha.shape, generator=g,
                                                                                          dtype=torch.float64)

    def grads(fn):
        out_img, out_alpha = fn(*inputs64, W, H, tile_size, offsets, flat, inputs64[4])
        return torch.autograd.grad((out_img * g_img).sum() + (out_alpha * g_alpha).sum(), inputs64)

    twin = grads(lambda m, q, c, o, bg, *rest: ref.rasterize_to_pixels_reference(m, q, c, o, *rest[:-1], bg))
    dense = grads(lambda m, q, c, o, bg, *rest: dense_rasterize(m, q, c, o, *rest[:-1], bg))
    for name, a, b in zip(("means2d", "conics", "colors", "opacities", "backgrounds"), twin, dense):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda s, n=name: f"{n}: {s}")  # float64 rounding


def test_blending_gradcheck_float64():
    W = H = 32
    (m, q, c, o, bg), offsets, flat = _projected_scene(6, W, H, 1, seed=11, dtype=torch.float64)
    inputs = [t.clone().requires_grad_() for t in (m, q, c, o, bg)]
    # fast mode: checks the Jacobian along random directions (the full one needs a backward per pixel)
    assert torch.autograd.gradcheck(
        lambda m, q, c, o, bg: ref.rasterize_to_pixels_reference(m, q, c, o, W, H, 16, offsets, flat, bg), inputs,
        fast_mode=True)


def test_absgrad_sums_per_pixel_absolute_gradients():
    W = H = 16
    (m, q, c, o, bg), offsets, flat = _projected_scene(8, W, H, 1, seed=5, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    g_img = torch.randn(1, H, W, 3, generator=g, dtype=torch.float64)
    mm = m.clone().requires_grad_()
    img, _ = ref.rasterize_to_pixels_reference(mm, q, c, o, W, H, 16, offsets, flat, bg, absgrad=True)
    (img * g_img).sum().backward()
    md = m.clone().requires_grad_()
    dense, _ = dense_rasterize(md, q, c, o, W, H, 16, offsets, flat, bg)
    per_pixel = (dense * g_img).sum(-1).reshape(-1)
    want = torch.zeros_like(m)
    for p in range(H * W):  # one backward per pixel: |d(pixel's loss)/d means2d| summed
        (gp,) = torch.autograd.grad(per_pixel[p], md, retain_graph=True)
        want += gp.abs()
    torch.testing.assert_close(mm.absgrad, want, rtol=1e-9, atol=1e-9)
    assert (mm.absgrad >= mm.grad.abs() - 1e-12).all() and (mm.absgrad > mm.grad.abs() + 1e-6).any()


def test_several_cameras_equal_one_call_per_camera():
    means, quats, scales, opac, sh = random_gaussians(120, seed=2, sh_k=9)
    views, Ks = camera(40, 30, 36.0, n=3, seed=4, spread=0.3)
    bg = torch.rand(3, 3, generator=torch.Generator().manual_seed(3))
    params = [t.clone().requires_grad_() for t in (means, quats, scales, opac, sh)]
    kw = dict(sh_degree=2, absgrad=True, render_mode="RGB+D")
    img, alpha, meta = kernels.rasterization(*params, views, Ks, 40, 30, backgrounds=bg, **kw)
    assert img.shape == (3, 30, 40, 4) and meta["n_cameras"] == 3
    cot = torch.randn(img.shape, generator=torch.Generator().manual_seed(0))
    (img * cot).sum().backward()
    multi = [p.grad.clone() for p in params]
    sums = [torch.zeros_like(p) for p in params]
    for i in range(3):
        for p in params:
            p.grad = None
        one, one_alpha, one_meta = kernels.rasterization(*params, views[i:i + 1], Ks[i:i + 1], 40, 30,
                                                         backgrounds=bg[i:i + 1], **kw)
        (one * cot[i:i + 1]).sum().backward()
        torch.testing.assert_close(one, img[i:i + 1])
        torch.testing.assert_close(one_alpha, alpha[i:i + 1])
        assert torch.equal(one_meta["radii"], meta["radii"][i:i + 1])
        # Each entry is a float32 sum over the view's 30 x 40 pixels of terms that the batched call
        # computes in another order: (1) the sum itself, two recursive sums of the same n terms
        # differing by at most n * eps * (the sum of the terms' magnitudes), which is absgrad (Higham,
        # Accuracy and Stability of Numerical Algorithms, eq. 4.4); (2) each term's share of the light
        # behind its Gaussian, a suffix sum over at most N = 120 Gaussians, divided by 1 - alpha
        # (<= 1 / (1 - ALPHA_MAX) = 100 times its rounding). Their bound, (n + N / (1 - ALPHA_MAX)) *
        # eps * absgrad, holds on every CPU whatever its summation order (one of them broke the default
        # float32 tolerance by 60 ulps); a wrong camera's or pixel's terms miss it by orders of magnitude.
        amplify = 1.0 / (1.0 - ref.ALPHA_MAX)
        bound = (30 * 40 + 120 * amplify) * torch.finfo(torch.float32).eps * meta["means2d"].absgrad[i:i + 1]
        for what in ("grad", "absgrad"):
            diff = (getattr(one_meta["means2d"], what) - getattr(meta["means2d"], what)[i:i + 1]).abs()
            assert bool((diff <= bound).all()), f"means2d.{what}, camera {i}: {float((diff - bound).max())} over"
        for s, p in zip(sums, params):
            s += p.grad
    # float32 sums over thousands of pixel terms (random cotangents, so they cancel), accumulated in
    # another order per call: equal up to ~1e-5 of each gradient's largest magnitude
    for name, a, b in zip(("means", "quats", "scales", "opacities", "sh"), multi, sums):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * float(a.abs().max()), msg=lambda m, n=name: f"{n}: {m}")


def test_bad_inputs_raise_value_errors_naming_the_problem():
    means, quats, scales, opac, _ = random_gaussians(10, seed=0)
    rgb = torch.rand(10, 3)
    K = _K(20.0, 20.0, 8.0, 8.0)

    def render(**kw):
        args = dict(means=means, quats=quats, scales=scales, opacities=opac, colors=rgb, viewmats=EYE, Ks=K,
                    width=16, height=16)
        args.update(kw)
        return kernels.rasterization(**args)

    def nan_at(t, i=3):
        t = t.clone()
        t.view(-1)[i] = float("nan")
        return t

    cases = [
        (dict(means=nan_at(means)), "means must be finite"),
        (dict(scales=scales.clone().index_fill_(0, torch.tensor([2]), float("inf"))), "scales must be finite"),
        (dict(quats=nan_at(quats)), "quats must be finite"),
        (dict(quats=quats.clone().index_fill_(0, torch.tensor([4]), 0.0)), "quats must be non-zero"),
        (dict(means=means.double()), "means must be torch.float32"),
        (dict(opacities=opac.half()), "opacities must be torch.float32"),
        (dict(means=means.t().contiguous().t()), "means must be contiguous"),
        (dict(colors=torch.rand(3, 10).t()), "colors must be contiguous"),
        (dict(quats=quats[:, :3].contiguous()), r"quats must have shape \[N, 4\]"),
        (dict(opacities=opac[:9]), r"opacities must have shape \[N\] \(N=10\)"),
        (dict(width=0), "width must be an int >= 1"),
        (dict(height=0), "height must be an int >= 1"),
        (dict(viewmats=torch.eye(4)[None, :3]), r"viewmats must have shape \[C, 4, 4\]"),
        (dict(render_mode="RGBD"), "render_mode must be one of"),
        (dict(tile_size=12), "tile_size must be one of"),
        (dict(near_plane=0.0), "0 < near < far"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            render(**kw)
    with pytest.raises(ValueError, match="sh_degree"):
        render(colors=torch.rand(10, 4, 3), sh_degree=2)
    sh = torch.rand(10, 9, 3)  # SH as a 3DGS model holds them, (sh0, shN): the same render as one tensor
    want = render(colors=sh, sh_degree=2)
    got = render(colors=(sh[:, :1].contiguous(), sh[:, 1:].contiguous()), sh_degree=2)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"colors\[1\] \(shN\) must have shape \[N, K-1, 3\] \(N=10"):
        render(colors=(sh[:, :1].contiguous(), sh[:9, 1:].contiguous()), sh_degree=2)
    with pytest.raises(ValueError, match=r"colors\[0\] \(sh0\) must have shape \[N, 1, 3\]"):
        render(colors=(sh[:, :2].contiguous(), sh[:, 2:].contiguous()), sh_degree=2)
    with pytest.raises(ValueError, match="colors as SH parts must be"):
        render(colors=(sh,), sh_degree=2)
    with pytest.raises(ValueError, match=r"colors must hold K >= .* = 16 SH coefficients, got K=9"):
        render(colors=(sh[:, :1].contiguous(), sh[:, 1:].contiguous()), sh_degree=3)
    with pytest.raises(ValueError, match="coeffs must hold K"):
        kernels.spherical_harmonics(3, torch.rand(5, 3), torch.rand(5, 9, 3))
    with pytest.raises(ValueError, match="degree must be"):
        kernels.spherical_harmonics(4, torch.rand(5, 3), torch.rand(5, 25, 3))
    # the pair a 3DGS model holds (the partitioned renderer passes it): the values of one tensor
    dirs, sh0, shN = torch.randn(10, 3), sh[:, :1].contiguous(), sh[:, 1:].contiguous()
    torch.testing.assert_close(kernels.spherical_harmonics(2, dirs, (sh0, shN)),
                               kernels.spherical_harmonics(2, dirs, sh), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"coeffs\[1\] \(shN\) must have shape \[B0, K-1, 3\]"):
        kernels.spherical_harmonics(2, dirs, (sh0, shN[:9]))
    with pytest.raises(ValueError, match=r"coeffs must hold K >= .* = 16 coefficients for degree 3, got K=9"):
        kernels.spherical_harmonics(3, dirs, (sh0, shN))


def test_intersection_budget_is_checked_before_allocating():
    # 1100 Gaussians each covering all 2048 x 2048 tiles of a 32768^2 image: 4.6e9 intersections
    n = 1100
    means2d = torch.full((1, n, 2), 16384.0)
    radii = torch.full((1, n), 40000, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"exceed the budget of MAX_INTERSECTIONS = 2147483647"):
        kernels.intersect_tiles(means2d, radii, torch.ones(1, n), 16, 2048, 2048)


def test_rasterize_to_pixels_checks_its_lists():
    (m, q, c, o, bg), offsets, flat = _projected_scene(20, 32, 32, 1, seed=1)
    call = lambda **kw: kernels.rasterize_to_pixels(**{**dict(means2d=m, conics=q, colors=c, opacities=o, width=32,
                                                              height=32, tile_size=16, isect_offsets=offsets,
                                                              flatten_ids=flat), **kw})
    call()
    with pytest.raises(ValueError, match="flatten_ids must lie in"):
        call(flatten_ids=flat.clone().fill_(20))
    with pytest.raises(ValueError, match="isect_offsets must be non-decreasing"):
        call(isect_offsets=offsets.flip(-1).contiguous())
    with pytest.raises(ValueError, match=r"isect_offsets must have shape \[C, tile_height, tile_width\]"):
        call(isect_offsets=offsets[:, :1].contiguous())
    with pytest.raises(ValueError, match="flatten_ids must be torch.int32"):
        call(flatten_ids=flat.long())
    with pytest.raises(ValueError, match="width must be an int >= 1"):
        call(width=0)
