"""The NeRF with one component swapped for the peer's, everything else ours (issue 17).

nerfacc's instant-ngp example (``bench_nerf_peer.py``) learns more from each step than our NeRF does
with the same recipe. This asks which component is why: it runs ``bench_nerf_quality.py`` unchanged
except for what is named here, taken from the peer's own packages.

``--encoding``: the field's ``HashGrid`` becomes tiny-cuda-nn's ``HashGrid`` encoding with our levels,
table size and per-level scale:

    --encoding ours     our kernels (csrc/hashgrid.cu), as the profile trains
    --encoding tcnn32   tiny-cuda-nn's grid in float32 (its half-cell offset and real-valued scales)
    --encoding tcnn16   tiny-cuda-nn's grid in float16, as the peer trains it (output cast to float32)

``--renderer nerfacc``: training batches are sampled and composited by nerfacc (its ``OccGridEstimator``
over our box with our occupancy resolution, threshold and refresh interval, ``sampling`` with its
early stop and stratified steps of our march step, ``rendering``) instead of our occupancy grid and
packed renderer. Our grid is refreshed as ever, for our renderer to score the views with: a field
trained with skipping holds junk density in the space it never sampled, so scoring without a grid
fails (23.0 dB on lego when the first version of this left our grid untouched).

Compare the arms at equal steps (``--set steps=N`` with a budget past them): tiny-cuda-nn's modules
cannot be captured in our CUDA graph, so give every arm ``--set nerf.cuda_graph=off``, and its flat
parameter vector needs the dense table optimiser (``--set nerf.table_optimizer=adam``).

    python benchmarks/bench_nerf_swap.py --encoding tcnn32 --peer .gpu/peer --wheel-out $OUT -- \\
        --poses lego=.gpu/data/lego --budgets 300 --set steps=5000 --set nerf.cuda_graph=off \\
        --set nerf.table_optimizer=adam --json $OUT/tcnn32.json

tiny-cuda-nn's bindings come as ``bench_nerf_peer.py`` installs them (a wheel in ``--peer``, else built
from ``tiny-cuda-nn.tgz`` there, 135 s on an H100 host); the process re-executes itself once with the
compiler's libstdc++ preloaded (see ``bench_nerf_peer.peer_env``).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def tcnn_grid(dtype: torch.dtype):
    """A drop-in for ``kernels.HashGrid`` built on ``tinycudann.Encoding``."""
    import tinycudann as tcnn

    from kernels import grid_resolutions

    class TcnnGrid(torch.nn.Module):
        def __init__(self, levels=16, features_per_level=2, log2_hashmap_size=19, base_resolution=16,
                     max_resolution=2048, use_kernels=None, offset=0.0, **_):
            super().__init__()
            scale = math.exp((math.log(max_resolution) - math.log(base_resolution)) / max(levels - 1, 1))
            self.enc = tcnn.Encoding(3, {"otype": "HashGrid", "n_levels": levels,
                                         "n_features_per_level": features_per_level,
                                         "log2_hashmap_size": log2_hashmap_size,
                                         "base_resolution": base_resolution, "per_level_scale": scale},
                                     dtype=dtype)
            self.output_dim = levels * features_per_level
            self.use_kernels = use_kernels  # what the renderer reads off the field's encoding
            self.max_resolution = max_resolution
            self.register_buffer("resolutions", torch.tensor(
                grid_resolutions(levels, base_resolution, max_resolution), dtype=torch.int32))
            print(f"tiny-cuda-nn HashGrid: {dtype}, per-level scale {scale:.4f}, finest {max_resolution}, "
                  f"{self.enc.params.numel()} parameters", flush=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            lead = x.shape[:-1]
            return self.enc(x.reshape(-1, 3).float().contiguous()).float().reshape(*lead, self.output_dim)

    return TcnnGrid


def use_nerfacc_renderer() -> None:
    """NerfMethod's eager training step through nerfacc's estimator and renderer (module docstring)."""
    import nerfacc

    from stages.reconstruct.nerf.method import NerfMethod

    def estimator(self):
        est = getattr(self, "_nerfacc_grid", None)
        if est is None:
            est = nerfacc.OccGridEstimator(roi_aabb=self.field.aabb.flatten(), resolution=self.cfg.occ_resolution,
                                           levels=1).to(self.device)
            self._nerfacc_grid = est
            print(f"nerfacc renderer: occupancy {self.cfg.occ_resolution}^3 over {self.field.aabb.tolist()}, "
                  f"step {self.step_size:.3g}", flush=True)
        return est

    ours_pre_forward = NerfMethod.step_pre_forward

    def step_pre_forward(self, step, generator):
        # our grid is refreshed as ever (and the ray budget revised with it): the views are scored by our
        # renderer, which must skip the space training never sampled (a field holds junk density there)
        occupied = ours_pre_forward(self, step, generator)
        every = self.occ_schedule()[0]
        estimator(self).update_every_n_steps(step=step, occ_eval_fn=lambda x: self.field.density(x) * self.step_size,
                                             occ_thre=self.cfg.occ_threshold, n=every)
        return occupied

    def loss(self, o, d, rgb, generator, background=None, appearance=None):
        if appearance is not None:
            raise SystemExit("bench_nerf_swap: --renderer nerfacc takes no appearance codes (nerf.appearance_dim 0)")

        def sigma_fn(t0, t1, ri):
            return self.field.density(o[ri] + d[ri] * ((t0 + t1) * 0.5)[:, None])

        def rgb_sigma_fn(t0, t1, ri):
            sigma, colour = self.field(o[ri] + d[ri] * ((t0 + t1) * 0.5)[:, None], d[ri])
            return colour, sigma

        ri, t0, t1 = estimator(self).sampling(o, d, sigma_fn=sigma_fn, near_plane=self.cfg.near,
                                               render_step_size=self.step_size, stratified=True)
        bg = self.field.background_rgb() if background is None else background
        colour, opacity, depth, _ = nerfacc.rendering(t0, t1, ri, n_rays=o.shape[0], rgb_sigma_fn=rgb_sigma_fn,
                                                      render_bkgd=bg)
        out = {"rgb": colour, "opacity": opacity.squeeze(-1), "depth": depth.squeeze(-1),
               "num_samples": torch.tensor(t0.numel())}
        return self._training_loss(out, rgb)

    NerfMethod.step_pre_forward, NerfMethod.loss = step_pre_forward, loss


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoding", choices=["ours", "tcnn32", "tcnn16"], default="ours")
    ap.add_argument("--renderer", choices=["ours", "nerfacc"], default="ours")
    ap.add_argument("--peer", type=Path, default=ROOT / ".gpu" / "peer", help="bench_nerf_peer.py's --peer folder")
    ap.add_argument("--wheel-out", type=Path, help="keep a tiny-cuda-nn wheel built here")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if (args.encoding != "ours" or args.renderer != "ours") and not os.environ.get("RF_PEER_READY"):
        import bench_nerf_peer as peer  # install the peer's packages, then run once more in its environment

        log = (args.wheel_out or Path("/tmp")) / "peer_install.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        if args.encoding != "ours":
            print(peer.ensure_tcnn(args.peer, args.wheel_out, log), flush=True)
        if args.renderer != "ours":
            print(peer.ensure_nerfacc(args.peer, log), flush=True)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**peer.peer_env(), "RF_PEER_READY": "1"})
    if args.encoding != "ours":
        import stages.reconstruct.nerf.field as field

        field.HashGrid = tcnn_grid(torch.float32 if args.encoding == "tcnn32" else torch.float16)
    if args.renderer == "nerfacc":
        use_nerfacc_renderer()
    import bench_nerf_quality

    return bench_nerf_quality.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
