"""``rayforge``: the pipeline's stages and tools as one command, shaped like nerfstudio's ns-* tools.

    rayforge process   photos -> poses        (the ingest and poses stages)
    rayforge train     poses -> model         (the reconstruct stage; torchrun, SLURM, Kubernetes)
    rayforge eval      model -> scores        (the evaluate stage)
    rayforge render    model -> MP4 videos of a camera path
    rayforge export    model -> mesh, point cloud or Gaussians PLY (the export stage)
    rayforge view      model -> interactive web viewer
    rayforge report    scores -> HTML and Markdown report (the report stage)

Every subcommand runs the same stage code as ``dvc repro`` (the stage modules' ``main()``), with
the folders of ``dvc.yaml`` as defaults, so ``rayforge train`` in a checkout writes what
``dvc repro reconstruct`` would. ``-S section.key=value`` changes a param for one run: the
params file is copied with the change to a temporary file beside it, which the stage reads and
which is removed afterwards (``params.yaml`` itself is never written). Without a params file,
every section's built-in defaults apply.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

PROG = "rayforge"


@dataclass(frozen=True)
class Command:
    """One subcommand: its one-line summary, what it runs, the params it reads, examples."""

    name: str
    summary: str
    runs: str
    sections: tuple[str, ...]
    examples: tuple[str, ...]
    add_arguments: Callable[[argparse.ArgumentParser], None]
    steps: Callable[[argparse.Namespace, str, list[str]], list[tuple[str, list[str]]]]


# ---------------------------------------------------------------- params overrides


def parse_override(text: str) -> tuple[list[str], object]:
    """``section.key=value`` -> (["section", "key"], the value read as YAML 1.2 the way ``dvc exp run
    -S`` reads it: 5000, 1e-3, true, [1, 2], lego)."""
    from ruamel.yaml import YAML, YAMLError  # a dependency of dvc

    key, sep, value = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ValueError(f"-S {text!r}: expected section.key=value, e.g. -S reconstruct.steps=5000")
    try:
        return parts, YAML(typ="safe", pure=True).load(value) if value.strip() else ""
    except YAMLError as exc:
        raise ValueError(f"-S {text!r}: the value is not YAML: {exc}") from None


@contextlib.contextmanager
def params_file(path: Path, overrides: list[str], sections: tuple[str, ...], log=print) -> Iterator[str]:
    """The params file a stage should read: ``path`` itself, or (with overrides, or when ``path``
    is missing) a temporary copy with the overrides laid on, beside ``path`` so relative paths in
    it keep their meaning; removed afterwards.

    Raises:
        ValueError: a malformed override, or one of a section this command does not read.
    """
    from stages.common.params import read_yaml

    parsed = [parse_override(o) for o in overrides]
    for (parts, _), text in zip(parsed, overrides):
        if parts[0] not in sections:
            raise ValueError(f"-S {text}: this command reads {', '.join(sections)}; {parts[0]!r} would change nothing")
    if not parsed and path.is_file():
        yield str(path)
        return
    data = read_yaml(path) if path.is_file() else {}
    if not path.is_file():
        log(f"{PROG}: no {path}: using every section's built-in defaults" + (" and the -S values" if parsed else ""))
    for parts, value in parsed:
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"-S {'.'.join(parts)}: {p} is not a section")
        node[parts[-1]] = value
    folder = path.parent if path.parent.is_dir() else Path.cwd()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.{PROG}-", suffix=".yaml", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(data, f, sort_keys=False)
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


# ---------------------------------------------------------------- subcommands


def _paths(ap: argparse.ArgumentParser, *specs: tuple[str, str, str]) -> None:
    for flag, default, what in specs:
        ap.add_argument(flag, type=Path, default=Path(default), help=f"{what} (default: {default})")


def _records(ap: argparse.ArgumentParser, out_default: str, *specs: tuple[str, str, str, str]) -> None:
    """Files a stage writes beside its out (metrics JSON, a training curve): dvc.yaml's paths while --out is
    dvc.yaml's, else next to the --out given (``<out>.<suffix>``, as the checkpoints' ``<out>.ckpt``), so a
    run elsewhere leaves the pipeline's tracked records alone."""
    records = {}
    for flag, default, suffix, what in specs:
        ap.add_argument(flag, type=Path, default=None,
                        help=f"{what} (default: {default}, or <out>.{suffix} beside an --out other than {out_default})")
        records[flag.lstrip("-")] = (default, out_default, suffix)
    ap.set_defaults(records=records)


def _record(args: argparse.Namespace, name: str) -> str:
    """The path of record ``name`` (``metrics``, ``plots``; see :func:`_records`)."""
    given = getattr(args, name)
    if given is not None:
        return str(given)
    default, out_default, suffix = args.records[name]
    return default if args.out.resolve() == Path(out_default).resolve() else f"{args.out}.{suffix}"


Steps = list[tuple[str, list[str]]]  # (stage module, its argv), run in order


