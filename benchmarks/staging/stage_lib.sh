# Shared by benchmarks/staging/stage_vllm.sh and benchmarks/staging/stage_sglang.sh (sourced after their settings block:
# tag, root, pins, pack_rel, pack_dir, site, stage, part_mib, slim_rows, slim, exports, cmd): stage a
# pinned wheel set on an offline machine where each transfer carries at most ~64 MiB.
#   pack     download the wheels here, slim them (slim_rows), split one tar of them into parts
#   repart   split the parts here again at part_mib (after a change of it)
#   install  there, once per part: collect it; when every part is there, install them all into
#            $site once and print the unmet requirements and the exports
say() { echo "stage_$tag: $*"; }

# Delete members from a wheel and their lines from its RECORD.
wheel_drop() {
  local whl=$1
  shift
  local record tmp member
  record=$(unzip -Z1 "$whl" | grep '\.dist-info/RECORD$')
  zip -q -d "$whl" "$@"
  tmp=$(mktemp -d)
  unzip -q -d "$tmp" "$whl" "$record"
  for member in "$@"; do
    grep -v -F "$member," "$tmp/$record" > "$tmp/RECORD.new" || true
    mv "$tmp/RECORD.new" "$tmp/$record"
  done
  (cd "$tmp" && zip -q "$whl" "$record")
  rm -rf "$tmp"
}

# Download the pinned wheels (cp312, manylinux x86_64), slim them, and split one tar of them into
# parts named by the tar's hash, so that parts of two packs never mix.
pack() {
  local platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  local n row glob members whl
  for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  mkdir -p "$pack_dir/whl"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$pack_dir/whl" "$root" -r "$pins"
  rm -rf "$pack_dir/bundle" "$pack_dir/parts"
  mkdir -p "$pack_dir/bundle" "$pack_dir/parts"
  cp "$pack_dir"/whl/*.whl "$pack_dir/bundle/"
  if [ "$slim" = 1 ]; then
    for row in "${slim_rows[@]}"; do
      read -r glob members <<< "$row"
      whl=$(compgen -G "$pack_dir/bundle/$glob") || { say "no wheel matches $glob" >&2; exit 1; }
      # shellcheck disable=SC2086  # members: a space-separated list
      wheel_drop "$whl" $members
    done
  fi
  tar -cf "$pack_dir/bundle.tar" -C "$pack_dir/bundle" .
  split_bundle
  say "$(ls "$pack_dir"/bundle/*.whl | wc -l) wheels, $(du -sm "$pack_dir/bundle" | cut -f1) MiB -> $(ls -d "$pack_dir"/parts/*/ | wc -l) parts:"
  du -m "$pack_dir"/parts/*/"$tag"-* | sed "s#$pack_dir/##"
  say "one device call per part, carry [\"$pack_rel/parts/<k>\"], command: benchmarks/staging/stage_$tag.sh install"
}

# Split $pack_dir/bundle.tar into parts of $part_mib MiB named by the tar's hash, one folder each.
split_bundle() {
  local id n k i
  id=$(sha256sum "$pack_dir/bundle.tar" | cut -c1-12)
  rm -rf "$pack_dir/parts" && mkdir -p "$pack_dir/parts"
  split -b "${part_mib}M" -d -a 2 "$pack_dir/bundle.tar" "$pack_dir/parts/chunk-"
  local chunks=("$pack_dir"/parts/chunk-*)
  n=${#chunks[@]}
  for i in "${!chunks[@]}"; do
    k=$((i + 1))
    mkdir "$pack_dir/parts/$k"
    mv "${chunks[$i]}" "$pack_dir/parts/$k/$tag-$id-part-$k-of-$n"
  done
  (cd "$pack_dir/parts" && sha256sum */"$tag-$id"-part-* | sed 's#  [0-9]*/#  #') > "$pack_dir/SHA256SUMS"
  for k in $(seq 1 "$n"); do cp "$pack_dir/SHA256SUMS" "$pack_dir/parts/$k/"; done
  rm "$pack_dir/bundle.tar"
}

