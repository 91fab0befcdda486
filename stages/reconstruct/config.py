"""Typed params of the reconstruct stage (section ``reconstruct`` of params.yaml)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from stages.common.params import check

from .gs.densify import DensifyParams
from .gs.mcmc import MCMCParams


@dataclass
class NerfParams:
    """Hash-grid NeRF (instant-ngp class). Defaults are instant-ngp's where it has one."""

    levels: int = 16
    features_per_level: int = 2
    log2_hashmap_size: int = 19
    base_resolution: int = 16
    # The finest level's cells across the box's longest side. auto: one cell per pixel footprint at the
    # box's centre (the training cameras' median distance to it / focal length; 4096 with scene
    # contraction, where the box is the grid's middle half): lego in its alpha hull, 400 px, gets 375.
    # Finer levels fit the training views' pixels and generalise worse: on lego (one H100, 15 / 30 / 60
    # s) finest 2048 scored 32.63 / 33.57 / 33.96 dB, 512 32.74 / 33.68 / 34.16, 384 32.86 / 33.79 /
    # 34.26, 256 32.77 / 33.81 / 34.30, 192 32.41 / 33.48 / 34.01, 128 31.32 / 32.46 / 33.13.
    max_resolution: int | Literal["auto"] = 2048
    # Added to every level's grid coordinate x * R before the cell lookup, in [0, 1). 0: every level's
    # vertices include the box's corners (and, for even R, its centre planes); 0.5: tiny-cuda-nn's
    # half-cell shift, which staggers the levels' vertices (a level then has R + 2 per axis).
    grid_offset: float = 0.0
    hidden_dim: int = 64
    geo_feat_dim: int = 15
    # The MLPs' layers: "torch" (nn.Linear: biases, Kaiming-uniform weights), or "tcnn" as tiny-cuda-nn's
    # fully fused MLP has them (what instant-ngp and nerfacc's example train): no biases, weights uniform
    # in +-sqrt(6 / (fan_in + fan_out))
    mlp_init: Literal["torch", "tcnn"] = "torch"
    samples_per_ray: int = 128
    occ_resolution: int = 64
    occ_update_every: int = 16
    occ_threshold: float = 0.01
    # Steps before the occupancy grid prunes anything (its density record is refreshed all along).
    # At initialisation every cell has about the same density, so the threshold min(occ_threshold,
    # mean) drops a random half of them. Default scene on the CPU, 2048 rays: with a 2^19-entry
    # table (max_resolution 2048) training then stalled at ~15.5 dB train PSNR for 500 steps, and
    # with 256 warm-up steps reached 20.8 dB at step 247 and 23.4 at 499; with this params.yaml's
    # 2^17 table the warm-up trained faster early (22.7 vs 21.5 dB at step 501) but ended 1.3 dB
    # lower on the test views at 1000 steps (21.97 vs 23.23 dB), so it is off by default.
    occ_warmup_steps: int = 0
    # Multiplies the grid's step counts (occ_update_every, occ_warmup_steps, and the first 256
    # steps in which every cell is refreshed), rounded, at least 1 step. Training with N times the
    # rays per step (N GPUs at the same per-GPU batch), 1/N keeps the grid's refreshes at the same
    # number of rays seen as with one; benchmarks/bench_scaling.py's weak protocol sets it so (as
    # gsplat's steps_scaler does for its schedules).
    occ_schedule_scale: float = 1.0
    lr: float = 1e-2
    lr_final: float = 5e-4  # the end of the "exp" schedule
    # "exp": warm-up, then exponential decay from lr to lr_final over the run; "ngp": instant-ngp's
    # (constant, then x lr_decay_base every lr_decay_every steps from lr_decay_start; nerf/optim.py)
    lr_schedule: Literal["exp", "ngp"] = "exp"
    lr_decay_start: int = 20000
    lr_decay_every: int = 10000
    lr_decay_base: float = 0.33
    # L2 on the MLP weights (torch Adam's weight_decay: added to the gradient), none on the table. Off: 1e-6
    # (instant-ngp's l2_reg) cost lego 0.79 dB at 5000 steps (33.83 against 34.62) and 0.8 dB at 60 s, fox 0.46
    # at 120 s, fern nothing (one H100, 2026-12-07). nerfacc's example barely feels its own 1e-6, as its
    # gradients reach Adam 1024 times the loss's (GradScaler); given ours it fell from 35.24 to 31.71 dB,
    # presumably as late in training the MLPs' gradients from the data grow small enough for 1e-6 to pull as hard.
    weight_decay: float = 0.0
    # Adam's second-moment decay for the table and the MLPs: instant-ngp's 0.99. torch's default 0.999,
    # which nerfacc's instant-ngp example keeps, scored 33.80 / 33.86 dB on lego at 46 s, alone / with
    # cull_occluded (34.31 dB with 0.99 and culling on the same H100, 2026-12-07)
    adam_beta2: float = 0.99
    # the hash table's optimiser: "adam" (torch's, every entry every step) or "sparse" (tiny-cuda-nn's:
    # entries with a zero gradient are not stepped; nerf/optim.py TableAdam)
    table_optimizer: Literal["adam", "sparse"] = "adam"
    # renders (evaluation, the held-out PSNR) use an exponential moving average of the weights with
    # this decay (instant-ngp: 0.95); 0 = the trained weights
    ema_decay: float = 0.0
    # rays per step adapt so that a step evaluates about this many samples (instant-ngp: 2^18 per
    # step); 0 = batch_rays rays every step. The ray count is revised every occ_update_every steps
    # and kept on a grid of 8 values per octave, so a CUDA-graph step is captured again only when it
    # moves by a grid value (nerf/method.py RayBudget).
    target_samples: int = 0
    # the MLPs' arithmetic on a GPU: "float32"; "tf32" (TF32 tensor-core matmuls: torch's
    # allow_tf32, process-wide, so every other float32 matmul of the process too; the rays are built
    # without one); "bfloat16" (autocast around the MLPs alone; densities and colours still float32).
    # On lego (one H100, 60 s) bfloat16 scored 36.08 dB and tf32 35.43 (bench_nerf_quality.py GPU_NERF)
    mlp_precision: Literal["float32", "tf32", "bfloat16"] = "float32"
    near: float = 0.02
    # mip-NeRF 360's distortion loss (eq. 15) x this, on each ray's weights along it (t in scene
    # units): it penalises weight spread along a ray, as floaters and fog spread it. 0 = off
    # (instant-ngp has none; mip-NeRF 360 weighs 0.01 in its normalised ray space).
    distortion_loss: float = 0.0
    # The colour loss: "mse", or "huber" (quadratic within huber_delta of the target, linear past it:
    # a pixel the field cannot explain yet, such as a thin edge or a specular glint, pulls no harder
    # than huber_delta). instant-ngp's NeRF config names a Huber loss; reimplementations of it use
    # delta 0.1. The logged "mse" and PSNR are the squared error either way.
    loss: Literal["mse", "huber"] = "mse"
    huber_delta: float = 0.1
    # Unbounded scenes (real captures with backgrounds): "mipnerf360" contracts the world outside the
    # box into a shell around it (mip-NeRF 360's contraction, L-inf as in nerfstudio), so the hash grid
    # and the occupancy grid cover everything and rays march on past the box in steps uniform in
    # disparity (up to 3 x samples_per_ray steps). The box is then the cameras' and the sparse points'
    # (nerf/method.py contraction_box). "cascades": instant-ngp's way instead: the hash grid spans
    # that box scaled by aabb_scale, the occupancy grid is a cascade of nested grids (box k: the box
    # scaled by 2^k, each occ_resolution^3), and the march step grows with the distance, max(step,
    # cone_angle * t). "none": the scene is the box.
    scene_contraction: Literal["none", "mipnerf360", "cascades"] = "none"
    # instant-ngp's aabb_scale (a power of two, 1..128; 16 is its advice for captures with a far
    # background) and cone angle (1/256 there when aabb_scale > 1), for scene_contraction "cascades"
    aabb_scale: int = 16
    cone_angle: float = 1.0 / 256
    # A learned code of this many values per training image fed to the colour MLP (nerfacto's
    # appearance embedding, for captures whose exposure or white balance changes); views are rendered
    # with the mean code. 0 = off.
    appearance_dim: int = 0
    # Packed-sample renderer (kernels.march_rays / kernels.composite): "on" everywhere (CUDA kernels on
    # a GPU, their references on the CPU), "auto" where the CUDA kernels run, "off" the dense one.
    fused_render: Literal["auto", "on", "off"] | bool = "auto"
    # The training step's forward + backward captured once in a CUDA graph and replayed (packed
    # renderer with a fixed sample budget; nerf/graph.py): "auto" whenever the packed renderer runs
    # CUDA kernels (and overlap_comm is off), "on" (an error where it cannot), "off".
    cuda_graph: Literal["auto", "on", "off"] | bool = "auto"
    # Views with alpha (ingest.alpha: keep) train on a random colour per ray behind them, as
    # instant-ngp does ("auto" / "on"), or on white ("off"); they render onto white either way.
    random_background: Literal["auto", "on", "off"] | bool = "auto"
    # Views with alpha: the box shrinks to the visual hull of their masks ("auto"; nerf/hull.py), so the
    # hash grid, the occupancy grid and the march step cover the object instead of the loose box of the
    # poses out (lego: a 4.03-unit cube of camera focus around a 1.3 x 2.3 x 1.4 object). "off": the box.
    alpha_box: Literal["auto", "off"] | bool = "auto"
    # Training rays through a uniform random point of their pixel, as instant-ngp trains (its
    # snap_to_pixel_centers off), instead of through its centre: the field then fits each pixel's
    # footprint rather than one point of it. Evaluation renders pixel centres either way.
    pixel_jitter: bool = False
    # Training drops each ray's samples behind an opaque surface (transmittance below 1e-4 by a
    # density-only pass over the marched samples) before the field's differentiable pass, as
    # instant-ngp trains on its "compacted" samples and nerfacc culls with a sigma_fn; target_samples
    # then counts the kept samples, so a step holds more rays. Lego after 1000 CPU steps: 40 % of the
    # marched samples (NerfMethod.occlusion_census). Packed renderer only (fused_render); in a CUDA
    # graph the march and the kept samples get a fixed budget each (nerf/graph.py).
    cull_occluded: bool = False

    def __post_init__(self) -> None:
        check(1 <= self.levels <= 32, "levels", "must be in 1..32", self.levels)
        check(1 <= self.features_per_level <= 8, "features_per_level", "must be in 1..8", self.features_per_level)
        check(10 <= self.log2_hashmap_size <= 24, "log2_hashmap_size", "must be in 10..24", self.log2_hashmap_size)
        check(self.base_resolution >= 2, "base_resolution", "must be >= 2", self.base_resolution)
        check(self.max_resolution == "auto" or self.max_resolution >= self.base_resolution, "max_resolution",
              "must be auto or >= base_resolution", self.max_resolution)
        check(0 <= self.grid_offset < 1, "grid_offset", "must be in [0, 1)", self.grid_offset)
        check(self.hidden_dim >= 8, "hidden_dim", "must be >= 8", self.hidden_dim)
        check(self.mlp_init in ("torch", "tcnn"), "mlp_init", "must be 'torch' or 'tcnn'", self.mlp_init)
        check(self.geo_feat_dim >= 1, "geo_feat_dim", "must be >= 1", self.geo_feat_dim)
        check(8 <= self.samples_per_ray <= 4096, "samples_per_ray", "must be in 8..4096", self.samples_per_ray)
        check(8 <= self.occ_resolution <= 512, "occ_resolution", "must be in 8..512", self.occ_resolution)
        check(self.occ_update_every >= 1, "occ_update_every", "must be >= 1", self.occ_update_every)
        check(0 <= self.occ_threshold < 1, "occ_threshold", "must be in [0, 1)", self.occ_threshold)
        check(self.occ_warmup_steps >= 0, "occ_warmup_steps", "must be >= 0", self.occ_warmup_steps)
        check(0 < self.occ_schedule_scale <= 1024, "occ_schedule_scale", "must be in (0, 1024]",
              self.occ_schedule_scale)
        check(self.lr > 0, "lr", "must be > 0", self.lr)
        check(0 < self.lr_final <= self.lr, "lr_final", "must be in (0, lr]", self.lr_final)
        check(self.lr_decay_start >= 0, "lr_decay_start", "must be >= 0", self.lr_decay_start)
        check(self.lr_decay_every >= 1, "lr_decay_every", "must be >= 1", self.lr_decay_every)
        check(0 < self.lr_decay_base <= 1, "lr_decay_base", "must be in (0, 1]", self.lr_decay_base)
        check(0 < self.adam_beta2 < 1, "adam_beta2", "must be in (0, 1)", self.adam_beta2)
        check(self.weight_decay >= 0, "weight_decay", "must be >= 0", self.weight_decay)
        check(0 <= self.ema_decay < 1, "ema_decay", "must be in [0, 1)", self.ema_decay)
        check(self.target_samples == 0 or self.target_samples >= 1024, "target_samples",
              "must be 0 (off) or >= 1024", self.target_samples)
        check(self.near >= 0, "near", "must be >= 0", self.near)
        check(self.distortion_loss >= 0, "distortion_loss", "must be >= 0 (0 = off)", self.distortion_loss)
        check(self.loss in ("mse", "huber"), "loss", "must be 'mse' or 'huber'", self.loss)
        check(self.huber_delta > 0, "huber_delta", "must be > 0", self.huber_delta)
        check(self.scene_contraction in ("none", "mipnerf360", "cascades"), "scene_contraction",
              "must be 'none', 'mipnerf360' or 'cascades'", self.scene_contraction)
        check(isinstance(self.aabb_scale, int) and 1 <= self.aabb_scale <= 128
              and self.aabb_scale & (self.aabb_scale - 1) == 0, "aabb_scale", "must be a power of two in 1..128",
              self.aabb_scale)
        check(0 <= self.cone_angle < 1, "cone_angle", "must be in [0, 1)", self.cone_angle)
        check(0 <= self.appearance_dim <= 256, "appearance_dim", "must be in 0..256", self.appearance_dim)
        for key in ("fused_render", "cuda_graph", "random_background", "alpha_box"):
            switch(self, key)