def _process_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--photos", type=Path, help="folder of photos (default: ingest.photos of the params)")
    _paths(ap, ("--ingest", "data/ingest", "the ingest stage's out folder"),
           ("--out", "data/poses", "the poses out folder"))
    _records(ap, "data/poses", ("--metrics", "data/metrics/poses.json", "metrics.json", "pose metrics JSON"))


def _process(args: argparse.Namespace, params: str, rest: list[str]) -> Steps:
    photos = ["--photos", str(args.photos)] if args.photos else []
    return [("stages.ingest", [*photos, "--out", str(args.ingest), "--params", params]),
            ("stages.poses", ["--ingest", str(args.ingest), "--out", str(args.out),
                              "--metrics", _record(args, "metrics"), "--params", params])]


def _train_args(ap: argparse.ArgumentParser) -> None:
    _paths(ap, ("--poses", "data/poses", "the poses stage's out folder"),
           ("--out", "data/reconstruct", "out folder for the model"))
    _records(ap, "data/reconstruct", ("--metrics", "data/metrics/reconstruct.json", "metrics.json", "training metrics JSON"),
             ("--plots", "data/plots/train.csv", "train.csv", "training curve CSV"))


JOB_FILES = ("--write-slurm", "--write-k8s")


def _train(args: argparse.Namespace, params: str, rest: list[str]) -> Steps:
    if args.S and any(a.split("=")[0] in JOB_FILES for a in rest):
        raise ValueError("-S with --write-slurm / --write-k8s: the job would read a params file that is gone by "
                         "then; put the values in params.yaml")
    return [("stages.reconstruct", ["--poses", str(args.poses), "--out", str(args.out),
                                    "--metrics", _record(args, "metrics"), "--plots", _record(args, "plots"),
                                    "--params", params, *rest])]


def _eval_args(ap: argparse.ArgumentParser) -> None:
    _paths(ap, ("--poses", "data/poses", "the poses stage's out folder"),
           ("--model", "data/reconstruct", "the reconstruct stage's out folder"),
           ("--out", "data/evaluate", "out folder for renders and scores"))
    _records(ap, "data/evaluate", ("--metrics", "data/metrics/evaluate.json", "metrics.json", "metrics JSON"))


def _eval(args: argparse.Namespace, params: str, rest: list[str]) -> Steps:
    return [("stages.evaluate", ["--poses", str(args.poses), "--model", str(args.model), "--out", str(args.out),
                                 "--metrics", _record(args, "metrics"), "--params", params])]


def _render_args(ap: argparse.ArgumentParser) -> None:
    from stages import render_path

    render_path.add_arguments(ap)


def _render(args: argparse.Namespace, params: str, rest: list[str]) -> Steps:
    return [("stages.render_path", args.argv)]


def _export_args(ap: argparse.ArgumentParser) -> None:
    _paths(ap, ("--model", "data/reconstruct", "the reconstruct stage's out folder"),
           ("--poses", "data/poses", "the poses stage's out folder"),
           ("--out", "data/export", "out folder (replaced)"))


def _export(args: argparse.Namespace, params: str, rest: list[str]) -> Steps:
    return [("stages.export", ["--model", str(args.model), "--poses", str(args.poses), "--out", str(args.out),
                               "--params", params])]


def _view_args(ap: argparse.ArgumentParser) -> None:
    from stages import viewer

    viewer.add_arguments(ap)


def _view(args: argparse.Namespace, params: str, rest: list[str]) -> Steps:
    return [("stages.viewer", args.argv)]


def _report_args(ap: argparse.ArgumentParser) -> None:
    _paths(ap, ("--evaluate", "data/evaluate", "the evaluate stage's out folder"),
           ("--metrics-dir", "data/metrics", "folder of the stages' metrics JSON"),
           ("--plots", "data/plots/train.csv", "the training curve"),
           ("--poses", "data/poses", "the poses stage's out folder"),
           ("--out", "data/report", "out folder for report.html and report.md"))
    ap.add_argument("--scaling", type=Path, action="append", help="a bench_scaling.py JSON to add as a scaling "
                    "table (repeatable)")


def _report(args: argparse.Namespace, params: str, rest: list[str]) -> Steps:
    extra = [a for f in args.scaling or [] for a in ("--scaling", str(f))]
    return [("stages.report", ["--evaluate", str(args.evaluate), "--metrics-dir", str(args.metrics_dir),
                               "--plots", str(args.plots), "--poses", str(args.poses), "--out", str(args.out),
                               "--params", params, *extra])]


