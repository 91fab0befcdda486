"""Starting the stage's workers: plain in-process, under torchrun, or from a SLURM job.

``python -m stages.reconstruct`` works out the world size from
``reconstruct.distributed`` (:func:`plan`); with more than one process it re-runs
itself as ``python -m torch.distributed.run --nproc-per-node N ... -m
stages.reconstruct <same arguments>`` (:func:`torchrun_command`), whose workers see
torchrun's environment and train. The environment is passed through unchanged
(``NCCL_*`` and the rest: the host's settings are never overridden).

torchrun dies with the launcher (``PR_SET_PDEATHSIG``: it then stops its workers, which die with
it in turn, see ``stages/common/process.py``) and holds the launcher's out locks, so no second run
starts on the same out before the workers are gone. Ctrl-C or SIGTERM is passed on to torchrun; its
own report of the signal is not shown (rank 0 says where training stopped).
"""
from __future__ import annotations

import hashlib
import os
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from stages.common.process import tied

from .config import ReconstructParams

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RDZV_PORT = 29500


@dataclass
class LaunchPlan:
    """How many processes, where."""

    device_type: str  # "cuda" | "cpu"
    nproc_per_node: int
    nodes: int
    visible_gpus: int

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nodes

    @property
    def needs_torchrun(self) -> bool:
        return self.world_size > 1


def plan(params: ReconstructParams, visible_gpus: int | None = None) -> LaunchPlan:
    """The processes ``params`` ask for on this host.

    Raises:
        ValueError: more GPUs asked for than are visible, or a GPU device with none.
    """
    dp = params.distributed
    visible = torch.cuda.device_count() if visible_gpus is None else visible_gpus
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={cvd})" if cvd is not None else ""
    if params.batch_rays % dp.micro_batches:
        raise ValueError(f"reconstruct.batch_rays ({params.batch_rays}) must be a multiple of "
                         f"reconstruct.distributed.micro_batches ({dp.micro_batches})")
    if dp.nodes > 1 and not dp.rdzv_endpoint:
        raise ValueError(f"reconstruct.distributed.nodes is {dp.nodes} but rdzv_endpoint is empty: give the "
                         "host:port of the rendezvous (the host of node rank 0), or use --write-slurm")
    if params.device == "cpu":
        return LaunchPlan("cpu", dp.cpu_workers, dp.nodes, visible)
    if params.device == "cuda" and visible == 0:
        raise ValueError(f"reconstruct.device is 'cuda' but no CUDA GPU is visible{where}")
    if dp.gpus != "auto" and dp.gpus > visible:
        raise ValueError(f"reconstruct.distributed.gpus is {dp.gpus} but only {visible} GPU(s) are visible "
                         f"on this host{where}; set gpus to 'auto' or at most {visible}"
                         + ("" if visible else ", or reconstruct.device to 'cpu'"))
    if visible == 0:  # device auto on a CPU host
        return LaunchPlan("cpu", dp.cpu_workers, dp.nodes, 0)
    return LaunchPlan("cuda", visible if dp.gpus == "auto" else dp.gpus, dp.nodes, visible)


