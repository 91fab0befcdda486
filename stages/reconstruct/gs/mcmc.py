"""3DGS as Markov chain Monte Carlo (Kheradmand et al., "3D Gaussian Splatting as Markov Chain Monte
Carlo", NeurIPS 2024): density control without gradient thresholds, as gsplat's ``MCMCStrategy``.

The Gaussians are samples, and training moves them:

* Every training step, Gaussians that are nearly transparent get a random step in position
  (:func:`inject_noise`): noise shaped by the Gaussian's own covariance, scaled by the means'
  current learning rate times ``noise_lr``, and gated by opacity (``sigmoid(100 (1 - o - 0.995))``,
  so opaque Gaussians keep their place).
* Every ``refine_every`` steps between ``refine_start`` and ``refine_stop``, the dead (opacity <=
  ``min_opacity``) are *relocated* onto live ones drawn with probability proportional to opacity,
  and then ``grow_factor`` x more are *added* the same way, up to ``cap_max``. A source drawn n
  times is shared by N = n + 1 Gaussians, so each gets opacity ``1 - (1 - o)^(1/N)`` and scale
  ``o / D x scale`` with ``D = sum_{j=1..N} C(N, j) (-1)^(j-1) o_new^j / sqrt(j)`` (the paper's
  eq. 9-10; its double sum over i and k folds into one over j by the hockey-stick identity):
  together they render like the source did (:func:`relocation`).
* The loss carries L1 penalties on opacity and scale (``opacity_reg``, ``scale_reg``), which push
  unneeded Gaussians to die and be relocated (the method adds them).

Relocation edits the parameters and their Adam moments in place (the moments of every Gaussian
it touches restart at zero), so a CUDA graph of the training view stays valid; growth appends
rows (densify.py's surgery: the parameters are replaced, and the loop re-binds). Every random draw
comes from the generator every rank shares and the opacities are replicated, so data-parallel
ranks move identically (the replica check compares them).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from stages.common.params import check

from .densify import append_rows, zero_state
from .model import quat_to_rotmat

MAX_SHARE = 51  # a source shared by more Gaussians than this is split as if by this many (gsplat's table size)


@dataclass
class MCMCParams:
    """``reconstruct.gs.mcmc``: used when ``gs.strategy`` is ``mcmc``. Defaults are gsplat's
    MCMCStrategy and its example trainer's mcmc preset (initial opacity 0.5, scale 0.1, both
    regularisers 0.01)."""

    cap_max: int = 1_000_000  # the Gaussian budget growth stops at
    noise_lr: float = 5e5  # position noise = means lr x this x covariance x opacity gate
    refine_start: int = 500
    refine_stop: int = 25_000
    refine_every: int = 100
    min_opacity: float = 0.005  # dead at or below this; relocated opacities are clamped to it
    grow_factor: float = 1.05  # Gaussians added per refinement: x this, up to cap_max
    opacity_reg: float = 0.01  # + opacity_reg x mean(opacity) in the loss
    scale_reg: float = 0.01  # + scale_reg x mean(scale) in the loss
    init_opacity: float = 0.5  # in place of gs.init_opacity
    init_scale: float = 0.1  # in place of gs.init_scale (x the mean distance to the 3 nearest points)

    def __post_init__(self) -> None:
        check(self.cap_max >= 1, "cap_max", "must be >= 1", self.cap_max)
        check(self.noise_lr >= 0, "noise_lr", "must be >= 0", self.noise_lr)
        check(self.refine_start >= 0, "refine_start", "must be >= 0", self.refine_start)
        check(self.refine_stop >= 0, "refine_stop", "must be >= 0", self.refine_stop)
        check(self.refine_every >= 1, "refine_every", "must be >= 1", self.refine_every)
        check(0 < self.min_opacity < 0.5, "min_opacity", "must be in (0, 0.5)", self.min_opacity)
        check(self.grow_factor >= 1, "grow_factor", "must be >= 1", self.grow_factor)
        check(self.opacity_reg >= 0, "opacity_reg", "must be >= 0", self.opacity_reg)
        check(self.scale_reg >= 0, "scale_reg", "must be >= 0", self.scale_reg)
        check(0 < self.init_opacity < 1, "init_opacity", "must be in (0, 1)", self.init_opacity)
        check(self.init_scale > 0, "init_scale", "must be > 0", self.init_scale)


# ---------------------------------------------------------------------------- the relocation rule


_TABLES: dict = {}


def _share_table(device) -> tuple[Tensor, Tensor]:
    """(C(N, j) for N, j in 0..MAX_SHARE [float64, exact], (-1)^(j-1) / sqrt(j) for j in 0..MAX_SHARE
    (0 at j = 0)), cached per device."""
    key = str(device)
    if key not in _TABLES:
        size = MAX_SHARE + 1
        binom = torch.tensor([[float(math.comb(n, j)) for j in range(size)] for n in range(size)],
                             dtype=torch.float64)
        sign = torch.tensor([0.0] + [(-1.0) ** (j - 1) / math.sqrt(j) for j in range(1, size)], dtype=torch.float64)
        _TABLES[key] = (binom.to(device), sign.to(device))
    return _TABLES[key]


@torch.no_grad()
def relocation(opacities: Tensor, scales: Tensor, shares: Tensor) -> tuple[Tensor, Tensor]:
    """Opacity and scale of each of ``shares`` Gaussians that together stand in for one.

    Args:
        opacities: [E] in (0, 1); scales: [E, 3] (linear); shares: [E] ints >= 1 (how many
            Gaussians share the source: 1 leaves it as it is), capped at :data:`MAX_SHARE`.

    Returns:
        (opacities [E], scales [E, 3]): ``1 - (1 - o)^(1/N)`` and ``o / D x scale`` (module docstring).
    """
    n = shares.clamp(1, MAX_SHARE).long()
    o = opacities.double()
    new_o = 1.0 - torch.pow(1.0 - o, 1.0 / n.double())
    binom, sign = _share_table(o.device)
    j = torch.arange(MAX_SHARE + 1, device=o.device, dtype=torch.float64)
    terms = binom[n] * sign[None, :] * new_o[:, None].pow(j[None, :])  # [E, MAX_SHARE + 1], zero past N
    denom = terms.sum(1)
    new_scales = (o / denom)[:, None] * scales.double()
    return new_o.to(opacities.dtype), new_scales.to(scales.dtype)


def _draw(probs: Tensor, n: int, generator: torch.Generator) -> Tensor:
    """``n`` indices drawn with replacement, proportional to ``probs`` (on the generator's device)."""
    picks = torch.multinomial(probs.to(generator.device).float(), n, replacement=True, generator=generator)
    return picks.to(probs.device)


def _share(params: Mapping[str, Tensor], sources: Tensor, min_opacity: float) -> None:
    """Give the drawn ``sources`` (in place) the opacity and scale of a Gaussian shared by the
    times it was drawn plus one."""
    eps = torch.finfo(torch.float32).eps
    counts = torch.bincount(sources, minlength=params["means"].shape[0])
    o, s = relocation(torch.sigmoid(params["opacities"][sources]), torch.exp(params["scales"][sources]),
                      counts[sources] + 1)
    params["opacities"].data[sources] = torch.logit(o.clamp(min_opacity, 1.0 - eps))
    params["scales"].data[sources] = torch.log(s)


# ---------------------------------------------------------------------------- the strategy


class MCMCStrategy:
    """The MCMC moves over a dict of parameters and a dict of Adams (the module docstring).

    It has :class:`~stages.reconstruct.gs.densify.DensifyStrategy`'s members the method calls;
    it keeps no statistics (``active`` is False: no view-space gradients are accumulated)."""

    def __init__(self, params: MCMCParams | None = None):
        self.params = params or MCMCParams()
        self.budget_reached = False
        self.stats = None  # what DensifyStrategy accumulates; MCMC has none (read by gs/shards.py)

    def active(self, step: int) -> bool:
        return False

    def accumulate(self, meta) -> None:
        """No statistics: MCMC decides by opacity alone."""

    def refines(self, step: int) -> bool:
        cfg = self.params
        return cfg.refine_start < step < cfg.refine_stop and step % cfg.refine_every == 0

    @torch.no_grad()
    def step(self, step: int, params: MutableMapping[str, nn.Parameter],
             optimizers: Mapping[str, torch.optim.Optimizer], generator: torch.Generator, means_lr: float) -> dict:
        """Relocate and grow at refinement steps, then move the nearly transparent Gaussians.

        Returns ``{"relocated", "added": int, "budget_hit": bool, "n_gaussians": int}``;
        ``budget_hit`` is True at the first step ``cap_max`` capped growth.
        """
        out = {"relocated": 0, "added": 0, "budget_hit": False}
        if self.refines(step):
            out["relocated"] = self._relocate(params, optimizers, generator)
            out["added"], out["budget_hit"] = self._add(params, optimizers, generator)
        inject_noise(params, means_lr * self.params.noise_lr, generator)
        out["n_gaussians"] = params["means"].shape[0]
        return out

    def _relocate(self, params, optimizers, generator) -> int:
        cfg = self.params
        opac = torch.sigmoid(params["opacities"])
        dead = opac <= cfg.min_opacity
        n_dead = int(dead.sum())  # sync point (every refine_every steps)
        alive = torch.nonzero(~dead).squeeze(1)
        if n_dead == 0 or alive.numel() == 0:
            return 0
        dead_idx = torch.nonzero(dead).squeeze(1)
        sources = alive[_draw(opac[alive], n_dead, generator)]
        _share(params, sources, cfg.min_opacity)
        for p in params.values():  # the dead take their source's (updated) values
            p.data[dead_idx] = p.data[sources]
        touched = torch.cat([sources, dead_idx])
        for name, p in params.items():  # moments restart where the rows changed (in place: no new tensors)
            if name in optimizers:
                zero_state(optimizers[name], p, touched)
        return n_dead

    def _add(self, params, optimizers, generator) -> tuple[int, bool]:
        cfg = self.params
        n = params["means"].shape[0]
        target = min(cfg.cap_max, int(cfg.grow_factor * n))
        hit = False
        if target >= cfg.cap_max and not self.budget_reached:
            hit = self.budget_reached = True
        extra = target - n
        if extra <= 0:
            return 0, hit
        sources = _draw(torch.sigmoid(params["opacities"]), extra, generator)
        _share(params, sources, cfg.min_opacity)
        append_rows(params, optimizers, {name: p.detach()[sources] for name, p in params.items()})
        return extra, hit

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        return {"stats": None, "budget_reached": self.budget_reached}

    def load_state_dict(self, state: Mapping) -> None:
        self.budget_reached = bool(state["budget_reached"])


@torch.no_grad()
def inject_noise(params: MutableMapping[str, nn.Parameter], scale: float, generator: torch.Generator) -> None:
    """Move each mean by ``scale x (R S^2 R^T) z`` (z standard normal from ``generator``), gated by
    ``sigmoid(100 (1 - o - 0.995))``: only Gaussians about as transparent as the dead move."""
    if scale == 0:
        return
    means = params["means"]
    opac = torch.sigmoid(params["opacities"])
    rot = quat_to_rotmat(params["quats"])
    var = torch.exp(params["scales"]) ** 2
    cov = rot @ (var[:, :, None] * rot.transpose(1, 2))  # [N, 3, 3]
    z = torch.randn(means.shape, generator=generator, device=generator.device).to(means.device)
    gate = torch.sigmoid(100.0 * ((1.0 - opac) - 0.995))
    step = torch.einsum("nij,nj->ni", cov, z * (gate * scale)[:, None])
    means.data.add_(step)


def regulariser(gaussians: Mapping[str, Tensor], cfg: MCMCParams) -> Tensor | float:
    """The loss terms: ``opacity_reg x mean(opacity) + scale_reg x mean(scale)``."""
    reg = 0.0
    if cfg.opacity_reg:
        reg = reg + cfg.opacity_reg * torch.sigmoid(gaussians["opacities"]).mean()
    if cfg.scale_reg:
        reg = reg + cfg.scale_reg * torch.exp(gaussians["scales"]).mean()
    return reg