COMMANDS = (
    Command("process", "Photos to camera poses: ingest the photos, then structure from motion (or import cameras).",
            "python -m stages.ingest, then python -m stages.poses (DVC stages 'ingest' and 'poses')",
            ("seed", "ingest", "poses"),
            ("rayforge process --photos ~/photos/garden",
             "rayforge process -S poses.source=transforms -S poses.camera_file=/data/lego -S ingest.alpha=white "
             "-S ingest.recursive=true --photos /data/lego"),
            _process_args, _process),
    Command("train", "Train the model (NeRF or 3DGS) on the poses; several GPUs run under torchrun.",
            "python -m stages.reconstruct (DVC stage 'reconstruct'); its other options pass through: "
            "--checkpoint-dir, --launch, --node-rank, --write-slurm FILE, --write-k8s FILE with --k8s-image, "
            "--k8s-pvc, --k8s-namespace, --k8s-name",
            ("seed", "reconstruct"),
            ("rayforge train -S reconstruct.steps=5000 -S reconstruct.batch_rays=8192",
             "rayforge train --write-k8s job.yaml --k8s-image registry/rayforge:1 --k8s-pvc scenes"),
            _train_args, _train),
    Command("eval", "Render the held-out test views and score them (PSNR, SSIM, LPIPS, FPS).",
            "python -m stages.evaluate (DVC stage 'evaluate')", ("seed", "reconstruct", "evaluate"),
            ("rayforge eval", "rayforge eval --model runs/lego/reconstruct --out runs/lego/evaluate"),
            _eval_args, _eval),
    Command("render", "Render a camera path of the model to MP4 videos: RGB, depth and opacity.",
            "python -m stages.render_path (a command, not a DVC stage)", (),
            ("rayforge render --path orbit --frames 120 --size 640",
             "rayforge render --path views --views view_001.png,view_009.png,view_017.png --loop",
             "rayforge render --path camera_path.json --outputs rgb"),
            _render_args, _render),
    Command("export", "Export the model: NeRF mesh (PLY/GLB) and point cloud, or 3DGS Gaussians (PLY).",
            "python -m stages.export (DVC stage 'export')", ("seed", "export"),
            ("rayforge export", "rayforge export -S export.mesh_format=glb -S export.resolution=256"),
            _export_args, _export),
    Command("view", "Open an interactive web viewer of the model (training cameras and sparse points too).",
            "python -m stages.viewer (a command)", (),
            ("rayforge view data/reconstruct", "rayforge view runs/lego/reconstruct --poses runs/lego/poses --port 7007"),
            _view_args, _view),
    Command("report", "Write the HTML and Markdown report of a run.",
            "python -m stages.report (DVC stage 'report')", ("report", "ingest", "poses"),
            ("rayforge report", "rayforge report --scaling benchmarks/results/scaling_weak_2xH200.json"),
            _report_args, _report),
)


def _wrap(text: str) -> str:
    import textwrap

    return textwrap.fill(text, width=88, break_on_hyphens=False, break_long_words=False)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Photos in, a measured 3D reconstruction out: the pipeline's stages as commands.",
        epilog=_wrap("Each command runs the stage code of `dvc repro` with dvc.yaml's folders as defaults. "
                     f"`{PROG} <command> --help` shows its options, the params it reads and examples."))
    sub = ap.add_subparsers(dest="command", metavar="<command>", required=True)
    for c in COMMANDS:
        reads = (f"Reads params: {', '.join(c.sections)} (of --params; -S section.key=value changes one for "
                 "this run, params.yaml itself is not written)" if c.sections else "Reads no params.yaml section.")
        sp = sub.add_parser(c.name, help=c.summary, formatter_class=argparse.RawDescriptionHelpFormatter,
                            description="\n\n".join([c.summary, _wrap(f"Runs: {c.runs}."), _wrap(reads)]),
                            epilog="examples:\n" + "\n".join(f"  {e}" for e in c.examples))
        c.add_arguments(sp)
        if c.sections:
            sp.add_argument("--params", type=Path, default=Path("params.yaml"), help="params file (default: params.yaml)")
            sp.add_argument("-S", "--set", dest="S", action="append", default=[], metavar="SECTION.KEY=VALUE",
                            help="change a param for this run (repeatable)")
        sp.set_defaults(cmd=c)
    return ap


def run_steps(steps: list[tuple[str, list[str]]]) -> int:
    """Run each stage module's ``main(argv)`` in turn; the first non-zero status stops it."""
    import importlib

    for module, argv in steps:
        rc = importlib.import_module(module if module != "stages.reconstruct" else "stages.reconstruct.__main__").main(argv)
        if rc:
            return rc
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    c: Command = args.cmd
    if rest and c.name != "train":  # only train passes options on (to python -m stages.reconstruct)
        ap.parse_args(argv)  # argparse's own error for the unknown option
    args.argv = argv[1:]  # a command's own argv, for the commands that take their stage's options verbatim
    try:
        if not c.sections:
            return run_steps(c.steps(args, "", rest))
        with params_file(args.params, args.S, c.sections, log=lambda m: print(m, file=sys.stderr)) as params:
            return run_steps(c.steps(args, params, rest))
    except ValueError as exc:
        print(f"{PROG} {c.name}: error: {exc}", file=sys.stderr)
        return 1


def command() -> None:
    """The ``rayforge`` console script: :func:`main` as the stages' own commands run (``entry.cli``: tied to its
    parent, and SIGTERM the same clean stop as Ctrl-C, so the ``-S`` params copy is removed on the way out)."""
    from stages.common.entry import cli as stage_cli

    stage_cli(main)


if __name__ == "__main__":
    command()