def switch(obj, key: str) -> None:
    """An auto|on|off key that YAML 1.1 read as a bool (a bare on/off) back to "on"/"off"."""
    if isinstance(getattr(obj, key), bool):
        setattr(obj, key, "on" if getattr(obj, key) else "off")


@dataclass
class DistributedParams:
    """Scale-out of training (``reconstruct.distributed``); see docs/distributed.md.

    World size = processes per node x ``nodes``; processes per node are ``gpus`` on a
    GPU host (one per GPU, NCCL) and ``cpu_workers`` on a CPU (gloo). A world of one
    process trains in-process, without torchrun. ``batch_rays`` is per process: the
    global batch is ``batch_rays * world_size``.
    """

    gpus: Literal["auto"] | int = "auto"  # auto: every visible GPU; N: the first N of them
    nodes: int = 1
    rdzv_endpoint: str = ""  # host:port of torchrun's c10d rendezvous; "" = standalone (or the SLURM head node)
    rdzv_timeout_s: int = 120  # how long hosts wait for each other at the rendezvous
    cpu_workers: int = 1  # gloo processes when training on the CPU (tests); 1 = plain single process
    micro_batches: int = 1  # gradient accumulation: batch_rays split in this many, one all-reduce
    lr_scaling: Literal["sqrt", "linear", "none"] = "sqrt"  # learning rate x f(world_size)
    grad_sync: Literal["dense", "sparse", "auto"] = "dense"  # all-reduce of the gradients
    # start each dense gradient bucket's all-reduce during backward; off by default: the NeRF's
    # hash-table gradient (nearly all the bytes) is the last one backward makes, so there is little
    # to overlap and the hooks cost time (2xH200: 1000 steps in 11.3 s with it, 10.1 s without)
    overlap_comm: bool = False
    grad_wire_dtype: Literal["float32", "bfloat16"] = "float32"  # dense buckets sent (and summed) in this type
    # replicated: every rank holds the whole model (data parallel). partitioned (3DGS only): each rank
    # owns a shard of the Gaussians and renders a range of every image's tiles; all ranks train on the
    # same views, gs.densify.max_gaussians is per rank (docs/distributed.md)
    mode: Literal["replicated", "partitioned"] = "replicated"
    checkpoint_every: int = 500  # steps; 0 = never
    max_restarts: int = 3  # torchrun restarts of the whole worker group after a failure
    replica_check_every: int = 100  # steps between checksum comparisons; 0 = at checkpoints and the end only
    metrics_port: int = 0  # Prometheus endpoint on rank 0; 0 = off
    metrics_addr: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.gpus != "auto":
            check(self.gpus >= 1, "gpus", "must be 'auto' or >= 1", self.gpus)
        check(self.nodes >= 1, "nodes", "must be >= 1", self.nodes)
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            check(bool(host) and port.isdigit() and 0 < int(port) < 65536, "rdzv_endpoint",
                  "must be host:port", self.rdzv_endpoint)
        check(self.rdzv_timeout_s >= 1, "rdzv_timeout_s", "must be >= 1", self.rdzv_timeout_s)
        check(self.cpu_workers >= 1, "cpu_workers", "must be >= 1", self.cpu_workers)
        check(self.micro_batches >= 1, "micro_batches", "must be >= 1", self.micro_batches)
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0", self.checkpoint_every)
        check(self.max_restarts >= 0, "max_restarts", "must be >= 0", self.max_restarts)
        check(self.replica_check_every >= 0, "replica_check_every", "must be >= 0", self.replica_check_every)
        check(0 <= self.metrics_port < 65536, "metrics_port", "must be in 0..65535", self.metrics_port)