def rendezvous_id(out: str, endpoint: str) -> str:
    """The same on every host of one run: the SLURM job id, else a hash of --out and the endpoint."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"rayforge-{os.environ['SLURM_JOB_ID']}"
    return "rayforge-" + hashlib.sha1(f"{out}|{endpoint}".encode()).hexdigest()[:12]


def torchrun_command(p: LaunchPlan, params: ReconstructParams, stage_args: list[str], *,
                     node_rank: int | None = None, rdzv_id: str = "rayforge") -> list[str]:
    """``python -m torch.distributed.run ... -m stages.reconstruct <stage_args>``."""
    dp = params.distributed
    cmd = [sys.executable, "-m", "torch.distributed.run",
           "--nnodes", str(p.nodes), "--nproc-per-node", str(p.nproc_per_node),
           "--max-restarts", str(dp.max_restarts), "--monitor-interval", "0.5"]
    if dp.rdzv_endpoint:
        t = dp.rdzv_timeout_s
        conf = f"join_timeout={t},read_timeout={t},last_call_timeout=5"
        if node_rank is not None:  # rank 0 hosts the store; the others only connect to it
            conf += f",is_host={'true' if node_rank == 0 else 'false'}"
            cmd += ["--node-rank", str(node_rank)]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", dp.rdzv_endpoint, "--rdzv-id", rdzv_id,
                "--rdzv-conf", conf]
    else:
        cmd += ["--standalone"]
    return cmd + ["-m", "stages.reconstruct", *stage_args]


def child_env() -> dict[str, str]:
    """This process's environment (NCCL_* included, untouched) with the project importable.

    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` defaults to 1 (a value already set wins):
    torchrun's shared rendezvous store keeps the previous attempt's keys, so workers
    restarted after a failure can read a dead peer's address (pytorch/pytorch#135712,
    #167288); without sharing, every attempt gets a fresh store.
    """
    env = dict(os.environ)
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    paths = [str(PROJECT_ROOT)] + [q for q in env.get("PYTHONPATH", "").split(os.pathsep) if q]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


_RDZV_ERRORS = ("RendezvousConnectionError", "RendezvousTimeoutError", "RendezvousClosedError",
                "RendezvousStateError")


# what the workers say when stopped; after a signal, the rest of torchrun's output is its own report of it
_KEPT_AFTER_SIGNAL = (b"reconstruct: ", b"[rank")


def run_torchrun(cmd: list[str], params: ReconstructParams, log=None, pass_fds: list[int] | tuple = ()) -> int:
    """Run torchrun, forwarding its output and SIGINT/SIGTERM; returns its exit status (128 + the
    signal when one was passed on).

    Args:
        pass_fds: file descriptors torchrun keeps open (the out locks).

    Raises:
        ValueError: the hosts did not meet at the rendezvous endpoint in time.
    """
    if log is not None:
        log.info("launching: %s", shlex.join(cmd))
    proc = subprocess.Popen(tied(cmd), env=child_env(), stderr=subprocess.PIPE, pass_fds=tuple(pass_fds))
    tail = bytearray()
    got: list[int] = []  # signals passed on to torchrun

    def show(data: bytes) -> None:
        out = getattr(sys.stderr, "buffer", None)
        if out is not None:
            out.write(data)
            out.flush()
        else:
            sys.stderr.write(data.decode(errors="replace"))

    def pump() -> None:
        pending = b""
        while True:
            chunk = os.read(proc.stderr.fileno(), 65536)
            if not chunk:
                break
            tail.extend(chunk)
            del tail[:-65536]
            if not got:
                show(chunk)
                continue
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.lstrip(b"\r").startswith(_KEPT_AFTER_SIGNAL):
                    show(line + b"\n")

    def forward(sig: int, _frame) -> None:
        got.append(sig)
        proc.send_signal(sig)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, forward)
    try:
        rc = proc.wait()
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        reader.join(timeout=5)
    if got:
        return 128 + got[0]
    if rc != 0:
        text = tail.decode(errors="replace")
        found = [e for e in _RDZV_ERRORS if e in text]
        dp = params.distributed
        if found:
            ep, t = dp.rdzv_endpoint or "standalone", dp.rdzv_timeout_s
            what = (f"rendezvous endpoint {ep} did not answer within rdzv_timeout_s={t} s"
                    if found[0] == "RendezvousConnectionError" else
                    f"the {dp.nodes} hosts did not all join at rendezvous endpoint {ep} within rdzv_timeout_s={t} s")
            raise ValueError(
                f"torchrun could not form the worker group: {what} ({found[0]}). Check that the host of node "
                f"rank 0 runs the stage, that {ep} is reachable from every host, and that every host uses the "
                f"same reconstruct.distributed params")
    return rc


def write_slurm(path: str | Path, params: ReconstructParams, stage_args: list[str], *,
                workdir: str | Path | None = None, job_name: str = "rayforge-reconstruct") -> str:
    """Write a SLURM batch script (sbatch -> srun, one task per node -> torchrun -> workers).

    Returns the script's text.
    """
    dp = params.distributed
    workdir = Path(workdir or os.getcwd()).resolve()
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={job_name}",
             f"#SBATCH --nodes={dp.nodes}",
             "#SBATCH --ntasks-per-node=1  # one torchrun agent per node; it starts the workers"]
    if params.device == "cpu":
        nproc = str(dp.cpu_workers)
        lines.append(f"#SBATCH --cpus-per-task={max(2, dp.cpu_workers)}")
    elif dp.gpus == "auto":
        nproc = "gpu"  # torchrun: one worker per visible GPU
        lines.append("#SBATCH --exclusive  # every GPU of each node (reconstruct.distributed.gpus: auto)")
    else:
        nproc = str(dp.gpus)
        lines.append(f"#SBATCH --gpus-per-node={dp.gpus}")
    lines += [f"#SBATCH --chdir={workdir}",
              "#SBATCH --output=%x-%j.out",
              "",
              "set -euo pipefail",
              "# written by `python -m stages.reconstruct --write-slurm` from reconstruct.distributed;",
              "# NCCL_* and other variables set here or by the site reach the workers untouched.",
              f'export PYTHONPATH={shlex.quote(str(PROJECT_ROOT))}"${{PYTHONPATH:+:$PYTHONPATH}}"',
              "# a fresh store for every torchrun restart (pytorch/pytorch#135712)",
              'export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"',
              ]
    if dp.rdzv_endpoint:
        lines.append(f"endpoint={shlex.quote(dp.rdzv_endpoint)}")
    else:
        lines += ['head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                  f'endpoint="$head:{DEFAULT_RDZV_PORT}"']
    t = dp.rdzv_timeout_s
    lines += [
        f"srun --kill-on-bad-exit=1 {shlex.quote(sys.executable)} -m torch.distributed.run \\",
        f"    --nnodes={dp.nodes} --nproc-per-node={nproc} --max-restarts={dp.max_restarts} \\",
        '    --rdzv-backend=c10d --rdzv-endpoint="$endpoint" --rdzv-id="rayforge-$SLURM_JOB_ID" \\',
        f"    --rdzv-conf=join_timeout={t},read_timeout={t} \\",
        f"    -m stages.reconstruct {shlex.join(stage_args)}",
        "",
    ]
    text = "\n".join(lines)
    path = Path(path)
    path.write_text(text)
    path.chmod(0o755)
    return text


K8S_PORT_NAME = "pytorchjob-port"  # the Training Operator sets MASTER_PORT from the Master's port of this name


def write_k8s(path: str | Path, params: ReconstructParams, stage_args: list[str], *, image: str,
              job_name: str = "rayforge-reconstruct", namespace: str = "", volume_claim: str = "",
              mount: str = "/workspace") -> str:
    """Write a Kubeflow PyTorchJob manifest (``kubeflow.org/v1``, the Training Operator) for
    ``reconstruct.distributed.nodes`` pods of ``gpus`` GPUs each (``cpu_workers`` processes on a CPU).

    One Master pod and ``nodes - 1`` Worker pods each run torchrun with the stage's arguments;
    they meet at a c10d rendezvous on the Master's service (``$(MASTER_ADDR):$(MASTER_PORT)``,
    which the operator sets in every pod), hosted by the Master's agent (``is_host``).
    ``volume_claim``: a PersistentVolumeClaim mounted at ``mount`` in every pod, the working
    directory, where the stage's relative paths (poses, out, checkpoints) must be shared.

    Returns the manifest's text.

    Raises:
        ValueError: ``gpus: auto`` (a pod must ask for a number of GPUs), no image, a bad job name.
    """
    import re

    import yaml

    dp = params.distributed
    if not image:
        raise ValueError("a Kubernetes manifest needs the container image that holds this project (--k8s-image)")
    if not re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", job_name):
        raise ValueError(f"job name {job_name!r} must be a DNS-1035 label: lowercase letters, digits and '-', "
                         "starting with a letter, at most 63 characters")
    if params.device == "cpu":
        nproc, gpus = dp.cpu_workers, 0
    elif dp.gpus == "auto":
        raise ValueError("reconstruct.distributed.gpus is 'auto', but a Kubernetes pod must ask for a number of "
                         "GPUs: set reconstruct.distributed.gpus to the GPUs per node (e.g. -S "
                         "reconstruct.distributed.gpus=8)")
    else:
        nproc, gpus = dp.gpus, dp.gpus
    t = dp.rdzv_timeout_s

    def replica(role: str, replicas: int) -> dict:
        host = "true" if role == "Master" else "false"
        command = ["python", "-m", "torch.distributed.run", f"--nnodes={dp.nodes}", f"--nproc-per-node={nproc}",
                   f"--max-restarts={dp.max_restarts}", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=$(MASTER_ADDR):$(MASTER_PORT)", f"--rdzv-id={job_name}",
                   f"--rdzv-conf=join_timeout={t},read_timeout={t},is_host={host}",
                   "-m", "stages.reconstruct", *stage_args]
        container = {
            "name": "pytorch",  # the operator's default container name: it injects the rendezvous env here
            "image": image,
            "command": command,
            # a fresh store for every torchrun restart (pytorch/pytorch#135712)
            "env": [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"}],
            "ports": [{"name": K8S_PORT_NAME, "containerPort": DEFAULT_RDZV_PORT}],
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],  # NCCL needs more than 64 MiB
        }
        if gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
        volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        if volume_claim:
            container["workingDir"] = mount
            container["volumeMounts"].append({"name": "work", "mountPath": mount})
            volumes.append({"name": "work", "persistentVolumeClaim": {"claimName": volume_claim}})
        return {"replicas": replicas, "restartPolicy": "OnFailure",
                "template": {"metadata": {"labels": {"app": "rayforge", "role": role.lower()}},
                             "spec": {"containers": [container], "volumes": volumes}}}

    specs = {"Master": replica("Master", 1)}
    if dp.nodes > 1:
        specs["Worker"] = replica("Worker", dp.nodes - 1)
    metadata: dict = {"name": job_name, "labels": {"app": "rayforge"}}
    if namespace:
        metadata["namespace"] = namespace
    doc = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata,
           "spec": {"nprocPerNode": str(nproc),
                    "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": max(1, dp.max_restarts)},
                    "pytorchReplicaSpecs": specs}}
    where = f"{dp.nodes} pod(s) x {nproc} {'GPU' if gpus else 'CPU'} process(es)"
    header = ["# Kubeflow PyTorchJob written by `python -m stages.reconstruct --write-k8s` from",
              f"# reconstruct.distributed: {where}, torchrun in each, c10d rendezvous on the Master.",
              f"# Submit: kubectl apply -f {Path(path).name}   (needs the Kubeflow Training Operator)"]
    if not volume_claim:
        header.append("# No --k8s-pvc: the image's working directory must hold the poses and keep the outs.")
    text = "\n".join(header) + "\n" + yaml.safe_dump(doc, sort_keys=False, width=1000)
    path = Path(path)
    path.write_text(text)
    return text
