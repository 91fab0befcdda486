"""``python -m stages.reconstruct``: see the package docstring."""
from __future__ import annotations

import argparse
import sys

from stages.common import log as logsetup
from stages.common.params import ParamsError, load_section, read_yaml


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.reconstruct", description=__doc__)
    ap.add_argument("--poses", required=True, help="the poses stage's out folder")
    ap.add_argument("--out", required=True, help="out folder for the model")
    ap.add_argument("--metrics", help="metrics JSON to write")
    ap.add_argument("--plots", help="training-curve CSV to write")
    ap.add_argument("--params", default="params.yaml")
    args = ap.parse_args(argv)
    log = logsetup.setup("stages.reconstruct")
    from . import ReconstructParams, run

    try:
        data = read_yaml(args.params)
        params = load_section(ReconstructParams, "reconstruct", data=data)
        seed = data.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ParamsError(f"seed: expected an integer, got {seed!r}")
        run(params, args.poses, args.out, args.metrics, args.plots, seed=seed)
    except ValueError as exc:
        log.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
