"""``python -m stages.reconstruct``: see the package docstring and docs/distributed.md.

One entry point for every role: started plainly it checks the params and either trains
in-process (a world of one) or re-launches itself under torchrun; started by torchrun
(``RANK``/``WORLD_SIZE``/... in the environment) it is a worker and trains.
"""
from __future__ import annotations

import argparse
import os
from contextlib import nullcontext
from pathlib import Path

from stages.common import log as logsetup
from stages.common.entry import cli, run_stage
from stages.common.fingerprint import data_fingerprint
from stages.common.params import ParamsError, load_section, read_yaml


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m stages.reconstruct", description=__doc__)
    ap.add_argument("--poses", required=True, help="the poses stage's out folder")
    ap.add_argument("--out", required=True, help="out folder for the model")
    ap.add_argument("--metrics", help="metrics JSON to write")
    ap.add_argument("--plots", help="training-curve CSV to write")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--checkpoint-dir", help="training checkpoints (default: <out>.ckpt beside --out); "
                    "must be on a filesystem every host sees")
    ap.add_argument("--write-slurm", metavar="FILE", help="write a SLURM batch script that runs this "
                    "command on reconstruct.distributed.nodes hosts, then exit without training")
    ap.add_argument("--write-k8s", metavar="FILE", help="write a Kubeflow PyTorchJob manifest that runs this "
                    "command on reconstruct.distributed.nodes pods, then exit without training")
    ap.add_argument("--k8s-image", default="", help="--write-k8s: the container image holding this project")
    ap.add_argument("--k8s-name", default="rayforge-reconstruct", help="--write-k8s: the PyTorchJob's name")
    ap.add_argument("--k8s-namespace", default="", help="--write-k8s: its namespace (default: kubectl's)")
    ap.add_argument("--k8s-pvc", default="", help="--write-k8s: a PersistentVolumeClaim mounted as the working "
                    "directory of every pod (where the poses are and the outs go)")
    ap.add_argument("--node-rank", type=int, help="this host's place when reconstruct.distributed.nodes > 1 "
                    "(0 hosts the rendezvous)")
    ap.add_argument("--launch", choices=("auto", "torchrun", "inline"), default="auto",
                    help="auto: torchrun when the world has more than one process; torchrun: always "
                    "(benchmarks); inline: never")
    return ap


def _stage_args(args: argparse.Namespace, checkpoint_dir: str) -> list[str]:
    """The arguments a worker gets: the paths, never the launcher's own options."""
    out = ["--poses", args.poses, "--out", args.out, "--params", args.params, "--checkpoint-dir", checkpoint_dir]
    if args.metrics:
        out += ["--metrics", args.metrics]
    if args.plots:
        out += ["--plots", args.plots]
    return out


def interrupt_line(ckpt_dir: str | None, every: int | None) -> str:
    """``at step N; rerun to resume from the checkpoint of step K`` (what an interrupted run says)."""
    from . import guards
    from .checkpoint import CheckpointStore

    g = guards.current()
    where = " before training started" if g is None or g.step is None else f" at step {g.step + 1}"
    found = CheckpointStore(ckpt_dir).candidates() if ckpt_dir else []
    if found:
        return f"{where}; rerun to resume from the checkpoint of step {found[0][0]}"
    if not every:
        return f"{where}; checkpoints are off (reconstruct.distributed.checkpoint_every: 0), a rerun starts from step 0"
    return f"{where}; no checkpoint yet (one every {every} steps), a rerun starts from step 0"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    log = logsetup.setup("stages.reconstruct")
    from . import distributed as D
    from . import guards

    seen: dict = {}  # what _main has read, for the interrupt and out-of-memory lines
    worker = D.under_torchrun()
    return run_stage(
        "reconstruct", lambda: _main(args, log, seen),
        interrupted=lambda: interrupt_line(seen.get("ckpt_dir"), seen.get("every")),
        oom_advice=lambda: guards.oom_advice(seen.get("data") or {}),
        quiet_interrupt=worker and os.environ.get("RANK", "0") != "0",  # rank 0 speaks for the group
        reraise=(ValueError,) if worker else ())  # torchrun reports it as `[rankN]: ValueError: ...`


def _main(args: argparse.Namespace, log, seen: dict) -> int:
    from . import ReconstructParams, claim, run
    from . import distributed as D
    from . import launch as L
    from .checkpoint import CheckpointStore, default_dir
    from .methods import expectation

    data = read_yaml(args.params)
    seen["data"] = data
    params = load_section(ReconstructParams, "reconstruct", args.params, data=data)
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ParamsError(f"seed: expected an integer, got {seed!r}")
    ckpt_dir = args.checkpoint_dir or str(default_dir(args.out))
    seen.update(ckpt_dir=ckpt_dir, every=params.distributed.checkpoint_every)

    if D.under_torchrun():  # a worker
        try:
            ctx = D.init_from_env(params.device)
            try:
                run(params, args.poses, args.out, args.metrics, args.plots, seed=seed, ctx=ctx,
                    checkpoint_dir=ckpt_dir, progress=ctx.is_main)
            finally:
                D.shutdown()
        except ValueError as exc:
            log.error("%s", exc)
            raise
        return 0

    if args.write_slurm:
        L.write_slurm(args.write_slurm, params, _stage_args(args, str(Path(ckpt_dir).resolve())))
        log.info("wrote %s: submit it with `sbatch %s`", args.write_slurm, args.write_slurm)
        return 0

    if args.write_k8s:
        L.write_k8s(args.write_k8s, params, _stage_args(args, ckpt_dir), image=args.k8s_image,
                    job_name=args.k8s_name, namespace=args.k8s_namespace, volume_claim=args.k8s_pvc)
        log.info("wrote %s: submit it with `kubectl apply -f %s`", args.write_k8s, args.write_k8s)
        return 0

    p = L.plan(params)
    if args.launch == "inline" and p.world_size > 1:
        raise ValueError(f"--launch inline but the params ask for {p.world_size} processes")
    poses = Path(args.poses)
    for name in ("transforms.json", "split.json"):
        if not (poses / name).is_file():
            raise ValueError(f"{poses}: missing {name}; run the poses stage first")
    # one host: this launcher locks the out for its workers; several: rank 0's worker does (run())
    claimed = claim(args.poses, args.out, args.metrics, args.plots, ckpt_dir) if p.nodes == 1 else nullcontext([])
    with claimed as locks:
        if params.distributed.checkpoint_every and args.node_rank in (None, 0):
            # a checkpoint of another run or scene fails here, before any worker starts
            fp = {"fingerprint": data_fingerprint(poses), "poses": str(poses)}
            CheckpointStore(ckpt_dir, data=fp).load_latest(expectation(params, seed, p.world_size))
        if p.needs_torchrun or args.launch == "torchrun":
            if p.nodes > 1 and args.node_rank is None:
                log.info("nodes=%d: this host's rank is assigned at the rendezvous (--node-rank pins it)", p.nodes)
            cmd = L.torchrun_command(p, params, _stage_args(args, ckpt_dir), node_rank=args.node_rank,
                                     rdzv_id=L.rendezvous_id(args.out, params.distributed.rdzv_endpoint))
            rc = L.run_torchrun(cmd, params, log, pass_fds=[fd for lk in locks for fd in lk.fds])
            if 0 < rc < 128:
                log.error("torchrun exited with status %d (see the workers' errors above)", rc)
            return rc
        run(params, args.poses, args.out, args.metrics, args.plots, seed=seed, checkpoint_dir=ckpt_dir)
    return 0


if __name__ == "__main__":
    cli(main)
