"""Pure-PyTorch references of the kernels in ``csrc/``: same signatures, same arithmetic.

These run wherever PyTorch runs (the CPU path, and the yardstick the CUDA kernels are tested against).
They favour plain, vectorised tensor code over speed; autograd differentiates them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# instant-ngp's spatial hash primes (Mueller et al. 2022, Eq. 4; pi_1 = 1 keeps x coherent in memory).
HASH_PRIMES = (1, 2654435761, 805459861)
_U32 = 0xFFFFFFFF
# Corner c of a cell: bit 0 -> +x, bit 1 -> +y, bit 2 -> +z (the kernel's order).
_CORNER_BITS = [[(c >> d) & 1 for d in range(3)] for c in range(8)]


def _as_int_list(resolutions: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(resolutions, torch.Tensor):
        return [int(r) for r in resolutions.tolist()]
    return [int(r) for r in resolutions]


def grid_vertices(resolution: int, offset: float = 0.0) -> int:
    """Vertices per axis V of a level of resolution R: R + 1, or R + 2 with a grid offset (the grid
    coordinate then spans [offset, R + offset], which reaches into one more cell)."""
    return max(int(resolution), 1) + (2 if offset > 0 else 1)


def grid_index(corners: torch.Tensor, resolution: int, table_size: int, offset: float = 0.0) -> torch.Tensor:
    """Table row of integer grid corners at one level.

    Args:
        corners: [..., 3] int64 corners in [0, V - 1].
        resolution: R of the level.
        table_size: T, rows of the level's table.
        offset: the grid offset, which sets V (:func:`grid_vertices`).

    Returns:
        [...] int64 in [0, T): dense ``x + y V + z V^2`` when V^3 <= T, else the spatial hash
        ``(x * 1 ^ y * 2654435761 ^ z * 805459861) mod T`` in uint32 arithmetic.
    """
    x, y, z = corners.unbind(-1)
    r1 = grid_vertices(resolution, offset)
    if r1**3 <= table_size:
        return x + y * r1 + z * (r1 * r1)
    # Products fit in int64 (corners < 2^31, primes < 2^32); masking each to 32 bits then XOR is
    # the same as XOR then mask, which is what uint32 wrap-around gives.
    h = (x * HASH_PRIMES[0]) ^ ((y * HASH_PRIMES[1]) & _U32) ^ ((z * HASH_PRIMES[2]) & _U32)
    return (h & _U32) % table_size


def hash_encode_reference(points: torch.Tensor, table: torch.Tensor,
                          resolutions: torch.Tensor | Sequence[int], offset: float = 0.0) -> torch.Tensor:
    """Multi-resolution hash encoding in plain PyTorch (the CUDA kernel's reference).

    Args:
        points: [N, 3] positions in [0, 1] (clamped; NaN is read as 0, like the kernel).
        table: [L, T, F] features, float16, float32 or float64.
        resolutions: [L] grid resolution per level (int tensor or list of ints).
        offset: in [0, 1), added to every level's grid coordinate ``x * R`` (0.5: tiny-cuda-nn's
            half-cell shift); with one, a level has R + 2 vertices per axis instead of R + 1.

    Returns:
        [N, L * F] level-major features (``out[:, l * F + f]``), float32 for float16/float32 tables
        (float64 for float64 ones). A float16 table is read as float32 before interpolation, so its
        gradient is summed in float32 and cast once, as the kernel does. Differentiable in ``table``
        and in ``points`` (the CUDA path returns no gradient for ``points``).
    """
    res = _as_int_list(resolutions)
    num_levels, table_size, _ = table.shape
    if len(res) != num_levels:
        raise ValueError(f"resolutions has {len(res)} entries but table has {num_levels} levels")
    dtype = torch.promote_types(torch.promote_types(table.dtype, torch.float32), points.dtype)
    x = torch.nan_to_num(points.to(dtype), nan=0.0).clamp(0.0, 1.0)
    n = points.shape[0]
    outs = []
    for level, r in enumerate(res):
        r = max(r, 1)
        r1 = grid_vertices(r, offset)
        last = r1 - 2  # the last cell
        pos = x * r + offset  # [N, 3]; + 0.0 changes no value
        cell = torch.floor(pos).clamp(max=last)
        frac = pos - cell
        # Per axis the two corner weights (1 - frac, frac) and coordinates (cell, cell + 1), [N, 2]
        # each; the 8 corners are their outer products, laid out [N, z, y, x] so that the flat
        # index is corner c = x + 2 y + 4 z (the kernel's order). Work per level stays [N, 2] per
        # axis instead of [N, 8, 3].
        w = torch.stack([1 - frac, frac], dim=-1)  # [N, 3, 2]
        wxy = w[:, 1, :, None] * w[:, 0, None, :]  # [N, y, x]: wx * wy (commutes exactly)
        weights = (w[:, 2, :, None, None] * wxy[:, None]).reshape(n, 8)  # (wx * wy) * wz like the kernel
        c = cell.long()[:, :, None] + torch.tensor([0, 1], device=points.device)  # [N, 3, 2]
        cx, cy, cz = c[:, 0, None, None, :], c[:, 1, None, :, None], c[:, 2, :, None, None]
        if r1**3 <= table_size:  # dense, as grid_index
            rows = (cx + cy * r1 + cz * (r1 * r1)).reshape(n, 8)
        else:  # the spatial hash of grid_index, one axis at a time
            h = (cx * HASH_PRIMES[0]) ^ ((cy * HASH_PRIMES[1]) & _U32) ^ ((cz * HASH_PRIMES[2]) & _U32)
            rows = ((h & _U32) % table_size).reshape(n, 8)
        # index_select, not table[rows]: its backward (index_add_) sums repeated rows in a fixed
        # order, so CPU runs with several threads are bit-identical (advanced indexing's backward,
        # index_put_ with accumulate, adds them in thread order).
        feats = table[level].to(dtype).index_select(0, rows.reshape(-1)).reshape(*rows.shape, table.shape[-1])
        outs.append((weights[..., None] * feats).sum(dim=1))
    return torch.cat(outs, dim=1)


# ---------------------------------------------------------------- volume rendering (csrc/render.cu)


def ray_box_reference(origins: torch.Tensor, dirs: torch.Tensor, aabb: torch.Tensor,
                      near: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry and exit distances [R] of rays with the box ``aabb`` [2, 3]; exit <= entry: a miss.
    Direction components below 1e-9 in magnitude count as +1e-9; the entry is clamped to >= near."""
    inv = 1.0 / torch.where(dirs.abs() < 1e-9, torch.full_like(dirs, 1e-9), dirs)
    t0 = (aabb[0] - origins) * inv
    t1 = (aabb[1] - origins) * inv
    tmin = torch.minimum(t0, t1).amax(dim=-1).clamp(min=near)
    tmax = torch.maximum(t0, t1).amin(dim=-1)
    return tmin, tmax


