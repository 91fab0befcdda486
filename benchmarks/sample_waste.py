"""How much of a NeRF training step's sample budget lies behind opaque surfaces.

The packed training step evaluates (forward and backward) every sample the occupancy grid lets
through, including those after the ray's transmittance has fallen below 1e-4, where a sample can
add at most 1e-4 of a colour and gets next to no gradient. instant-ngp and nerfacc cull those
before the differentiable pass: instant-ngp composites every marched sample once without
gradients and trains on the "compacted" ones, nerfacc's ``OccGridEstimator.sampling`` takes a
``sigma_fn`` and drops samples past ``early_stop_eps``. Their 2^18-sample batches count the samples
that remain, so at the same budget they train on more rays a step than this project's packed step.

This script measures that share on a trained model: for training rays through random pixels it
marches as the training step does, evaluates the density without gradients, and counts the samples
whose transmittance before them is below 1e-4 (``EARLY_STOP_T``), and the rays a 2^18-sample
step would hold with and without them.

    python benchmarks/sample_waste.py --model data/reconstruct --poses data/poses [--rays 8192] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stages.reconstruct.api import load_trained  # noqa: E402
from stages.reconstruct.data import load_scene  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a reconstruct out (model.pt) of a NeRF")
    ap.add_argument("--poses", required=True, help="the poses out it was trained on")
    ap.add_argument("--rays", type=int, default=8192)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = load_trained(args.model, device=args.device)
    if model.method != "nerf":
        raise SystemExit(f"{args.model}: a {model.method} model, not a NeRF")
    views = load_scene(args.poses).train.to(model.device)
    res = model.module.occlusion_census(views, args.rays)
    res.update(model=str(args.model), device=str(model.device))
    print("| rays | samples/ray | behind T < 1e-4 | kept/ray | rays per 2^18 samples: all | kept |")
    print("|---|---|---|---|---|---|")
    print(f"| {res['rays']} | {res['samples_per_ray']:.1f} | {100 * res['occluded_share']:.1f} % | "
          f"{res['kept_per_ray']:.1f} | {res['rays_per_step_all']:.0f} | {res['rays_per_step_kept']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
