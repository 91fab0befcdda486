"""3D Gaussian Splatting as a trainable method (Kerbl et al. 2023), through the project's rasterizer.

It implements :class:`stages.reconstruct.methods.Method`. A batch is ``gs.batch_views`` training
views of this rank; each is rendered whole (``kernels.rasterization``: CUDA kernels on a GPU,
their PyTorch twins on the CPU) and scored with ``(1 - l) L1 + l (1 - SSIM)``. After the
optimizer step the densification strategy (``densify.py``) reads the view-space gradients of the
projected means, and every ``refine_every`` steps clones, splits and prunes Gaussians; the
parameter set then changes, and the loop's parallel strategy rebinds its gradient buffers.

With several ranks every rank renders its own views; the densification statistics are summed
(gradients, counts) or maxed (radii) over ranks before a decision, and the split samples come
from the generator every rank shares, so every replica densifies identically (the replica check
verifies it).
"""
from __future__ import annotations

import logging
import math

import torch

from stages.common.cameras import Intrinsics

from ..methods import resolve_use_kernels, step_optimizers
from .densify import DensifyStrategy
from .mcmc import MCMCStrategy, regulariser
from .model import PARAM_NAMES as NAMES
from .model import init_box, init_gaussians, make_optimizers, scene_extent, sh_degree_at

log = logging.getLogger("stages.reconstruct.gs")


def _viewmats(c2w: torch.Tensor) -> torch.Tensor:
    """World-to-camera [V, 4, 4] of camera-to-world [V, 4, 4] (OpenCV axes)."""
    R, t = c2w[:, :3, :3], c2w[:, :3, 3:]
    out = torch.zeros_like(c2w)
    out[:, :3, :3] = R.transpose(1, 2)
    out[:, :3, 3:] = -R.transpose(1, 2) @ t
    out[:, 3, 3] = 1.0
    return out


def _K(intr: Intrinsics, device) -> torch.Tensor:
    return torch.tensor([[intr.fx, 0.0, intr.cx], [0.0, intr.fy, intr.cy], [0.0, 0.0, 1.0]], device=device)


