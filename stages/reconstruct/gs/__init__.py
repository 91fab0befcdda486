"""3D Gaussian Splatting (Kerbl et al., SIGGRAPH 2023): the Gaussians and their initialisation
(:mod:`.model`), adaptive density control (:mod:`.densify`) or
its MCMC alternative (:mod:`.mcmc`) and the PLY layout the common 3DGS viewers
read (:mod:`.ply`). The rasterizer is :mod:`kernels.gaussians`; the method the training loop drives is
``method.py``.
"""
