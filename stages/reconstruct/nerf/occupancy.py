"""Occupancy grid for empty-space skipping (instant-ngp §4, nerfacc's OccGridEstimator).

A cube of ``resolution**3`` cells over the scene box keeps an exponential moving
maximum of the density seen at random points in each cell; samples that fall in cells
whose opacity over one march step is below a threshold are skipped before the network
is evaluated. State lives in registered buffers so it is saved with the model. With scene
contraction (``contract``) the cells tile the contracted space (the box in the middle half of
each axis, the rest of the world in the shell around it; kernels/_reference.py contract_reference).
With ``cascades`` (instant-ngp's occupancy cascades) there are that many grids of ``resolution**3``
cells, grid k over the box scaled by 2^k about its centre; a point belongs to the smallest that holds it
(kernels/_reference.py occupancy_cell_reference), so the cells grow with the distance from the box.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kernels._reference import occupancy_cell_reference, uncontract_reference


class OccupancyGrid(nn.Module):
    def __init__(self, aabb: torch.Tensor, resolution: int = 64, threshold: float = 0.01, decay: float = 0.95,
                 contract: bool = False, cascades: int = 0):
        super().__init__()
        if contract and cascades:
            raise ValueError("OccupancyGrid: contract and cascades exclude each other")
        self.resolution = resolution
        self.contract = contract
        self.cascades = cascades
        cells = max(1, cascades) * resolution**3
        self.threshold = threshold
        self.decay = decay
        self.register_buffer("aabb", aabb.clone().float())
        # Nothing is skipped until the first update has seen the field (the mask starts
        # full); the density record starts empty so the first update alone decides.
        self.register_buffer("density", torch.zeros(cells))
        self.register_buffer("mask", torch.ones(cells, dtype=torch.bool))

    def cell_index(self, x: torch.Tensor) -> torch.Tensor:
        """Flat cell index [N] of world points [N, 3] (clamped into the grid), as the marching
        kernel computes it (kernels/_reference.py, occupancy_cell_reference)."""
        return occupancy_cell_reference(x, self.aabb, self.resolution, self.contract, self.cascades)

    def occupied(self, x: torch.Tensor) -> torch.Tensor:
        return self.mask[self.cell_index(x)]

    @torch.no_grad()
    def update(
        self,
        density_fn: Callable[[torch.Tensor], torch.Tensor],
        step_size: float,
        generator: torch.Generator | None = None,
        fraction: float = 1.0,
        chunk: int = 65536,
        prune: bool = True,
    ) -> torch.Tensor:
        """Refresh a random ``fraction`` of the cells from ``density_fn`` at jittered
        points in them; returns the occupied fraction of the grid as a 0-dim tensor on the grid's
        device (nothing here waits for the GPU: a training step that refreshes the grid keeps its
        launches queued ahead). ``prune=False`` refreshes the density record but keeps every cell
        occupied (a warm-up)."""
        r = self.resolution
        n = self.mask.numel()
        dev = self.density.device
        if fraction < 1.0:
            cells = torch.randperm(n, generator=generator, device=generator.device if generator else "cpu")
            cells = cells[: max(1, int(n * fraction))].to(dev)
        else:
            cells = torch.arange(n, device=dev)
        ijk = torch.stack([(cells // (r * r)) % r, (cells // r) % r, cells % r], dim=-1).float()
        jitter = torch.rand(ijk.shape, generator=generator, device=generator.device if generator else "cpu").to(dev)
        if self.contract:  # a point of the cell in the contracted space, back in the world
            x = uncontract_reference((ijk + jitter) / r, self.aabb)
        elif self.cascades:  # in its level's box: the box scaled by 2^level about its centre
            scale = torch.ldexp(torch.ones_like(cells, dtype=torch.float32), (cells // r**3).to(torch.int32))
            centre, half = (self.aabb[0] + self.aabb[1]) * 0.5, (self.aabb[1] - self.aabb[0]) * 0.5
            x = centre + ((ijk + jitter) / r * 2.0 - 1.0) * half * scale[:, None]
        else:
            x = self.aabb[0] + (ijk + jitter) / r * (self.aabb[1] - self.aabb[0])
        new = torch.cat([density_fn(x[i : i + chunk]).float() for i in range(0, len(x), chunk)])
        self.density[cells] = torch.maximum(self.density[cells] * self.decay, new)
        if not prune:
            self.mask.fill_(True)
            return torch.ones((), device=dev)
        # Opacity of one march step; a cell is kept if it could stop light.
        alpha = 1.0 - torch.exp(-self.density * step_size)
        thresh = alpha.mean().clamp(max=self.threshold)  # min(threshold, mean), on the device
        # in place: a captured training step holds its address. The densest cells always stay: when
        # every cell has the same density (a bfloat16 field at initialisation rounds them alike) no
        # cell is above the mean, and a grid with no cell left would never be trained open again
        self.mask.copy_((alpha > thresh) | (alpha >= alpha.max()))
        return self.mask.float().mean()
