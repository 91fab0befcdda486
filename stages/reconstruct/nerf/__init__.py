"""Hash-grid NeRF (instant-ngp class): field, occupancy grid, volume renderer.

Reference: Müller et al., "Instant Neural Graphics Primitives with a Multiresolution
Hash Encoding", SIGGRAPH 2022.
"""
from .field import NerfField
from .occupancy import OccupancyGrid
from .render import render_rays

__all__ = ["NerfField", "OccupancyGrid", "render_rays"]