def contract_reference(points: torch.Tensor, aabb: torch.Tensor) -> torch.Tensor:
    """Scene contraction (mip-NeRF 360, Barron et al. 2022, eq. 10, with the L-inf norm as
    nerfstudio's hash-grid models use it): points [N, 3] -> [N, 3] in [0, 1]^3.

    ``u = (p - centre) / half`` maps the box ``aabb`` to [-1, 1]^3; with ``n = max |u_k|``, points
    with n > 1 go to ``(2 - 1 / n) u / n`` (all of space into [-2, 2]^3); then ``(u + 2) / 4``. The
    box fills the middle half of every axis. Every op rounds once, as the kernel's intrinsics."""
    lo, hi = aabb[0], aabb[1]
    centre = (lo + hi) * 0.5
    half = (hi - lo) * 0.5
    u = (points - centre) / half
    n = u.abs().amax(dim=-1, keepdim=True)
    outside = n > 1.0
    u = torch.where(outside, u * ((2.0 - 1.0 / n) / n), u)
    return (u + 2.0) * 0.25


def uncontract_reference(x: torch.Tensor, aabb: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`contract_reference`: points of [0, 1]^3 back to the world (the outer
    shell, contracted radius 2, is infinitely far: clamped to contracted radius 2 - 1e-4)."""
    lo, hi = aabb[0], aabb[1]
    v = x * 4.0 - 2.0
    m = v.abs().amax(dim=-1, keepdim=True).clamp(max=2.0 - 1e-4)
    n = 1.0 / (2.0 - m)  # the L-inf norm before contraction, where m > 1
    u = torch.where(m > 1.0, v * (n / m), v)
    return (lo + hi) * 0.5 + u * ((hi - lo) * 0.5)


def cascade_box_reference(aabb: torch.Tensor, cascades: int) -> torch.Tensor:
    """[2, 3] the outermost of ``cascades`` nested boxes around ``aabb`` (instant-ngp's ``aabb_scale``
    = 2^(cascades - 1)): box k is ``aabb`` scaled by 2^k about its centre. Rounded as the kernel."""
    lo, hi = aabb[0], aabb[1]
    centre = (lo + hi) * 0.5
    half = (hi - lo) * 0.5 * float(2 ** (cascades - 1))  # a power of two: exact
    return torch.stack([centre - half, centre + half])


def cascade_level_reference(points: torch.Tensor, aabb: torch.Tensor,
                            cascades: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(level [N] int64, u [N, 3]) of points [N, 3] among ``cascades`` nested boxes around ``aabb``
    (:func:`cascade_box_reference`): the smallest box k that holds the point (points outside every
    box: the last), and the point's coordinates in that box, [-1, 1] per axis inside it. Only
    comparisons with powers of two and scalings by them: exact, as in the kernel."""
    lo, hi = aabb[0], aabb[1]
    centre = (lo + hi) * 0.5
    half = (hi - lo) * 0.5
    u = (points - centre) / half
    n = u.abs().amax(dim=-1)
    level = torch.zeros(points.shape[0], dtype=torch.int64, device=points.device)
    for k in range(cascades - 1):
        level += (n > float(2**k)).long()
    scale = torch.ldexp(torch.ones_like(n), -level.to(torch.int32))  # 2^-level, exact
    return level, u * scale[:, None]


def occupancy_cell_reference(points: torch.Tensor, aabb: torch.Tensor, resolution: int,
                             contract: bool = False, cascades: int = 0) -> torch.Tensor:
    """Flat cell [N] (int64) of points [N, 3] in a ``resolution``^3 grid over ``aabb`` (clamped), or
    with ``contract`` over the contracted space (:func:`contract_reference`), or with ``cascades`` > 0
    in the grid of the smallest of the nested boxes that holds the point, grid k's cells after the
    k r^3 cells of the grids inside it (:func:`cascade_level_reference`)."""
    r = resolution
    if cascades > 0:
        level, u = cascade_level_reference(points, aabb, cascades)
        ijk = (((u + 1.0) * 0.5) * r).long().clamp(0, r - 1)
        return level * r**3 + (ijk[:, 0] * r + ijk[:, 1]) * r + ijk[:, 2]
    xn = contract_reference(points, aabb) if contract else (points - aabb[0]) / (aabb[1] - aabb[0])
    ijk = (xn * r).long().clamp(0, r - 1)
    return (ijk[:, 0] * r + ijk[:, 1]) * r + ijk[:, 2]


# Contracted marching: the disparity segment ends where 1/t falls to this fraction of its start
# (1000 times the linear segment's end: far past the grid's outer cells).
FAR_RATIO = 1e-3


def march_steps_reference(origins: torch.Tensor, dirs: torch.Tensor, jitter: torch.Tensor, aabb: torch.Tensor,
                          dt: float, max_samples: int, near: float = 0.0, contract: bool = False,
                          cascades: int = 0, cone: float = 0.0):
    """Sample distances along rays before occupancy culling: (t [R, S], step [R, S] or None,
    valid [R, S]) for S = ``max_samples`` steps (``valid`` is a prefix of each row).

    Box (``contract`` False): ``t = tmin + (s + jitter) dt`` inside ``aabb`` (tmin: the entry, at
    least ``near``); every step is ``dt`` (``step`` None).

    Contracted (the scene beyond the box squeezed into a shell, :func:`contract_reference`):
    linear steps ``t = near + (s + jitter) dt`` up to T1 = max(the box exit, the point nearest the
    box centre, near + half the box diagonal), then steps uniform in disparity, ``t = 1 / (1/T1 - (k + jitter) dd)``
    for the k-th one with ``dd = dt / T1^2`` (so the step length ``dd t^2`` starts at dt) while
    ``1/t`` stays above ``FAR_RATIO / T1``, as mip-NeRF 360's sampling in disparity beyond the
    inner region (and nerfstudio's lin-disp sampler).

    Cascades (``cascades`` > 0, instant-ngp's ``aabb_scale`` = 2^(cascades - 1)): the ray runs
    through the outermost box (:func:`cascade_box_reference`) with a step that grows with the
    distance, ``step(t) = max(dt, cone t)`` (instant-ngp's cone tracing; ``cone`` 1/256 in its
    unbounded scenes): ``t_0 = tmin + jitter step(tmin)``, ``t_(s+1) = t_s + step(t_s)`` while
    ``t_s`` is before the exit. One step at a time, as the kernel takes them, so both round alike.
    """
    R = origins.shape[0]
    if cascades > 0:
        return _cone_steps(origins, dirs, jitter, cascade_box_reference(aabb, cascades), dt, max_samples, near, cone)
    s = torch.arange(max_samples, device=origins.device, dtype=origins.dtype)
    j = jitter.reshape(R, 1)
    tmin, tmax = ray_box_reference(origins, dirs, aabb, near)
    if not contract:
        t = tmin[:, None] + (s[None, :] + j) * dt  # [R, S]
        return t, None, t < tmax[:, None]
    c = (aabb[0] + aabb[1]) * 0.5
    w = (c - origins) * dirs
    t_close = (w[:, 0] + w[:, 1]) + w[:, 2]
    e = aabb[1] - aabb[0]
    reach = ((e[0] * e[0] + e[1] * e[1]) + e[2] * e[2]).sqrt() * 0.5  # half the box diagonal
    t1_end = torch.maximum(torch.maximum(tmax, t_close), torch.full_like(tmax, near) + reach)
    t_lin = near + (s[None, :] + j) * dt
    lin = t_lin < t1_end[:, None]
    n1 = lin.sum(dim=1, keepdim=True).to(origins.dtype)
    inv = 1.0 / t1_end[:, None]
    dd = (torch.full_like(t1_end, dt) / (t1_end * t1_end))[:, None]  # one rounding (scalar / tensor: two)
    den = inv - ((s[None, :] - n1) + j) * dd
    far = den > inv * FAR_RATIO
    t_disp = 1.0 / torch.where(lin | ~far, torch.ones_like(den), den)
    t = torch.where(lin, t_lin, t_disp)
    step = torch.where(lin, torch.full_like(t, dt), (dd * t_disp) * t_disp)
    return t, step, lin | far


def _cone_steps(origins, dirs, jitter, box, dt: float, max_samples: int, near: float, cone: float):
    """:func:`march_steps_reference` through the cascades' outer ``box``: steps ``max(dt, cone t)``."""
    R = origins.shape[0]
    tmin, tmax = ray_box_reference(origins, dirs, box, near)
    dt_, cone_ = (torch.tensor(v, dtype=origins.dtype, device=origins.device) for v in (dt, cone))
    ts, steps = [], []
    t = tmin + jitter.reshape(R) * torch.maximum(dt_, tmin * cone_)
    for _ in range(max_samples):
        step = torch.maximum(dt_, t * cone_)
        ts.append(t)
        steps.append(step)
        t = t + step
    t, step = torch.stack(ts, 1), torch.stack(steps, 1)
    return t, step, t < tmax[:, None]


def march_rays_reference(origins: torch.Tensor, dirs: torch.Tensor, jitter: torch.Tensor,
                         aabb: torch.Tensor, occupancy: torch.Tensor | None, dt: float,
                         max_samples: int, near: float = 0.0, contract: bool = False,
                         cascades: int = 0, cone: float = 0.0):
    """Samples of rays [R, 3] at the distances of :func:`march_steps_reference` (box: ``t = tmin +
    (s + jitter) * dt`` for s < max_samples inside the box; ``contract``: linear, then uniform in
    disparity; ``cascades``: steps growing with t through the outermost box), kept where their cell
    of ``occupancy`` ([r, r, r] or [r^3] bool, [cascades r^3] with ``cascades``; None: all) is set
    (cells over the contracted space with ``contract``, :func:`occupancy_cell_reference`).

    Returns:
        (ray_index [S] int64, t [S], points [S, 3], offsets [R] int64, counts [R] int32, step [S] or
        None): samples ray by ray, in marching order; ray i's are ``offsets[i] .. offsets[i] +
        counts[i] - 1``; ``step`` holds each sample's step length (None: all ``dt``).
    """
    R = origins.shape[0]
    t, step, valid = march_steps_reference(origins, dirs, jitter, aabb, dt, max_samples, near, contract,
                                           cascades, cone)
    pts = origins[:, None, :] + t[..., None] * dirs[:, None, :]
    if occupancy is not None:
        r = round((occupancy.numel() // max(1, cascades)) ** (1 / 3))
        cells = occupancy_cell_reference(pts.reshape(-1, 3), aabb, r, contract, cascades)
        valid = valid & occupancy.reshape(-1)[cells].view(R, max_samples)
    ray, k = valid.nonzero(as_tuple=True)
    counts = torch.bincount(ray, minlength=R).to(torch.int32)
    offsets = torch.cumsum(counts, 0, dtype=torch.int64) - counts
    return ray, t[ray, k], pts[ray, k], offsets, counts, None if step is None else step[ray, k]


def distortion_coords(t: torch.Tensor, steps: torch.Tensor | None, base_step: float,
                      cone: bool = False) -> torch.Tensor:
    """The distortion loss's coordinate u [same shape as t], in float64, of samples at distances ``t``
    with march steps ``steps`` (None: box rays, every step ``base_step``; then u = t).

    Contracted rays (:func:`march_steps_reference`) step ``base_step`` up to T1, then uniformly in
    disparity with step ``base_step t^2 / T1^2``. With ``r = sqrt(base_step / step)`` (1 before T1,
    T1 / t past it), ``u = t (2 r - r^2)`` is t up to T1 and ``2 T1 - T1^2 / t`` past it, so every
    march step is ``base_step`` in u: mip-NeRF 360's normalised ray distance (linear, then linear
    in disparity) in the box's units. Measured in metric t instead, the background's far samples
    dominate the sum (fern fell from ~28 to 20.3 dB with the term at 0.001, one H200, 2026-12-04).

    ``cone``: rays through cascades (:func:`march_steps_reference`), whose step is ``max(dt, c t)``.
    There ``u`` is t while the step is dt, and ``T (1 + ln(t / T))`` past ``T = dt / c``, written with
    the step alone as ``(dt t / step) (1 + ln(step / dt))``: again each march step is dt in u (du/dt
    = dt / step), now logarithmic in t past T.
    """
    t64 = t.double()
    if steps is None:
        return t64
    base = torch.tensor(base_step, dtype=torch.float32).double()  # the kernels' float argument
    if cone:
        ratio = (steps.double() / base).clamp(min=1.0)
        return t64 / ratio * (1.0 + torch.log(ratio))
    r = torch.sqrt(base / steps.double()).clamp(max=1.0)
    return t64 * (2.0 * r - r * r)


def distortion_reference(w: torch.Tensor, u: torch.Tensor, dt) -> torch.Tensor:
    """Each ray's distortion (mip-NeRF 360, Barron et al. 2022, eq. 15) [R] from dense weights ``w``
    [R, S] (0 where a sample is not taken), coordinates ``u`` [R, S] (ascending; t on box rays,
    :func:`distortion_coords` on contracted ones) and the step ``dt`` (a number or [R, S]):
    ``sum_ij w_i w_j |u_i - u_j| + 1/3 sum_i w_i^2 dt_i``, in O(S) a ray as
    ``sum_i 2 w_i (u_i W_i - U_i)`` with ``W_i``, ``U_i`` the sums of ``w_j`` and ``w_j u_j`` before
    ``i``, in float64."""
    w64, u64 = w.double(), u.double()
    dt64 = dt.double() if isinstance(dt, torch.Tensor) else dt
    cw, cwu = torch.cumsum(w64, 1) - w64, torch.cumsum(w64 * u64, 1) - w64 * u64
    return (2.0 * w64 * (u64 * cw - cwu) + w64 * w64 * dt64 / 3.0).sum(1).to(w.dtype)


def composite_reference(sigma: torch.Tensor, rgb: torch.Tensor, t: torch.Tensor, offsets: torch.Tensor,
                        counts: torch.Tensor, dt: float | torch.Tensor, distortion: bool = False,
                        base_step: float | None = None, cone: bool = False) -> tuple[torch.Tensor, ...]:
    """Front-to-back alpha compositing of packed samples (ray i: ``offsets[i] ..`` ``counts[i]`` of
    them): alpha = 1 - exp(-sigma dt), w_i = alpha_i prod_{j<i} (1 - alpha_j + 1e-10); ``dt`` one
    step for all samples or one per sample [S].

    Returns:
        color [R, 3] (sum w rgb, no background), opacity [R] (sum w), depth [R] (sum w t), and with
        ``distortion`` each ray's distortion [R] (:func:`distortion_reference` of its weights, in the
        coordinates :func:`distortion_coords` gives with ``base_step``, the march's step, which a
        per-sample ``dt`` needs, and ``cone``, steps of cascades; with a number ``dt`` it is that number);
        differentiable in ``sigma`` and ``rgb``. Rays are composited in a dense [R, longest ray]
        layout, so one ray's values never mix into another's sums.
    """
    R = counts.shape[0]
    cnt = counts.long()
    width = int(cnt.max()) if R else 0
    ray = torch.repeat_interleave(torch.arange(R, device=sigma.device), cnt)
    pos = torch.arange(ray.numel(), device=sigma.device) - (torch.cumsum(cnt, 0) - cnt)[ray]
    src = offsets.long()[ray] + pos  # rows not owned by a ray (a padded sample budget) are never read
    dense_sigma = sigma.new_zeros(R, width).index_put((ray, pos), sigma[src])
    dense_rgb = rgb.new_zeros(R, width, 3).index_put((ray, pos), rgb[src])
    dense_t = t.new_zeros(R, width).index_put((ray, pos), t.detach()[src])
    per_sample = isinstance(dt, torch.Tensor)
    if per_sample:
        dt = t.new_ones(R, width).index_put((ray, pos), dt.detach()[src])  # 1 past a ray's end: no 0 division
    alpha = 1.0 - torch.exp(-dense_sigma * dt)
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1.0 - alpha + 1e-10], dim=1), dim=1)[:, :-1]
    w = alpha * trans
    out = (w[..., None] * dense_rgb).sum(dim=1), w.sum(dim=1), (w * dense_t).sum(dim=1)
    if not distortion:
        return out
    if per_sample and base_step is None:
        raise ValueError("composite_reference: per-sample steps need base_step (the march's step) for the distortion")
    base = base_step if per_sample else dt
    u = distortion_coords(dense_t, dt if per_sample else None, base, cone)
    return (*out, distortion_reference(w, u, base))


