#!/usr/bin/env bash
# Online training speed of recipe variants (issue #13), on a machine staged with benchmarks/staging/gpu_stage.sh:
# N conversations synthesized once as benchmarks/smollm2_synth.sh does (all GPUs), then each
# variant trained on one GPU for STEPS steps with the recipe's training settings plus its overrides,
# as many variants at a time as there are GPUs. Results: $W/ab.json (per variant: the median of the
# logged tokens/s after the first fifth of the steps, the train stage's seconds, the last logged
# simulated tau). A variant that fails is reported with its return code; the others go on.
#
#   W=/tmp/ab bash benchmarks/train_ab_gpu.sh
#   W=/tmp/ab STEPS=150 VARIANTS="base=;eager=train.compile=false;v8k=online.draft_vocab_size=8192" bash benchmarks/train_ab_gpu.sh
# A variant is name=overrides (eagle3-train overrides, space-separated; online.draft_vocab_size goes
# through DRAFT_VOCAB, since the recipe sets it).
set -uo pipefail
W=$(realpath -m "${W:-/tmp/ab}")  # absolute: the variants link to its data
N=${N:-16384}
STEPS=${STEPS:-150}
VARIANTS=${VARIANTS:-"base=;eager=train.compile=false"}
NG=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
[ "$NG" -ge 1 ] || NG=1
mkdir -p "$W"
echo "== $(date +%T) synthesis: $N conversations" >> "$W/log"
RUN_DIR="$W/data" N="$N" UNTIL=synthesize bash benchmarks/smollm2_synth.sh >> "$W/log" 2>&1 || { echo "synthesis failed" >> "$W/log"; exit 1; }
IFS=';' read -ra specs <<< "$VARIANTS"
i=0
for spec in "${specs[@]}"; do
  name=${spec%%=*}
  extra=""
  [[ $spec == *=* ]] && extra=${spec#*=}
  vocab=$(sed -n 's/.*online\.draft_vocab_size=\([0-9]*\).*/\1/p' <<< "$extra")
  extra=$(sed 's/online\.draft_vocab_size=[0-9]*//' <<< "$extra")
  mkdir -p "$W/$name"
  ln -sfn "$W/data/prepared" "$W/$name/prepared"  # the same conversations: nothing is generated again
  gpu=$((i % NG))
  echo "== $(date +%T) $name on GPU $gpu: $extra ${vocab:+DRAFT_VOCAB=$vocab}" >> "$W/log"
  ( env CUDA_VISIBLE_DEVICES=$gpu NGPU=1 N="$N" RUN_DIR="$W/$name" UNTIL=train ${vocab:+DRAFT_VOCAB=$vocab} \
      TRAIN_EXTRA="train.max_steps=$STEPS train.log_every=10 $extra" bash benchmarks/smollm2_synth.sh \
      > "$W/$name.log" 2>&1; echo $? > "$W/$name.rc" ) &
  i=$((i + 1))
  if [ $((i % NG)) -eq 0 ]; then wait; fi
done
wait
python3 - "$W" "$VARIANTS" "$STEPS" <<'PY' >> "$W/log" 2>&1
import json, statistics, sys
from pathlib import Path
w, variants, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
out = {"what": f"online training speed of recipe variants, {steps} steps each on one GPU (benchmarks/train_ab_gpu.sh)",
       "variants": {}}
for spec in variants.split(";"):
    name, _, extra = spec.partition("=")
    r = {"overrides": extra, "rc": int((w / f"{name}.rc").read_text()) if (w / f"{name}.rc").is_file() else None}
    metrics = w / name / "train" / "metrics.jsonl"
    if metrics.is_file():
        lines = [json.loads(l) for l in metrics.read_text().splitlines()]
        rates = [m["tokens_per_s"] for m in lines if "tokens_per_s" in m and m["step"] > steps // 5]
        taus = [m["tau"] for m in lines if "tau" in m and "step" in m]
        r |= {"median_tokens_per_s": round(statistics.median(rates)) if rates else None, "last_tau": taus[-1] if taus else None}
    timings = w / name / "timings.jsonl"
    if timings.is_file():
        r["train_s"] = sum(json.loads(l)["seconds"] for l in timings.read_text().splitlines() if '"train"' in l)
    out["variants"][name] = r
(w / "ab.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out, indent=1))
PY
echo "== $(date +%T) all done" >> "$W/log"
