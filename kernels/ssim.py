"""Fused SSIM for training losses (the 3DGS loss's ``1 - SSIM``): CUDA forward and backward, and the
PyTorch twin that runs on the CPU.

SSIM as the 3DGS reference's training loss computes it (``utils/loss_utils.py: ssim``, Kerbl et al.
2023; Wang et al. 2004): an 11x11 Gaussian window with sigma 1.5 applied to each image plane (colour
channel) on its own, ``C1 = 0.01^2``, ``C2 = 0.03^2`` (data range 1), population variances, and the
mean of the SSIM map. ``padding="same"`` (the default, the reference's) blurs with zero padding and
averages the whole H x W map; ``padding="valid"`` (gsplat's simple_trainer, torchmetrics,
scikit-image) averages only the (H - 10) x (W - 10) pixels whose window lies inside the image.
These are the conventions of ``stages.common.metrics.ssim`` too (same window, constants and
padding; that one computes in float64 for evaluation, this one in float32 with gradients).

CUDA source: ``csrc/ssim.cu`` (one pass for the map and its partial derivatives, one for the
gradient). Twin: :func:`ssim_reference` (separable convolutions, autograd).

Example:
    >>> import torch
    >>> from kernels.ssim import ssim
    >>> img = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0))
    >>> round(float(ssim(img, img)), 6)
    1.0
    >>> round(float(ssim(img, img * 0.5)), 4), round(float(ssim(img, img * 0.5, padding="valid")), 4)
    (0.6414, 0.6415)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ._driver import KernelProgram, i32, ptr
from .hashgrid import _use_kernels

WINDOW = 11
RADIUS = WINDOW // 2
SIGMA = 1.5
C1 = 0.01**2
C2 = 0.03**2
PADDINGS = ("same", "valid")
TILE = 16  # the kernels' tile (csrc/ssim.cu SSIM_TILE)
_MAX_GRID_Z = 65535  # planes per launch (CUDA's gridDim.z limit)
_NAMES = ["ssim_fwd", "ssim_bwd"]
_program: KernelProgram | None = None
_taps_cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def program() -> KernelProgram:
    global _program
    if _program is None:
        _program = KernelProgram("ssim.cu", _NAMES)
    return _program


def default_programs() -> list[KernelProgram]:
    return [program()]


def gaussian_taps(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The normalised 1D window [11]: exp(-d^2 / (2 sigma^2)) / sum, built in float64 then cast."""
    key = (torch.device(device), dtype)
    taps = _taps_cache.get(key)
    if taps is None:
        d = torch.arange(WINDOW, dtype=torch.float64) - RADIUS
        g = torch.exp(-(d**2) / (2 * SIGMA**2))
        taps = _taps_cache[key] = (g / g.sum()).to(device=key[0], dtype=dtype)
    return taps


def _check(img1, img2, padding: str, dtypes: tuple[torch.dtype, ...]) -> None:
    for name, img in (("img1", img1), ("img2", img2)):
        if not isinstance(img, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(img).__name__}")
        if img.ndim not in (3, 4):
            raise ValueError(f"{name} must be [C, H, W] or [B, C, H, W], got shape {tuple(img.shape)}")
        if img.dtype not in dtypes:
            raise ValueError(f"{name} must be {' or '.join(map(str, dtypes))}, got {img.dtype}")
    if img1.shape != img2.shape:
        raise ValueError(f"img1 and img2 shapes differ: {tuple(img1.shape)} vs {tuple(img2.shape)}")
    if img1.device != img2.device:
        raise ValueError(f"img1 and img2 must be on one device, got {img1.device} and {img2.device}")
    if padding not in PADDINGS:
        raise ValueError(f"padding must be 'same' or 'valid', got {padding!r}")
    h, w = img1.shape[-2:]
    low = WINDOW if padding == "valid" else 1
    if h < low or w < low or img1.numel() == 0:
        raise ValueError(f"padding={padding!r} needs images of at least {low}x{low} and one plane, "
                         f"got shape {tuple(img1.shape)}")


def ssim_reference(img1: torch.Tensor, img2: torch.Tensor, padding: str = "same") -> torch.Tensor:
    """PyTorch twin of :func:`ssim` (mirrors csrc/ssim.cu ssim_fwd / ssim_bwd through autograd).

    Args:
        img1, img2: [C, H, W] or [B, C, H, W], float32 or float64, values in [0, 1] (data range 1).
        padding: ``"same"`` or ``"valid"`` (see the module docstring).

    Returns:
        The mean SSIM, a 0-dim tensor, differentiable in both images.
    """
    _check(img1, img2, padding, (torch.float32, torch.float64))
    h, w = img1.shape[-2:]
    x, y = img1.reshape(-1, 1, h, w), img2.reshape(-1, 1, h, w)
    taps = gaussian_taps(img1.device, img1.dtype)
    r = RADIUS if padding == "same" else 0
    moments = torch.cat([x, y, x * x, y * y, x * y], 1)  # [P, 5, H, W]
    blurred = F.conv2d(moments, taps.view(1, 1, 1, WINDOW).expand(5, 1, 1, WINDOW), padding=(0, r), groups=5)
    blurred = F.conv2d(blurred, taps.view(1, 1, WINDOW, 1).expand(5, 1, WINDOW, 1), padding=(r, 0), groups=5)
    mu1, mu2, e11, e22, e12 = blurred.unbind(1)
    s11, s22, s12 = e11 - mu1 * mu1, e22 - mu2 * mu2, e12 - mu1 * mu2
    num = (2 * mu1 * mu2 + C1) * (2 * s12 + C2)
    den = (mu1 * mu1 + mu2 * mu2 + C1) * (s11 + s22 + C2)
    return (num / den).mean()