@dataclass
class GaussianParams:
    """3D Gaussian Splatting (``reconstruct.gs``). Defaults are the 3DGS reference's (Kerbl et al.
    2023) as gsplat's simple_trainer uses them, for one image per step."""

    sh_degree: int = 3
    sh_degree_every: int = 1000  # steps between raising the SH degree by one (from 0)
    init_opacity: float = 0.1
    init_scale: float = 1.0  # x the mean distance to the 3 nearest points
    init_random: int = 100_000  # Gaussians drawn at random when the poses have no sparse points
    # where those are drawn: 0, the poses' scene box; > 0, a cube of half-side init_extent x the scene
    # extent around the box's centre. 0.3 is the 3DGS reference's [-1.3, 1.3]^3 on nerf_synthetic
    # (cameras 4.03 out: 0.3 x 1.1 x 4.03 = 1.33); on lego at 7k it gave 32.7-32.8 dB against 31.8
    # from the box, and gsplat's simple_trainer's 3.0 gave 31.5 (one H200, 2026-12-02)
    init_extent: float = 0.3
    batch_views: int = 1  # views rendered per step per process
    means_lr: float = 1.6e-4  # x the scene extent, decayed exponentially to means_lr_final
    means_lr_final: float = 1.6e-6
    sh0_lr: float = 2.5e-3
    shN_lr: float = 2.5e-3 / 20
    opacities_lr: float = 5e-2
    scales_lr: float = 5e-3
    quats_lr: float = 1e-3
    ssim_lambda: float = 0.2  # loss = (1 - l) L1 + l (1 - SSIM)
    # images with alpha train on a random background colour each step (a fixed one lets
    # Gaussians paint it); "auto": when the images have alpha
    random_background: Literal["auto", "on", "off"] | bool = "auto"
    # views without alpha: a colour learned behind the Gaussians ("auto"), so a plain sky or wall
    # need not be painted by Gaussians that then float in front of other views; "off": black, as
    # the reference (partitioned runs sum its gradient over the ranks' tiles)
    learn_background: Literal["auto", "off"] | bool = "auto"
    background_lr: float = 0.01  # Adam's rate for that colour, in logit space
    antialiased: bool = False
    eps2d: float = 0.3
    # alpha's clamp: 0.99 as the 3DGS reference; 0.999 is gsplat's (its images, for a swap of the two)
    alpha_max: float = 0.99
    near: float = 0.01
    far: float = 1e10
    # where the training images live: "auto" on the GPU when they fit in a quarter of its free
    # memory, else in pinned CPU memory (copied per step); "cuda" | "cpu" force it
    images_on: Literal["auto", "cuda", "cpu"] = "auto"
    # each training view's forward and backward captured in a CUDA graph and replayed, with a fixed
    # budget of tile intersections (gs/graph.py): "auto" where the rasterizer runs CUDA kernels
    # (replicated, overlap_comm off), "on" (an error where it cannot), "off"
    cuda_graph: Literal["auto", "on", "off"] | bool = "auto"
    # how Gaussians are added and removed: "default", adaptive density control (gs/densify.py, the
    # reference's and gsplat's DefaultStrategy); "mcmc", 3DGS as MCMC (gs/mcmc.py, gsplat's MCMCStrategy)
    strategy: Literal["default", "mcmc"] = "default"
    # adaptive density control (gs/densify.py): schedule, thresholds, the Gaussian budget max_gaussians
    densify: DensifyParams = field(default_factory=DensifyParams)
    # the MCMC strategy's budget, noise, schedule, regularisers and initialisation (gs/mcmc.py)
    mcmc: MCMCParams = field(default_factory=MCMCParams)

    def __post_init__(self) -> None:
        check(0 <= self.sh_degree <= 3, "sh_degree", "must be in 0..3", self.sh_degree)
        check(self.sh_degree_every >= 1, "sh_degree_every", "must be >= 1", self.sh_degree_every)
        check(0 < self.init_opacity < 1, "init_opacity", "must be in (0, 1)", self.init_opacity)
        check(self.init_scale > 0, "init_scale", "must be > 0", self.init_scale)
        check(self.init_random >= 1, "init_random", "must be >= 1", self.init_random)
        check(math.isfinite(self.init_extent) and self.init_extent >= 0, "init_extent",
              "must be a finite number >= 0 (0: the scene box)", self.init_extent)
        check(self.batch_views >= 1, "batch_views", "must be >= 1", self.batch_views)
        for key in ("means_lr", "sh0_lr", "shN_lr", "opacities_lr", "scales_lr", "quats_lr"):
            check(getattr(self, key) > 0, key, "must be > 0", getattr(self, key))
        check(0 < self.means_lr_final <= self.means_lr, "means_lr_final", "must be in (0, means_lr]",
              self.means_lr_final)
        check(0 <= self.ssim_lambda <= 1, "ssim_lambda", "must be in [0, 1]", self.ssim_lambda)
        switch(self, "random_background")
        switch(self, "cuda_graph")
        if isinstance(self.learn_background, bool):  # YAML 1.1 reads a bare on/off as a bool
            self.learn_background = "auto" if self.learn_background else "off"
        check(self.background_lr > 0, "background_lr", "must be > 0", self.background_lr)
        check(self.eps2d >= 0, "eps2d", "must be >= 0", self.eps2d)
        check(1 / 255 < self.alpha_max < 1, "alpha_max", "must be in (1/255, 1)", self.alpha_max)
        check(0 < self.near < self.far, "near", "must be > 0 and < far", self.near)


