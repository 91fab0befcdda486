#!/usr/bin/env bash
# The poses outs the GPU benchmarks read (bench_3dgs.py, bench_nerf_quality.py, bench_rasterizer.py),
# made from ../shared/data by the project's own ingest and poses stages, into <out>/{lego,fern,fox}.
# Copy <out> into an ignored folder of the checkout and carry it to the GPU host.
#   bash benchmarks/prepare_scenes.sh [out=.gpu/data] [data=../shared/data] [scenes="lego fern fox"]
# lego: the Blender import (transforms_train/test.json), 400x400, RGBA kept (25 test views);
# fern: SfM on images_8 with bench_poses.py's fern settings (SIMPLE_RADIAL, global mapper; 496x372
#       after undistortion, 3 test views);
# fox:  SfM on the 50 phone frames at 720 px with bench_poses.py's fox settings (OPENCV, principal
#       point refined, SIFT at 960 px, sequential matching; 399x710, 7 test views).
# About 1 minute on 2 CPU cores. SfM results depend on pycolmap's version: rows measured on
# different poses outs are not comparable (the result JSONs say which poses their rows used).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.gpu/data}; DATA=${2:-../shared/data}; SCENES=${3:-lego fern fox}
[ -d "$DATA" ] || { echo "prepare_scenes: no data folder at $DATA" >&2; exit 1; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
one() {  # name photos ingest-overrides: params.yaml with bench_poses.py's poses settings for the scene
  python3 - "$WORK/$1.yaml" "$3" "$1" <<'PY'
import sys, yaml
from benchmarks.bench_poses import SCENE_SETTINGS
p = yaml.safe_load(open("params.yaml"))
p["ingest"].update(yaml.safe_load(sys.argv[2]))
p["poses"].update(SCENE_SETTINGS.get(sys.argv[3], {}))
yaml.safe_dump(p, open(sys.argv[1], "w"), sort_keys=False)
PY
  python3 -m stages.ingest --photos "$2" --out "$WORK/$1_ingest" --params "$WORK/$1.yaml"
  # the poses stage replaces its out atomically: an older poses out of this name is kept until it succeeds
  python3 -m stages.poses --ingest "$WORK/$1_ingest" --out "$OUT/$1" --metrics "$WORK/$1_poses.json" \
    --params "$WORK/$1.yaml"
  echo "prepare_scenes: $1 -> $OUT/$1"
}
for s in $SCENES; do
  case $s in
    lego) one lego "$DATA/lego" "{max_size: 400, alpha: keep}" ;;
    fern) one fern "$DATA/fern/images_8" "{}" ;;
    fox)  one fox "$DATA/fox/images" "{max_size: 720}" ;;
    *) echo "prepare_scenes: unknown scene $s (lego, fern, fox)" >&2; exit 1 ;;
  esac
done
