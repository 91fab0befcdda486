#!/usr/bin/env bash
# Everything we measure on a lent GPU host, in one go (the device time is scarce: one call).
# Usage, from the repo root on the GPU host:  bash benchmarks/gpu_suite.sh <poses_dir> <out_dir>
# (SECTIONS="scaling" LEGO_POSES=<dir> FOX_POSES=<dir> ... for the multi-scene scaling table)
# <poses_dir> is a poses-stage out (e.g. data/poses of the default scene). Prints tables and
# writes metrics JSON/CSV into <out_dir>. Needs torch with CUDA; no DVC, pycolmap or open3d.
set -uo pipefail
# SECTIONS picks what runs (default: all): kernels render quality scaling overhead sync nccl gs
# (gs: 3DGS beside gsplat 1.5.3, which must be importable; LEGO_POSES / FERN_POSES / FOX_POSES pick the scenes)
POSES=${1:?poses dir}; OUT=${2:?out dir}; mkdir -p "$OUT"
SECTIONS=${SECTIONS:-kernels render quality scaling overhead sync nccl gs}
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 - <<'PY'
import torch, cuda.bindings; print("torch", torch.__version__, "cuda-bindings", cuda.bindings.__version__)
PY

# GPU params profile: instant-ngp's encoding (L=16, T=2^19, finest 2048), bigger batches, more steps.
python3 - "$OUT" <<'PY'
import sys, yaml
p = yaml.safe_load(open("params.yaml"))
r = p["reconstruct"]
r.update(steps=5000, batch_rays=8192, eval_every=500, device="cuda")
r["nerf"].update(levels=16, features_per_level=2, log2_hashmap_size=19, max_resolution=2048, samples_per_ray=256,
                 occ_resolution=128, occ_warmup_steps=256)
r["distributed"].update(gpus=1, checkpoint_every=0)
yaml.safe_dump(p, open(f"{sys.argv[1]}/params_gpu1.yaml", "w"), sort_keys=False)
r.update(steps=1000, eval_every=1000)
for n in (1, 2):
    r["distributed"]["gpus"] = n
    yaml.safe_dump(p, open(f"{sys.argv[1]}/params_scale{n}.yaml", "w"), sort_keys=False)
PY

if want kernels; then
echo "== 1. kernel tests on this GPU"
timeout 120 python3 -m pytest tests/test_hashgrid.py tests/test_kernels_runtime.py -q -p no:cacheprovider -x 2>&1 | tail -3
fi

if want render; then
echo "== 1b. packed renderer and CUDA-graph step: kernels vs references, graph vs eager, then 1-GPU training: dense / packed / packed in a graph"
timeout 200 python3 -m pytest tests/test_render_kernels.py tests/test_cuda_graph.py -m gpu -q -p no:cacheprovider 2>&1 | tail -3
timeout 120 python3 benchmarks/bench_render.py --json "$OUT/render.json" 2>&1 | tail -6
for mode in "off off" "on off" "on on"; do
  set -- $mode
  timeout 150 python3 benchmarks/bench_scaling.py --poses "default=$POSES" --gpus 1 --total-rays 8192000 --no-eval \
    --set nerf.fused_render=$1 --set nerf.cuda_graph=$2 --json "$OUT/render_$1_graph_$2.json" 2>&1 \
    | grep -E "^\|    1|Error|Traceback" | tail -1
done
fi

if want quality; then
echo "== 2. quality: reconstruct (1 GPU, CUDA kernels) + evaluate"
timeout 240 python3 -m stages.reconstruct --poses "$POSES" --out /tmp/r1 --metrics "$OUT/reconstruct_gpu1.json" \
  --plots "$OUT/train_gpu1.csv" --params "$OUT/params_gpu1.yaml" 2>&1 | grep -v "it/s\]" | tail -15
timeout 120 python3 -m stages.evaluate --poses "$POSES" --model /tmp/r1 --out /tmp/e1 --metrics "$OUT/evaluate_gpu1.json" \
  --params "$OUT/params_gpu1.yaml" 2>&1 | tail -3
