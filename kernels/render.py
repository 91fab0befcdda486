"""Ray marching and alpha compositing on packed samples (the NeRF renderer's two hot loops).

CUDA source: ``csrc/render.cu``; references: ``_reference.march_rays_reference`` and
``_reference.composite_reference`` (what the CPU runs). A batch of rays is marched into a packed
list of samples, ray by ray (``offsets``/``counts`` say which belong to which ray), the field is
evaluated on them, and the samples are composited back into one colour per ray, as nerfacc's
``OccGridEstimator.sampling`` + ``rendering`` do.

Example:
    >>> import torch, kernels
    >>> o = torch.tensor([[0.0, 0.0, -2.0]]); d = torch.tensor([[0.0, 0.0, 1.0]])
    >>> aabb = torch.tensor([[-1.0, -1, -1], [1, 1, 1]])
    >>> s = kernels.march_rays(o, d, torch.full((1,), 0.5), aabb, None, dt=0.5, max_samples=8)
    >>> s.t.tolist(), s.counts.tolist()
    ([1.25, 1.75, 2.25, 2.75], [4])
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from ._driver import KernelProgram, f32, i32, i64, ptr, u32
from ._reference import FAR_RATIO, composite_reference, march_rays_reference
from .hashgrid import _check_tensor, _use_kernels

BLOCK_SIZE = 128
_SPACES = {"box": 0, "contract": 1, "cascades": 2}  # march_rays' SPACE (csrc/render.cu)
_NAMES = [f"march_rays<{w}, {k}>" for k in _SPACES.values() for w in ("false", "true")] + ["composite_fwd",
                                                                                          "composite_bwd"]
_program: KernelProgram | None = None


def program() -> KernelProgram:
    global _program
    if _program is None:
        _program = KernelProgram("render.cu", _NAMES)
    return _program


def default_programs() -> list[KernelProgram]:
    return [program()]


class Samples(NamedTuple):
    """Packed samples of R rays: ray i owns ``offsets[i] .. offsets[i] + counts[i] - 1``.

    With a ``capacity`` (see :func:`march_rays`) the arrays have exactly that many rows; rows past
    the last sample are zeros (ray 0, t 0, point 0) and belong to no ray."""

    ray_index: torch.Tensor  # [S] int64
    t: torch.Tensor  # [S] float32, distance along the ray
    points: torch.Tensor  # [S, 3] float32
    offsets: torch.Tensor  # [R] int64
    counts: torch.Tensor  # [R] int32
    total: torch.Tensor | None = None  # 0-d int64 on the rays' device: samples before any capacity cut
    steps: torch.Tensor | None = None  # [S] float32 step length of each sample (contracted, cascades); None: all dt


def _fit_capacity(ray_index, t, points, offsets, counts, steps, capacity: int) -> Samples:
    """Cut packed samples to their first ``capacity`` rows (counts clamped), or zero-pad to it."""
    total = counts.sum(dtype=torch.int64)
    n = ray_index.shape[0]
    keep = min(n, capacity)
    pad = capacity - keep
    counts = torch.minimum(counts.long(), (capacity - offsets).clamp(min=0)).to(torch.int32)
    fit = lambda x, *shape: torch.cat([x[:keep], x.new_zeros(pad, *shape)])  # noqa: E731
    return Samples(fit(ray_index), fit(t), fit(points, 3), offsets, counts, total,
                   None if steps is None else fit(steps))


def _check(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """``t`` is a tensor of ``shape`` (None: any size), ``dtype``, on ``device``."""
    _check_tensor(name, t, len(shape))
    if any(s is not None and a != s for a, s in zip(t.shape, shape)):
        want = "[" + ", ".join("N" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} with the other inputs, got {t.device}")


def march_rays(origins: torch.Tensor, dirs: torch.Tensor, jitter: torch.Tensor, aabb: torch.Tensor,
               occupancy: torch.Tensor | None, dt: float, max_samples: int, near: float = 0.0, *,
               capacity: int | None = None, contract: bool = False, cascades: int = 0, cone: float = 0.0,
               use_kernels: bool | None = None) -> Samples:
    """Samples along rays at a fixed step, inside the box and in occupied cells.

    Sample s of a ray (0 <= s < max_samples) sits at ``t = tmin + (s + jitter) * dt`` (tmin: where the
    ray enters ``aabb``, at least ``near``) and is kept while ``t`` is before the exit and its cell
    of ``occupancy`` is set (cells as ``OccupancyGrid.cell_index``). With ``contract`` the ray runs
    on past the box, through the contracted scene (``_reference.march_steps_reference``: linear
    steps, then steps uniform in disparity) and ``Samples.steps`` holds each sample's step. With
    ``cascades`` > 0 (instant-ngp's occupancy cascades, ``aabb_scale`` = 2^(cascades - 1)) the ray runs
    through the outermost of the nested boxes around ``aabb`` with steps ``max(dt, cone t)``, cells are
    those of the smallest box holding the sample (``_reference.occupancy_cell_reference``), and
    ``Samples.steps`` holds each sample's step.

    Args:
        origins, dirs: [R, 3] float32 (unit directions).
        jitter: [R] float32 in [0, 1) (0.5 = cell midpoints).
        aabb: [2, 3] float32 box (min corner, max corner).
        occupancy: bool grid with r^3 entries (any shape; cascades r^3 with ``cascades``), or None.
        dt: march step; max_samples: samples per ray at most; near: minimum t.
        capacity: a fixed number of sample rows instead of exactly as many as there are: no host
            sync (the kernels' sample count stays on the device) and the same shapes every call, so
            the march can be captured in a CUDA graph. Samples past ``capacity`` (in ray order) are
            dropped and their rays' counts cut; ``Samples.total`` holds the uncut count.
        use_kernels: as :func:`kernels.hash_encode`.

    Returns:
        :class:`Samples`. Not differentiable (positions along fixed rays).
    """
    dev = origins.device
    _check("origins", origins, (None, 3), torch.float32, dev)
    R = origins.shape[0]
    _check("dirs", dirs, (R, 3), torch.float32, dev)
    _check("jitter", jitter, (R,), torch.float32, dev)
    _check("aabb", aabb, (2, 3), torch.float32, dev)
    if contract and cascades:
        raise ValueError("march_rays: contract and cascades exclude each other")
    if isinstance(cascades, bool) or not isinstance(cascades, int) or not 0 <= cascades <= 16:
        raise ValueError(f"cascades must be an int in [0, 16], got {cascades!r}")
    if cascades and not cone >= 0:
        raise ValueError(f"cone must be >= 0, got {cone}")
    r = 0
    if occupancy is not None:
        if not isinstance(occupancy, torch.Tensor) or occupancy.dtype != torch.bool or occupancy.device != dev:
            raise ValueError(f"occupancy must be a bool tensor on {dev}")
        levels = max(1, cascades)
        r = round((occupancy.numel() // levels) ** (1 / 3))
        if levels * r**3 != occupancy.numel() or r < 1:
            what = "r^3" if cascades == 0 else f"{cascades} r^3"
            raise ValueError(f"occupancy must have {what} cells, got {occupancy.numel()}")
    if not (dt > 0) or int(max_samples) < 1:
        raise ValueError(f"dt must be > 0 and max_samples >= 1, got {dt}, {max_samples}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
    if not _use_kernels(dev, use_kernels):
        *out, steps = march_rays_reference(origins, dirs, jitter, aabb, occupancy, dt, max_samples, near, contract,
                                           cascades, cone)
        if capacity is None:
            return Samples(*out, total=torch.tensor(out[0].shape[0], device=dev), steps=steps)
        return _fit_capacity(*out, steps, capacity)
    origins, dirs, jitter = origins.contiguous(), dirs.contiguous(), jitter.contiguous()
    box = aabb.contiguous().reshape(6)
    occ = occupancy.contiguous() if occupancy is not None else None
    prog = program()
    counts = torch.empty(R, dtype=torch.int32, device=dev)
    grid = (max(1, -(-R // BLOCK_SIZE)),)
    common = [(origins.data_ptr(), ptr), (dirs.data_ptr(), ptr), (jitter.data_ptr(), ptr),
              (box.data_ptr(), ptr), (0 if occ is None else occ.data_ptr(), ptr), (r, i32),
              (float(dt), f32), (int(max_samples), i32), (float(near), f32), (FAR_RATIO, f32),
              (int(cascades), i32), (float(cone), f32), (R, u32)]
    mode = _SPACES["contract" if contract else "cascades" if cascades else "box"]
    if R:
        prog.launch(f"march_rays<false, {mode}>", grid, (BLOCK_SIZE,),
                    common + [(counts.data_ptr(), ptr), (0, ptr), (0, i64), (0, ptr), (0, ptr), (0, ptr), (0, ptr)],
                    device=dev)
    ends = torch.cumsum(counts, 0, dtype=torch.int64)
    offsets = ends - counts
    total_dev = ends[-1] if R else torch.zeros((), dtype=torch.int64, device=dev)
    if capacity is None:
        rows = int(total_dev)  # the one host sync: how many samples to allocate
        alloc = torch.empty
    else:
        rows, alloc = capacity, torch.zeros  # rows past the last sample stay zeros
    ray_index = alloc(rows, dtype=torch.int64, device=dev)
    t = alloc(rows, dtype=torch.float32, device=dev)
    points = alloc(rows, 3, dtype=torch.float32, device=dev)
    steps = alloc(rows, dtype=torch.float32, device=dev) if contract or cascades else None
    if R and rows:
        prog.launch(f"march_rays<true, {mode}>", grid, (BLOCK_SIZE,),
                    common + [(counts.data_ptr(), ptr), (offsets.data_ptr(), ptr), (rows, i64),
                              (ray_index.data_ptr(), ptr), (t.data_ptr(), ptr), (points.data_ptr(), ptr),
                              (0 if steps is None else steps.data_ptr(), ptr)],
                    device=dev)
    return Samples(ray_index, t, points, offsets, counts, total_dev, steps)


class _Composite(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sigma, rgb, t, offsets, counts, dt, steps, with_distortion, cone):
        R = counts.shape[0]
        dev = sigma.device
        color = torch.empty(R, 3, dtype=torch.float32, device=dev)
        opacity = torch.empty(R, dtype=torch.float32, device=dev)
        depth = torch.empty(R, dtype=torch.float32, device=dev)
        dist = torch.empty(R, dtype=torch.float32, device=dev) if with_distortion else None
        dist_u = torch.empty(R, dtype=torch.float32, device=dev) if with_distortion else None  # sum w u
        if R:
            program().launch("composite_fwd", (-(-R // BLOCK_SIZE),), (BLOCK_SIZE,),
                             [(sigma.data_ptr(), ptr), (rgb.data_ptr(), ptr), (t.data_ptr(), ptr),
                              (offsets.data_ptr(), ptr), (counts.data_ptr(), ptr), (float(dt), f32),
                              (0 if steps is None else steps.data_ptr(), ptr), (int(cone), i32), (R, u32),
                              (color.data_ptr(), ptr), (opacity.data_ptr(), ptr), (depth.data_ptr(), ptr),
                              (0 if dist is None else dist.data_ptr(), ptr),
                              (0 if dist_u is None else dist_u.data_ptr(), ptr)],
                             device=dev)
        ctx.save_for_backward(sigma, rgb, t, offsets, counts, steps, opacity, dist_u)
        ctx.dt, ctx.cone = dt, cone
        if dist is None:
            return color, opacity, depth
        return color, opacity, depth, dist

    @staticmethod
    @once_differentiable
    def backward(ctx, g_color, g_opacity, g_depth, g_dist=None):
        sigma, rgb, t, offsets, counts, steps, opacity, dist_u = ctx.saved_tensors
        R = counts.shape[0]
        dev = sigma.device
        g_color = torch.zeros(R, 3, device=dev) if g_color is None else g_color.float().contiguous()
        g_opacity = torch.zeros(R, device=dev) if g_opacity is None else g_opacity.float().contiguous()
        g_depth = torch.zeros(R, device=dev) if g_depth is None else g_depth.float().contiguous()
        g_dist = None if g_dist is None else g_dist.float().contiguous()
        g_sigma = torch.zeros_like(sigma)
        g_rgb = torch.zeros_like(rgb)
        if R:
            program().launch("composite_bwd", (-(-R // BLOCK_SIZE),), (BLOCK_SIZE,),
                             [(sigma.data_ptr(), ptr), (rgb.data_ptr(), ptr), (t.data_ptr(), ptr),
                              (offsets.data_ptr(), ptr), (counts.data_ptr(), ptr), (float(ctx.dt), f32),
                              (0 if steps is None else steps.data_ptr(), ptr), (int(ctx.cone), i32), (R, u32),
                              (g_color.data_ptr(), ptr), (g_opacity.data_ptr(), ptr), (g_depth.data_ptr(), ptr),
                              (0 if g_dist is None else g_dist.data_ptr(), ptr),
                              (opacity.data_ptr(), ptr), (0 if dist_u is None else dist_u.data_ptr(), ptr),
                              (g_sigma.data_ptr(), ptr), (g_rgb.data_ptr(), ptr)], device=dev)
        return g_sigma, g_rgb, None, None, None, None, None, None, None


def composite(sigma: torch.Tensor, rgb: torch.Tensor, t: torch.Tensor, offsets: torch.Tensor,
              counts: torch.Tensor, dt: float, *, steps: torch.Tensor | None = None, distortion: bool = False,
              cone: bool = False, use_kernels: bool | None = None) -> tuple[torch.Tensor, ...]:
    """Front-to-back alpha compositing of packed samples (see :class:`Samples`).

    ``alpha_i = 1 - exp(-sigma_i dt)``, ``w_i = alpha_i prod_{j<i} (1 - alpha_j + 1e-10)``.

    Args:
        sigma: [S] float32 densities; rgb: [S, 3] float32 colours; t: [S] float32 distances.
        offsets: [R] int64, counts: [R] int32 (from :func:`march_rays`).
        dt: the march step; steps: [S] float32 step of each sample instead (``Samples.steps``).
        distortion: also each ray's distortion (mip-NeRF 360, eq. 15), ``sum_ij w_i w_j |u_i - u_j| +
            1/3 sum_i w_i^2 dt``, computed in the same pass over the samples, ray by ray, in the march
            coordinate u (``t`` on box rays; with ``steps``, linear then linear in disparity:
            ``_reference.distortion_coords``; ``cone``: the steps are those of cascades, and u is
            linear, then logarithmic in t); ``_reference.distortion_reference`` is the formula.

    Returns:
        color [R, 3] = sum w rgb (the caller adds ``(1 - opacity) * background``), opacity [R] = sum w,
        depth [R] = sum w t, and with ``distortion`` the distortion [R]; differentiable in ``sigma``
        and ``rgb``.
    """
    dev = sigma.device
    _check("sigma", sigma, (None,), torch.float32, dev)
    S = sigma.shape[0]
    _check("rgb", rgb, (S, 3), torch.float32, dev)
    _check("t", t, (S,), torch.float32, dev)
    _check("offsets", offsets, (None,), torch.int64, dev)
    _check("counts", counts, (offsets.shape[0],), torch.int32, dev)
    if steps is not None:
        _check("steps", steps, (S,), torch.float32, dev)
    if not _use_kernels(dev, use_kernels):
        return composite_reference(sigma, rgb, t, offsets, counts, dt if steps is None else steps,
                                   distortion=distortion, base_step=float(dt), cone=cone)
    return _Composite.apply(sigma.contiguous(), rgb.contiguous(), t.contiguous(), offsets.contiguous(),
                            counts.contiguous(), float(dt), None if steps is None else steps.contiguous(),
                            bool(distortion), bool(cone))