def _at(t: torch.Tensor | None, plane: int) -> tuple[int, type]:
    """Pointer argument to ``plane`` of a [P, H, W] tensor (null for None)."""
    return (0 if t is None else t[plane].data_ptr(), ptr)


def _launch(name: str, planes: int, h: int, w: int, device: torch.device, args_at) -> None:
    """Launch ``name`` on 16 x 16 tiles of every plane, at most 65535 planes (gridDim.z) at a time;
    ``args_at(z0)`` gives the arguments with the plane pointers offset to plane z0."""
    for z0 in range(0, planes, _MAX_GRID_Z):
        grid = (-(-w // TILE), -(-h // TILE), min(_MAX_GRID_Z, planes - z0))
        program().launch(name, grid, (TILE, TILE), args_at(z0), device=device)


class _FusedSSIM(torch.autograd.Function):
    """CUDA forward and backward of the mean SSIM; gradients for the images that need them."""

    @staticmethod
    def forward(ctx, img1, img2, border, want1, want2):
        h, w = img1.shape[-2:]
        x, y = img1.reshape(-1, h, w).contiguous(), img2.reshape(-1, h, w).contiguous()
        planes = x.shape[0]
        taps = gaussian_taps(x.device)
        ssim_map = torch.empty_like(x)
        grads = want1 or want2
        # dS/dmu1, dS/dmu2 (only for img2's gradient), dS/dG(x^2) = dS/dG(y^2), dS/dG(xy)
        dm = [torch.empty_like(x) if grads else None, torch.empty_like(x) if want2 else None,
              torch.empty_like(x) if grads else None, torch.empty_like(x) if grads else None]

        def args_at(z0):
            return ([_at(x, z0), _at(y, z0), (taps.data_ptr(), ptr), _at(ssim_map, z0)]
                    + [_at(t, z0) for t in dm] + [(h, i32), (w, i32)])

        _launch("ssim_fwd", planes, h, w, x.device, args_at)
        region = ssim_map if border == 0 else ssim_map[:, border:h - border, border:w - border]
        if grads:
            ctx.save_for_backward(x, y, *dm[:1], *dm[2:], *([dm[1]] if want2 else []))
        ctx.meta = (img1.shape, border, region.numel(), want1, want2)
        return region.mean()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        shape, border, count, want1, want2 = ctx.meta
        x, y, dm_mu1, dm_sq, dm_cross, *rest = ctx.saved_tensors
        dm_mu2 = rest[0] if want2 else None
        planes, h, w = x.shape
        taps = gaussian_taps(x.device)
        scale = (grad.float() / count).reshape(1).contiguous()  # dL/dS of every averaged pixel
        grad1 = torch.empty_like(x)  # the kernel always writes it
        grad2 = torch.empty_like(y) if want2 else None

        def args_at(z0):
            return [_at(x, z0), _at(y, z0), (taps.data_ptr(), ptr), _at(dm_mu1, z0), _at(dm_mu2, z0),
                    _at(dm_sq, z0), _at(dm_cross, z0), (scale.data_ptr(), ptr), _at(grad1, z0),
                    _at(grad2, z0), (h, i32), (w, i32), (border, i32)]

        _launch("ssim_bwd", planes, h, w, x.device, args_at)
        return (grad1.reshape(shape) if want1 else None, grad2.reshape(shape) if want2 else None,
                None, None, None)


def ssim(img1: torch.Tensor, img2: torch.Tensor, padding: str = "same", *,
         use_kernels: bool | None = None) -> torch.Tensor:
    """Mean SSIM of two images, fused on a GPU; for a loss use ``1 - ssim(render, target)``.

    Args:
        img1: [C, H, W] or [B, C, H, W] float32, values in [0, 1] (the rendering: differentiable).
        img2: the same shape, dtype and device (the target; differentiable too if it requires grad).
        padding: ``"same"`` (3DGS reference, default) or ``"valid"`` (gsplat, torchmetrics).
        use_kernels: None picks the CUDA kernels on CUDA tensors where :func:`kernels.available`,
            else the twin :func:`ssim_reference`; True insists on the kernels; False runs the twin.

    Returns:
        A 0-dim float32 tensor: the mean of the SSIM map over every plane and pixel averaged.

    Raises:
        ValueError: a non-tensor, a shape other than [C, H, W] / [B, C, H, W], shapes that differ,
            a dtype other than float32, two devices, an unknown padding, or images too small.
    """
    _check(img1, img2, padding, (torch.float32,))
    if not _use_kernels(img1.device, use_kernels):
        return ssim_reference(img1, img2, padding)
    grad_on = torch.is_grad_enabled()
    border = 0 if padding == "same" else RADIUS
    return _FusedSSIM.apply(img1, img2, border, grad_on and img1.requires_grad,
                            grad_on and img2.requires_grad)