python3 -c "import json; m=json.load(open('$OUT/evaluate_gpu1.full.json')); print({k: m.get(k) for k in ('psnr','ssim','fps','train_time_s','peak_gpu_memory_bytes','num_params','gpu_name')})"
fi

if want scaling; then
echo "== 3. scaling (the README's table): 1, 2, 4, 8 GPUs as visible, same training rays; JSON for report.scaling"
# LEGO_POSES / FOX_POSES: more scenes' poses outs (optional)
scenes="--poses default=$POSES"
[ -n "${LEGO_POSES:-}" ] && scenes="$scenes --poses lego=$LEGO_POSES"
[ -n "${FOX_POSES:-}" ] && scenes="$scenes --poses fox=$FOX_POSES"
timeout 590 python3 benchmarks/bench_scaling.py $scenes --gpus auto --total-rays 40960000 \
  --json "$OUT/scaling_weak.json" 2>&1 | grep -E "^\||Error|Traceback" | tail -20
timeout 300 python3 benchmarks/bench_scaling.py --poses "default=$POSES" --gpus auto --total-rays 16384000 \
  --global-batch-rays 16384 --json "$OUT/scaling_strong.json" 2>&1 | grep -E "^\||Error|Traceback" | tail -8
fi

if want overhead; then
echo "== 3b. world size 1: in-process vs through torchrun + process group (1000 steps each)"
for launch in inline torchrun; do
  timeout 150 python3 -m stages.reconstruct --poses "$POSES" --out /tmp/o_$launch --launch $launch \
    --params "$OUT/params_scale1.yaml" > /tmp/o_$launch.log 2>&1 || tail -5 /tmp/o_$launch.log
  python3 -c "import json; s=json.load(open('/tmp/o_$launch/summary.json')); print('$launch', {k: s.get(k) for k in ('world_size','train_time_s','rays_per_s','step_comm_s')})"
done
fi

if [ "$NGPU" -ge 2 ] && want sync; then
  echo "== 4. gradient sync with NCCL: dense vs sparse (2 GPUs)"
  timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_distributed.py sync --backend nccl 2>&1 | grep -v "^W1\|OMP_NUM" | tail -14
fi
if [ "$NGPU" -ge 2 ] && want nccl; then
  echo "== 5. NCCL all-reduce bus bandwidth (1 GiB fp32), ring vs tree"
  for algo in Ring Tree; do
    NCCL_ALGO=$algo timeout 60 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_allreduce.py 2>&1 | grep -E "GB/s|Error" | tail -2
  done
fi
if want gs; then
  echo "== 6. 3DGS: CUDA-graph views and MCMC on this GPU, then ours (graphed and eager) beside gsplat and gsplat+reset at 7k"
  timeout 240 python3 -m pytest tests/test_gs_graph.py tests/test_gs_mcmc.py tests/test_gs_method.py -m gpu -q \
    -p no:cacheprovider 2>&1 | tail -3
  gs_scenes="--poses default=$POSES"
  [ -n "${LEGO_POSES:-}" ] && gs_scenes="--poses lego=$LEGO_POSES"
  [ -n "${FERN_POSES:-}" ] && gs_scenes="$gs_scenes --poses fern=$FERN_POSES"
  [ -n "${FOX_POSES:-}" ] && gs_scenes="$gs_scenes --poses fox=$FOX_POSES"
  timeout 600 python3 benchmarks/bench_3dgs.py $gs_scenes --steps 7000 --gsplat-reset-fix --eager \
    --json "$OUT/gs_vs_gsplat_7k.json" --save-ply "$OUT/ply" 2>&1 | grep -E "^\||steps:|Error|Traceback"
  ply=$(ls "$OUT"/ply/*_7000.ply 2>/dev/null | head -1)
  [ -n "$ply" ] && timeout 120 python3 benchmarks/bench_rasterizer.py --ply "$ply" --json "$OUT/rasterizer.json" 2>&1 | tail -12
fi
echo "== done"
