"""Fused SSIM (kernels/ssim.py): the PyTorch twin against the evaluation SSIM
(stages/common/metrics.py), the backward formulas of csrc/ssim.cu checked on the CPU against autograd,
input checks; on a GPU (marked ``gpu``) the CUDA kernels against the twin.

Relation to the evaluation SSIM: the same definition (11x11 Gaussian window with sigma 1.5, per
channel, C1 = 0.01^2, C2 = 0.03^2, population variances, mean of the map) and the same two border
conventions ("same": zero padding, the 3DGS default; "valid": interior windows only). Differences:
the evaluation metric takes [H, W, 3] images and computes in float64 without gradients; the loss takes
[C, H, W] / [B, C, H, W] float32 with gradients. In float64 the twin equals the metric to rounding.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import ssim as ks
from stages.common import metrics

from conftest import requires_gpu


def _images(seed: int, shape=(3, 37, 45), dtype=torch.float32):
    """A pair of textured images in [0, 1]: smooth structure plus noise, the second a distorted copy."""
    g = torch.Generator().manual_seed(seed)
    c, h, w = shape[-3:]
    yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    base = 0.5 + 0.3 * torch.sin(6 * xx + 4 * yy) * torch.cos(5 * yy)
    img = (base + 0.1 * torch.randn(*shape, generator=g)).clamp(0, 1)
    other = (0.8 * img + 0.1 + 0.08 * torch.randn(*shape, generator=g)).clamp(0, 1)
    return img.to(dtype), other.to(dtype)


def _structured(h=40, w=52):
    """[3, H, W] pairs with sharp structure: a checkerboard against a shifted copy, a ramp against its
    square, and a flat field against noise."""
    g = torch.Generator().manual_seed(3)
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    checker = ((yy // 4 + xx // 4) % 2).float()
    ramp = (xx / (w - 1)).float()
    flat = torch.full((h, w), 0.6)
    a = torch.stack([checker, ramp, flat])
    b = torch.stack([torch.roll(checker, 1, 1), ramp**2, (0.6 + 0.2 * torch.randn(h, w, generator=g)).clamp(0, 1)])
    return a, b


# ---------------------------------------------------------------------------- twin vs evaluation SSIM


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_twin_matches_the_evaluation_ssim(padding):
    for a, b in (_images(0), _images(1, (3, 11, 30)), _structured()):
        want = metrics.ssim(a.permute(1, 2, 0).double(), b.permute(1, 2, 0).double(), padding)
        # float64: the same arithmetic as the metric up to summation order
        assert float(ks.ssim_reference(a.double(), b.double(), padding)) == pytest.approx(want, abs=1e-12)
        # float32: each moment sums 121 products (relative error ~1e-7); variances subtract nearly
        # equal numbers and are divided by D >= C2 = 9e-4, so a pixel's SSIM can be off by ~1e-5 in
        # flat regions; the mean over thousands of pixels stays well inside 1e-5
        assert float(ks.ssim(a, b, padding)) == pytest.approx(want, abs=1e-5)
    a, _ = _images(2)
    assert float(ks.ssim(a, a)) == pytest.approx(1.0, abs=1e-6)


def test_batches_average_every_plane():
    a, b = _images(4, (2, 3, 24, 20))
    whole = ks.ssim(a, b, "valid")
    each = torch.stack([ks.ssim(a[i], b[i], "valid") for i in range(2)]).mean()
    torch.testing.assert_close(whole, each, rtol=0, atol=1e-6)  # float32 means of equal-sized parts


# ---------------------------------------------------------------------------- the kernel's backward


def _blur_same(t: torch.Tensor) -> torch.Tensor:
    """Zero-padded separable Gaussian blur of [P, H, W] (float64), as the kernels do it."""
    taps = ks.gaussian_taps(dtype=torch.float64)
    out = F.conv2d(t[:, None], taps.view(1, 1, 1, -1), padding=(0, ks.RADIUS))
    return F.conv2d(out, taps.view(1, 1, -1, 1), padding=(ks.RADIUS, 0))[:, 0]


def _kernel_math(x: torch.Tensor, y: torch.Tensor, border: int):
    """Mean SSIM and both gradients by csrc/ssim.cu's formulas (partials, then the adjoint blur)."""
    mu1, mu2 = _blur_same(x), _blur_same(y)
    s11, s22, s12 = _blur_same(x * x) - mu1**2, _blur_same(y * y) - mu2**2, _blur_same(x * y) - mu1 * mu2
    A, B = 2 * mu1 * mu2 + ks.C1, 2 * s12 + ks.C2
    C, D = mu1**2 + mu2**2 + ks.C1, s11 + s22 + ks.C2
    S = A * B / (C * D)
    d_mu1 = 2 / (C * D) * (mu2 * (B - A) + mu1 * S * (C - D))
    d_mu2 = 2 / (C * D) * (mu1 * (B - A) + mu2 * S * (C - D))
    d_sq, d_cross = -S / D, 2 * A / (C * D)
    h, w = x.shape[-2:]
    region = torch.zeros_like(x)
    region[:, border:h - border, border:w - border] = 1
    g = region / region.sum()  # d mean / dS
    gx = _blur_same(g * d_mu1) + 2 * x * _blur_same(g * d_sq) + y * _blur_same(g * d_cross)
    gy = _blur_same(g * d_mu2) + 2 * y * _blur_same(g * d_sq) + x * _blur_same(g * d_cross)
    return (S * g).sum(), gx, gy


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_the_kernels_backward_formulas_equal_autograd(padding):
    """What csrc/ssim.cu computes (the partial derivatives of S and their adjoint blur), in float64
    on the CPU, against autograd through the twin: equal to rounding."""
    for a, b in (_images(5, (3, 23, 31), torch.float64), _structured(29, 35)):
        a, b = a.double().requires_grad_(), b.double().requires_grad_()
        value = ks.ssim_reference(a, b, padding)
        want_a, want_b = torch.autograd.grad(value, (a, b))
        got, got_a, got_b = _kernel_math(a.detach(), b.detach(), 0 if padding == "same" else ks.RADIUS)
        assert float(got) == pytest.approx(float(value.detach()), abs=1e-12)
        scale = float(want_a.abs().max())
        torch.testing.assert_close(got_a, want_a, rtol=1e-9, atol=1e-9 * scale)
        torch.testing.assert_close(got_b, want_b, rtol=1e-9, atol=1e-9 * scale)


