"""The 3DGS rasterizer's CUDA kernels (kernels/_gs_cuda.py, csrc/gaussians_*.cu) against their PyTorch
twins (kernels/_gs_reference.py) on a GPU (marked ``gpu``), and one CPU check: every launch passes
its kernel's C parameter list (a wrong list would hand the GPU garbage without an error).

The kernels are float32 only, so their gradients are compared with the float64 twin's at the
tolerances written next to each comparison (float32 rounding of the kernels' own arithmetic), and
their forwards with the float32 twin's.
"""
from __future__ import annotations

import ctypes
import math
import re

import pytest
import torch

import kernels
from kernels import _driver, _gs_cuda, loader
from kernels import _gs_reference as ref

from _gs_scenes import camera, gaussians
from conftest import requires_gpu

W, H = 100, 75  # partial tiles at every tile size


@pytest.fixture
def cuda():
    if not kernels.available():
        pytest.skip(f"CUDA kernels cannot run here: {kernels.unavailable_reason()}")
    return torch.device("cuda")


def _close(got, want, rtol, atol_scale, what):
    """assert_close with atol = atol_scale * max |want| (gradients span orders of magnitude)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    atol = atol_scale * float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _close_image(got, want, what):
    """Pixels agree to float32 rounding (__expf against exp, sums over a pixel's list), except the
    rare pixel where one (pixel, Gaussian) pair lands within rounding of alpha = 1/255 (or T of
    1e-4) and one side skips it: that pixel moves by at most (1/255) |colour - colour behind|, < 0.02
    here, and such pixels are at most 1e-4 of the image (expected: none or one)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    diff = (got - want).abs()
    tight = 2e-5 * max(1.0, float(want.abs().max()))
    off = int((diff > tight).sum())
    assert off <= max(2, int(1e-4 * diff.numel())), f"{what}: {off} of {diff.numel()} values differ by > {tight:.1e}"
    assert float(diff.max()) < 0.02, f"{what}: max |difference| {float(diff.max()):.3g}"


# ---------------------------------------------------------------------------- CPU: launch arguments

_C_TYPES = {"long long": ctypes.c_int64, "int": ctypes.c_int32, "float": ctypes.c_float}


def _signature(source: str, kernel: str) -> list:
    m = re.search(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?" + re.escape(kernel) + r"\s*\((.*?)\)\s*\{", source, re.S)
    assert m, f"no __global__ {kernel} in the source"
    types = []
    for param in re.sub(r"//[^\n]*", "", m.group(1)).split(","):
        param = param.replace("const", "").strip()
        if "*" in param:
            types.append(ctypes.c_void_p)
        else:
            types.append(next(t for name, t in _C_TYPES.items() if param.startswith(name + " ")))
    return types


def test_launch_arguments_match_the_kernel_signatures(monkeypatch):
    """Run the CUDA path's Python on CPU tensors with launches intercepted: each launch's ctypes
    must be its kernel's parameter types in order. tile_counts' stand-in writes one tile per
    Gaussian so that the emit and finish launches happen too."""
    seen = set()

    def launch(self, name, grid, block, args, device=None, shared_mem=0):
        base = name.split("<")[0]
        assert [t for _, t in args] == _signature(self.source.read_text(), base), f"{name}: argument types differ"
        assert name in self.name_expressions, f"{name} is not among its program's name expressions"
        seen.add(name)
        if base == "tile_counts":
            n = args[0][0]
            (ctypes.c_int32 * n).from_address(args[-1][0])[:] = [1] * n

    monkeypatch.setattr(_driver.KernelProgram, "launch", launch)
    monkeypatch.setattr(_driver.KernelProgram, "set_max_dynamic_shared", lambda *a, **k: None)
    monkeypatch.setattr(kernels.gaussians, "_use_cuda", lambda device: True)
    means, quats, scales, opac, sh = (t.requires_grad_() for t in gaussians(5, seed=0))
    views, Ks = camera(16, 16, 20.0, n=2, spread=0.1)
    for mode, ts, sort in (("RGB", 16, "torch"), ("RGB+D", 8, "radix"), ("D", 32, "torch"), ("RGB+ED", 16, "torch16")):
        monkeypatch.setattr(_gs_cuda, "SORT", sort)
        img, alpha, meta = kernels.rasterization(means, quats, scales, opac, sh, views, Ks, 16, 16, sh_degree=3,
                                                 render_mode=mode, backgrounds=torch.rand(2, 3), tile_size=ts,
                                                 absgrad=True, antialiased=True)
        (img.sum() + alpha.sum()).backward()
    colors = torch.rand(2, 5, 6, requires_grad=True)  # 6 channels: two launches of 4 and 2
    img, _ = kernels.rasterize_to_pixels(meta["means2d"].detach(), meta["conics"].detach(), colors,
                                         meta["opacities"].detach(), 16, 16, 16, torch.zeros(2, 1, 1, dtype=torch.int32),
                                         torch.zeros(0, dtype=torch.int32))
    img.sum().backward()
    kernels.intersect_tiles(meta["means2d"].detach(), meta["radii"], meta["depths"].detach(), 16, 1, 1)
    kernels.isect_offset_encode(meta["isect_ids"], 2, 1, 1)
    kernels.spherical_harmonics(2, torch.rand(3, 3, requires_grad=True), torch.rand(3, 9, 3)).sum().backward()
    # the check kernel's flags decide (its stand-in above flags nothing): bit 1 is the means' message
    monkeypatch.setattr(_gs_cuda, "check_inputs", lambda *a: 1)
    with pytest.raises(ValueError, match="means must be finite"):
        kernels.rasterization(means, quats, scales, opac, sh, views, Ks, 16, 16, sh_degree=3)
    everything = {n for p in _gs_cuda.default_programs() for n in p.name_expressions}
    assert seen == everything, f"never launched: {sorted(everything - seen)}"


# ---------------------------------------------------------------------------- projection


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("antialiased", [False, True])
def test_projection_matches_the_twin(cuda, antialiased):
    means, quats, scales, opac, _ = gaussians(4000, seed=1, depth=(0.3, 9.0), fov=0.9, log_scale=(-3.0, 0.8))
    means[:40, 2] = -1.0  # behind the camera; depth 0.3 .. 9 straddles near 0.5 and far 8; fov 0.9 goes off-screen
    views, Ks = camera(200, 150, 160.0, n=3, seed=2, spread=0.3)
    kw = dict(eps2d=0.3, near=0.5, far=8.0, radius_clip=0.5, antialiased=antialiased, radii_per_axis=True)
    gpu = [t.to(cuda).requires_grad_() for t in (means, quats, scales)]
    p = kernels.project_gaussians(*gpu, views.to(cuda), Ks.to(cuda), 200, 150, opacities=opac.to(cuda), **kw)
    r = ref.project_gaussians_reference(means, quats, scales, views, Ks, 200, 150, opacities=opac, **kw)
    d = [t.double().requires_grad_() for t in (means, quats, scales)]
    r64 = ref.project_gaussians_reference(*d, views.double(), Ks.double(), 200, 150, opacities=opac.double(), **kw)
    radii, want_radii = p.radii.cpu(), r.radii
    # a box half-size is a ceil(): where the float32 value sits within an ulp of an integer the kernel
    # and the twin (other summation order, CUDA's logf / sqrtf) may round to neighbours
    differ = (radii != want_radii).any(-1)
    assert differ.float().mean() <= 2e-3, f"{int(differ.sum())} of {differ.numel()} radii differ"
    seen_by_both = (radii > 0).all(-1) & (want_radii > 0).all(-1)
    assert ((radii - want_radii).abs()[seen_by_both] <= 1).all()
    both = (radii > 0).all(-1) & (want_radii > 0).all(-1) & ~differ & (r64.radii == want_radii).all(-1)
    assert 0.3 < both.float().mean() < 0.95, "the scene should have visible and culled Gaussians"
    # culled entries are zeros in the kernel's outputs, as in the twin's
    culled = (radii == 0).all(-1)
    assert (p.means2d.cpu()[culled] == 0).all() and (p.conics.cpu()[culled] == 0).all()
    # float32 throughout; means2d (pixels, up to ~200): a few ulps; conics: det = ac - b^2 cancels for
    # thin ellipses (relative rounding up to ~1e-3 of the conic)
    _close(p.means2d.cpu()[both], r.means2d[both], 1e-5, 1e-6, "means2d")
    _close(p.depths.cpu()[both], r.depths[both], 1e-6, 1e-7, "depths")
    _close(p.conics.cpu()[both], r.conics[both], 2e-3, 1e-6, "conics")
    if antialiased:
        # in [0, 1]; det(Sigma2d) without the low-pass cancels more (thin ellipses): 1e-5 absolute
        _close(p.compensations.cpu()[both], r.compensations[both], 1e-4, 1e-5, "compensations")
    # backward: random cotangents on the entries both keep, against the float64 twin
    g = torch.Generator().manual_seed(3)
    cot = [torch.randn(t.shape, generator=g) * (both[..., None] if t.ndim == 3 else both) for t in
           (r.means2d, r.depths, r.conics)]
    outs = [p.means2d, p.depths, p.conics]
    if antialiased:
        cot.append(torch.randn(r.depths.shape, generator=g) * both)
        outs.append(p.compensations)
    got = torch.autograd.grad(sum((o * c.to(cuda)).sum() for o, c in zip(outs, cot)), gpu)
    outs64 = [r64.means2d, r64.depths, r64.conics] + ([r64.compensations] if antialiased else [])
    want = torch.autograd.grad(sum((o * c.double()).sum() for o, c in zip(outs64, cot)), d)
    # float32 kernel vs float64: the conics' cancellation (above) bounds the relative error, ~2e-3
    for name, a, b in zip(("means", "quats", "scales"), got, want):
        _close(a, b, 2e-3, 1e-4, f"d/d{name}")


# ---------------------------------------------------------------------------- spherical harmonics


def _same_as_the_pair(degree, d, c, out, cot, got):
    """3DGS's pair (sh0 [N, 1, 3], shN [N, K - 1, 3]), each read where it lies, gives the colours
    ``out`` and the gradients ``got`` (d/ddirs, d/dcoeffs) of one [N, K, 3] tensor ``c``, bit for bit."""
    c0, cr = c.detach()[:, :1].clone().requires_grad_(), c.detach()[:, 1:].clone().requires_grad_()
    out_p = kernels.gaussians._sh(degree, d, (c0, cr))
    torch.testing.assert_close(out_p, out, rtol=0, atol=0)
    got_p = torch.autograd.grad((out_p * cot).sum(), (d, c0, cr))
    torch.testing.assert_close(got_p[0], got[0], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(got_p[1:], 1), got[1], rtol=0, atol=0)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("degree", [0, 1, 2, 3])
def test_spherical_harmonics_match_the_twin(cuda, degree):
    g = torch.Generator().manual_seed(degree)
    dirs = torch.randn(3, 500, 3, generator=g) * 2
    coeffs = torch.randn(500, 16, 3, generator=g)
    d, c = dirs.to(cuda).requires_grad_(), coeffs.to(cuda).requires_grad_()
    # the public op: one coefficient set per direction
    per_item = c[None].expand(3, 500, 16, 3).contiguous()
    out = kernels.spherical_harmonics(degree, d, per_item)
    _close(out, ref.spherical_harmonics_reference(degree, dirs, coeffs[None].expand(3, 500, 16, 3)), 1e-5, 1e-6,
           "colours")
    # and one pair (sh0, shN) per direction, as the partitioned renderer passes a model's
    pair = (per_item[..., :1, :].contiguous(), per_item[..., 1:, :].contiguous())
    torch.testing.assert_close(kernels.spherical_harmonics(degree, d, pair), out, rtol=0, atol=0)
    # the rasterizer's: [N, K, 3] sets broadcast over [C, N] directions
    out_b = kernels.gaussians._sh(degree, d, c)
    torch.testing.assert_close(out_b, out)
    cot = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad((out_b * cot.to(cuda)).sum(), (d, c))
    d64, c64 = dirs.double().requires_grad_(), coeffs.double().requires_grad_()
    want = torch.autograd.grad((ref.spherical_harmonics_reference(degree, d64, c64) * cot.double()).sum(), (d64, c64),
                               allow_unused=True, materialize_grads=True)  # degree 0 ignores the directions
    _close(got[0], want[0], 1e-4, 1e-6, "d/ddirs")  # float32 sums of <= 16 terms
    _close(got[1], want[1], 1e-4, 1e-6, "d/dcoeffs")
    assert (got[1][:, (degree + 1) ** 2:] == 0).all()
    _same_as_the_pair(degree, d, c, out_b, cot.to(cuda), got)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("n_sets, n_cams, degree", [(37, 5, 3), (300, 2, 1), (65, 1, 2)])
def test_spherical_harmonics_across_blocks(cuda, n_sets, n_cams, degree):
    """The SH kernels run three threads an item in blocks of 192 (64 items), and sh_bwd sums an
    item's direction gradient over its threads in shared memory: fewer sets than a block,
    broadcast over cameras (sh_bwd loops over them), a count that leaves a partial last block, one
    set past a block. Colours and both gradients against the twin in float64."""
    g = torch.Generator().manual_seed(n_sets)
    dirs = torch.randn(n_cams, n_sets, 3, generator=g)
    coeffs = torch.randn(n_sets, 16, 3, generator=g)
    d, c = dirs.to(cuda).requires_grad_(), coeffs.to(cuda).requires_grad_()
    out = kernels.gaussians._sh(degree, d, c)
    cot = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad((out * cot.to(cuda)).sum(), (d, c))
    d64, c64 = dirs.double().requires_grad_(), coeffs.double().requires_grad_()
    want_out = ref.spherical_harmonics_reference(degree, d64, c64)
    want = torch.autograd.grad((want_out * cot.double()).sum(), (d64, c64))
    _close(out, want_out, 1e-5, 1e-6, "colours")
    _close(got[0], want[0], 1e-4, 1e-6, "d/ddirs")
    _close(got[1], want[1], 1e-4, 1e-6, "d/dcoeffs")
    assert (got[1][:, (degree + 1) ** 2:] == 0).all()
    _same_as_the_pair(degree, d, c, out, cot.to(cuda), got)


# ---------------------------------------------------------------------------- tiles


def _projected(n, seed, n_cams=2, width=W, height=H, log_scale=(-2.6, 0.7), device="cpu"):
    means, quats, scales, opac, sh = gaussians(n, seed=seed, log_scale=log_scale)
    views, Ks = camera(width, height, 0.9 * width, n=n_cams, seed=seed, spread=0.25)
    p = ref.project_gaussians_reference(means, quats, scales, views, Ks, width, height, opacities=opac,
                                        radii_per_axis=True)
    return p, opac[None].expand(n_cams, n).contiguous()


@pytest.mark.parametrize("ids", [2**15 - 1, 300])
def test_int16_key_sort_equals_the_int32_sort(ids):
    """SORT = "torch16": tile_emit's int32 keys narrowed to int16, sorted, widened back, give the
    keys and the permutation of the stable int32 sort (ties in input order), with a fixed budget's
    padding tail last; 300 ids make long runs of equal keys, 2^15 - 1 the widest key space it takes."""
    g = torch.Generator().manual_seed(ids)
    v = torch.cat([torch.randint(0, ids, (20000,), generator=g, dtype=torch.int32),
                   torch.tensor([0, ids - 1], dtype=torch.int32)])
    keys = torch.cat([v + (-2**31), torch.full((777,), _gs_cuda._PAD_KEY, dtype=torch.int32)])  # (id) ^ 0x80000000
    keys = keys[torch.randperm(keys.numel(), generator=g)]
    real = int((keys != _gs_cuda._PAD_KEY).sum())
    want_keys, want_perm = torch.sort(keys, stable=True)
    got_keys, got_perm = _gs_cuda.sort_keys_int16(keys)
    assert got_keys.dtype == torch.int32 and got_perm.dtype == torch.int64
    assert torch.equal(got_perm, want_perm)
    assert torch.equal(got_keys[:real], want_keys[:real])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("M,bits", [(1, 3), (4095, 9), (4096, 14), (123457, 14), (50000, 21), (70000, 31)])
def test_radix_sort_equals_a_stable_torch_sort(cuda, M, bits):
    """The binning's own sort (csrc/gaussians_tiles.cu) on keys with many duplicates: same keys and
    the values in the order a stable sort leaves them (M not a multiple of the 4096 keys a block sorts)."""
    g = torch.Generator().manual_seed(M)
    used = min(bits, 12)  # few distinct keys: long runs of equal ones
    low = torch.randint(0, 2**used, (M,), generator=g) << (bits - used)
    keys = (low ^ 0x80000000).to(torch.int64).sub(2**32 * (low ^ 0x80000000 >= 2**31)).to(torch.int32)
    values = torch.arange(M, dtype=torch.int32)
    got_keys, got_values = _gs_cuda._radix_sort(keys.to(cuda), values.to(cuda), bits)
    want_keys, perm = torch.sort(keys, stable=True)
    assert torch.equal(got_keys.cpu(), want_keys) and torch.equal(got_values.cpu(), values[perm])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("sort", ["torch", "torch16", "radix"])
@pytest.mark.parametrize("tile_size", [8, 16, 32])
def test_intersections_and_offsets_equal_the_twin(cuda, tile_size, sort, monkeypatch):
    monkeypatch.setattr(_gs_cuda, "SORT", sort)
    p, _ = _projected(3000, seed=tile_size)
    tw, th = -(-W // tile_size), -(-H // tile_size)
    for radii in (p.radii, p.radii.amax(-1).contiguous()):  # per axis and square
        want = ref.intersect_tiles_reference(p.means2d, radii, p.depths, tile_size, tw, th)
        got = kernels.intersect_tiles(p.means2d.to(cuda), radii.to(cuda), p.depths.to(cuda), tile_size, tw, th)
        for name, a, b in zip(("tiles_per_gauss", "isect_ids", "flatten_ids"), got, want):
            assert torch.equal(a.cpu(), b), f"{name} differs from the twin (tile size {tile_size}, {sort} sort)"
        offsets = kernels.isect_offset_encode(got[1], 2, tw, th)
        assert torch.equal(offsets.cpu(), ref.isect_offset_encode_reference(want[1], 2, tw, th))
    none = kernels.intersect_tiles(p.means2d.to(cuda), torch.zeros_like(p.radii).to(cuda), p.depths.to(cuda),
                                   tile_size, tw, th)
    assert none[1].numel() == 0 and kernels.isect_offset_encode(none[1], 2, tw, th).abs().sum() == 0


@pytest.mark.gpu
@requires_gpu
def test_rasterizer_binning_drops_only_tiles_alpha_cannot_reach(cuda):
    """The rasterizer's own binning (conics and opacities given) keeps a subset of the box's tiles,
    and every tile it drops has alpha < 1/255 at all its pixel centres."""
    p, opac = _projected(2000, seed=5, log_scale=(-2.2, 0.9))
    ts, tw, th = 16, -(-W // 16), -(-H // 16)
    args = [t.to(cuda) for t in (p.means2d, p.radii, p.depths)]
    box = _gs_cuda.bin_tiles(*args, ts, tw, th, lambda m: None)
    exact = _gs_cuda.bin_tiles(*args, ts, tw, th, lambda m: None, W, H, p.conics.to(cuda), opac.to(cuda))

    def pairs(out):
        ids, flat = out[1].cpu(), out[2].cpu().long()
        return set(zip(((ids >> 32)).tolist(), flat.tolist()))

    kept, full = pairs(exact), pairs(box)
    assert kept <= full and len(kept) < 0.9 * len(full), (len(kept), len(full))
    assert torch.equal(exact[0].cpu() <= box[0].cpu(), torch.ones_like(box[0].cpu(), dtype=torch.bool))
    _, tile_bits = ref.key_bits(2, tw * th)
    dropped = torch.tensor(sorted(full - kept))
    cam, tile, g = dropped[:, 0] >> tile_bits, dropped[:, 0] & ((1 << tile_bits) - 1), dropped[:, 1]
    ys, xs = torch.meshgrid(torch.arange(ts), torch.arange(ts), indexing="ij")
    px = ((tile % tw) * ts)[:, None] + xs.reshape(1, -1) + 0.5
    py = ((tile // tw) * ts)[:, None] + ys.reshape(1, -1) + 0.5
    inside = (px < W) & (py < H)
    m, q, o = p.means2d.reshape(-1, 2)[g], p.conics.reshape(-1, 3)[g], opac.reshape(-1)[g]
    dx, dy = m[:, :1] - px, m[:, 1:] - py
    sigma = 0.5 * (q[:, :1] * dx * dx + q[:, 2:] * dy * dy) + q[:, 1:2] * dx * dy
    alpha = torch.where(inside, o[:, None] * torch.exp(-sigma), 0.0)
    assert (alpha < ref.ALPHA_MIN).all(), f"a dropped tile had alpha {float(alpha.max())} >= 1/255"
    assert (cam < 2).all()


# ---------------------------------------------------------------------------- blending


def _lists(p, tile_size, width=W, height=H):
    tw, th = -(-width // tile_size), -(-height // tile_size)
    _, isect_ids, flat = ref.intersect_tiles_reference(p.means2d, p.radii, p.depths, tile_size, tw, th)
    return ref.isect_offset_encode_reference(isect_ids, p.depths.shape[0], tw, th), flat


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("tile_size,D,background,alpha_max", [(16, 3, True, 0.99), (16, 1, False, 0.99),
                                                               (8, 4, True, 0.99), (32, 2, False, 0.99),
                                                               (16, 6, True, 0.99), (16, 3, True, 0.999)])
def test_blending_matches_the_twin(cuda, tile_size, D, background, alpha_max):
    """Same lists into both; forward against the float32 twin, backward (random cotangents on colour
    and alpha) against the float64 twin. D = 6 runs as two launches (4 + 2 channels); alpha_max
    0.999 (gsplat's clamp) is a program of its own."""
    p, opac = _projected(3000, seed=D + tile_size, log_scale=(-3.2, 0.6))
    opac = opac.clone()
    opac[:, ::9] = 0.999 if alpha_max == 0.99 else 0.9995  # clamped: saturated pixels that stop early
    offsets, flat = _lists(p, tile_size)
    g = torch.Generator().manual_seed(1)
    colors = torch.rand(2, 3000, D, generator=g)
    bg = torch.rand(2, D, generator=g) if background else None
    cpu_in = [p.means2d, p.conics, colors, opac] + ([bg] if background else [])
    gpu_in = [t.to(cuda).requires_grad_() for t in cpu_in]
    gm, gq, gc, go, *gb = gpu_in
    img, alpha = kernels.rasterize_to_pixels(gm, gq, gc, go, W, H, tile_size, offsets.to(cuda), flat.to(cuda),
                                             gb[0] if gb else None, absgrad=D <= 4, alpha_max=alpha_max)
    want_img, want_alpha = ref.rasterize_to_pixels_reference(*cpu_in[:4], W, H, tile_size, offsets, flat,
                                                             bg if background else None, alpha_max=alpha_max)
    assert 0.3 < float(want_alpha.mean()) < 0.97
    _close_image(img, want_img, "colours")
    _close_image(alpha, want_alpha, "alphas")
    cot_img, cot_alpha = torch.randn(img.shape, generator=g), torch.randn(alpha.shape, generator=g)
    got = torch.autograd.grad((img * cot_img.to(cuda)).sum() + (alpha * cot_alpha.to(cuda)).sum(), gpu_in)
    d64 = [t.double().requires_grad_() for t in cpu_in]
    r_img, r_alpha = ref.rasterize_to_pixels_reference(*d64[:4], W, H, tile_size, offsets, flat,
                                                       d64[4] if background else None, absgrad=D <= 4,
                                                       alpha_max=alpha_max)
    want = torch.autograd.grad((r_img * cot_img.double()).sum() + (r_alpha * cot_alpha.double()).sum(), d64)
    # float32 sums of hundreds of pixel terms per Gaussian (atomics in any order) and T recovered by
    # dividing by 1 - alpha (up to 100x per step near saturation): 1e-3 relative, 1e-4 of the largest
    for name, a, b in zip(("means2d", "conics", "colors", "opacities", "backgrounds"), got, want):
        _close(a, b, 1e-3, 1e-4, f"d/d{name}")
    if D <= 4:
        _close(gm.absgrad, d64[0].absgrad, 1e-3, 1e-4, "absgrad")


# ---------------------------------------------------------------------------- end to end


def _scene_inputs(n, width, height, n_cams, seed):
    means, quats, scales, opac, sh = gaussians(n, seed=seed, log_scale=(-3.5 - math.log(n / 2000) / 3, 0.6))
    views, Ks = camera(width, height, 0.9 * width, n=n_cams, seed=seed, spread=0.25)
    bg = torch.rand(n_cams, 3, generator=torch.Generator().manual_seed(seed))
    return (means, quats, scales, opac, sh), views, Ks, bg


def _render_and_grads(leaves, views, Ks, bg, width, height, dev, weights=None, weight_seed=0, **kw):
    """Render ``leaves`` (copied to ``dev`` as leaf tensors) and backpropagate sum(img * weights):
    (img, alpha, meta, grads, weights). Without ``weights`` they are drawn (``weight_seed``) for this
    image's shape, and an expected-depth channel (D / alpha, ill-conditioned where alpha is small) keeps
    them only on the pixels whose alpha > 0.5."""
    params = [t.detach().clone().to(dev).requires_grad_() for t in leaves]
    img, alpha, meta = kernels.rasterization(*params, views.to(dev), Ks.to(dev), width, height, sh_degree=3,
                                             backgrounds=bg.to(dev), **kw)
    if weights is None:
        weights = torch.randn(img.shape, generator=torch.Generator().manual_seed(weight_seed))
        weights[..., 3:] *= (alpha.detach().cpu() > 0.5)
    (img * weights.to(dev)).sum().backward()
    return img, alpha, meta, [t.grad for t in params], weights


def _render_both(n, width, height, n_cams, seed, cuda, **kw):
    """Render on the CPU (twins) and on the GPU (kernels) and backpropagate the same loss
    (:func:`_render_and_grads`, the weights drawn on the CPU side)."""
    leaves, views, Ks, bg = _scene_inputs(n, width, height, n_cams, seed)
    *cpu, weights = _render_and_grads(leaves, views, Ks, bg, width, height, "cpu", weight_seed=seed + 1, **kw)
    *gpu, _ = _render_and_grads(leaves, views, Ks, bg, width, height, cuda, weights, **kw)
    return tuple(cpu), tuple(gpu)


GRAD_RTOL, GRAD_ATOL = 2e-3, 1e-4  # float32 both: see the projection and blending tests


def _row_mismatch(got, want, rtol=GRAD_RTOL, atol_scale=GRAD_ATOL):
    """[N] bool: the Gaussians (first axis) with a coordinate outside _close's tolerance."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    bad = (got - want).abs() > atol_scale * float(want.abs().max()) + rtol * want.abs()
    return bad.reshape(bad.shape[0], -1).any(1)


def _means2d_grad(meta):
    """The view-space mean gradient, Gaussians first ([N, C, 2])."""
    return meta["means2d"].grad.transpose(0, 1)


def _threshold_rows(n, width, height, n_cams, seed, cpu_grads, perturbations=((2**-22, 2), (2**-20, 2))):
    """[N] bool: the Gaussians whose twin gradients jump when the inputs move by a few float32 ulps.

    A (pixel, Gaussian) pair within rounding of the 1/255 alpha cut (or of the 1e-4 transmittance
    stop) is kept by one evaluation and skipped by another, and the gradient of that Gaussian jumps
    by its whole share of the pixel: the gradient is discontinuous there, and two correct float32
    evaluations (the kernels with __expf, the twin with exp) need not agree. These rows are found
    from the twin alone, on the CPU, by rendering again with every input scaled by
    (1 + eps * N(0, 1)) for eps of 2^-22 and 2^-20 (about 2 and 8 ulps), two draws each: a row whose
    gradient then leaves the tolerance sits at such a cut (the view-space mean gradient counts too).
    At 100k Gaussians they are about 0.1 % of the rows (145 of 100,000 with these four draws), and
    the worst of the kernels' 5 coordinates outside the tolerance before this rule (Gaussian 2824's
    d/dmeans, 0.38 off; H200, 2026-12-02) is among them, at 2^-22 already. The GPU's other four have not been looked at one by one. Before the
    view-space mean gradient was part of the rule, one of its rows failed (0.45 relative, H200,
    2026-12-02 evening)."""
    leaves, views, Ks, bg = _scene_inputs(n, width, height, n_cams, seed)
    rows = torch.zeros(n, dtype=torch.bool)
    for k, (eps, draws) in enumerate(perturbations):
        for d in range(draws):
            g = torch.Generator().manual_seed(1000 + 10 * k + d)
            moved = [t * (1 + eps * torch.randn(t.shape, generator=g)) for t in leaves]
            _, _, meta, grads, _ = _render_and_grads(moved, views, Ks, bg, width, height, "cpu", weight_seed=seed + 1)
            for got, want in zip(grads + [_means2d_grad(meta)], cpu_grads):
                rows |= _row_mismatch(got, want)
    return rows


def _compare_renders(cpu, gpu, what, skip_rows=None):
    """Images within _close_image's rule; gradients within GRAD_RTOL / GRAD_ATOL, but for the
    Gaussians of ``skip_rows`` (an [N] bool mask from :func:`_threshold_rows`), which need only be finite."""
    (img, alpha, meta, grads), (gimg, galpha, gmeta, ggrads) = cpu, gpu
    # the GPU bins with the exact tile test, so its lists are shorter; the image is the same
    assert gmeta["n_intersections"] <= meta["n_intersections"]
    assert torch.equal(gmeta["radii"].cpu(), meta["radii"]) or \
        (gmeta["radii"].cpu() != meta["radii"]).float().mean() < 2e-3  # ceil() at an ulp, see projection
    _close_image(gimg[..., :3], img[..., :3], f"{what}: colours")
    _close_image(galpha, alpha, f"{what}: alphas")
    if img.shape[-1] > 3:  # expected depth where it is well conditioned
        covered = alpha[..., 0] > 0.5
        _close(gimg[..., 3].cpu()[covered], img[..., 3][covered], 1e-4, 1e-5, f"{what}: expected depth")
    pairs = list(zip(("means", "quats", "scales", "opacities", "sh"), ggrads, grads))
    pairs.append(("means2d", _means2d_grad(gmeta), _means2d_grad(meta)))
    for name, a, b in pairs:
        if skip_rows is not None:
            assert torch.isfinite(a[skip_rows.to(a.device)]).all(), f"{what}: d/d{name} not finite"
            keep = ~skip_rows
            a, b = a[keep.to(a.device)], b[keep]
        _close(a, b, GRAD_RTOL, GRAD_ATOL, f"{what}: d/d{name}")


def test_threshold_rows_are_few_and_come_from_the_twin_alone():
    """The rows test_many_gaussians leaves out: none without a perturbation (the twin is
    deterministic), a few hundredths of a percent at 2 ulps, at most 0.5 % with the full rule."""
    leaves, views, Ks, bg = _scene_inputs(100_000, 320, 240, 1, 11)
    _, _, meta, grads, _ = _render_and_grads(leaves, views, Ks, bg, 320, 240, "cpu", weight_seed=12)
    grads = grads + [_means2d_grad(meta)]
    assert not _threshold_rows(100_000, 320, 240, 1, 11, grads, perturbations=((0.0, 1),)).any()
    two_ulps = int(_threshold_rows(100_000, 320, 240, 1, 11, grads, perturbations=((2**-22, 1),)).sum())
    full = int(_threshold_rows(100_000, 320, 240, 1, 11, grads).sum())
    print(f"threshold rows: {two_ulps} at 2 ulps, {full} with the full rule")
    assert 0 < two_ulps <= full <= 500, (two_ulps, full)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("mode,sort", [("RGB", "torch"), ("RGB+ED", "torch"), ("RGB", "radix"), ("RGB", "torch16")])
def test_rasterization_end_to_end_matches_the_twin(cuda, mode, sort, monkeypatch):
    """Projection, SH, binning and blending through the public call, several cameras, antialiased."""
    monkeypatch.setattr(_gs_cuda, "SORT", sort)
    cpu, gpu = _render_both(4000, 120, 90, 3, 7, cuda, render_mode=mode, antialiased=True, absgrad=True)
    _compare_renders(cpu, gpu, mode)
    _close(gpu[2]["means2d"].absgrad, cpu[2]["means2d"].absgrad, 2e-3, 1e-4, "absgrad")


@pytest.mark.gpu
@requires_gpu
def test_many_gaussians(cuda):
    """100k Gaussians, one 320 x 240 camera: long tile lists (many batches per block)."""
    cpu, gpu = _render_both(100_000, 320, 240, 1, 11, cuda)
    assert cpu[2]["n_intersections"] > 100_000
    skip = _threshold_rows(100_000, 320, 240, 1, 11, cpu[3] + [_means2d_grad(cpu[2])])
    assert int(skip.sum()) <= 500, f"{int(skip.sum())} Gaussians at an alpha or transmittance cut (expected ~0.1 %)"
    _compare_renders(cpu, gpu, "100k", skip_rows=skip)


@pytest.mark.gpu
@requires_gpu
def test_tiny_scene_gradients_match_float64_twin(cuda):
    """A handful of Gaussians on 32 x 32: kernel gradients (float32) against the float64 twin (the
    kernels have no float64 to gradcheck; the twin is gradchecked in test_gs_raster.py)."""
    means, quats, scales, opac, sh = gaussians(6, seed=4, depth=(2.0, 3.0), fov=0.3, log_scale=(-2.2, 0.3))
    views, Ks = camera(32, 32, 30.0, n=1)
    params = [t.to(cuda).requires_grad_() for t in (means, quats, scales, opac, sh)]
    img, alpha, _ = kernels.rasterization(*params, views.to(cuda), Ks.to(cuda), 32, 32, sh_degree=3)
    cot = torch.randn(img.shape, generator=torch.Generator().manual_seed(0))
    got = torch.autograd.grad((img * cot.to(cuda)).sum(), params)
    d64 = [t.double().requires_grad_() for t in (means, quats, scales, opac, sh)]
    r = ref.project_gaussians_reference(*d64[:3], views.double(), Ks.double(), 32, 32, opacities=d64[3],
                                        radii_per_axis=True)
    campos = torch.linalg.inv(views.double())[:, :3, 3]
    rgb = torch.clamp_min(ref.spherical_harmonics_reference(3, d64[0][None] - campos[:, None], d64[4]) + 0.5, 0)
    offsets, flat = _lists(r, 16, 32, 32)
    img64, _ = ref.rasterize_to_pixels_reference(r.means2d, r.conics, rgb, d64[3][None].expand(1, 6).contiguous(),
                                                 32, 32, 16, offsets, flat)
    _close_image(img, img64, "colours")
    want = torch.autograd.grad((img64 * cot.double()).sum(), d64)
    for name, a, b in zip(("means", "quats", "scales", "opacities", "sh"), got, want):
        _close(a, b, 1e-3, 1e-5, f"d/d{name}")  # float32 arithmetic of a few dozen pixel terms


@pytest.mark.gpu
@requires_gpu
def test_empty_and_all_culled_scenes(cuda):
    views, Ks = camera(40, 30, 36.0, n=2)
    bg = torch.tensor([[0.1, 0.2, 0.3], [1.0, 0.0, 0.5]], device=cuda)
    for n, behind in ((0, False), (50, True)):
        means, quats, scales, opac, _ = gaussians(n, seed=0)
        if behind:
            means[:, 2] = -means[:, 2]  # all behind both cameras
        params = [t.to(cuda).requires_grad_() for t in (means, quats, scales, opac)]
        rgb = torch.rand(n, 3, device=cuda, requires_grad=True)
        img, alpha, meta = kernels.rasterization(*params, rgb, views.to(cuda), Ks.to(cuda), 40, 30, backgrounds=bg)
        assert meta["n_intersections"] == 0 and (meta["radii"] == 0).all()
        torch.testing.assert_close(img, bg[:, None, None, :].expand(2, 30, 40, 3))
        assert (alpha == 0).all()
        (img.sum() + alpha.sum()).backward()
        for t in (*params, rgb):
            assert t.grad is not None and (t.grad == 0).all()


@pytest.mark.gpu
@requires_gpu
def test_several_cameras_equal_one_call_per_camera_on_gpu(cuda):
    means, quats, scales, opac, sh = (t.to(cuda) for t in gaussians(3000, seed=9))
    views, Ks = (t.to(cuda) for t in camera(W, H, 90.0, n=3, seed=9, spread=0.3))
    img, alpha, meta = kernels.rasterization(means, quats, scales, opac, sh, views, Ks, W, H, sh_degree=3)
    for i in range(3):
        one, one_alpha, one_meta = kernels.rasterization(means, quats, scales, opac, sh, views[i:i + 1], Ks[i:i + 1],
                                                         W, H, sh_degree=3)
        torch.testing.assert_close(one, img[i:i + 1], rtol=0, atol=1e-6)  # same arithmetic per camera
        torch.testing.assert_close(one_alpha, alpha[i:i + 1], rtol=0, atol=1e-6)
        assert torch.equal(one_meta["radii"], meta["radii"][i:i + 1])


@pytest.mark.gpu
@requires_gpu
def test_bad_values_are_caught_by_the_check_kernel(cuda):
    means, quats, scales, opac, sh = (t.to(cuda) for t in gaussians(300, seed=0))
    views, Ks = (t.to(cuda) for t in camera(32, 32, 30.0, n=2))

    def spoil(t, index, value):
        t = t.clone()
        t[index] = value
        return t

    cases = [(dict(means=spoil(means, (299, 2), float("nan"))), "means must be finite"),
             (dict(scales=spoil(scales, (0, 1), float("inf"))), "scales must be finite"),
             (dict(quats=spoil(quats, (7, 0), float("-inf"))), "quats must be finite"),
             (dict(quats=spoil(quats, 150, 0.0)), "quats must be non-zero"),
             (dict(quats=spoil(quats, 3, 1e-30)), "quats must be non-zero"),  # |q|^2 underflows
             (dict(viewmats=spoil(views, (1, 0, 3), float("nan"))), "viewmats must be finite"),
             (dict(Ks=spoil(Ks, (1, 1, 1), 0.0)), "Ks must be finite with fx, fy > 0")]
    for kw, message in cases:
        args = dict(means=means, quats=quats, scales=scales, opacities=opac, colors=sh, viewmats=views, Ks=Ks,
                    width=32, height=32, sh_degree=3)
        with pytest.raises(ValueError, match=message):
            kernels.rasterization(**{**args, **kw})
    kernels.rasterization(means, quats, scales, opac, sh, views, Ks, 32, 32, sh_degree=3)  # the clean inputs pass


@pytest.mark.gpu
@requires_gpu
def test_programs_compile_and_load(cuda):
    """Every program of the rasterizer compiles for this GPU and exposes its kernels."""
    for prog in _gs_cuda.default_programs():
        functions = prog.load(cuda)
        assert set(functions) == set(prog.name_expressions)
    assert loader.normalize_arch(_driver.device_arch(torch.cuda.current_device())).startswith("sm_")
