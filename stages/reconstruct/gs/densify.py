"""Adaptive density control of 3DGS: duplicate, split and prune Gaussians, reset opacities.

The paper's Sec. 5 (Kerbl et al. 2023) with gsplat's ``DefaultStrategy`` semantics and defaults:
every ``refine_every`` steps after ``refine_start`` and before ``refine_stop``, Gaussians whose mean
view-space gradient (in NDC units, over the views that saw them) exceeds ``grow_grad2d`` grow: small
ones (largest scale <= ``grow_scale3d`` x scene extent) are duplicated, large ones split into two
drawn from their own distribution with scales / 1.6. Then Gaussians with opacity < ``prune_opa`` go,
and after the first opacity reset also those larger than ``prune_scale3d`` x extent. Every
``reset_every`` steps opacities are clamped to 2 x ``prune_opa``. A Gaussian budget
(``max_gaussians``) caps the growth; this is not in gsplat.

The parameter surgery (:func:`update_rows`, :func:`append_rows`, :func:`remove_rows`,
:func:`zero_state`) keeps each Adam's moments row-aligned with its parameter. Rows are added and
removed by replacing the parameters with new ``nn.Parameter`` objects, in the dict and in the
optimizers' param groups: callers re-bind anything that held the old ones (a gradient reducer's hooks,
a DDP bucket, a CUDA graph's pointers). The new parameters have no ``.grad``; densify after the
optimizer step, as gsplat does (before it, that step skips the replaced parameters, as the 3DGS
reference's loop does).

Data parallel: every rank accumulates statistics over its own views; the ``reduce`` hook merges them
before each decision (:func:`all_reduce_statistics`), and splits draw from a generator seeded alike on
every rank, so all ranks change their parameters identically.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from stages.common.params import check

from .model import quat_to_rotmat

Statistics = dict[str, Tensor]  # "grad2d" [N] (sum), "count" [N] (sum), "radii" [N] (max)
Reducer = Callable[[Statistics], Statistics]
_STAT_NAMES = ("grad2d", "count", "radii")
_SPLIT_SCALE_DIVISOR = 1.6  # the paper's phi: each half of a split Gaussian is 1.6 x smaller


@dataclass
class DensifyParams:
    """Adaptive density control; defaults are gsplat's DefaultStrategy (the 3DGS paper's).

    Steps are 0-based training steps. Thresholds: ``grow_grad2d`` in NDC units per view; the 3D
    scales are fractions of the scene extent; the 2D ones fractions of the larger image side.
    """

    refine_start: int = 500  # first refinement at the first multiple of refine_every after this
    refine_stop: int = 15_000  # no refinement, statistics or opacity reset from this step on
    refine_every: int = 100
    reset_every: int = 3000
    grow_grad2d: float = 2e-4
    grow_scale3d: float = 0.01
    grow_scale2d: float = 0.05
    prune_opa: float = 0.005
    prune_scale3d: float = 0.1
    prune_scale2d: float = 0.15
    # Split / prune by 2D radius before this step (0: never, gsplat's default; the reference's
    # screen-size pruning is inert through a bug, graphdeco-inria/gaussian-splatting#123).
    refine_scale2d_stop: int = 0
    absgrad: bool = False  # AbsGS: sum |dL/dmeans2d| (the rasterizer needs absgrad=True); raise grow_grad2d
    # Split halves get opacity 1 - sqrt(1 - o) instead of o (Bulo et al. 2024, gsplat's
    # revised_opacity): two overlapping halves then block as much light as the one they replace.
    revised_opacity: bool = False
    # No opacity reset in the run's last reset_every steps (not in gsplat or the reference): such a
    # reset has too little time left to be re-learned. A 7000-step run then resets at 3000 only; a
    # 30000-step run is unchanged (its resets stop with refine_stop). On by default since
    # 2026-12-06: at 7k on lego (three-seed means) ours went from 0.13 dB under gsplat to 0.02 over.
    skip_late_reset: bool = True
    max_gaussians: int = 0  # growth stops at this many Gaussians; 0 = no budget

    def __post_init__(self) -> None:
        check(self.refine_start >= 0, "refine_start", "must be >= 0", self.refine_start)
        check(self.refine_stop >= 0, "refine_stop", "must be >= 0", self.refine_stop)
        check(self.refine_every >= 1, "refine_every", "must be >= 1", self.refine_every)
        check(self.reset_every >= 1, "reset_every", "must be >= 1", self.reset_every)
        for key in ("grow_grad2d", "grow_scale3d", "grow_scale2d", "prune_scale3d", "prune_scale2d"):
            check(getattr(self, key) > 0, key, "must be > 0", getattr(self, key))
        check(0 < self.prune_opa < 0.5, "prune_opa", "must be in (0, 0.5) (resets go to 2 x prune_opa)",
              self.prune_opa)
        check(self.refine_scale2d_stop >= 0, "refine_scale2d_stop", "must be >= 0", self.refine_scale2d_stop)
        check(self.max_gaussians >= 0, "max_gaussians", "must be >= 0 (0 = no budget)", self.max_gaussians)


# ---------------------------------------------------------------------------- parameter surgery


def _single_param(optimizer: torch.optim.Optimizer, param: nn.Parameter, name: str) -> dict:
    groups = optimizer.param_groups
    if len(groups) != 1 or len(groups[0]["params"]) != 1 or groups[0]["params"][0] is not param:
        raise ValueError(f"optimizers[{name!r}] must hold exactly params[{name!r}] in one param group "
                         "(was a parameter replaced without its optimizer?)")
    return groups[0]


def _num_rows(params: Mapping[str, Tensor]) -> int:
    rows = {name: p.shape[0] for name, p in params.items()}
    if len(set(rows.values())) != 1:
        raise ValueError(f"parameters disagree on the number of Gaussians: {rows}")
    return next(iter(rows.values()))


@torch.no_grad()
def update_rows(params: MutableMapping[str, nn.Parameter], optimizers: Mapping[str, torch.optim.Optimizer],
                keep: Tensor | None, new_rows: Mapping[str, Tensor] | None) -> None:
    """Replace every parameter ``p`` by ``cat(p[keep], new_rows[name])``, its Adam state alike.

    Kept rows carry their moments (``exp_avg``, ``exp_avg_sq``, any state tensor shaped like the
    parameter); new rows start at zero; ``step`` is kept. Each parameter becomes a new
    ``nn.Parameter`` (same ``requires_grad``), in ``params`` and in its optimizer's param group.

    Args:
        params: name -> [N, ...] parameters, all with the same N.
        optimizers: name -> optimizer holding exactly that parameter (names without one are allowed
            for parameters that do not require grad).
        keep: int64 indices [M] of the rows to keep, in order; None keeps all.
        new_rows: name -> [A, ...] rows appended after the kept ones, one entry per parameter; None
            appends nothing.
    """
    n = _num_rows(params)
    keep_all = keep is None
    if not keep_all and (keep.ndim != 1 or keep.dtype != torch.int64
                         or (keep.numel() and not 0 <= int(keep.min()) <= int(keep.max()) < n)):
        raise ValueError(f"keep must be int64 row indices [M] in [0, {n}), got {keep.dtype} "
                         f"{tuple(keep.shape)}")
    if new_rows is not None:
        if set(new_rows) != set(params):
            raise ValueError(f"new_rows must have one entry per parameter {sorted(params)}, "
                             f"got {sorted(new_rows)}")
        added = {name: rows.shape[0] for name, rows in new_rows.items()}
        if len(set(added.values())) != 1:
            raise ValueError(f"new_rows disagree on the number of Gaussians: {added}")
    for name in list(params):
        old = params[name]
        kept = old.detach() if keep_all else old.detach()[keep]
        extra = None
        if new_rows is not None:
            extra = new_rows[name].detach().to(old.dtype)
            if extra.shape[1:] != old.shape[1:]:
                raise ValueError(f"new_rows[{name!r}] has rows of shape {tuple(extra.shape[1:])}, "
                                 f"the parameter's are {tuple(old.shape[1:])}")
            kept = torch.cat([kept, extra])
        new = nn.Parameter(kept.contiguous(), requires_grad=old.requires_grad)
        params[name] = new
        optimizer = optimizers.get(name)
        if optimizer is None:
            if old.requires_grad:
                raise ValueError(f"params[{name!r}] requires grad but has no optimizer")
            continue
        group = _single_param(optimizer, old, name)
        state = optimizer.state.pop(old, None)
        group["params"] = [new]
        if state is None:
            continue  # no step taken yet: nothing to carry
        for key, value in state.items():
            if key == "step" or not isinstance(value, Tensor) or value.shape != old.shape:
                continue
            value = value if keep_all else value[keep]
            if extra is not None:
                value = torch.cat([value, value.new_zeros((extra.shape[0], *value.shape[1:]))])
            state[key] = value.contiguous()
        optimizer.state[new] = state


def append_rows(params: MutableMapping[str, nn.Parameter], optimizers: Mapping[str, torch.optim.Optimizer],
                new_rows: Mapping[str, Tensor]) -> None:
    """Append rows to every parameter (their Adam moments zero); see :func:`update_rows`."""
    update_rows(params, optimizers, None, new_rows)


def remove_rows(params: MutableMapping[str, nn.Parameter], optimizers: Mapping[str, torch.optim.Optimizer],
                mask: Tensor) -> None:
    """Remove the rows where ``mask`` [N] (bool) is True, with their Adam state; see :func:`update_rows`."""
    update_rows(params, optimizers, torch.nonzero(~mask).squeeze(1), None)


@torch.no_grad()
def zero_state(optimizer: torch.optim.Optimizer, param: nn.Parameter, rows: Tensor | None = None) -> None:
    """Zero ``param``'s Adam moments in place (``step`` kept): all of them, or those of ``rows``."""
    for key, value in optimizer.state.get(param, {}).items():
        if key != "step" and isinstance(value, Tensor) and value.shape == param.shape:
            if rows is None:
                value.zero_()
            else:
                value[rows] = 0.0