def test_twin_gradcheck():
    a, b = _images(6, (1, 12, 13), torch.float64)
    for padding in ("same", "valid"):
        assert torch.autograd.gradcheck(lambda x, y: ks.ssim_reference(x, y, padding),
                                        (a.requires_grad_(), b.requires_grad_()))


def test_bad_input_is_a_clear_error():
    a, b = _images(7)
    cases = [
        ((a.double(), b.double()), "float32"),
        ((a[0], b[0]), r"\[C, H, W\]"),
        ((a, b[:, :-1]), "shapes differ"),
        ((a[:, :10, :10], b[:, :10, :10], "valid"), "at least 11x11"),
        ((a, b, "full"), "padding"),
        ((a.numpy(), b), "torch.Tensor"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            ks.ssim(*args)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        ks.ssim(a, b, use_kernels=True)


# ---------------------------------------------------------------------------- GPU: kernels vs twin

# Shapes: tiny and odd sizes (partial tiles, images smaller than the halo), a batch, a large plane
GPU_SHAPES = [(3, 1, 1), (1, 11, 11), (3, 17, 33), (2, 3, 64, 48), (3, 300, 401)]


def _gpu_pair(shape, seed):
    a, b = _images(seed, shape)
    return a.cuda(), b.cuda()


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["same", "valid"])
def test_gpu_forward_matches_the_twin(padding):
    for i, shape in enumerate(GPU_SHAPES):
        if padding == "valid" and min(shape[-2:]) < ks.WINDOW:
            continue
        a, b = _gpu_pair(shape, 10 + i)
        got = float(ks.ssim(a, b, padding, use_kernels=True))
        want64 = float(ks.ssim_reference(a.double(), b.double(), padding))
        twin32 = float(ks.ssim_reference(a, b, padding))
        # float32 either way: the kernel's FMAs and cuDNN's sums round differently; the mean is within
        # 1e-5 of the float64 value for these textured images (see test_twin_matches_the_evaluation_ssim)
        assert abs(got - want64) <= 1e-5, (shape, padding, got, want64, twin32)
    a, _ = _gpu_pair((3, 40, 40), 20)
    assert float(ks.ssim(a, a, padding, use_kernels=True)) == pytest.approx(1.0, abs=1e-6)
    with torch.no_grad():  # no partials written, same value
        assert float(ks.ssim(a, a * 0.5, padding, use_kernels=True)) == pytest.approx(
            float(ks.ssim_reference(a.double(), a.double() * 0.5, padding)), abs=1e-5)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("padding", ["same", "valid"])
def test_gpu_backward_matches_the_twin(padding):
    for i, shape in enumerate(GPU_SHAPES):
        if padding == "valid" and min(shape[-2:]) < ks.WINDOW:
            continue
        a, b = _gpu_pair(shape, 30 + i)
        cot = 1.7  # a cotangent other than 1 (the loss weight 0.2 of 1 - SSIM is one)
        for needs in ((True, False), (True, True), (False, True)):
            x, y = a.clone().requires_grad_(needs[0]), b.clone().requires_grad_(needs[1])
            (ks.ssim(x, y, padding, use_kernels=True) * cot).backward()
            x64, y64 = a.double().requires_grad_(needs[0]), b.double().requires_grad_(needs[1])
            (ks.ssim_reference(x64, y64, padding) * cot).backward()
            for got, want in ((x.grad, x64.grad), (y.grad, y64.grad)):
                if want is None:
                    assert got is None
                    continue
                # float32 partials amplify rounding by up to ~1/D (D >= C2); a wrong tap, halo or sign
                # moves gradients by percents of their largest value, so 1e-3 of it separates the two
                scale = float(want.abs().max())
                torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-3 * scale,
                                           msg=lambda m: f"{shape} {padding} {needs}: {m}")