@dataclass
class ReconstructParams:
    method: Literal["nerf", "3dgs"] = "nerf"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # CUDA kernels (hash encoding, renderer; rasterizer, SSIM) for every method: "auto" where a GPU
    # and the NVRTC runtime are present, "on" (an error where they are not), "off" (PyTorch twins)
    kernels: Literal["auto", "on", "off"] | bool = "auto"
    steps: int = 2500
    batch_rays: int = 4096
    eval_every: int = 250
    tensorboard: bool = True  # scalars in <out>.tb/<run name>/ (kept: `tensorboard --logdir <out>.tb` compares runs)
    viewer_port: int = 0  # > 0: a live web viewer of the model on rank 0 while it trains (stages/viewer.py)
    nerf: NerfParams = field(default_factory=NerfParams)
    gs: GaussianParams = field(default_factory=GaussianParams)
    distributed: DistributedParams = field(default_factory=DistributedParams)

    def __post_init__(self) -> None:
        check(self.steps >= 1, "steps", "must be >= 1", self.steps)
        check(self.batch_rays >= 16, "batch_rays", "must be >= 16", self.batch_rays)
        check(self.eval_every >= 1, "eval_every", "must be >= 1", self.eval_every)
        check(0 <= self.viewer_port < 65536, "viewer_port", "must be in 0..65535 (0 = off)", self.viewer_port)
        switch(self, "kernels")
        check(self.distributed.mode != "partitioned" or self.method == "3dgs", "distributed.mode",
              f"partitioned shards 3D Gaussians: needs method 3dgs (method is {self.method!r})",
              self.distributed.mode)
        check(self.distributed.mode != "partitioned" or self.gs.strategy == "default", "gs.strategy",
              "mcmc draws from every Gaussian at once: it needs distributed.mode replicated, not partitioned",
              self.gs.strategy)


def migrate_config(config: dict) -> dict:
    """A saved ``reconstruct`` config (model.pt, checkpoints) in today's layout: ``nerf.use_kernels``
    became the shared ``kernels`` switch. Returns a new dict."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in config.items()}
    nerf = out.get("nerf")
    if isinstance(nerf, dict) and "use_kernels" in nerf:
        out.setdefault("kernels", nerf.pop("use_kernels"))
    return out
