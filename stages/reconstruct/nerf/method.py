"""The hash-grid NeRF as a trainable method: model, optimizer, one training step, rendering.

It implements :class:`stages.reconstruct.methods.Method` (the members the training loop,
checkpoints and evaluation call); its batches are random rays of the training views. Beside
``render_image`` it has ``render_outputs`` (depth and opacity too) for camera paths and export.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from stages.common.cameras import Intrinsics

from ..config import NerfParams, ReconstructParams
from ..data import RaySampler, composite, image_rays
from ..methods import resolve_use_kernels, step_optimizers
from .budget import RayBudget
from .field import NerfField
from .hull import alpha_hull_box
from .occupancy import OccupancyGrid
from .optim import TableAdam, WeightAverage, lr_factor
from .render import occluded_samples, render_packed, render_rays, render_rays_early_stop, sample_jitter


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
        if cfg.cull_occluded and not self.fused:
            raise ValueError("reconstruct.nerf.cull_occluded needs the packed renderer: fused_render 'on' "
                             "(or 'auto' where the CUDA kernels run)")
        self.graphed = self._captured_step(cfg.cuda_graph, params.distributed.overlap_comm)
        step_diag = None  # the diagonal the march step divides (the box's, unless the hull replaced it)
        if scene is not None:
            check_scene(scene, aabb)
            if cfg.scene_contraction != "none":
                aabb = contraction_box(scene)
            elif scene.train.channels == 4 and cfg.alpha_box != "off":
                hull = alpha_hull_box(scene.train, aabb, device=device)
                if hull is not None:
                    # the march keeps the step of the poses out's box: in lego's hull (13 % of the box) with
                    # the hull's own step, rays took 1.9 times the samples and the test views lost 0.3-0.8 dB
                    # at 15-60 s; with the box's step they gained 0.2-0.3 dB (H200, 2026-12-04)
                    step_diag = float((aabb[1] - aabb[0]).norm())
                    aabb = hull
        images = len(scene.train) if scene is not None else 1  # appearance codes; a loaded model brings its own
        # the finest level: auto resolves from the scene; a model loaded without one (to render) gets
        # its levels' resolutions from its state (HashGrid's buffer)
        finest = finest_resolution(cfg, scene, aabb)
        self.field = NerfField(dataclasses.replace(cfg, max_resolution=finest), aabb,
                               use_kernels=self.use_kernels, num_images=images).to(device)
        alpha = scene is not None and scene.train.channels == 4
        if background is None and alpha:  # views with alpha render onto white (what evaluate composites on)
            background = (1.0, 1.0, 1.0)
        if background is not None:  # images composited on a known colour: render onto exactly that
            self.field.fixed_background.copy_(torch.tensor(background, dtype=torch.float32))
        # views with alpha train on a random colour per ray behind them (instant-ngp): a fixed one lets
        # the field paint that colour into the box as floaters that cost nothing in the training views
        self.random_bg = alpha and cfg.random_background != "off"
        self.grid = OccupancyGrid(aabb, cfg.occ_resolution, cfg.occ_threshold, contract=self.field.contract,
                                  cascades=self.field.cascades).to(device)
        self.step_diag = step_diag
        self._set_step()
        self._build_optimizers(params.steps, device)
        self.ema = WeightAverage(self.parameters(), cfg.ema_decay) if cfg.ema_decay > 0 else None
        self._last_count: tuple | None = None  # (samples or None for a graph step, rays) of the last micro-batch
        self.budget = (RayBudget(cfg.target_samples, params.batch_rays, device) if cfg.target_samples
                       else None)
        if device.type == "cuda" and cfg.mlp_precision == "tf32":
            torch.backends.cuda.matmul.allow_tf32 = True  # process-wide: the field's GEMMs on tensor cores

    def _set_step(self) -> None:
        """The march step (the box diagonal / samples_per_ray) and the steps a ray may take (3 times
        as many with scene contraction, past the box steps uniform in disparity; with cascades as many
        as it takes to cross the outermost box, :func:`cone_steps`)."""
        aabb = self.field.aabb.cpu()
        diag = self.step_diag if self.step_diag is not None else (aabb[1] - aabb[0]).norm().item()
        self.step_size = diag / self.cfg.samples_per_ray
        self.max_steps = self.cfg.samples_per_ray * (3 if self.field.contract else 1)
        if self.field.cascades:
            reach = diag * 2 ** (self.field.cascades - 1)  # the outermost box's diagonal
            self.max_steps = cone_steps(self.step_size, self.field.cone, reach)

    def _build_optimizers(self, steps: int, device: torch.device) -> None:
        """instant-ngp: Adam(0.9, 0.99, eps=1e-15), β2 ``adam_beta2``; weight decay on the MLPs only. One
        Adam with two groups ("field"), or with ``table_optimizer: sparse`` the MLPs' Adam ("field") and
        the table's :class:`TableAdam` ("table"); each with the ``lr_schedule``."""
        cfg = self.cfg
        enc = list(self.field.encoding.parameters())
        enc_ids = {id(p) for p in enc}
        mlp = [p for p in self.field.parameters() if id(p) not in enc_ids]
        groups = [{"params": mlp, "weight_decay": cfg.weight_decay}]
        if cfg.table_optimizer == "adam":
            groups.insert(0, {"params": enc, "weight_decay": 0.0})
        self.optimizer = torch.optim.Adam(
            groups, lr=cfg.lr, betas=(0.9, cfg.adam_beta2), eps=1e-15,
            # one fused kernel on the GPU: the multi-tensor Adam was ~8 % of a step's GPU time
            # (profile of 8192-ray steps on an H200, RAYFORGE_PROFILE); the CPU keeps the default
            fused=device.type == "cuda",
        )
        self.optimizers = {"field": self.optimizer}
        if cfg.table_optimizer == "sparse":
            self.optimizers["table"] = TableAdam(enc, lr=cfg.lr, betas=(0.9, cfg.adam_beta2), eps=1e-15,
                                                 use_kernels=self.use_kernels)
        self.schedulers = {name: torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(cfg, steps))
                           for name, opt in self.optimizers.items()}

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

    def make_sampler(self, views, generator: torch.Generator):
        sampler = RaySampler(views, generator, jitter=self.cfg.pixel_jitter)
        if self.field.appearance is not None:  # batches carry each ray's image (its appearance code)
            sampler.sample = sampler.sample_indexed
        return sampler if self.budget is None else _BudgetedSampler(sampler, self.budget)

    def occ_schedule(self) -> tuple[int, int, int]:
        """(refresh every, warm-up steps, all-cells steps) of the occupancy grid in training steps:
        16 / occ_warmup_steps / 256 by default, times ``occ_schedule_scale``."""
        s = self.cfg.occ_schedule_scale
        return (max(1, round(self.cfg.occ_update_every * s)), round(self.cfg.occ_warmup_steps * s),
                round(256 * s))

    def step_pre_forward(self, step: int, generator: torch.Generator) -> torch.Tensor | None:
        """Refresh the occupancy grid every ``occ_update_every`` steps; all cells during
        the first 256 steps, a quarter of them afterwards (instant-ngp); nothing pruned before
        ``occ_warmup_steps`` (all three scaled by ``occ_schedule_scale``). With ``target_samples``
        the ray budget is revised then too (its buffer is broadcast with the grid's). Returns the
        occupied fraction (a device tensor) after a refresh, None on other steps."""
        every, warmup, full = self.occ_schedule()
        if step % every != 0:
            return None
        if self.budget is not None and self._last_count is not None:
            self.budget.revise(*self._counted())
        return self.grid.update(
            self.field.density, self.step_size, generator=generator, fraction=1.0 if step < full else 0.25,
            prune=step >= warmup,
        )

    def loss(self, o, d, rgb, generator: torch.Generator, background: torch.Tensor | None = None,
             appearance: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        out = render_rays(
            self.field, self.grid, o, d, self.step_size, self.max_steps,
            near=self.cfg.near, perturb=True, generator=generator, fused=self.fused, background=background,
            appearance=appearance, distortion=self.cfg.distortion_loss > 0, cull=self.cfg.cull_occluded,
        )
        return self._training_loss(out, rgb)

    def _training_loss(self, out: dict, rgb: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(the training loss, its info) of a render ``out`` against the target colours ``rgb``: the
        colour loss (``nerf.loss``), plus ``distortion_loss`` x the rays' mean distortion. The info's
        ``mse`` is the squared error whatever the colour loss (PSNR is read from it)."""
        mse = torch.nn.functional.mse_loss(out["rgb"], rgb)
        loss = mse
        if self.cfg.loss == "huber":
            loss = torch.nn.functional.huber_loss(out["rgb"], rgb, delta=self.cfg.huber_delta)
        info = {"mse": mse.detach(), "num_samples": out["num_samples"]}
        if "distortion" in out:
            dist = out["distortion"].mean()
            info["distortion"] = dist.detach()
            loss = loss + self.cfg.distortion_loss * dist
        return loss, info

    def packed_loss(self, o, d, rgb, jitter: torch.Tensor, capacity: int | None = None,
                    background: torch.Tensor | None = None, image: torch.Tensor | None = None,
                    march_capacity: int | None = None):
        """(loss, info, render output) of the packed renderer with the sample ``jitter`` given and an
        optional fixed sample budget: the body of a CUDA-graph step (nerf/graph.py) and of the eager
        step that sizes its first budget. ``image``: each ray's training image (appearance codes).
        The loss is :meth:`_training_loss`'s. With
        ``cull_occluded`` the march has its own budget, ``march_capacity``, and ``capacity`` is the
        kept samples' (render_packed)."""
        out = render_packed(self.field, self.grid, o, d, jitter, self.step_size, self.max_steps,
                            self.cfg.near, capacity=capacity, background=background,
                            appearance=None if image is None else self.field.appearance(image),
                            distortion=self.cfg.distortion_loss > 0, cull=self.cfg.cull_occluded,
                            march_capacity=march_capacity)
        loss, info = self._training_loss(out, rgb)
        return loss, info, out

    def targets(self, rgb: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The colours [R, 3] a batch trains on and the background [R, 3] to render them on (None: the
        field's). RGBA [R, 4] (straight alpha) is composited on a random colour per ray (drawn from
        ``generator``) with ``random_background``, else on the field's fixed colour."""
        if rgb.shape[-1] != 4:
            return rgb, None
        if not self.random_bg:
            return composite(rgb, self.field.fixed_background), None
        bg = torch.rand((rgb.shape[0], 3), generator=generator, device=generator.device).to(rgb.device)
        return composite(rgb, bg), bg

    def forward_backward(self, batch, generator: torch.Generator, before_backward=None) -> dict:
        """One micro-batch of rays ``(o, d, rgb)`` (``rgb`` [R, 3], or RGBA [R, 4]: see :meth:`targets`):
        the loss's gradients are added to the parameters'
        ``.grad``; returns ``loss``, ``mse`` and ``num_samples`` (device tensors).
        ``before_backward`` is called between the forward and the backward of an eager step (a
        replayed graph step has no such point)."""
        o, d, rgb, *image = batch
        image = image[0] if image else None  # with appearance codes: each ray's training image
        rgb, bg = self.targets(rgb, generator)  # drawn before the jitter on both paths
        self._last_count = (None, o.shape[0])
        if self.graphed is not None:
            jitter = sample_jitter(o.shape[0], True, generator, self.device)  # as render_rays draws it
            got = self.graphed(o, d, rgb, jitter, bg, image)
            if got is not None:
                loss, mse, num, dist = got
                if dist is None:
                    return {"loss": loss, "mse": mse, "num_samples": num}
                return {"loss": loss, "mse": mse, "distortion": dist, "num_samples": num}
            # no sample count yet to size the graph's budget: this step runs eagerly and gives one
            loss, info, out = self.packed_loss(o, d, rgb, jitter, background=bg, image=image)
            self.graphed.observe(int(out["num_samples"]))
            if "march_total" in out:  # culling: the march's own budget is sized from this
                self.graphed.observe_march(int(out["march_total"]))
        else:
            app = None if image is None else self.field.appearance(image)
            loss, info = self.loss(o, d, rgb, generator, bg, app)
        self._last_count = (info["num_samples"], o.shape[0])
        if before_backward is not None:
            before_backward()
        if loss.requires_grad:  # a batch whose rays all missed the occupied cells trains nothing
            loss.backward()
        return {"loss": loss.detach(), **info}

    def _counted(self) -> tuple[int, int]:
        """(samples, rays) of the last micro-batch: its eager count, or a graph step's, waiting for
        that step to finish (once per budget revision, so every run revises from the same counts)."""
        samples, rays = self._last_count
        if samples is None:  # a replayed graph step: its count arrives asynchronously
            return self.graphed.flush(), rays
        return int(samples), rays

    def optimizer_step(self, step: int, skip: torch.Tensor) -> None:
        step_optimizers(self.optimizers, self.schedulers, skip)
        if self.ema is not None:
            self.ema.update()

    def _rendering(self):
        """The weights renders use: the moving average with ``ema_decay``, else the trained ones."""
        return self.ema.swapped_in() if self.ema is not None else contextlib.nullcontext()

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

    @torch.no_grad()
    def occlusion_census(self, views, rays: int = 8192, seed: int = 0) -> dict:
        """How many of the samples the packed training step evaluates for ``rays`` random training rays
        of ``views`` lie behind an opaque surface (``render.occluded_samples``): marched samples per
        ray, the occluded share, the samples per ray before each ray's cut, and the rays a step of
        2^18 samples (instant-ngp's) holds counting all of them or only those kept."""
        gen = torch.Generator(device=views.pixels.device).manual_seed(seed)
        o, d, _ = RaySampler(views, gen).sample(rays)
        jitter = torch.rand(rays, generator=gen, device=gen.device).to(o.device)
        got = occluded_samples(self.field, self.grid, o, d, jitter, self.step_size, self.max_steps, self.cfg.near)
        n, kept, budget = got["samples"], float(got["kept_per_ray"].double().mean()), 1 << 18
        return {"rays": rays, "samples": n, "samples_per_ray": n / rays, "occluded": got["occluded"],
                "occluded_share": got["occluded"] / max(1, n), "kept_per_ray": kept,
                "rays_per_step_all": budget / max(1e-9, n / rays), "rays_per_step_kept": budget / max(1e-9, kept)}

    def summary(self) -> dict:
        g = self.graphed
        graph = None if g is None else {
            "captures": g.captures, "capture_s": round(g.capture_s, 3), "budget_samples": g.capacity,
            "max_samples_seen": g.max_count,
            "overflow_steps": g.overflow_steps, "failed": g.failed, "events": [list(e) for e in g.events]}
        if g is not None and g.cull:
            graph.update(march_budget=g.march_capacity, march_overflow_steps=g.march_overflow_steps)
        out = {"kernels": self.use_kernels, "fused_render": self.fused, "cuda_graph": graph,
               "finest_resolution": int(self.field.encoding.resolutions[-1])}
        if self.budget is not None:
            b = self.budget
            out["ray_budget"] = {"target_samples": b.target, "rays_per_step": int(b.buffer),
                                 "revisions": b.revisions, "rays_drawn": b.rays_drawn}
        return out

    @torch.no_grad()
    def render_ray_outputs(self, o: torch.Tensor, d: torch.Tensor, chunk: int = 8192) -> dict[str, torch.Tensor]:
        """``rgb`` [R, 3] in [0, 1], ``depth`` [R] (the weights' sum of sample distances along the unit
        ray, not divided by the opacity) and ``alpha`` [R] (opacity, the weights' sum) of rays [R, 3];
        the dense renderer stops each ray early (render_rays_early_stop). With ``ema_decay`` the
        weight average renders."""
        outs: dict[str, list[torch.Tensor]] = {"rgb": [], "depth": [], "alpha": []}
        with self._rendering():
            for i in range(0, o.shape[0], chunk):
                args = (self.field, self.grid, o[i : i + chunk], d[i : i + chunk], self.step_size,
                        self.max_steps, self.cfg.near)
                r = render_rays(*args, fused=True) if self.fused else render_rays_early_stop(*args)
                for key, name in (("rgb", "rgb"), ("depth", "depth"), ("alpha", "opacity")):
                    outs[key].append(r[name])
        out = {k: torch.cat(v) for k, v in outs.items()}
        out["rgb"] = out["rgb"].clamp(0, 1)
        return out

    def render_rays(self, o: torch.Tensor, d: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
        """Colours [R, 3] in [0, 1] (:meth:`render_ray_outputs`)."""
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
        out = {"field": self.field.state_dict(), "grid": self.grid.state_dict()}
        if self.step_diag is not None:
            out["step_diag"] = torch.tensor(self.step_diag, dtype=torch.float64)
        if self.ema is not None:
            out["ema"] = self.ema.state_dict()
        if self.budget is not None:
            out["ray_budget"] = self.budget.state()
        return out

    def local_state(self) -> dict:
        return {}  # every rank holds the same state

    def load_local_state(self, state: dict) -> None:
        pass

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or not {"field", "grid"} <= set(state):
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a NeRF model state (it has {keys}; a NeRF's has 'field' and 'grid'): a "
                             "model of another method, or a file that is not a model")
        mine = {**{f"field.{k}": v for k, v in self.field.state_dict().items()},
                **{f"grid.{k}": v for k, v in self.grid.state_dict().items()}}
        saved = {**{f"field.{k}": v for k, v in state["field"].items()},
                 **{f"grid.{k}": v for k, v in state["grid"].items()}}
        wrong = [f"{k}: saved {tuple(v.shape)}, this config {tuple(mine[k].shape)}"
                 for k, v in saved.items() if k in mine and tuple(v.shape) != tuple(mine[k].shape)
                 and not (k == "field.appearance.weight" and v.shape[1:] == mine[k].shape[1:])]
        optional = {"field.appearance.weight", "field.fixed_background"}  # told apart below, or older models'

        def why(k: str) -> str:
            return f" (mlp_init {self.cfg.mlp_init!r}?)" if "_mlp." in k else ""

        wrong += [f"{k}: in the saved model, not in this config{why(k)}"
                  for k in saved if k not in mine and k not in optional]
        wrong += [f"{k}: in this config, not in the saved model{why(k)}"
                  for k in mine if k not in saved and k not in optional]
        if ("field.appearance.weight" in saved) != ("field.appearance.weight" in mine):
            wrong.append(f"field.appearance.weight: saved {'with' if 'field.appearance.weight' in saved else 'without'} "
                         f"appearance codes, this config appearance_dim {self.cfg.appearance_dim}")
        if wrong:
            raise ValueError("the NeRF state does not fit reconstruct.nerf's sizes (a model of another config: "
                             "levels, log2_hashmap_size, hidden_dim, mlp_init, occ_resolution, ...): " + "; ".join(wrong))
        field = dict(state["field"])
        field.setdefault("fixed_background", torch.full((3,), -1.0))  # models saved before it existed
        codes = field.get("appearance.weight")
        if self.field.appearance is not None and codes is not None and codes.shape != self.field.appearance.weight.shape:
            # a model loaded to render (built without its scene): one code per image it was trained on
            self.field.appearance = torch.nn.Embedding(*codes.shape).to(self.device)
        self.field.load_state_dict(field)
        self.grid.load_state_dict(state["grid"])
        # the saved box (with scene contraction: the cameras' and points' box; in an alpha hull, the step
        # of the box it replaced)
        self.step_diag = float(state["step_diag"]) if "step_diag" in state else None
        self._set_step()
        if (self.ema is not None) != ("ema" in state):
            raise ValueError(f"the saved NeRF state {'has' if 'ema' in state else 'lacks'} a weight average "
                             f"but reconstruct.nerf.ema_decay is {self.cfg.ema_decay}")
        if self.ema is not None:
            self.ema.load_state_dict(state["ema"])
        if self.budget is not None and "ray_budget" in state:
            self.budget.load(state["ray_budget"].to(self.device))


class _BudgetedSampler:
    """A :class:`RaySampler` that draws as many rays as the :class:`RayBudget` says (``target_samples``)."""

    def __init__(self, sampler: RaySampler, budget: RayBudget):
        self.sampler, self.budget = sampler, budget

    def sample(self, n: int):
        return self.sampler.sample(self.budget.rays(n))


def check_scene(scene, aabb: torch.Tensor) -> None:
    """Stop with a message naming the problem when the scene cannot train a NeRF: a box that is
    empty or not finite, or training cameras that all sit at one point (no parallax, no depth)."""
    if aabb.shape != (2, 3) or not bool(torch.isfinite(aabb).all()) or not bool((aabb[1] > aabb[0]).all()):
        raise ValueError(f"the scene box {aabb.tolist()} is empty or not finite (transforms.json 'aabb'); "
                         "rerun the poses stage, or set a box with min < max on every axis")
    centres = scene.train.c2w[:, :3, 3]
    if not bool(torch.isfinite(scene.train.c2w).all()):
        raise ValueError("a training camera pose is not finite (NaN or Inf in transforms.json)")
    spread = float((centres - centres.mean(0)).norm(dim=-1).max()) if len(centres) else 0.0
    if spread <= 1e-6 * float((aabb[1] - aabb[0]).norm()):
        raise ValueError(f"all {len(centres)} training cameras are at one point ({centres[0].tolist()}): a NeRF "
                         "needs views from different places to recover depth (a panorama or a camera turned "
                         "on the spot cannot be reconstructed); capture the scene moving around it")


def viewing_spread_deg(c2w: torch.Tensor) -> float:
    """The widest angle (degrees) between two cameras' optical axes: small for a forward-facing
    capture (LLFF's fern: every view looks one way), large for one that goes around its subject
    (an orbit, a 360 capture: up to 180)."""
    axes = c2w[:, :3, 2].double()
    axes = axes / axes.norm(dim=-1, keepdim=True)
    cos = (axes @ axes.T).min().clamp(-1, 1)
    return math.degrees(float(torch.arccos(cos)))


CONTRACTED_FINEST = 4096  # instant-ngp's 2048 over the box, which scene contraction maps to the grid's middle half
BOX_FINEST = 2048  # instant-ngp's finest level over its unit cube; with cascades, times aabb_scale (its testbed)
LOADED_FINEST = 2048  # auto without a scene (a model loaded to render): a stand-in until its state is loaded


def finest_resolution(cfg: NerfParams, scene, aabb: torch.Tensor) -> int:
    """``cfg.max_resolution``, or for ``auto`` one cell of the finest level per pixel footprint at the
    centre of the box ``aabb`` (the one the grid spans): its longest side over the median, across the
    training views, of the camera's distance to that centre / its focal length (pixels). Clamped to
    [base_resolution, 8192]. With scene contraction :data:`CONTRACTED_FINEST`; with cascades
    :data:`BOX_FINEST` times ``aabb_scale`` (the encoding spans the box scaled by it)."""
    if cfg.max_resolution != "auto":
        return int(cfg.max_resolution)
    if cfg.scene_contraction == "cascades":
        return BOX_FINEST * cfg.aabb_scale
    if cfg.scene_contraction != "none":
        return CONTRACTED_FINEST
    if scene is None:
        return LOADED_FINEST
    views = scene.train
    centre = (0.5 * (aabb[0] + aabb[1])).double().cpu()
    distance = (views.c2w[:, :3, 3].double().cpu() - centre).norm(dim=-1)
    focal = 0.5 * (views.cameras.fx.double() + views.cameras.fy.double()).cpu()
    footprint = float((distance / focal).median())
    side = float((aabb[1] - aabb[0]).max())
    cells = side / footprint if footprint > 0 else float("inf")
    return int(min(max(round(cells), cfg.base_resolution), 8192))


def cone_steps(dt: float, cone: float, reach: float) -> int:
    """How many steps ``max(dt, cone t)`` (the cascades' march) take a ray from t = 0 to ``reach``: ``dt``
    up to ``T = dt / cone``, then each step ``1 + cone`` times the last's t; one more for the jitter.
    With instant-ngp's cone 1/256, 512 steps across the box and aabb_scale 16: 1146."""
    if cone <= 0 or reach <= dt / cone:
        return math.ceil(reach / dt) + 1
    return math.ceil(1.0 / cone) + math.ceil(math.log(reach * cone / dt) / math.log1p(cone)) + 1


def contraction_box(scene, pad: float = 0.1) -> torch.Tensor:
    """[2, 3] inner box for scene contraction (and the innermost cascade): the bounding box of the
    training cameras and of the middle 90 % of the sparse points (5th to 95th percentile per axis),
    padded by ``pad`` of its largest side. mip-NeRF 360 puts the cameras inside its inner region so that the space they look
    through stays uncontracted; the points reach the objects in front of forward-facing cameras."""
    centres = scene.train.c2w[:, :3, 3].double()
    lo, hi = centres.min(0).values, centres.max(0).values
    if scene.points is not None and len(scene.points) >= 8:
        pts = scene.points.double()
        lo = torch.minimum(lo, torch.quantile(pts, 0.05, dim=0))
        hi = torch.maximum(hi, torch.quantile(pts, 0.95, dim=0))
    side = float((hi - lo).max())
    margin = pad * side
    lo, hi = lo - margin, hi + margin
    hi = torch.maximum(hi, lo + 0.1 * side)  # no flat axis (cameras on a plane, no points above it)
    return torch.stack([lo, hi]).float()
