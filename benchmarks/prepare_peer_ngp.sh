#!/usr/bin/env bash
# The instant-ngp-class NeRF peer for bench_nerf_peer.py, packed for a GPU host without network:
# nerfacc's instant-ngp example (examples/train_ngp_nerf_occ.py, nerfacc 0.5.3 from PyPI, the examples
# from the nerfacc repository at tag v0.5.3) on tiny-cuda-nn's PyTorch bindings, which have no wheel and
# are built there from source (bench_nerf_peer.py builds them once a machine: 135 s on an H100 host).
#   bash benchmarks/prepare_peer_ngp.sh <tiny-cuda-nn checkout, with submodules> <nerfacc checkout> \
#     [out=.gpu/peer] [data=../shared/data]
# A tiny-cuda-nn checkout: git clone --recursive https://github.com/NVlabs/tiny-cuda-nn (the bindings
# need its cutlass and fmt submodules); nerfacc: git clone https://github.com/nerfstudio-project/nerfacc.
# Writes <out>/tiny-cuda-nn.tgz (the sources the bindings compile, about 3 MB), <out>/tiny-cuda-nn.commit,
# <out>/nerfacc-0.5.3-py3-none-any.whl, <out>/nerfacc-examples/ and <out>/data/lego (a copy of the
# Blender-format lego the benchmark reads; .gpu/ is git-ignored and nothing of it is committed).
set -euo pipefail
cd "$(dirname "$0")/.."
TCNN=${1:?tiny-cuda-nn checkout}; NERFACC=${2:?nerfacc checkout}; OUT=${3:-.gpu/peer}; DATA=${4:-../shared/data}
for need in "$TCNN/bindings/torch/setup.py" "$TCNN/dependencies/cutlass/include/cutlass/cutlass.h" \
            "$TCNN/dependencies/fmt/src/format.cc"; do
  [ -f "$need" ] || { echo "prepare_peer_ngp: $need is missing (clone tiny-cuda-nn with --recursive)" >&2; exit 1; }
done
[ -d "$DATA/lego" ] || { echo "prepare_peer_ngp: no lego scene at $DATA/lego" >&2; exit 1; }
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT" "$WORK/tiny-cuda-nn/dependencies"
# what setup.py compiles and includes: the bindings, include/, src/, the header-only dependencies,
# cutlass's headers and fmt's sources (not tiny-cuda-nn's sample data nor cutlass's docs and tests)
cp -r "$TCNN/bindings" "$TCNN/include" "$TCNN/src" "$TCNN/CMakeLists.txt" "$TCNN/LICENSE.txt" "$WORK/tiny-cuda-nn/"
for dep in json pcg32 pybind11_json stbi; do
  [ -d "$TCNN/dependencies/$dep" ] && cp -r "$TCNN/dependencies/$dep" "$WORK/tiny-cuda-nn/dependencies/"
done
mkdir -p "$WORK/tiny-cuda-nn/dependencies/cutlass/tools/util" "$WORK/tiny-cuda-nn/dependencies/fmt"
cp -r "$TCNN/dependencies/cutlass/include" "$WORK/tiny-cuda-nn/dependencies/cutlass/"
cp -r "$TCNN/dependencies/cutlass/tools/util/include" "$WORK/tiny-cuda-nn/dependencies/cutlass/tools/util/"
cp -r "$TCNN/dependencies/fmt/include" "$TCNN/dependencies/fmt/src" "$WORK/tiny-cuda-nn/dependencies/fmt/"
tar -czf "$OUT/tiny-cuda-nn.tgz" -C "$WORK" tiny-cuda-nn
git -C "$TCNN" rev-parse HEAD > "$OUT/tiny-cuda-nn.commit" 2>/dev/null || echo unknown > "$OUT/tiny-cuda-nn.commit"
python3 -m pip download -q --no-deps nerfacc==0.5.3 -d "$OUT"
rm -rf "$OUT/nerfacc-examples"
if git -C "$NERFACC" rev-parse -q --verify v0.5.3 > /dev/null; then
  mkdir -p "$OUT/nerfacc-examples" && git -C "$NERFACC" archive v0.5.3 examples | tar -x -C "$OUT/nerfacc-examples"
else
  echo "prepare_peer_ngp: $NERFACC has no tag v0.5.3; copying its examples as checked out" >&2
  mkdir -p "$OUT/nerfacc-examples" && cp -r "$NERFACC/examples" "$OUT/nerfacc-examples/"
fi
rm -rf "$OUT/data/lego" && mkdir -p "$OUT/data" && cp -r "$DATA/lego" "$OUT/data/lego"
du -sh "$OUT"/* | sed 's/^/prepare_peer_ngp: /'
