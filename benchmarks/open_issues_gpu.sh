#!/usr/bin/env bash
# The GPU benchmarks the open issues ask for, as one background job on a 2-GPU machine staged with
# benchmarks/staging/gpu_stage.sh (run from the repository root, PYTHONPATH and EAGLE3_CACHE set). Each phase
# keeps both GPUs busy with measurements that do not share a GPU; every benchmark rewrites its JSON
# after each case, so whatever the device time allows is kept.
#
#   phase 1 (~5 min): generation probe (#13, GPU 0)       | online training (#15, GPU 1)
#   phase 2 (~7 min): trainer, one-GPU cases (#17, GPU 0)  | fp8 storage quality (#16, GPU 1)
#   phase 3 (~10 min): trainer, two-GPU cases (#17)         ; dump benchmark (#16, 1 and 2 GPUs)
#
#   W=/tmp/w SYNTH_FILE=synth_16384.jsonl.gz setsid nohup bash benchmarks/open_issues_gpu.sh &
# Results: $W/{generate,online_bench,train_bench_1gpu,storage_quality,train_bench_2gpu,dump_bench}.json,
# logs beside them, the phases in $W/log.
set -uo pipefail
W=${W:-/tmp/w}
mkdir -p "$W"
py=python3
b=benchmarks
{
  echo "== $(date +%T) phase 1: generation probe (GPU 0) | online training (GPU 1)"
  CUDA_VISIBLE_DEVICES=1 timeout 360 $py $b/bench_online.py --out "$W/online_bench.json" --budget 300 \
    > "$W/online_bench.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0 timeout 360 $py $b/bench_generate.py --out "$W/generate.json" --n "${PROBE_N:-2048}" \
    ${SYNTH_FILE:+--conversations "$SYNTH_FILE"} \
    --cases "${PROBE_CASES:-padded_1024,static_1024,padded_1024_x3,padded_4096,continuous_1024}" \
    --budget 300 --case-budget 100 > "$W/generate.log" 2>&1
  wait
  echo "== $(date +%T) phase 2: trainer one-GPU cases (GPU 0) | fp8 storage quality (GPU 1)"
  CUDA_VISIBLE_DEVICES=1 timeout 430 $py $b/storage_quality.py --out "$W/storage_quality.json" \
    > "$W/storage_quality.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0 timeout 430 $py $b/bench_train.py --suite --out "$W/train_bench_1gpu.json" --budget 400 \
    --cases mfu,longest_1gpu,fit_32k_no_checkpointing,mfu_compile > "$W/train_bench_1gpu.log" 2>&1
  wait
  echo "== $(date +%T) phase 3: trainer two-GPU cases, then the dump benchmark"
  timeout 260 $py $b/bench_train.py --suite --out "$W/train_bench_2gpu.json" --budget 240 --cases sp2,dp2 \
    > "$W/train_bench_2gpu.log" 2>&1
  timeout 390 $py $b/bench_dump.py --out "$W/dump_bench.json" --budget 360 > "$W/dump_bench.log" 2>&1
  echo "== $(date +%T) all done"
} >> "$W/log" 2>&1
