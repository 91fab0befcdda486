"""The training loop, method-agnostic: draw rays, step the method, log, evaluate.

It writes the per-step training curve (``train.csv``: step, loss, psnr, test_psnr, lr,
elapsed_s, samples_per_s) and returns a summary; the caller writes the outs.
"""
from __future__ import annotations

import csv
import io
import logging
import math
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from .config import ReconstructParams
from .data import RaySampler, Scene
from .nerf.method import NerfMethod

log = logging.getLogger("stages.reconstruct.train")

CSV_FIELDS = ["step", "loss", "psnr", "test_psnr", "lr", "elapsed_s", "samples_per_s"]


def build_method(params: ReconstructParams, aabb: torch.Tensor, device: torch.device) -> NerfMethod:
    if params.method == "nerf":
        return NerfMethod(params, aabb, device)
    raise ValueError(f"reconstruct.method: unknown method {params.method!r}")


def mse_to_psnr(mse: float) -> float:
    return -10.0 * math.log10(max(mse, 1e-10))


@dataclass
class TrainResult:
    method: NerfMethod
    rows: list[dict] = field(default_factory=list)
    train_time_s: float = 0.0
    samples_per_s: float = 0.0
    rays_per_s: float = 0.0
    final_psnr: float = float("nan")
    final_test_psnr: float | None = None

    def csv_text(self) -> str:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in self.rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in CSV_FIELDS})
        return buf.getvalue()


def seeded_generator(seed: int, rank: int, device: torch.device) -> torch.Generator:
    """Every rank draws its own rays: the stream is seeded from ``seed`` and the global rank."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1_000_003 + rank)
    return g


@torch.no_grad()
def held_out_psnr(method: NerfMethod, scene: Scene, generator: torch.Generator, n_rays: int = 4096) -> float | None:
    """PSNR on random rays of the test views (a cheap point on the training curve)."""
    if len(scene.test) == 0:
        return None
    sampler = RaySampler(scene.test, generator)
    o, d, rgb = sampler.sample(n_rays)
    pred = method.render_rays(o, d)
    return mse_to_psnr(float(torch.mean((pred - rgb) ** 2)))


def train(
    params: ReconstructParams,
    scene: Scene,
    device: torch.device,
    seed: int,
    rank: int = 0,
    progress: bool = True,
) -> TrainResult:
    torch.manual_seed(seed * 1_000_003 + rank)
    method = build_method(params, scene.aabb, device)
    gen = seeded_generator(seed, rank, device if device.type == "cuda" else torch.device("cpu"))
    eval_gen = seeded_generator(seed + 7, 0, gen.device)
    train_views = scene.train.to(device)
    test_views = scene.test.to(device)
    scene_dev = Scene(train_views, test_views, scene.aabb)
    sampler = RaySampler(train_views, gen)
    log.info(
        "training %s on %s for %d steps: %d train / %d test views at %dx%d, %d parameters, kernels %s",
        params.method, device, params.steps, len(train_views), len(test_views),
        scene.train.intr.width, scene.train.intr.height, method.num_params, "on" if method.use_kernels else "off",
    )
    res = TrainResult(method)
    total_samples = 0
    t0 = time.perf_counter()
    bar = tqdm(range(params.steps), desc="reconstruct", unit="step", disable=not progress, mininterval=2.0)
    last_loss = float("nan")
    for step in bar:
        method.step_pre_forward(step, gen)
        o, d, rgb = sampler.sample(params.batch_rays)
        loss, info = method.loss(o, d, rgb, gen)
        loss.backward()
        method.optimizer_step()
        total_samples += int(info["num_samples"])
        last = step + 1 == params.steps
        if step % 25 == 0 or last or (step + 1) % params.eval_every == 0:
            last_loss = float(info["mse"])
            elapsed = time.perf_counter() - t0
            row = {
                "step": step + 1,
                "loss": round(last_loss, 6),
                "psnr": round(mse_to_psnr(last_loss), 3),
                "test_psnr": None,
                "lr": method.optimizer.param_groups[0]["lr"],
                "elapsed_s": round(elapsed, 2),
                "samples_per_s": round(total_samples / max(elapsed, 1e-9)),
            }
            if (step + 1) % params.eval_every == 0 or last:
                tp = held_out_psnr(method, scene_dev, eval_gen)
                row["test_psnr"] = None if tp is None else round(tp, 3)
                log.info("step %d/%d loss %.5f train psnr %.2f test psnr %s (%.1f s)", step + 1, params.steps,
                         last_loss, row["psnr"], "n/a" if tp is None else f"{tp:.2f}", elapsed)
            res.rows.append(row)
            bar.set_postfix(loss=f"{last_loss:.4f}", psnr=f"{row['psnr']:.2f}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    res.train_time_s = time.perf_counter() - t0
    res.samples_per_s = total_samples / max(res.train_time_s, 1e-9)
    res.rays_per_s = params.steps * params.batch_rays / max(res.train_time_s, 1e-9)
    res.final_psnr = res.rows[-1]["psnr"]
    res.final_test_psnr = res.rows[-1]["test_psnr"]
    return res