@requires_gpu
@pytest.mark.gpu
def test_gpu_permuted_renders_as_the_loss_passes_them():
    """The rasterizer gives [1, H, W, 3]; the loss passes ``.permute(0, 3, 1, 2)`` (not contiguous)."""
    a, b = _gpu_pair((1, 3, 50, 70), 50)
    render = a.permute(0, 2, 3, 1).contiguous().requires_grad_()  # [1, H, W, 3]
    (1 - ks.ssim(render.permute(0, 3, 1, 2), b, use_kernels=True)).backward()
    twin = a.permute(0, 2, 3, 1).double().requires_grad_()
    (1 - ks.ssim_reference(twin.permute(0, 3, 1, 2), b.double())).backward()
    scale = float(twin.grad.abs().max())
    torch.testing.assert_close(render.grad.double(), twin.grad, rtol=0, atol=1e-3 * scale)


@requires_gpu
@pytest.mark.gpu
def test_gpu_more_planes_than_one_launch_holds():
    """65543 planes: two launches along gridDim.z (at most 65535 each)."""
    g = torch.Generator().manual_seed(40)
    a = torch.rand(65543, 12, 12, generator=g).cuda()
    b = (a + 0.1 * torch.rand(65543, 12, 12, generator=g).cuda()).clamp(0, 1)
    x = a.clone().requires_grad_()
    got = ks.ssim(x[None], b[None], use_kernels=True)
    got.backward()
    x64 = a.double().requires_grad_()
    want = ks.ssim_reference(x64[None], b.double()[None])
    want.backward()
    assert float(got) == pytest.approx(float(want), abs=1e-5)
    last = slice(65535, None)  # the planes of the second launch
    scale = float(x64.grad.abs().max())
    torch.testing.assert_close(x.grad[last].double(), x64.grad[last], rtol=0, atol=1e-3 * scale)