class ViewSampler:
    """Training views in random order, epoch after epoch without repeats (as the reference's
    shuffled loader). The order of epoch ``e`` is a permutation drawn from a generator seeded
    from this shard's seed and ``e``, so the position alone (units drawn) says where a resumed
    run continues: :meth:`seek`."""

    def __init__(self, n_views: int, generator: torch.Generator):
        self.n = n_views
        self.seed = generator.initial_seed()
        self.drawn = 0
        self._epoch, self._perm = -1, None

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return self._perm

    def sample(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            epoch, pos = divmod(self.drawn, self.n)
            out.append(int(self._order(epoch)[pos]))
            self.drawn += 1
        return out

    def seek(self, drawn: int) -> None:
        self.drawn = drawn


class GaussianMethod:
    """3D Gaussians with SH colours, trained with one Adam per parameter and adaptive density control."""

    name = "3dgs"
    VERSION = 1
    UNIT = "views"
    OPERATIONAL_KEYS = frozenset({"kernels", "gs.images_on", "gs.cuda_graph"})

    def __init__(self, params, aabb: torch.Tensor, device: torch.device,
                 background: tuple[float, float, float] | None = None, scene=None):
        cfg = params.gs
        self.cfg, self.params, self.device = cfg, params, device
        self.use_kernels = resolve_use_kernels(params.kernels, device)
        self.aabb = aabb.to(device)
        self.background = None if background is None else torch.tensor(background, dtype=torch.float32,
                                                                         device=device)
        if scene is not None:
            pts = None if scene.points is None else scene.points.to(device)
            rgb = None if scene.point_rgb is None else scene.point_rgb.to(device)
            g = torch.Generator().manual_seed(torch.initial_seed())  # the same Gaussians on every rank
            mcmc = cfg.strategy == "mcmc"  # its own starting opacity and scale, as gsplat's mcmc preset
            box = init_box(self.aabb, scene.train.c2w, cfg.init_extent)
            self.gaussians = init_gaussians(pts, rgb, box, sh_degree=cfg.sh_degree,
                                            init_opacity=cfg.mcmc.init_opacity if mcmc else cfg.init_opacity,
                                            init_scale=cfg.mcmc.init_scale if mcmc else cfg.init_scale,
                                            n_random=cfg.init_random, generator=g, device=device)
            self.extent = scene_extent(scene.train.c2w)
            where = "the box" if cfg.init_extent <= 0 else f"a cube of {cfg.init_extent:g} scene extents"
            source = "sparse points" if pts is not None and len(pts) else f"{cfg.init_random} random in {where}"
            log.info("3DGS: %d Gaussians from %s, scene extent %.3f", self.n, source, self.extent)
        else:  # a state dict follows (load_state_dict)
            self.gaussians = init_gaussians(None, None, self.aabb, sh_degree=cfg.sh_degree, n_random=4,
                                            generator=torch.Generator().manual_seed(0), device=device)
            self.extent = 1.0
        self.optimizers = make_optimizers(
            self.gaussians, means_lr=cfg.means_lr, scene_extent=self.extent, sh0_lr=cfg.sh0_lr, shN_lr=cfg.shN_lr,
            opacities_lr=cfg.opacities_lr, scales_lr=cfg.scales_lr, quats_lr=cfg.quats_lr,
            # gsplat and Grendel-GS: lr x sqrt(views per step), eps / sqrt(views); the loop adds x sqrt(ranks)
            lr_scale=math.sqrt(cfg.batch_views), eps=1e-15 / math.sqrt(cfg.batch_views),
            fused=device.type == "cuda")
        # Views without alpha and no known colour: the background is learned (a logit per channel,
        # its own Adam under the name "background"; not one of the fused six, not densified)
        self.bg_logit: torch.nn.Parameter | None = None
        if (scene is not None and scene.train.channels == 3 and self.background is None
                and cfg.learn_background == "auto"):
            self.bg_logit = torch.nn.Parameter(torch.zeros(3, device=device))
            lr = cfg.background_lr * math.sqrt(cfg.batch_views)
            self.optimizers["background"] = torch.optim.Adam(
                [{"params": [self.bg_logit], "lr": lr, "initial_lr": lr, "name": "background"}],
                eps=1e-15 / math.sqrt(cfg.batch_views), fused=device.type == "cuda")
        gamma = (cfg.means_lr_final / cfg.means_lr) ** (1.0 / max(1, params.steps))
        self.schedulers = {"means": torch.optim.lr_scheduler.ExponentialLR(self.optimizers["means"], gamma)}
        self.densify = (MCMCStrategy(cfg.mcmc) if cfg.strategy == "mcmc"
                        else DensifyStrategy(cfg.densify, total_steps=params.steps))
        self.graphed = self._captured_view(cfg.cuda_graph, params)
        self.densify_log: list[dict] = []
        self._has_alpha = False

    def _captured_view(self, setting: str, params):
        """The CUDA-graph training view (gs/graph.py), or None for eager views."""
        if setting == "off":
            return None
        why = ("the rasterizer does not run CUDA kernels here (reconstruct.kernels)" if not self.use_kernels else
               "distributed.overlap_comm starts all-reduces from backward hooks, which a replayed graph skips"
               if params.distributed.overlap_comm else
               "partitioned mode renders through the exchange of Gaussians between ranks"
               if params.distributed.mode == "partitioned" else None)
        if why is not None:
            if setting == "on":
                raise ValueError(f"reconstruct.gs.cuda_graph is 'on' but {why}")
            return None
        from .graph import CapturedView

        return CapturedView(self, required=setting == "on")

    # ------------------------------------------------------------ the Method members

    @property
    def n(self) -> int:
        return int(self.gaussians["means"].shape[0])

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.gaussians.values())

    def parameters(self) -> list[torch.nn.Parameter]:
        out = [self.gaussians[k] for k in NAMES]
        return out if self.bg_logit is None else out + [self.bg_logit]

    def background_rgb(self, learning: bool = False) -> torch.Tensor:
        """The colour [3] behind the Gaussians: the learned one (with its gradient when ``learning``),
        the known one of the images, or black."""
        if self.bg_logit is not None:
            bg = torch.sigmoid(self.bg_logit)
            return bg if learning else bg.detach()
        return self.background if self.background is not None else torch.zeros(3, device=self.device)

    def batch_size(self) -> int:
        return self.cfg.batch_views

    def place(self, views):
        """The training images on the GPU when they fit (a quarter of the free memory), else pinned."""
        where = self.cfg.images_on
        if self.device.type != "cuda":
            return views.to(self.device)
        if where == "auto":
            free, _ = torch.cuda.mem_get_info(self.device)
            where = "cuda" if views.pixels.numel() * 4 < free // 4 else "cpu"  # float copies of a batch aside
            if where == "cpu":
                log.info("3DGS: %.1f GB of training images stay in pinned CPU memory", views.pixels.numel() / 1e9)
        return views.to(self.device) if where == "cuda" else views.to("cpu").pin_memory()

    def make_sampler(self, views, generator: torch.Generator) -> "_Views":
        self._has_alpha = views.channels == 4
        if self._has_alpha and self.background is None:
            # RGBA views with no known colour: evaluation composites them on white (evaluate stage), so
            # the trained model renders onto white too (training itself draws random colours)
            self.background = torch.ones(3, device=self.device)
        out = _Views(views, ViewSampler(len(views), generator), self.device)
        sizes = {(k.width, k.height) for k in out.intrs}
        if self.graphed is not None and len(sizes) > 1:
            # a graph holds one image size: views of several would capture again at almost every step
            log.info("3DGS: the training views come in %d image sizes; each view renders eagerly, without a "
                     "CUDA graph", len(sizes))
            self.graphed = None
        return out

    def step_pre_forward(self, step: int, generator: torch.Generator) -> None:
        """Remember the step (the SH degree follows it) and the generator every rank shares (split samples)."""
        self._step, self._shared = step, generator
        return None

    def sh_degree(self, step: int) -> int:
        return sh_degree_at(step, self.cfg.sh_degree, self.cfg.sh_degree_every)

    def _render(self, viewmats, Ks, width: int, height: int, sh_degree: int, backgrounds, absgrad: bool = False,
                render_mode: str = "RGB", validate: bool = True, capacity: int | None = None):
        import kernels

        g = self.gaussians
        budget = {} if capacity is None else {"capacity": capacity}  # the CUDA-graph view's (gs/graph.py)
        return (self.renderer or kernels.rasterization)(
            g["means"], g["quats"], torch.exp(g["scales"]), torch.sigmoid(g["opacities"]),
            (g["sh0"], g["shN"]), viewmats, Ks, width, height, sh_degree=sh_degree,
            backgrounds=backgrounds, near_plane=self.cfg.near, far_plane=self.cfg.far, eps2d=self.cfg.eps2d,
            antialiased=self.cfg.antialiased, absgrad=absgrad, render_mode=render_mode, validate=validate,
            alpha_max=self.cfg.alpha_max, **budget)

    def _random_bg(self) -> bool:
        rb = self.cfg.random_background
        return rb == "on" or (rb == "auto" and self._has_alpha)

    def _view_loss(self, image: torch.Tensor, viewmat: torch.Tensor, K: torch.Tensor, width: int, height: int,
                   bg: torch.Tensor | None, n: int, capacity: int | None = None):
        """(loss / n, mse / n, meta) of one training view: its uint8 ``image`` [H, W, C] on the method's
        device, composited over ``bg`` [3] where it has alpha (None: the method's own colour, with its
        gradient when learned), against the render; the body of an eager view and of a captured one."""
        from kernels.ssim import ssim as fused_ssim

        lam = self.cfg.ssim_lambda
        if bg is None:
            bg = self.background_rgb(learning=True)
        img = image.float() / 255.0
        gt = img[..., :3]
        if img.shape[-1] == 4:
            a = img[..., 3:]
            gt = gt * a + bg * (1.0 - a)
        render, _, meta = self._render(viewmat, K, width, height, self.sh_degree(self._step), bg[None],
                                       absgrad=self.cfg.densify.absgrad, validate=False,  # finite by construction
                                       capacity=capacity)
        pred = render[0]
        l1 = (pred - gt).abs().mean()
        ssim = fused_ssim(pred.permute(2, 0, 1)[None], gt.permute(2, 0, 1)[None], use_kernels=self.use_kernels)
        loss = (1.0 - lam) * l1 + lam * (1.0 - ssim)
        if self.cfg.strategy == "mcmc":
            loss = loss + regulariser(self.gaussians, self.cfg.mcmc)
        loss = loss / n
        mse = ((pred.detach() - gt) ** 2).mean() / n
        return loss, mse, meta

    def forward_backward(self, batch, generator: torch.Generator, before_backward=None) -> dict:
        """Render each view of ``batch`` (a :class:`_Batch`) and add the gradients of the mean loss:
        replayed in a CUDA graph where one runs (gs/graph.py), else eagerly."""
        views, n = batch.views, len(batch.indices)
        loss_sum = mse_sum = None
        pixels = 0
        for k, i in enumerate(batch.indices):
            intr = views.intrs[i]
            image = views.image(i)
            bg = None
            if image.shape[-1] == 4 and self._random_bg():
                bg = torch.rand(3, generator=generator, device=generator.device).to(self.device)
            if k == n - 1 and before_backward is not None:
                before_backward()
            got = None
            if self.graphed is not None and self.renderer is None:
                got = self.graphed(image, views.viewmats[i:i + 1], views.Ks[i:i + 1], bg, n)
            if got is not None:
                loss, mse, meta = got
            else:
                loss, mse, meta = self._view_loss(image.to(self.device, non_blocking=True), views.viewmats[i:i + 1],
                                                  views.Ks[i:i + 1], intr.width, intr.height, bg, n)
                loss.backward()
                loss = loss.detach()  # nothing of this view's autograd graph may outlive it: a CUDA graph
                if self.graphed is not None:  # captured while it lives would wait on it and fail
                    self.graphed.observe(meta["n_intersections"])
            # the view-space gradients, read now (a replayed graph rewrites them with the next view)
            if self.densify.active(self._step):
                self.densify.accumulate(meta)
            del meta
            loss_sum = loss if loss_sum is None else loss_sum + loss
            mse_sum = mse if mse_sum is None else mse_sum + mse
            pixels += intr.width * intr.height
        # a count made on the device: torch.as_tensor(int) would copy from the host and wait for the GPU
        return {"loss": loss_sum, "mse": mse_sum, "num_samples": torch.full((), float(pixels), device=self.device)}

    def optimizer_step(self, step: int, skip: torch.Tensor) -> None:
        """All six Adams in one launch where the kernels run (kernels.adam), torch's otherwise."""
        if not self.use_kernels:
            step_optimizers(self.optimizers, self.schedulers, skip)
            return
        from kernels.adam import step_adams

        step_adams({k: self.optimizers[k] for k in NAMES}, skip)
        # the launch stepped them without optimizer.step(): tell the schedulers' call-order check
        # (torch warned "lr_scheduler.step() before optimizer.step()" on every GPU run)
        for k in self.schedulers:
            self.optimizers[k]._opt_called = True
        if self.bg_logit is not None:  # torch's fused Adam reads the flag on the device too
            step_optimizers({"background": self.optimizers["background"]}, {}, skip)
        for s in self.schedulers.values():
            s.step()

    def after_step(self, step: int, strategy) -> bool:
        """Densification statistics of this step's renders; clone, split, prune at refine steps
        (MCMC: relocate, grow and move, :meth:`_mcmc_step`)."""
        if isinstance(self.densify, MCMCStrategy):
            return self._mcmc_step(step)
        if not self.densify.active(step):  # (forward_backward accumulated the statistics)
            return False
        self.densify.reduce = lambda stats: _reduced(strategy, stats)
        before = self.n
        out = self.densify.step(step, self.gaussians, self.optimizers, self._shared, self.extent)
        if out["budget_hit"]:
            log.warning("3DGS: the Gaussian budget (reconstruct.gs.densify.max_gaussians = %d) is reached at "
                        "step %d; densification stops growing", self.cfg.densify.max_gaussians, step + 1)
        changed = self.n != before or out["duplicated"] or out["split"] or out["pruned"]
        if changed:
            self.densify_log.append({"step": step + 1, "gaussians": self.n, "duplicated": out["duplicated"],
                                     "split": out["split"], "pruned": out["pruned"]})
        return bool(changed)

    def _mcmc_step(self, step: int) -> bool:
        before = self.n
        lr = self.optimizers["means"].param_groups[0]["lr"]  # after this step's scheduler step, as gsplat
        out = self.densify.step(step, self.gaussians, self.optimizers, self._shared, lr)
        if out["budget_hit"]:
            log.info("3DGS (mcmc): the Gaussian budget (reconstruct.gs.mcmc.cap_max = %d) is reached at step %d; "
                     "from here on the dead are only relocated", self.cfg.mcmc.cap_max, step + 1)
        if out["relocated"] or out["added"]:
            self.densify_log.append({"step": step + 1, "gaussians": self.n, "relocated": out["relocated"],
                                     "added": out["added"]})
        return self.n != before  # relocation edits the rows in place: nothing to re-bind

    @torch.no_grad()
    def quick_test_psnr(self, views, generator: torch.Generator) -> float | None:
        """PSNR of one random held-out view, rendered whole."""
        if len(views) == 0:
            return None
        i = int(torch.randint(0, len(views), (1,), generator=generator, device=generator.device))
        img = views.image(i).to(self.device).float() / 255.0
        gt = img[..., :3]
        bg = self.background_rgb()
        if img.shape[-1] == 4:
            gt = gt * img[..., 3:] + bg * (1.0 - img[..., 3:])
        pred = self.render_image(views.intr(i), views.c2w[i].float())
        return -10.0 * math.log10(max(float(torch.mean((pred - gt) ** 2)), 1e-10))

    @torch.no_grad()
    def render_outputs(self, intr: Intrinsics, c2w: torch.Tensor, chunk: int = 0) -> dict[str, torch.Tensor]:
        """``rgb`` [H, W, 3] in [0, 1] (onto the scene's background, or black), ``depth`` [H, W] (the
        blending weights' sum of camera-space depths, not divided by the opacity, as the NeRF's) and
        ``alpha`` [H, W] (opacity), on the method's device."""
        bg = self.background_rgb()
        render, alpha, _ = self._render(_viewmats(c2w.to(self.device).float()[None]), _K(intr, self.device)[None],
                                        intr.width, intr.height, self.cfg.sh_degree, bg[None], render_mode="RGB+D")
        return {"rgb": render[0, ..., :3].clamp(0.0, 1.0), "depth": render[0, ..., 3], "alpha": alpha[0, ..., 0]}

    @torch.no_grad()
    def render_image(self, intr: Intrinsics, c2w: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """[H, W, 3] float32 in [0, 1] on the method's device (onto the scene's background, or black)."""
        bg = self.background_rgb()
        render, _, _ = self._render(_viewmats(c2w.to(self.device).float()[None]), _K(intr, self.device)[None],
                                    intr.width, intr.height, self.cfg.sh_degree, bg[None])
        return render[0].clamp(0.0, 1.0)

    def state_dict(self) -> dict:
        if self.bg_logit is not None or self.background is not None:
            bg = self.background_rgb()
        else:
            bg = torch.full((3,), -1.0, device=self.device)
        state = {"params": {k: self.gaussians[k].detach() for k in NAMES}, "sh_degree": self.cfg.sh_degree,
                 "version": self.VERSION, "extent": torch.tensor(self.extent), "background": bg}
        if self.bg_logit is not None:
            state["background_logit"] = self.bg_logit.detach()
        return state

    def load_state_dict(self, state: dict) -> None:
        params = state["params"]
        missing = [k for k in NAMES if k not in params]
        if missing:
            raise ValueError(f"3DGS state without {', '.join(missing)}: not a model of this method")
        for k in NAMES:
            p = torch.nn.Parameter(params[k].to(self.device).clone())
            self.gaussians[k] = p
            opt = self.optimizers[k]
            opt.param_groups[0]["params"] = [p]
            opt.state.clear()
        self.extent = float(state.get("extent", torch.tensor(self.extent)))
        logit, bg = state.get("background_logit"), state.get("background")
        if self.bg_logit is not None and logit is not None:  # a resumed run goes on learning it
            with torch.no_grad():
                self.bg_logit.copy_(logit.to(self.device))
        elif bg is not None and float(bg.min()) >= 0:  # -1: none (black); else the colour (known or learned)
            self.background = bg.to(self.device).float()

    def local_state(self) -> dict:
        """This rank's densification statistics (its own views' gradients, not yet reduced)."""
        st = self.densify.state_dict()  # on the CPU: it travels through all_gather_object to rank 0
        stats = None if st["stats"] is None else {k: v.cpu() for k, v in st["stats"].items()}
        return {"densify": {**st, "stats": stats}}

    def load_local_state(self, state: dict) -> None:
        st = dict(state["densify"])
        if st["stats"] is not None:
            st["stats"] = {k: v.to(self.device) for k, v in st["stats"].items()}
        self.densify.load_state_dict(st)

    def summary(self) -> dict:
        bg = None if self.bg_logit is None else [round(float(v), 4) for v in self.background_rgb()]
        return {"kernels": self.use_kernels, "num_gaussians": self.n, "sh_degree": self.cfg.sh_degree,
                "learned_background": bg, "densify": self.densify_log[-50:],
                "cuda_graph": None if self.graphed is None else self.graphed.summary()}

    _step = 0
    _shared: torch.Generator | None = None
    # kernels.rasterization's stand-in, set by a parallel strategy (parallel.Partitioned: this rank's shard
    # of the Gaussians rendered with the other ranks'); None renders with kernels.rasterization
    renderer = None


def _reduced(strategy, stats: dict) -> dict:
    """Densification statistics made global through the parallel strategy (sum, sum, max)."""
    summed = torch.stack([stats["grad2d"], stats["count"]])
    radii = stats["radii"].clone()
    strategy.reduce_stats([summed, radii], ["sum", "max"])
    return {"grad2d": summed[0], "count": summed[1], "radii": radii}


class _Batch:
    def __init__(self, views, indices: list[int]):
        self.views, self.indices = views, indices


class _Views:
    """The method's batch sampler: view indices, handed over with the images they index.

    Everything a step reads per view is prepared once: the cameras as Python numbers and the
    world-to-camera matrices and K on the method's device, and image offsets as Python ints
    (slicing the pixel buffer by a device tensor would wait for the GPU every step)."""

    def __init__(self, views, order: ViewSampler, device: torch.device):
        self.views, self.order = views, order
        cams = views.cameras.to("cpu")
        self.intrs = [cams.intrinsics(i) for i in range(len(views))]
        self.offsets = views.offsets.tolist()
        self.viewmats = _viewmats(views.c2w.to(device).float())
        self.Ks = torch.stack([_K(k, "cpu") for k in self.intrs]).to(device)
        self.channels = views.channels

    def image(self, i: int) -> torch.Tensor:
        intr = self.intrs[i]
        return self.views.pixels[self.offsets[i]:self.offsets[i + 1]].view(intr.height, intr.width, self.channels)

    def sample(self, k: int) -> _Batch:
        return _Batch(self, self.order.sample(k))

    def seek(self, drawn: int) -> None:
        self.order.seek(drawn)