# ---------------------------------------------------------------------------- statistics


def all_reduce_statistics(group=None) -> Reducer:
    """A ``reduce`` hook for data-parallel ranks: sums ``grad2d`` and ``count``, maxes ``radii``,
    over ``group`` (torch.distributed's default group when None). Returns the statistics unchanged
    when torch.distributed is not initialised or the world has one rank."""
    import torch.distributed as dist

    def reduce(stats: Statistics) -> Statistics:
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return stats
        summed = torch.stack([stats["grad2d"], stats["count"]])
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
        radii = stats["radii"].clone()
        dist.all_reduce(radii, op=dist.ReduceOp.MAX, group=group)
        return {"grad2d": summed[0], "count": summed[1], "radii": radii}

    return reduce


def _identity(stats: Statistics) -> Statistics:
    return stats


# ---------------------------------------------------------------------------- the strategy


class DensifyStrategy:
    """gsplat's DefaultStrategy over a dict of parameters and a dict of Adams.

    Per training step: after backward, :meth:`accumulate` the rasterizer's meta; then (after the
    optimizer step) :meth:`step`, which refines, prunes and resets on its schedule and reports what
    it did.

    Args:
        params: the densification settings.
        reduce: applied to the statistics (``{"grad2d", "count", "radii"}``, each [N]) before every
            decision; it must return statistics that are identical on all ranks
            (:func:`all_reduce_statistics`). Identity by default.
        total_steps: the run's length, for ``skip_late_reset``; None (a length not known) keeps
            every reset, as the reference does.
    """

    def __init__(self, params: DensifyParams | None = None, reduce: Reducer | None = None,
                 total_steps: int | None = None):
        self.params = params or DensifyParams()
        self.total_steps = total_steps
        self.reduce = reduce or _identity
        self.stats: Statistics | None = None  # created on the first accumulate
        self.budget_reached = False  # reported once, the first time the budget capped growth

    # ------------------------------------------------------------------ statistics

    def active(self, step: int) -> bool:
        """Whether ``step`` still refines or resets (so its statistics are worth accumulating)."""
        return step < self.params.refine_stop

    @torch.no_grad()
    def accumulate(self, meta: Mapping) -> None:
        """Add one step's view-space gradients and radii (read after backward).

        Args:
            meta: the rasterizer's meta: ``means2d`` [C, N, 2] with ``.grad`` (``.absgrad`` with
                ``absgrad``), ``radii`` [C, N] (or [C, N, 2]; > 0 where visible), ``width``,
                ``height`` (pixels), ``n_cameras`` (C).

        Per Gaussian and view where it is visible: the pixel gradient is scaled to NDC
        (x: width / 2, y: height / 2) and by the number of views C (the loss averages over them), its
        norm added to ``grad2d`` and 1 to ``count``; ``radii`` keeps the largest radius seen as a
        fraction of max(width, height).
        """
        means2d = meta["means2d"]
        grad = getattr(means2d, "absgrad", None) if self.params.absgrad else means2d.grad
        if grad is None:
            what = "absgrad (rasterize with absgrad=True)" if self.params.absgrad else "grad"
            raise ValueError(f"meta['means2d'] has no {what}: accumulate after loss.backward()")
        radii = meta["radii"]
        if radii.ndim == 3:
            visible, radius = (radii > 0).all(-1), radii.amax(-1)
        else:
            visible, radius = radii > 0, radii
        if grad.ndim != 3 or grad.shape[-1] != 2 or visible.shape != grad.shape[:2]:
            raise ValueError(f"means2d gradient [C, N, 2] and radii [C, N] disagree: "
                             f"{tuple(grad.shape)} vs {tuple(radii.shape)}")
        c, n = visible.shape
        width, height, cameras = float(meta["width"]), float(meta["height"]), float(meta["n_cameras"])
        if self.stats is None:
            self.stats = {key: torch.zeros(n, device=grad.device) for key in _STAT_NAMES}
        elif self.stats["count"].shape[0] != n:
            raise ValueError(f"meta has {n} Gaussians, the statistics {self.stats['count'].shape[0]}: "
                             "the parameters changed outside this strategy")
        # NDC scale as Python numbers: a tensor built from them would be a host-to-device copy,
        # which waits for the GPU's queue every training step
        sx, sy = width / 2.0 * cameras, height / 2.0 * cameras
        norms = torch.hypot(grad[..., 0] * sx, grad[..., 1] * sy)  # [C, N]
        vis = visible.to(norms.dtype)
        self.stats["grad2d"] += (norms * vis).sum(0)
        self.stats["count"] += vis.sum(0)
        seen = torch.where(visible, radius.to(norms.dtype), 0.0).amax(0) / max(width, height)
        torch.maximum(self.stats["radii"], seen, out=self.stats["radii"])

    # ------------------------------------------------------------------ decisions

    @torch.no_grad()
    def step(self, step: int, params: MutableMapping[str, nn.Parameter],
             optimizers: Mapping[str, torch.optim.Optimizer], generator: torch.Generator,
             scene_extent: float) -> dict:
        """Refine (grow, then prune) and reset opacities when ``step`` calls for it.

        Args:
            step: the 0-based training step just taken.
            params, optimizers: the Gaussians and their Adams (modified; see the module docstring).
            generator: draws the split samples; seeded alike on every rank (its device is where the
                samples are drawn).
            scene_extent: scene size (:func:`.model.scene_extent`).

        Returns:
            ``{"duplicated", "split", "pruned": int, "reset": bool, "budget_hit": bool,
            "n_gaussians": int}``; ``budget_hit`` is True at the first step the budget capped growth.
        """
        cfg = self.params
        out = {"duplicated": 0, "split": 0, "pruned": 0, "reset": False, "budget_hit": False,
               "n_gaussians": params["means"].shape[0]}
        if not self.active(step):
            return out
        if step > cfg.refine_start and step % cfg.refine_every == 0:
            stats = self._reduced(params)
            out.update(self._grow(step, params, optimizers, stats, generator, scene_extent))
            out["pruned"] = self._prune(step, params, optimizers, stats, scene_extent)
            self.stats = {key: torch.zeros_like(params["opacities"]) for key in _STAT_NAMES}
        if step > 0 and step % cfg.reset_every == 0 and not self._late(step):
            self._reset_opacities(params, optimizers)
            out["reset"] = True
        out["n_gaussians"] = params["means"].shape[0]
        return out

    def _late(self, step: int) -> bool:
        """Whether a reset at ``step`` falls in the run's last ``reset_every`` steps and is skipped."""
        return (self.params.skip_late_reset and self.total_steps is not None
                and step > self.total_steps - self.params.reset_every)

    def _reduced(self, params: Mapping[str, Tensor]) -> Statistics:
        n = params["means"].shape[0]
        if self.stats is None:
            raise RuntimeError("DensifyStrategy.step refines before any accumulate(meta)")
        if self.stats["count"].shape[0] != n:
            raise ValueError(f"statistics cover {self.stats['count'].shape[0]} Gaussians, params hold "
                             f"{n}: the parameters changed outside this strategy")
        stats = self.reduce(dict(self.stats))
        return {key: stats[key] for key in _STAT_NAMES}

    def _grow(self, step: int, params, optimizers, stats: Statistics, generator: torch.Generator,
              extent: float) -> dict:
        cfg = self.params
        grads = stats["grad2d"] / stats["count"].clamp_min(1.0)
        high = grads > cfg.grow_grad2d
        small = params["scales"].exp().amax(-1) <= cfg.grow_scale3d * extent
        dupli, split = high & small, high & ~small
        if step < cfg.refine_scale2d_stop:
            split |= stats["radii"] > cfg.grow_scale2d
        budget_hit = False
        if cfg.max_gaussians:
            room = max(cfg.max_gaussians - params["means"].shape[0], 0)
            wanted = dupli | split
            if int(wanted.sum()) > room:  # keep the `room` highest gradients (sync point)
                priority = torch.where(wanted, grads, -torch.inf)
                chosen = torch.zeros_like(wanted)
                chosen[torch.sort(priority, descending=True, stable=True).indices[:room]] = True
                dupli, split = dupli & chosen, split & chosen
                budget_hit = not self.budget_reached
                self.budget_reached = True
        n_dupli, n_split = int(dupli.sum()), int(split.sum())  # sync point
        if n_dupli:
            self._duplicate(params, optimizers, stats, dupli)
            split = torch.cat([split, split.new_zeros(n_dupli)])  # copies are not split
        if n_split:
            self._split(params, optimizers, stats, split, generator, cfg.revised_opacity)
        return {"duplicated": n_dupli, "split": n_split, "budget_hit": budget_hit}

    @staticmethod
    def _duplicate(params, optimizers, stats: Statistics, mask: Tensor) -> None:
        sel = torch.nonzero(mask).squeeze(1)
        append_rows(params, optimizers, {name: p[sel] for name, p in params.items()})
        for key in _STAT_NAMES:
            stats[key] = torch.cat([stats[key], stats[key][sel]])

    @staticmethod
    def _split(params, optimizers, stats: Statistics, mask: Tensor, generator: torch.Generator,
               revised_opacity: bool = False) -> None:
        sel = torch.nonzero(mask).squeeze(1)
        rest = torch.nonzero(~mask).squeeze(1)
        scales = params["scales"][sel].exp()  # [S, 3]
        rot = quat_to_rotmat(params["quats"][sel])  # [S, 3, 3]
        noise = torch.randn(2, sel.numel(), 3, generator=generator, device=generator.device)
        offsets = torch.einsum("sij,sj,bsj->bsi", rot, scales, noise.to(scales.device))  # [2, S, 3]
        new_rows = {}
        for name, p in params.items():
            if name == "means":
                new_rows[name] = (p[sel] + offsets).reshape(-1, 3)
            elif name == "scales":
                new_rows[name] = torch.log(scales / _SPLIT_SCALE_DIVISOR).repeat(2, 1)
            elif name == "opacities" and revised_opacity:
                # 1 - (1 - o')^2 = o: the halves' combined alpha where they overlap is the parent's
                half = 1.0 - torch.sqrt(1.0 - torch.sigmoid(p[sel]))
                new_rows[name] = torch.logit(half, eps=1e-6).repeat(2)
            else:
                new_rows[name] = p[sel].repeat(2, *([1] * (p.ndim - 1)))
        update_rows(params, optimizers, rest, new_rows)
        for key in _STAT_NAMES:
            stats[key] = torch.cat([stats[key][rest], stats[key][sel].repeat(2)])

    def _prune(self, step: int, params, optimizers, stats: Statistics, extent: float) -> int:
        cfg = self.params
        prune = params["opacities"].sigmoid() < cfg.prune_opa
        if step > cfg.reset_every:
            prune |= params["scales"].exp().amax(-1) > cfg.prune_scale3d * extent
            if step < cfg.refine_scale2d_stop:
                prune |= stats["radii"] > cfg.prune_scale2d
        n_prune = int(prune.sum())  # sync point
        if n_prune:
            remove_rows(params, optimizers, prune)
        return n_prune

    def _reset_opacities(self, params, optimizers) -> None:
        """Clamp the opacities to 2 x prune_opa (in place) and zero their Adam moments."""
        ceiling = 2.0 * self.params.prune_opa
        params["opacities"].clamp_(max=math.log(ceiling / (1.0 - ceiling)))
        zero_state(optimizers["opacities"], params["opacities"])

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Statistics between refinements and the budget flag, for an exact resume."""
        return {"stats": None if self.stats is None else {k: v.clone() for k, v in self.stats.items()},
                "budget_reached": self.budget_reached}

    def load_state_dict(self, state: Mapping) -> None:
        stats = state["stats"]
        self.stats = None if stats is None else {key: stats[key].clone() for key in _STAT_NAMES}
        self.budget_reached = bool(state["budget_reached"])