# ---------------------------------------------------------------- optimiser (csrc/adam.cu)


@torch.no_grad()
def sparse_adam_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                          steps: torch.Tensor, lr: float, betas: tuple[float, float] = (0.9, 0.99),
                          eps: float = 1e-15, found_inf: torch.Tensor | None = None) -> None:
    """Adam in place on the entries whose gradient is not 0 (tiny-cuda-nn's rule for non-matrix
    parameters): ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, ``s += 1``, ``p -= lr
    sqrt(1 - b2^s) / (1 - b1^s) m / (sqrt(v) + eps)``; nothing changes where ``found_inf`` != 0."""
    b1, b2 = betas
    hit = grad != 0
    if found_inf is not None:
        hit &= found_inf.reshape(()) == 0
    m = torch.where(hit, exp_avg * b1 + grad * (1 - b1), exp_avg)
    v = torch.where(hit, exp_avg_sq * b2 + grad * grad * (1 - b2), exp_avg_sq)
    s = steps + hit.to(torch.int32)
    t = s.clamp(min=1).float()
    scale = torch.sqrt(1 - torch.pow(b2, t)) / (1 - torch.pow(b1, t))
    update = (lr * scale) * m / (v.sqrt() + eps)
    param.sub_(torch.where(hit, update, torch.zeros((), device=param.device)))
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    steps.copy_(s)
