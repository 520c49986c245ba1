#!/usr/bin/env bash
# Issue #13's next GPU run in one background job (a 2-GPU machine staged with launch/gpu_stage.sh):
# 1. the generation probe (tests/benchmarks/bench_generate.py) on GPU 0 beside the online-training
#    benchmark (tests/benchmarks/bench_online.py, issue #15) on GPU 1;
# 2. the recipe (launch/recipes/smollm2_synth.sh) on both GPUs with the fastest generation the probe
#    found (GEN_BATCHING, GEN_BATCH, GEN_RANKS_PER_GPU) and N conversations.
# Results under $W: generate.json, online_bench.json, run/ (timings.jsonl, eval/report.json); log: $W/log.
#
#   W=/tmp/w N=49152 SYNTH_FILE=synth_16384.jsonl.gz bash tests/benchmarks/recipe_fast_gpu.sh
set -euo pipefail
W=${W:-/tmp/w}
mkdir -p "$W"
{
  echo "== $(date +%T) probe: generation on GPU 0, online training on GPU 1"
  CUDA_VISIBLE_DEVICES=1 timeout 420 python3 tests/benchmarks/bench_online.py --out "$W/online_bench.json" \
    > "$W/online_bench.log" 2>&1 &
  online=$!
  CUDA_VISIBLE_DEVICES=0 python3 tests/benchmarks/bench_generate.py --out "$W/generate.json" --n "${PROBE_N:-4096}" \
    ${SYNTH_FILE:+--conversations "$SYNTH_FILE"} --cases "${PROBE_CASES:-padded_1024,padded_4096,padded_1024_x3,static_1024,continuous_1024}" \
    --budget "${PROBE_BUDGET:-360}" --case-budget 150 || echo "generation probe failed"
  # the fastest case -> the recipe's generation options (padded_1024 when the probe has nothing)
  read -r GEN_BATCHING GEN_BATCH GEN_RANKS_PER_GPU < <(python3 - "$W/generate.json" <<'PY'
import json, sys
try:
    name = json.load(open(sys.argv[1]))["summary"]["fastest_greedy"]
except (OSError, ValueError, KeyError):
    name = "padded_1024"
parts = name.split("_")
print(parts[0], parts[1], parts[2][1:] if len(parts) > 2 and parts[2].startswith("x") else 1)
PY
  )
  export GEN_BATCHING GEN_BATCH GEN_RANKS_PER_GPU
  echo "== $(date +%T) fastest generation: batching=$GEN_BATCHING batch=$GEN_BATCH ranks/GPU=$GEN_RANKS_PER_GPU"
  wait $online || echo "online benchmark: exit $? (see $W/online_bench.log)"
  echo "== $(date +%T) recipe: N=${N:-49152} SOURCE=${SOURCE:-offline}"
  RUN_DIR="$W/run" N="${N:-49152}" bash launch/recipes/smollm2_synth.sh || echo "recipe failed"
  echo "== $(date +%T) all done"
} >> "$W/log" 2>&1
