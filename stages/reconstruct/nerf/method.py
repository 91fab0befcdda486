"""The hash-grid NeRF as a trainable method: model, optimizer, one training step, rendering.

It implements :class:`stages.reconstruct.methods.Method` (the members the training loop,
checkpoints and evaluation call); its batches are random rays of the training views. Beside
``render_image`` it has ``render_outputs`` (depth and opacity too) for camera paths and export.
"""
from __future__ import annotations

import math

import torch

from stages.common.cameras import Intrinsics

from ..config import NerfParams, ReconstructParams
from ..data import RaySampler, composite, image_rays
from ..methods import resolve_use_kernels, step_optimizers
from .field import NerfField
from .occupancy import OccupancyGrid
from .render import render_packed, render_rays, render_rays_early_stop, sample_jitter


class NerfMethod:
    """Hash-grid NeRF with an occupancy grid, trained with Adam on random rays."""

    name = "nerf"
    VERSION = 1
    UNIT = "rays"
    OPERATIONAL_KEYS = frozenset({"kernels", "nerf.use_kernels", "nerf.fused_render", "nerf.cuda_graph"})

    def __init__(self, params: ReconstructParams, aabb: torch.Tensor, device: torch.device,
                 background: tuple[float, float, float] | None = None, scene=None):
        cfg: NerfParams = params.nerf
        self.cfg = cfg
        self.params = params
        self.device = device
        self.background = background
        self.use_kernels = resolve_use_kernels(params.kernels, device)
        self.fused = cfg.fused_render == "on" or (cfg.fused_render == "auto" and self.use_kernels)
        self.graphed = self._captured_step(cfg.cuda_graph, params.distributed.overlap_comm)
        self.field = NerfField(cfg, aabb, use_kernels=self.use_kernels).to(device)
        if background is not None:  # images composited on a known colour: render onto exactly that
            self.field.fixed_background.copy_(torch.tensor(background, dtype=torch.float32))
        self.grid = OccupancyGrid(aabb, cfg.occ_resolution, cfg.occ_threshold).to(device)
        extent = (aabb[1] - aabb[0]).norm().item()
        self.step_size = extent / cfg.samples_per_ray
        # instant-ngp: Adam(0.9, 0.99, eps=1e-15); weight decay on the MLPs only.
        enc = list(self.field.encoding.parameters())
        enc_ids = {id(p) for p in enc}
        mlp = [p for p in self.field.parameters() if id(p) not in enc_ids]
        self.optimizer = torch.optim.Adam(
            [{"params": enc, "weight_decay": 0.0}, {"params": mlp, "weight_decay": cfg.weight_decay}],
            lr=cfg.lr, betas=(0.9, 0.99), eps=1e-15,
            # one fused kernel on the GPU: the multi-tensor Adam was ~8 % of a step's GPU time
            # (profile of 8192-ray steps on an H200, RAYFORGE_PROFILE); the CPU keeps the default
            fused=device.type == "cuda",
        )
        steps = params.steps
        warmup = min(100, max(1, steps // 10))
        decay = math.log(cfg.lr_final / cfg.lr)

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return math.exp(decay * min(1.0, (step - warmup) / max(1, steps - warmup)))

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.optimizers = {"field": self.optimizer}
        self.schedulers = {"field": self.scheduler}

    def _captured_step(self, setting: str, overlap_comm: bool):
        """The CUDA-graph training step (nerf/graph.py), or None for eager steps."""
        if setting == "off":
            return None
        why = ("the packed renderer does not run CUDA kernels here (fused_render and use_kernels)"
               if not (self.fused and self.use_kernels) else
               "distributed.overlap_comm starts all-reduces from backward hooks, which a replayed graph skips"
               if overlap_comm else None)
        if why is not None:
            if setting == "on":
                raise ValueError(f"reconstruct.nerf.cuda_graph is 'on' but {why}")
            return None
        from .graph import CapturedStep

        return CapturedStep(self, required=setting == "on")

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.field.parameters())

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.field.parameters())

    def batch_size(self) -> int:
        return self.params.batch_rays

    def place(self, views):
        return views.to(self.device)

    def make_sampler(self, views, generator: torch.Generator) -> RaySampler:
        return RaySampler(views, generator)

    def occ_schedule(self) -> tuple[int, int, int]:
        """(refresh every, warm-up steps, all-cells steps) of the occupancy grid in training steps:
        16 / occ_warmup_steps / 256 by default, times ``occ_schedule_scale``."""
        s = self.cfg.occ_schedule_scale
        return (max(1, round(self.cfg.occ_update_every * s)), round(self.cfg.occ_warmup_steps * s),
                round(256 * s))

    def step_pre_forward(self, step: int, generator: torch.Generator) -> torch.Tensor | None:
        """Refresh the occupancy grid every ``occ_update_every`` steps; all cells during
        the first 256 steps, a quarter of them afterwards (instant-ngp); nothing pruned before
        ``occ_warmup_steps`` (all three scaled by ``occ_schedule_scale``). Returns the occupied
        fraction (a device tensor) after a refresh, None on other steps."""
        every, warmup, full = self.occ_schedule()
        if step % every != 0:
            return None
        return self.grid.update(
            self.field.density, self.step_size, generator=generator, fraction=1.0 if step < full else 0.25,
            prune=step >= warmup,
        )

    def loss(self, o, d, rgb, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
        out = render_rays(
            self.field, self.grid, o, d, self.step_size, self.cfg.samples_per_ray,
            near=self.cfg.near, perturb=True, generator=generator, fused=self.fused,
        )
        mse = torch.nn.functional.mse_loss(out["rgb"], rgb)
        return mse, {"mse": mse.detach(), "num_samples": out["num_samples"]}

    def packed_loss(self, o, d, rgb, jitter: torch.Tensor, capacity: int | None = None):
        """(mse, render output) of the packed renderer with the sample ``jitter`` given and an
        optional fixed sample budget: the body of a CUDA-graph step (nerf/graph.py) and of the eager
        step that sizes its first budget."""
        out = render_packed(self.field, self.grid, o, d, jitter, self.step_size, self.cfg.samples_per_ray,
                            self.cfg.near, capacity=capacity)
        return torch.nn.functional.mse_loss(out["rgb"], rgb), out

    def forward_backward(self, batch, generator: torch.Generator, before_backward=None) -> dict:
        """One micro-batch of rays ``(o, d, rgb)``: the loss's gradients are added to the parameters'
        ``.grad``; returns ``loss`` (= ``mse``) and ``num_samples`` (device tensors).
        ``before_backward`` is called between the forward and the backward of an eager step (a
        replayed graph step has no such point)."""
        o, d, rgb = batch
        if self.graphed is not None:
            jitter = sample_jitter(o.shape[0], True, generator, self.device)  # as render_rays draws it
            got = self.graphed(o, d, rgb, jitter)
            if got is not None:
                return {"loss": got[0], "mse": got[0], "num_samples": got[1]}
            # no sample count yet to size the graph's budget: this step runs eagerly and gives one
            loss, out = self.packed_loss(o, d, rgb, jitter)
            self.graphed.observe(int(out["num_samples"]))
            info = {"mse": loss.detach(), "num_samples": out["num_samples"]}
        else:
            loss, info = self.loss(o, d, rgb, generator)
        if before_backward is not None:
            before_backward()
        loss.backward()
        return {"loss": info["mse"], **info}

    def optimizer_step(self, step: int, skip: torch.Tensor) -> None:
        step_optimizers(self.optimizers, self.schedulers, skip)

    def after_step(self, step: int, strategy) -> bool:
        return False  # the parameter set never changes

    @torch.no_grad()
    def quick_test_psnr(self, views, generator: torch.Generator, n_rays: int = 4096) -> float | None:
        """PSNR on random rays of the test views (a cheap point on the training curve)."""
        if len(views) == 0:
            return None
        o, d, rgb = RaySampler(views, generator).sample(n_rays)
        rgb = composite(rgb, self.background or (1.0, 1.0, 1.0))  # RGBA views: on the known colour, else white
        pred = self.render_rays(o, d)
        return -10.0 * math.log10(max(float(torch.mean((pred - rgb) ** 2)), 1e-10))

    def summary(self) -> dict:
        g = self.graphed
        graph = None if g is None else {
            "captures": g.captures, "budget_samples": g.capacity, "max_samples_seen": g.max_count,
            "overflow_steps": g.overflow_steps, "failed": g.failed, "events": [list(e) for e in g.events]}
        return {"kernels": self.use_kernels, "fused_render": self.fused, "cuda_graph": graph}

    @torch.no_grad()
    def render_ray_outputs(self, o: torch.Tensor, d: torch.Tensor, chunk: int = 8192) -> dict[str, torch.Tensor]:
        """``rgb`` [R, 3] in [0, 1], ``depth`` [R] (the weights' sum of sample distances along the unit
        ray, not divided by the opacity) and ``alpha`` [R] (opacity, the weights' sum) of rays [R, 3];
        the dense renderer stops each ray early (render_rays_early_stop)."""
        outs: dict[str, list[torch.Tensor]] = {"rgb": [], "depth": [], "alpha": []}
        for i in range(0, o.shape[0], chunk):
            args = (self.field, self.grid, o[i : i + chunk], d[i : i + chunk], self.step_size,
                    self.cfg.samples_per_ray, self.cfg.near)
            r = render_rays(*args, fused=True) if self.fused else render_rays_early_stop(*args)
            for key, name in (("rgb", "rgb"), ("depth", "depth"), ("alpha", "opacity")):
                outs[key].append(r[name])
        out = {k: torch.cat(v) for k, v in outs.items()}
        out["rgb"] = out["rgb"].clamp(0, 1)
        return out

    def render_rays(self, o: torch.Tensor, d: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
        return self.render_ray_outputs(o, d, chunk)["rgb"]

    @torch.no_grad()
    def render_outputs(self, intr: Intrinsics, c2w: torch.Tensor, chunk: int = 8192) -> dict[str, torch.Tensor]:
        """Render one view: ``rgb`` [H, W, 3] float32 in [0, 1], ``depth`` [H, W] and ``alpha`` [H, W]
        (see :meth:`render_ray_outputs`) on the method's device."""
        o, d = image_rays(intr, c2w.float(), self.device)
        shape = (intr.height, intr.width)
        return {k: v.view(*shape, *v.shape[1:]) for k, v in self.render_ray_outputs(o, d, chunk).items()}

    def render_image(self, intr: Intrinsics, c2w: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
        """Render one view: [H, W, 3] float32 in [0, 1] on the method's device."""
        return self.render_outputs(intr, c2w, chunk)["rgb"]

    def state_dict(self) -> dict:
        return {"field": self.field.state_dict(), "grid": self.grid.state_dict()}

    def local_state(self) -> dict:
        return {}  # every rank holds the same state

    def load_local_state(self, state: dict) -> None:
        pass

    def load_state_dict(self, state: dict) -> None:
        field = dict(state["field"])
        field.setdefault("fixed_background", torch.full((3,), -1.0))  # models saved before it existed
        self.field.load_state_dict(field)
        self.grid.load_state_dict(state["grid"])
