"""PSNR and SSIM (stages/common/metrics.py) against known values and independent implementations."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stages.common.metrics import SSIM_C1, SSIM_C2, psnr, ssim, ssim_map


def _pair(h=24, w=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    gt = torch.rand(h, w, 3, generator=g)
    pred = (gt + 0.15 * torch.randn(h, w, 3, generator=g)).clamp(0, 1)
    return pred, gt


def test_psnr_constant_error_is_20db():
    gt = torch.full((8, 6, 3), 0.3, dtype=torch.float64)
    assert psnr(gt + 0.1, gt) == pytest.approx(20.0, abs=1e-9)
    assert psnr(gt - 0.01, gt) == pytest.approx(40.0, abs=1e-9)


def test_psnr_identical_is_inf_and_matches_mse_formula():
    pred, gt = _pair()
    assert psnr(gt, gt) == math.inf
    mse = np.mean((pred.numpy().astype(np.float64) - gt.numpy()) ** 2)
    assert psnr(pred, gt) == pytest.approx(10 * np.log10(1 / mse), rel=1e-12)


def test_ssim_valid_matches_kornia():
    kornia = pytest.importorskip("kornia")
    pred, gt = _pair(32, 28)
    ref = kornia.metrics.ssim(pred.permute(2, 0, 1)[None].double(), gt.permute(2, 0, 1)[None].double(),
                              window_size=11, max_val=1.0, eps=0.0, padding="valid")
    # both float64; only the summation order differs
    assert ssim(pred, gt, padding="valid") == pytest.approx(ref.mean().item(), abs=1e-10)
    assert ssim_map(pred, gt, padding="valid").shape == (22, 18, 3)


def _naive_ssim_same(pred: np.ndarray, gt: np.ndarray) -> float:
    """Direct windowed sums over zero-padded images (the 3DGS conv2d(padding=5)), one pixel at a time."""
    x = np.arange(11) - 5
    g = np.exp(-(x**2) / (2 * 1.5**2))
    g /= g.sum()
    win = np.outer(g, g)
    h, w, _ = pred.shape
    p = np.pad(pred.astype(np.float64), ((5, 5), (5, 5), (0, 0)))
    t = np.pad(gt.astype(np.float64), ((5, 5), (5, 5), (0, 0)))
    vals = []
    for c in range(3):
        for i in range(h):
            for j in range(w):
                a, b = p[i:i + 11, j:j + 11, c], t[i:i + 11, j:j + 11, c]
                ma, mb = (win * a).sum(), (win * b).sum()
                va = (win * a * a).sum() - ma**2
                vb = (win * b * b).sum() - mb**2
                cov = (win * a * b).sum() - ma * mb
                vals.append((2 * ma * mb + SSIM_C1) * (2 * cov + SSIM_C2)
                            / ((ma**2 + mb**2 + SSIM_C1) * (va + vb + SSIM_C2)))
    return float(np.mean(vals))


def test_ssim_same_matches_naive_zero_padded_3dgs():
    pred, gt = _pair(14, 13, seed=1)
    assert ssim(pred, gt) == pytest.approx(_naive_ssim_same(pred.numpy(), gt.numpy()), abs=1e-10)


def test_ssim_same_interior_equals_valid_map():
    pred, gt = _pair(30, 26, seed=2)
    same, valid = ssim_map(pred, gt, "same"), ssim_map(pred, gt, "valid")
    torch.testing.assert_close(same[5:-5, 5:-5], valid, rtol=0, atol=1e-12)


def test_ssim_known_values():
    pred, gt = _pair()
    assert ssim(gt, gt) == pytest.approx(1.0, abs=1e-12)
    assert ssim(pred, gt) == pytest.approx(ssim(gt, pred), abs=1e-12)  # symmetric
    assert 0.0 < ssim(pred, gt) < 0.99
    # flat images: variances vanish, so the score is the luminance term alone
    a, b = 0.4, 0.6
    flat = ssim(torch.full((16, 16, 3), a), torch.full((16, 16, 3), b), padding="valid")
    assert flat == pytest.approx((2 * a * b + SSIM_C1) / (a * a + b * b + SSIM_C1), abs=1e-6)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="shapes differ"):
        psnr(torch.zeros(4, 4, 3), torch.zeros(4, 5, 3))
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        ssim(torch.zeros(3, 4, 4), torch.zeros(3, 4, 4))
    with pytest.raises(ValueError, match="padding"):
        ssim(torch.zeros(12, 12, 3), torch.zeros(12, 12, 3), padding="reflect")
