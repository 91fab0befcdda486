"""The batch measured in samples: rays per step that adapt to a target sample count (instant-ngp).

A NeRF step's work is the samples the network evaluates, not the rays: a ray through empty space
costs a few samples once the occupancy grid has pruned it, one through fog ~100. instant-ngp
keeps 2^18 samples per step and lets the ray count follow (``target_batch_size``; lego ends near
16k rays a step, a real capture near 3k). :class:`RayBudget` does the same
(``reconstruct.nerf.target_samples``):

* every ``occ_update_every`` steps the ray count becomes ``target / (samples per ray of the last
  step)``, kept between 128 and the target and snapped to a grid of 8 values per octave (multiples
  of 128); it moves only when the ideal count is more than 3/4 of a grid step away, so it does not
  flip between two values;
* the count lives in a one-element buffer of the method's state, so a distributed run broadcasts
  rank 0's with the occupancy grid (every rank draws the same number of rays) and a resumed run
  continues with it; the host reads it once per revision, not every step;
* a CUDA-graph step (nerf/graph.py) is captured for one ray count, so each revision that moves the
  count captures the step again (three eager steps); the grid keeps that to a few per run.
"""
from __future__ import annotations

import math

import torch

PER_OCTAVE = 8
GRANULE = 128
HYSTERESIS = 0.75  # of a grid step


def snap(rays: float) -> int:
    """The grid value nearest ``rays`` (8 per octave, multiples of :data:`GRANULE`)."""
    g = 2.0 ** (round(PER_OCTAVE * math.log2(max(rays, 1.0))) / PER_OCTAVE)
    return max(GRANULE, int(round(g / GRANULE)) * GRANULE)


class RayBudget:
    """Rays per micro-batch for a target number of samples per process and step.

    Args:
        target_samples: samples per process per step (``nerf.target_samples``).
        batch_rays: the configured rays per process per step (the starting count).
        device: where the count's buffer lives (the method's device).
    """

    def __init__(self, target_samples: int, batch_rays: int, device: torch.device):
        self.target = target_samples
        self.batch_rays = batch_rays
        self.buffer = torch.full((1,), batch_rays, dtype=torch.int64, device=device)  # rays per process
        self._rays = batch_rays
        self._stale = False
        self.revisions = 0
        self.rays_drawn = 0

    def rays(self, share: int) -> int:
        """Rays for a micro-batch that is ``share`` of ``batch_rays`` rays (``batch_rays`` / micro-batches)."""
        if self._stale:  # the buffer was revised (and maybe broadcast): one host read per revision
            self._rays = int(self.buffer)
            self._stale = False
        n = max(1, round(self._rays * share / self.batch_rays))
        self.rays_drawn += n
        return n

    def revise(self, samples: int, rays: int) -> None:
        """A step drew ``rays`` rays per process and evaluated ``samples`` samples: set the next count."""
        if rays <= 0:
            return
        per_ray = max(samples / rays, 1e-3)
        ideal = min(max(self.target / per_ray, GRANULE), max(self.target, GRANULE))
        now = int(self.buffer) if self._stale else self._rays
        if abs(math.log2(ideal / now)) * PER_OCTAVE > HYSTERESIS:
            self.buffer.fill_(snap(ideal))
            self.revisions += 1
        self._stale = True

    def state(self) -> torch.Tensor:
        return self.buffer

    def load(self, t: torch.Tensor) -> None:
        self.buffer.copy_(t.reshape(1))
        self._stale = True
