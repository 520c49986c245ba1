#!/usr/bin/env bash
# Ours' training step under torch.profiler (benchmarks/step_profile.py) as a recipe trains it, with one
# trainer option at each of its values and each batch size: one results file each, named
# <option>-<value>-<batch>.json, and its last line printed. The trainer's options are the recipe's own,
# read from eagle3-run's dry run, so they follow the recipe; the run goes on for as many epochs as the
# profile needs, and evaluates and keeps nothing on the way.
#
#   benchmarks/step_ab.sh OUT_DIR CONVERSATIONS.jsonl OPTION "VALUES" "BATCHES" [eagle3-run options...]
#   e.g. (the GPU machine, after gpu_stage.sh install):
#   benchmarks/step_ab.sh "$OUT" /tmp/c.jsonl runtime.cudnn_attention "true false" "8192 32768"
#
# Environment: WORK (its prepared data and logs; /tmp/step_ab), WARMUP (24), STEPS (12), STACKS (0: the
# host's time by Python frame too, in <name>.stacks.txt, where N > 0), PACK (0; 1: OUT_DIR holds one
# file, step_ab.tgz, of every profile so far, packed again after each, for a transfer that brings back
# a few files only, or a call cut short). The data is prepared once (an earlier call's is reused, so
# calls with other OUT dirs repeat the profiles on the same data); each profile's run starts afresh.
set -euo pipefail
if [ $# -lt 5 ]; then
  sed -n '2,16p' "$0" >&2
  exit 2
fi
case ${PACK:-0} in
0 | 1) ;;
*)
  echo "step_ab.sh: PACK=$PACK: 0 (the profiles' files in OUT_DIR) or 1 (their archive, step_ab.tgz)" >&2
  exit 2
  ;;
esac
out=$1 data=$2 option=$3 values=$4 batches=$5
shift 5
run=("$@")
work=${WORK:-/tmp/step_ab}
mkdir -p "$out" "$work"
dest=$out # (PACK=1: the profiles' files gather in WORK, and OUT_DIR gets their archive)
if [ "${PACK:-0}" = 1 ]; then
  dest=$work/profiles
  rm -rf "$dest" && mkdir -p "$dest"
fi
[ -f "$work/p/prepared/manifest.json" ] || python3 -m eagle3_train.run recipe=smollm2 "${run[@]}" \
  out="$work/p" data="$data" until=prepare >"$work/prepare.log" 2>&1 || {
  tail -20 "$work/prepare.log" >&2
  exit 1
}
train=$(python3 -m eagle3_train.run recipe=smollm2 "${run[@]}" out="$work/p" data="$data" dry_run=true |
  sed -n '/^# train$/{n;p;}')
# the recipe's options (the dry run quotes them as a shell would), less those the profile sets
mapfile -t words < <(python3 -c 'import shlex, sys; w = shlex.split(sys.stdin.read())
print("\n".join(w[w.index("eagle3_train.training.trainer") + 1 :]))' <<<"$train")
opts=()
for o in "${words[@]}"; do
  case $o in
  ++out=* | ++loop.epochs=* | ++loop.max_tokens_per_batch=* | ++loop.eval_every=* | ++loop.log_every=* | \
    ++checkpoint.keep_best=* | ++progress=* | "++$option="*) ;;
  *) opts+=("$o") ;;
  esac
done
for b in $batches; do
  for v in $values; do
    name="$option-$v-$b"
    rm -rf "${work:?}/$name" # (a run left there by an earlier call would be resumed, not profiled)
    if python3 -m benchmarks.step_profile --out "$dest/$name.json" --warmup "${WARMUP:-24}" --steps "${STEPS:-12}" \
      --stacks "${STACKS:-0}" -- "${opts[@]}" ++out="$work/$name" ++loop.epochs=1000 ++loop.max_tokens_per_batch="$b" \
      ++loop.eval_every=0 ++loop.log_every=10 ++checkpoint.keep_best=false ++progress=false "++$option=$v" \
      >"$work/$name.log" 2>&1; then
      echo "$name $(tail -1 "$work/$name.log")"
    else
      echo "$name failed: $(tail -3 "$work/$name.log")"
    fi
    if [ "$dest" != "$out" ]; then
      tar -czf "$out/.step_ab.tgz" -C "$dest" . && mv "$out/.step_ab.tgz" "$out/step_ab.tgz"
    fi
  done
done
