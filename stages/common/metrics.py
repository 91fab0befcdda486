"""Image quality metrics of novel-view synthesis: PSNR and SSIM.

Both take ``[H, W, 3]`` float tensors in ``[0, 1]`` (prediction first, ground truth
second) and return a Python float. The conventions are the ones the field reports, so
the numbers compare with published tables:

* PSNR as everywhere: ``10 * log10(1 / MSE)`` over all pixels and channels, data
  range 1. A constant error of 0.1 gives exactly 20 dB.
* SSIM as in the 3D Gaussian Splatting evaluation (Kerbl et al. 2023,
  ``utils/loss_utils.py:ssim`` called by ``metrics.py``), itself the Wang et al. 2004
  definition: an 11x11 Gaussian window with sigma 1.5, each colour channel on its own,
  ``C1 = 0.01**2``, ``C2 = 0.03**2`` (data range 1), population (not sample) variances,
  and the mean of the SSIM map over all pixels and channels.

Border handling (``padding``):

* ``"same"`` (default, the 3DGS convention): the local statistics are computed with
  ``conv2d(..., padding=5)``, i.e. the images are zero-padded and the map has the
  image's size. Zero padding pulls the border pixels' scores down a little, so this is
  slightly lower than ``"valid"`` (a few 1e-3 on a 400x300 image).
* ``"valid"`` (scikit-image ``structural_similarity(..., gaussian_weights=True,
  sigma=1.5, use_sample_covariance=False, data_range=1, channel_axis=-1)``, torchmetrics
  and nerfstudio, ``kornia.metrics.ssim(..., padding="valid")``): only the window
  positions fully inside the image, a map of ``(H - 10) x (W - 10)``.

The report states which one produced its numbers (:data:`SSIM_CONVENTION`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_C1 = 0.01**2
SSIM_C2 = 0.03**2
SSIM_CONVENTION = (
    "SSIM: 11x11 Gaussian window (sigma 1.5), per RGB channel, C1=0.01^2, C2=0.03^2, data range 1, "
    "zero 'same' padding as in the 3DGS evaluation, mean over all pixels and channels"
)


def _check_pair(pred: torch.Tensor, gt: torch.Tensor) -> None:
    if not isinstance(pred, torch.Tensor) or not isinstance(gt, torch.Tensor):
        raise TypeError(f"expected torch tensors, got {type(pred).__name__} and {type(gt).__name__}")
    if pred.shape != gt.shape:
        raise ValueError(f"pred and gt shapes differ: {tuple(pred.shape)} vs {tuple(gt.shape)}")
    if pred.ndim != 3 or pred.shape[-1] != 3:
        raise ValueError(f"expected images of shape [H, W, 3], got {tuple(pred.shape)}")


def psnr(pred: torch.Tensor, gt: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB, data range 1.

    Args:
        pred: rendered image [H, W, 3], float in [0, 1].
        gt: ground-truth image [H, W, 3], float in [0, 1].

    Returns:
        ``10 * log10(1 / mean((pred - gt)**2))``; ``inf`` for identical images.

    Example:
        >>> gt = torch.full((4, 4, 3), 0.5, dtype=torch.float64)
        >>> round(psnr(gt + 0.1, gt), 6)
        20.0
    """
    _check_pair(pred, gt)
    mse = torch.mean((pred.double() - gt.double()) ** 2).item()
    return math.inf if mse == 0 else -10.0 * math.log10(mse)


def gaussian_window(size: int = SSIM_WINDOW, sigma: float = SSIM_SIGMA, dtype=torch.float64) -> torch.Tensor:
    """The normalized 1D Gaussian taps [size] (centre at ``size // 2``), as 3DGS builds them."""
    x = torch.arange(size, dtype=dtype) - size // 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def ssim_map(pred: torch.Tensor, gt: torch.Tensor, padding: str = "same") -> torch.Tensor:
    """The SSIM map [H', W', 3] (float64) under the module's conventions.

    Args:
        pred: [H, W, 3] float in [0, 1].
        gt: [H, W, 3] float in [0, 1].
        padding: ``"same"`` (zero padding, 3DGS; map is [H, W, 3]) or ``"valid"``
            (scikit-image; map is [H - 10, W - 10, 3]).
    """
    _check_pair(pred, gt)
    if padding not in ("same", "valid"):
        raise ValueError(f"padding must be 'same' or 'valid', got {padding!r}")
    h, w = pred.shape[:2]
    if padding == "valid" and (h < SSIM_WINDOW or w < SSIM_WINDOW):
        raise ValueError(f"'valid' SSIM needs images of at least {SSIM_WINDOW}x{SSIM_WINDOW}, got {w}x{h}")
    # float64: the variances are differences of nearly equal numbers
    x = pred.detach().double().permute(2, 0, 1)[None]  # [1, 3, H, W]
    y = gt.detach().double().permute(2, 0, 1)[None]
    g = gaussian_window()
    r = SSIM_WINDOW // 2 if padding == "same" else 0
    wx = g.view(1, 1, 1, -1).expand(3, 1, 1, -1)
    wy = g.view(1, 1, -1, 1).expand(3, 1, -1, 1)

    def blur(img: torch.Tensor) -> torch.Tensor:
        # separable, identical to the 2D outer-product window of 3DGS (zero padding both ways)
        out = F.conv2d(img, wx, padding=(0, r), groups=3)
        return F.conv2d(out, wy, padding=(r, 0), groups=3)

    mu_x, mu_y = blur(x), blur(y)
    sxx = blur(x * x) - mu_x**2
    syy = blur(y * y) - mu_y**2
    sxy = blur(x * y) - mu_x * mu_y
    num = (2 * mu_x * mu_y + SSIM_C1) * (2 * sxy + SSIM_C2)
    den = (mu_x**2 + mu_y**2 + SSIM_C1) * (sxx + syy + SSIM_C2)
    return (num / den)[0].permute(1, 2, 0)


def ssim(pred: torch.Tensor, gt: torch.Tensor, padding: str = "same") -> float:
    """Mean structural similarity; see the module docstring for the conventions.

    Args:
        pred: rendered image [H, W, 3], float in [0, 1].
        gt: ground-truth image [H, W, 3], float in [0, 1].
        padding: ``"same"`` (default; zero padding as in the 3DGS evaluation) or
            ``"valid"`` (scikit-image / torchmetrics / kornia ``padding="valid"``).

    Returns:
        The mean of the SSIM map, 1.0 for identical images.
    """
    return ssim_map(pred, gt, padding).mean().item()
