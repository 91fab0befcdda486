"""Volume rendering of rays through the field, with occupancy-grid sample culling.

Samples are taken at a fixed step along each ray between its entry into and exit from
the scene box (stratified jitter while training), samples in empty cells are dropped
before the network runs, and the rest are alpha-composited front to back (Max 1995;
Mildenhall et al. 2020, eq. 3) over the learned background colour. With scene contraction
(``field.contract``) a ray does not stop at the box: past it the steps are uniform in disparity,
out to ~1000 times the distance it took to cross the box, and each sample has its own step length
(kernels/_reference.py march_steps_reference). With occupancy cascades (``field.cascades``,
instant-ngp's ``aabb_scale``) a ray runs through the outermost cascade's box with a step that grows
with the distance, ``max(step, cone t)``, each sample again with its own step length.

Optionally each ray's distortion (mip-NeRF 360, Barron et al. 2022, eq. 15) comes back too:
``sum_ij w_i w_j |u_i - u_j| + 1/3 sum_i w_i^2 dt`` over its samples (u: their march coordinates,
dt: the march step), small when the ray's weight sits in one short stretch and large when it is
spread out, as floaters and fog spread it. u is t on box rays; on contracted rays it is linear in
t, then in disparity (``kernels._reference.distortion_coords``), so each march step counts dt, as
mip-NeRF 360 measures the loss in its normalised ray distance rather than in metric t. The packed renderer gets it from ``kernels.composite`` (the same
pass over each ray's samples as its colour, and its gradient in the same backward); the dense one
from ``kernels._reference.distortion_reference`` on its weights (prefix sums along each row).
"""
from __future__ import annotations

import torch

import kernels
from kernels._reference import distortion_coords, distortion_reference, march_steps_reference, ray_box_reference

from .field import NerfField, sh_encode_deg4
from .occupancy import OccupancyGrid


