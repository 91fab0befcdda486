"""Typed params of the reconstruct stage (section ``reconstruct`` of params.yaml)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from stages.common.params import check


@dataclass
class NerfParams:
    """Hash-grid NeRF (instant-ngp class). Defaults are instant-ngp's where it has one."""

    levels: int = 16
    features_per_level: int = 2
    log2_hashmap_size: int = 19
    base_resolution: int = 16
    max_resolution: int = 2048
    hidden_dim: int = 64
    geo_feat_dim: int = 15
    samples_per_ray: int = 128
    occ_resolution: int = 64
    occ_update_every: int = 16
    occ_threshold: float = 0.01
    lr: float = 1e-2
    lr_final: float = 5e-4
    weight_decay: float = 1e-6
    near: float = 0.02
    use_kernels: Literal["auto", "on", "off"] | bool = "auto"

    def __post_init__(self) -> None:
        check(1 <= self.levels <= 32, "levels", "must be in 1..32", self.levels)
        check(1 <= self.features_per_level <= 8, "features_per_level", "must be in 1..8", self.features_per_level)
        check(10 <= self.log2_hashmap_size <= 24, "log2_hashmap_size", "must be in 10..24", self.log2_hashmap_size)
        check(self.base_resolution >= 2, "base_resolution", "must be >= 2", self.base_resolution)
        check(self.max_resolution >= self.base_resolution, "max_resolution", "must be >= base_resolution", self.max_resolution)
        check(self.hidden_dim >= 8, "hidden_dim", "must be >= 8", self.hidden_dim)
        check(self.geo_feat_dim >= 1, "geo_feat_dim", "must be >= 1", self.geo_feat_dim)
        check(8 <= self.samples_per_ray <= 4096, "samples_per_ray", "must be in 8..4096", self.samples_per_ray)
        check(8 <= self.occ_resolution <= 512, "occ_resolution", "must be in 8..512", self.occ_resolution)
        check(self.occ_update_every >= 1, "occ_update_every", "must be >= 1", self.occ_update_every)
        check(0 <= self.occ_threshold < 1, "occ_threshold", "must be in [0, 1)", self.occ_threshold)
        check(self.lr > 0, "lr", "must be > 0", self.lr)
        check(0 < self.lr_final <= self.lr, "lr_final", "must be in (0, lr]", self.lr_final)
        check(self.weight_decay >= 0, "weight_decay", "must be >= 0", self.weight_decay)
        check(self.near >= 0, "near", "must be >= 0", self.near)
        if isinstance(self.use_kernels, bool):
            self.use_kernels = "on" if self.use_kernels else "off"


@dataclass
class ReconstructParams:
    method: Literal["nerf"] = "nerf"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    steps: int = 2500
    batch_rays: int = 4096
    eval_every: int = 250
    nerf: NerfParams = field(default_factory=NerfParams)

    def __post_init__(self) -> None:
        check(self.steps >= 1, "steps", "must be >= 1", self.steps)
        check(self.batch_rays >= 16, "batch_rays", "must be >= 16", self.batch_rays)
        check(self.eval_every >= 1, "eval_every", "must be >= 1", self.eval_every)
