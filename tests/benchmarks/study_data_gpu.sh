#!/usr/bin/env bash
# Issue #35's data levers (longer replies, two turns, sampled replies, the shipped example prompts
# answered by the target and weighed 8 times beside the synthesized ones), as one background job on a
# GPU machine staged with launch/gpu_stage.sh:
# for each DATA_VARIANT (name|VAR=value, the environment of launch/recipes/smollm2_synth.sh that it
# changes), the recipe's synthesis of N conversations, dump and standardize (UNTIL=standardize,
# SOURCE=offline: each variant synthesizes its own data), then its draft trained with the study's
# head (tests/benchmarks/scaling_curve.sh, variant `base`: draft vocab 16384, MLP 6144, lr 2e-3,
# EPOCHS) and evaluated at 128 and 512 new tokens. A variant's training runs beside the next one's
# synthesis (the GPU shared: its minutes are not a solo figure). Results: $W/data_study.json (one row
# per data variant, a table for the docs); progress: $W/log; $W/done when finished.
#
#   W=/tmp/wd N=16384 setsid nohup bash tests/benchmarks/study_data_gpu.sh > /dev/null 2>&1 < /dev/null &
# A CPU dry run (minutes): W=/tmp/wd N=6 EPOCHS=1 NEW_TOKENS=8 EVAL_LONG= \
#   DATA_VARIANTS="base|
#   turns_2|PREPARE_EXTRA=synth.turns=2" TRAIN_EXTRA_ALL="train.max_steps=2" bash tests/benchmarks/study_data_gpu.sh
set -uo pipefail
W=${W:-/tmp/wd}
N=${N:-16384}
mkdir -p "$W"
rm -f "$W/done"
DATA_VARIANTS=${DATA_VARIANTS:-"base|
replies_256|NEW_TOKENS=256
turns_2|PREPARE_EXTRA=synth.turns=2
sampled_0.7|PREPARE_EXTRA=regen.do_sample=true regen.temperature=0.7
own_x8|OWN_REPEATS=8"}
names=()
{
  while IFS='|' read -r name assign; do
    [ -n "$name" ] || continue
    names+=("$name")
    echo "== $(date +%T) $name: synthesis, dump, standardize (${assign:-as the recipe makes it})"
    # shellcheck disable=SC2086  # NEW_TOKENS of the variant, if it sets it, also reaches the eval below
    env ${assign:+"$assign"} RUN_DIR="$W/$name" N="$N" UNTIL=standardize SOURCE=offline DRAFT_VOCAB=16384 \
      bash launch/recipes/smollm2_synth.sh > "$W/$name.data.log" 2>&1 || { echo "$name: data failed (see $W/$name.data.log)"; continue; }
    # the training data: this variant's whole standardize (its OWN_REPEATS dump included, whose sample ids
    # a max_samples cut would drop first), where scaling_curve.sh would otherwise cut its own from the dump
    mkdir -p "$W/$name/curve" && ln -sfn "$W/$name/std" "$W/$name/curve/std_$N"
    echo "== $(date +%T) $name: training (beside the next synthesis)"
    POINTS="" VARIANT_N="$N" VARIANTS="base|${TRAIN_EXTRA_ALL:-}" EPOCHS="${EPOCHS:-6}" LR=2e-3 DRAFT_VOCAB=16384 \
      RECIPE_EXTRA="model.intermediate_size=6144" EVAL_LONG="${EVAL_LONG-512}" TRAIN_TIMEOUT="${TRAIN_TIMEOUT:-900}" \
      bash tests/benchmarks/scaling_curve.sh "$W/$name" > "$W/$name.train.log" 2>&1 &
  done <<< "$DATA_VARIANTS"
  wait
  python3 - "$W" "${names[@]}" <<'PY'
import json, sys
from pathlib import Path
from tests.benchmarks.scaling_results import collect, read_jsonl, variants_table
w, names = Path(sys.argv[1]), sys.argv[2:]
rows = []
for name in names:
    run = w / name
    row = {"name": name} | collect(run / "curve" / "base", next(iter(sorted((run / "curve").glob("std_*"))), run / "std"))
    row["data_s"] = {t["stage"]: t["seconds"] for t in read_jsonl(run / "timings.jsonl")}
    rows.append(row)
table = variants_table(rows, {})
table["title"] = "Data levers, each its own synthesis of the same number of conversations (the same training)"
table["header"][1] = "training overrides beyond base"
table["header"].append("synthesis s")
for r, row in zip(rows, table["rows"]):
    row.append(str(r["data_s"].get("synthesize", "—")))
out = {"what": "issue #35's data levers (tests/benchmarks/study_data_gpu.sh)", "variants": rows, "tables": [table]}
(w / "data_study.json").write_text(json.dumps(out, indent=1) + "\n")
for r in rows:
    print(r["name"], r.get("eval", {}).get("tau"), r["data_s"])
PY
  echo "== $(date +%T) all done"
  touch "$W/done"
} >> "$W/log" 2>&1