def ray_aabb(o: torch.Tensor, d: torch.Tensor, aabb: torch.Tensor, near: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Entry and exit distances [R] of rays with the box; exit <= entry means a miss."""
    return ray_box_reference(o, d, aabb, near)  # one definition for both renderers (kernels/_reference.py)


def sample_jitter(rays: int, perturb: bool, generator: torch.Generator | None,
                  device: torch.device) -> torch.Tensor:
    """Offsets [R] of the samples within their march step: uniform draws from ``generator`` (on
    its own device) when ``perturb``, else 0.5 (step midpoints)."""
    if not perturb:
        return torch.full((rays,), 0.5, device=device)
    return torch.rand((rays,), generator=generator, device=generator.device if generator else "cpu").to(device)


def render_rays(
    field: NerfField,
    grid: OccupancyGrid | None,
    o: torch.Tensor,
    d: torch.Tensor,
    step_size: float,
    max_samples: int,
    near: float = 0.0,
    perturb: bool = False,
    generator: torch.Generator | None = None,
    fused: bool = False,
    background: torch.Tensor | None = None,
    appearance: torch.Tensor | None = None,
    distortion: bool = False,
    cull: bool = False,
) -> dict[str, torch.Tensor]:
    """Render rays [R, 3] (origins ``o``, unit directions ``d``).

    ``fused``: march and composite packed samples with :func:`kernels.march_rays` and
    :func:`kernels.composite` (CUDA kernels on a GPU, their PyTorch references elsewhere): the same
    samples and, up to float summation order, the same result as the dense path below, in a few
    launches instead of ~60. ``background``: a colour [R, 3] per ray behind the field (random
    colours while training on images with alpha); None: the field's own (learned or fixed).
    ``appearance``: each ray's appearance code [R, appearance_dim] (None: the field's mean code).
    ``distortion``: also each ray's distortion (module docstring), differentiable.
    ``cull``: (``fused`` only) drop each ray's samples behind an opaque surface before the
    differentiable pass (:func:`render_packed`).

    Returns:
        dict with ``rgb`` [R, 3], ``opacity`` [R], ``depth`` [R] and ``num_samples``
        (network evaluations, a 0-d tensor); with ``distortion``, ``distortion`` [R].
    """
    R = o.shape[0]
    dev = o.device
    jitter = sample_jitter(R, perturb, generator, dev)  # the same draws for both paths
    if fused:
        return render_packed(field, grid, o, d, jitter, step_size, max_samples, near, background=background,
                             appearance=appearance, distortion=distortion, cull=cull)
    if field.contract or field.cascades:  # each sample its own step
        t, dt, valid = _steps(field, o, d, jitter, step_size, max_samples, near)
    else:
        tmin, tmax = ray_aabb(o, d, field.aabb, near)
        steps = torch.arange(max_samples, device=dev, dtype=o.dtype)
        t = tmin[:, None] + (steps[None, :] + jitter[:, None]) * step_size  # [R, S] sample midpoints
        valid = t < tmax[:, None]
        dt = step_size
    pts = o[:, None, :] + t[..., None] * d[:, None, :]
    if grid is not None:
        # every sample looked up (a clamped cell index, cheap) rather than the valid ones picked by a
        # boolean mask first: the mask would cost a second host sync per batch besides nonzero below
        valid = valid & grid.occupied(pts.reshape(-1, 3)).view(R, max_samples)
    idx = valid.nonzero(as_tuple=True)  # the one host sync: the surviving sample count
    sigma = torch.zeros((R, max_samples), device=dev, dtype=o.dtype)
    rgb = torch.zeros((R, max_samples, 3), device=dev, dtype=o.dtype)
    if idx[0].numel() > 0:
        # the view encoding once per ray, gathered per sample (rays hold ~10-100 samples each)
        s, c = field(pts[idx], d_enc=sh_encode_deg4(d)[idx[0]], app=None if appearance is None else appearance[idx[0]])
        sigma = sigma.index_put(idx, s.to(o.dtype))
        rgb = rgb.index_put(idx, c.to(o.dtype))
    alpha = 1.0 - torch.exp(-sigma * dt)
    trans = torch.cumprod(torch.cat([torch.ones((R, 1), device=dev), 1.0 - alpha + 1e-10], dim=1), dim=1)[:, :-1]
    w = alpha * trans
    opacity = w.sum(dim=1)
    bg = field.background_rgb() if background is None else background
    color = (w[..., None] * rgb).sum(dim=1) + (1.0 - opacity)[:, None] * bg
    depth = (w * t).sum(dim=1)
    out = {"rgb": color, "opacity": opacity, "depth": depth, "num_samples": torch.tensor(idx[0].numel())}
    if distortion:
        u = distortion_coords(t, dt if field.contract or field.cascades else None, step_size, bool(field.cascades))
        out["distortion"] = distortion_reference(w, u, step_size)
    return out


# A ray stops once its transmittance is below this (instant-ngp; nerfacc's early_stop_eps): what is
# left could add at most 1e-4 of a colour, 0.03 of one 8-bit level.
EARLY_STOP_T = 1e-4


@torch.no_grad()
def render_rays_early_stop(
    field: NerfField,
    grid: OccupancyGrid | None,
    o: torch.Tensor,
    d: torch.Tensor,
    step_size: float,
    max_samples: int,
    near: float = 0.0,
    segment: int = 16,
    appearance: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """:func:`render_rays` for rendering views (no gradients, step midpoints): the same samples,
    marched ``segment`` steps at a time, and a ray is dropped once its transmittance falls below
    :data:`EARLY_STOP_T` (or it leaves the box), so the network never sees the occupied cells
    behind a surface. Same outputs as :func:`render_rays` up to the light that early stop leaves
    out (at most ``EARLY_STOP_T`` per ray) and float summation order."""
    R, dev, dt = o.shape[0], o.device, o.dtype
    per_sample = field.contract or field.cascades
    if per_sample:  # every step of every ray at once (each its own length); segments slice them
        t_all, step_all, valid_all = _steps(field, o, d, torch.full((R,), 0.5, device=dev), step_size,
                                            max_samples, near)
        live = valid_all[:, 0].nonzero(as_tuple=True)[0]
    else:
        tmin, tmax = ray_aabb(o, d, field.aabb, near)
        live = (tmin < tmax).nonzero(as_tuple=True)[0]
    color = torch.zeros((R, 3), device=dev, dtype=dt)
    opacity = torch.zeros(R, device=dev, dtype=dt)
    depth = torch.zeros(R, device=dev, dtype=dt)
    trans = torch.ones(R, device=dev, dtype=dt)
    d_enc = sh_encode_deg4(d)
    evaluated = 0
    for k0 in range(0, max_samples, segment):
        if live.numel() == 0:
            break
        k1 = min(k0 + segment, max_samples)
        if per_sample:
            t, valid, step = t_all[live, k0:k1], valid_all[live, k0:k1], step_all[live, k0:k1]
        else:
            steps = torch.arange(k0, k1, device=dev, dtype=dt)
            t = tmin[live, None] + (steps[None, :] + 0.5) * step_size  # [L, S]
            valid, step = t < tmax[live, None], step_size
        S = t.shape[1]
        pts = o[live, None, :] + t[..., None] * d[live, None, :]
        if grid is not None:
            valid = valid & grid.occupied(pts.reshape(-1, 3)).view(-1, S)
        idx = valid.nonzero(as_tuple=True)
        sigma = torch.zeros((live.numel(), S), device=dev, dtype=dt)
        rgb = torch.zeros((live.numel(), S, 3), device=dev, dtype=dt)
        if idx[0].numel() > 0:
            rays = live[idx[0]]
            s, c = field(pts[idx], d_enc=d_enc[rays], app=None if appearance is None else appearance[rays])
            sigma = sigma.index_put(idx, s.to(dt))
            rgb = rgb.index_put(idx, c.to(dt))
            evaluated += idx[0].numel()
        alpha = 1.0 - torch.exp(-sigma * step)
        keep = torch.cumprod(torch.cat([torch.ones((live.numel(), 1), device=dev, dtype=dt),
                                        1.0 - alpha + 1e-10], dim=1), dim=1)  # [L, S + 1]
        w = alpha * keep[:, :-1] * trans[live, None]
        color[live] += (w[..., None] * rgb).sum(dim=1)
        opacity[live] += w.sum(dim=1)
        depth[live] += (w * t).sum(dim=1)
        trans[live] = trans[live] * keep[:, -1]
        if per_sample:
            more = valid_all[live, k1] if k1 < max_samples else torch.zeros_like(live, dtype=torch.bool)
        else:
            more = t[:, -1] + step_size < tmax[live]
        live = live[(trans[live] > EARLY_STOP_T) & more]
    color = color + (1.0 - opacity)[:, None] * field.background_rgb()
    return {"rgb": color, "opacity": opacity, "depth": depth, "num_samples": torch.tensor(evaluated)}


def render_packed(field: NerfField, grid: OccupancyGrid | None, o: torch.Tensor, d: torch.Tensor,
                  jitter: torch.Tensor, step_size: float, max_samples: int, near: float = 0.0,
                  capacity: int | None = None, background: torch.Tensor | None = None,
                  appearance: torch.Tensor | None = None, distortion: bool = False,
                  cull: bool = False, march_capacity: int | None = None) -> dict[str, torch.Tensor]:
    """The packed-sample renderer of :func:`render_rays` (``fused=True``) with the sample jitter [R]
    given. ``capacity``: a fixed sample budget (see :func:`kernels.march_rays`): no host sync and
    the same shapes every call (what a CUDA graph needs); ``num_samples`` is then a 0-d device
    tensor (the samples evaluated; a 0-d CPU tensor without a budget) and ``total_samples`` the
    count before the budget's cut. ``background``, ``appearance``, ``distortion``: as :func:`render_rays`.

    ``cull``: the marched samples' densities are evaluated once without gradients, and each ray's
    samples behind the point where its transmittance falls below :data:`EARLY_STOP_T` are dropped
    before the differentiable pass (instant-ngp's compacted samples, nerfacc's ``sigma_fn``): they
    could add at most that much light, and the step need not run the field forward and backward on
    them. ``num_samples`` and ``total_samples`` then count the kept samples. With a ``capacity``
    the march gets its own fixed budget, ``march_capacity``, and the kept samples are packed into
    ``capacity`` rows without a host sync (``march_total`` is the march's uncut count)."""
    use = field.encoding.use_kernels  # the method's resolved choice: kernels here, or the references
    if cull and (capacity is None) != (march_capacity is None):
        raise ValueError("render_packed: cull takes both capacity and march_capacity, or neither")
    s = _march(field, grid, o, d, jitter, step_size, max_samples, near, march_capacity if cull else capacity)
    march_total = s.total
    if cull:
        s = _pack_visible(s, _visible(field, s, step_size), capacity)
    if s.t.numel() > 0:
        sigma, rgb = field(s.points, d_enc=sh_encode_deg4(d)[s.ray_index],
                           app=None if appearance is None else appearance[s.ray_index])
    else:
        sigma, rgb = o.new_zeros(0), o.new_zeros(0, 3)
    color, opacity, depth, *dist = kernels.composite(sigma.float(), rgb.float(), s.t, s.offsets, s.counts,
                                                     step_size, steps=s.steps, distortion=distortion,
                                                     cone=bool(field.cascades), use_kernels=use)
    bg = field.background_rgb() if background is None else background
    color = color + (1.0 - opacity)[:, None] * bg
    out = {"rgb": color, "opacity": opacity, "depth": depth}
    if distortion:
        out["distortion"] = dist[0]
    if capacity is None:
        out["num_samples"] = torch.tensor(s.t.numel())
    else:
        out["num_samples"] = torch.clamp(s.total, max=capacity)
        out["total_samples"] = s.total
    if cull:  # the march's uncut count (a 0-d tensor): what a march budget is sized from
        out["march_total"] = march_total
    return out


@torch.no_grad()
def occluded_samples(field: NerfField, grid: OccupancyGrid | None, o: torch.Tensor, d: torch.Tensor,
                     jitter: torch.Tensor, step_size: float, max_samples: int, near: float = 0.0) -> dict:
    """Of the packed samples a training step would evaluate for rays ``o``, ``d`` (marched as
    :func:`render_packed` marches them), how many lie where the ray's transmittance has already
    fallen below :data:`EARLY_STOP_T`, from the field's current densities.

    Those samples get next to no gradient, yet the packed training step evaluates them forward and
    backward; instant-ngp (its compacted samples) and nerfacc (``OccGridEstimator.sampling`` with a
    ``sigma_fn``) cull them before the differentiable pass, and their sample budgets count only what
    remains. Returns ``samples`` (marched), ``occluded`` (of those), ``kept_per_ray`` [R] (the
    samples before each ray's cut: a prefix of its samples, as transmittance only falls) as tensors.
    """
    s = _march(field, grid, o, d, jitter, step_size, max_samples, near)
    visible = _visible(field, s, step_size)
    kept = torch.zeros(o.shape[0], dtype=torch.int64, device=o.device).index_add_(0, s.ray_index, visible.long())
    return {"samples": int(s.t.numel()), "occluded": int(s.t.numel() - visible.sum()), "kept_per_ray": kept}


def _march(field: NerfField, grid: OccupancyGrid | None, o: torch.Tensor, d: torch.Tensor, jitter: torch.Tensor,
           step_size: float, max_samples: int, near: float, capacity: int | None = None) -> kernels.Samples:
    """The packed samples of rays ``o``, ``d`` through ``field``'s box and ``grid``'s occupied cells."""
    return kernels.march_rays(o.float().contiguous(), d.float().contiguous(), jitter, field.aabb,
                              None if grid is None else grid.mask, step_size, max_samples, near,
                              capacity=capacity, contract=field.contract, cascades=field.cascades,
                              cone=field.cone, use_kernels=field.encoding.use_kernels)


def _steps(field: NerfField, o: torch.Tensor, d: torch.Tensor, jitter: torch.Tensor, step_size: float,
           max_samples: int, near: float):
    """(t, step, valid) [R, max_samples] of rays through a field whose samples each have their own step
    (scene contraction or occupancy cascades): kernels/_reference.py march_steps_reference."""
    return march_steps_reference(o, d, jitter, field.aabb, step_size, max_samples, near, field.contract,
                                 field.cascades, field.cone)


@torch.no_grad()
def _visible(field: NerfField, s: kernels.Samples, step_size: float) -> torch.Tensor:
    """[S] bool: the rows of the packed samples ``s`` that are samples (a fixed budget's padding past
    ``s.total`` is not) with a transmittance in front of them, from the field's densities, of at least
    :data:`EARLY_STOP_T`: a prefix of each ray's samples, as transmittance only falls along a ray.
    No host sync (a CUDA graph's step computes it too)."""
    S = s.t.numel()
    if S == 0:
        return torch.zeros(0, dtype=torch.bool, device=s.t.device)
    valid = torch.arange(S, device=s.t.device) < s.total.clamp(max=S)
    sigma = field.density(s.points).double()
    tau = sigma * (s.steps.double() if s.steps is not None else step_size)  # each sample's optical thickness
    csum = torch.cat([tau.new_zeros(1), torch.cumsum(torch.where(valid, tau, 0.0), 0)])  # [S + 1]
    start = csum[s.offsets.clamp(max=S)][s.ray_index]  # at each row's ray's first row (cut rays: past the end)
    return valid & (torch.exp(-(csum[:-1] - start)) >= EARLY_STOP_T)  # thickness in front of each sample


def _pack_visible(s: kernels.Samples, keep: torch.Tensor, capacity: int | None) -> kernels.Samples:
    """The rows ``keep`` [S] of the packed samples ``s`` (a prefix of each ray's), packed in ray order
    into ``capacity`` rows without a host sync (a CUDA graph's step; kept samples past ``capacity``
    are dropped and their rays' counts cut, as the march's budget does, and rows past the kept ones
    are zeros), or into exactly as many rows as are kept (None: one host read). ``total``: the kept
    count, uncut."""
    rays, dev = s.counts.shape[0], s.t.device
    total = keep.sum()
    capacity = int(total) if capacity is None else capacity
    pos = torch.cumsum(keep.long(), 0) - 1
    fits = keep & (pos < capacity)
    slot = torch.where(fits, pos, capacity)  # row ``capacity``: a bin for what is not kept, cut off below

    def pack(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((capacity + 1, *x.shape[1:]))
        return out.index_put_((slot,), x)[:capacity]

    counts = torch.zeros(rays, dtype=torch.int64, device=dev).index_add_(0, s.ray_index, fits.long())
    offsets = torch.cumsum(counts, 0) - counts
    return kernels.Samples(pack(s.ray_index), pack(s.t), pack(s.points), offsets, counts.to(s.counts.dtype),
                           total, None if s.steps is None else pack(s.steps))