# Split the parts already here again at $part_mib MiB (the tar joined back from them: no download).
repart() {
  local n k
  n=$(ls -d "$pack_dir"/parts/*/ | wc -l)
  : > "$pack_dir/bundle.tar"
  for k in $(seq 1 "$n"); do cat "$pack_dir/parts/$k/$tag"-*-part-"$k"-of-* >> "$pack_dir/bundle.tar"; done
  split_bundle
  du -m "$pack_dir"/parts/*/"$tag"-* | sed "s#$pack_dir/##"
}

# Copy the parts that came with this call into $stage, checking each against SHA256SUMS.
collect() {
  local sums part name
  mkdir -p "$stage"
  for sums in "$pack_dir"/parts/*/SHA256SUMS; do
    [ -f "$sums" ] || continue
    for part in "$(dirname "$sums")/$tag"-*-part-*; do
      name=$(basename "$part")
      [ -f "$part" ] && [ ! -f "$stage/$name" ] || continue
      cp "$part" "$sums" "$stage/"
      if ! (cd "$stage" && grep -F "  $name" SHA256SUMS | sha256sum -c --quiet -); then
        rm -f "$stage/$name"
        say "$name arrived damaged (sha256 mismatch): carry it again" >&2
        exit 1
      fi
      say "received $name"
    done
  done
  [ -f "$stage/SHA256SUMS" ] || { say "no part here yet: carry $pack_rel/parts/<k>" >&2; exit 1; }
}

# What the staged packages ask for that this Python does not have (with $site first on sys.path, as
# it will be): the packages left out on purpose show up here too.
check_requirements() {
  PYTHONPATH=$site python3 - "$site" "$tag" <<'PY'
import sys
from importlib import metadata
from packaging.requirements import Requirement
from packaging.markers import default_environment

site, tag = sys.argv[1:]
env = default_environment() | {"extra": ""}
unmet = set()
for dist in metadata.distributions(path=[site]):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker and not req.marker.evaluate(env):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or (req.specifier and not req.specifier.contains(have, prereleases=True)):
            unmet.add(f"{req.name}{req.specifier} (have {have or 'none'}) for {dist.metadata['Name']}")
print(f"stage_{tag}: unmet requirements:" if unmet else f"stage_{tag}: every requirement met")
for line in sorted(unmet):
    print("  " + line)
PY
}

# Once every part is in $stage: join, untar and install the wheels into $site (once per bundle).
install() {
  collect
  local names id name missing=()
  mapfile -t names < <(awk '{print $2}' "$stage/SHA256SUMS")
  id=${names[0]#"$tag"-}
  id=${id%%-part-*}
  for name in "${names[@]}"; do [ -f "$stage/$name" ] || missing+=("${name#"$tag-$id"-part-}"); done
  if [ ${#missing[@]} -gt 0 ]; then
    say "$((${#names[@]} - ${#missing[@]})) of ${#names[@]} parts here; still missing: ${missing[*]}"
    exit 0
  fi
  if [ ! -f "$site/.stage_$tag-$id" ]; then
    rm -rf "$stage/whl"
    mkdir -p "$stage/whl" "$site"
    for name in "${names[@]}"; do cat "$stage/$name"; done | tar -xf - -C "$stage/whl"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$stage"/whl/*.whl
    touch "$site/.stage_$tag-$id"
    say "installed $(ls "$stage"/whl/*.whl | wc -l) wheels into $site"
  else
    say "bundle $id already installed in $site"
  fi
  check_requirements
  say "export $exports"
}

case $cmd in
pack) pack ;;
repart) repart ;;
install) install ;;
*)
  echo "usage: stage_$tag.sh pack|repart|install" >&2
  exit 2
  ;;
esac
