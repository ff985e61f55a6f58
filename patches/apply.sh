#!/usr/bin/env bash
# Apply megatron-hybridep's patches to a Megatron-LM checkout (see patches/README.md).
#
#   patches/apply.sh /path/to/Megatron-LM            check every patch, then apply the pending ones
#   patches/apply.sh --check /path/to/Megatron-LM    only report: applied / pending / does not apply
#   patches/apply.sh --reverse /path/to/Megatron-LM  take them out again
#
# All-or-nothing: if any patch does not apply, nothing is changed. Running it twice is harmless.
# Uses GNU patch with no fuzz (-F0): a hunk applies only where all of its context matches.
set -euo pipefail

usage() { sed -n '2,9s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

mode=apply
case "${1:-}" in
  --check) mode=check; shift ;;
  --reverse) mode=reverse; shift ;;
  -h|--help) usage; exit 0 ;;
esac
if [ $# -ne 1 ]; then usage >&2; exit 2; fi
target=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Order matters only for reporting; the patches touch different files.
patches=("$here/megatron_training_arguments.patch" "$here/pretrain_gpt.patch")

die() { echo "error: $*" >&2; exit 1; }
command -v patch >/dev/null 2>&1 || die "'patch' not found; fix: install GNU patch (e.g. apt-get install patch)"
[ -f "$target/megatron/training/arguments.py" ] ||
  die "$target has no megatron/training/arguments.py; fix: pass the root of a Megatron-LM checkout"
[ -f "$target/pretrain_gpt.py" ] ||
  die "$target has no pretrain_gpt.py; fix: pass the root of a Megatron-LM checkout (the megatron-core wheel ships only megatron/)"

run_patch() {  # run_patch PATCH [extra patch options...]
  local p=$1; shift
  patch -p1 -d "$target" -F0 -f -s --no-backup-if-mismatch -r - "$@" < "$p"
}
state_of() {  # applied | pending | conflict
  if run_patch "$1" -R --dry-run >/dev/null 2>&1; then echo applied
  elif run_patch "$1" --dry-run >/dev/null 2>&1; then echo pending
  else echo conflict
  fi
}

declare -A state
bad=0
for p in "${patches[@]}"; do
  state[$p]=$(state_of "$p")
  printf '%-36s %s\n' "$(basename "$p")" "${state[$p]}"
  if [ "${state[$p]}" = conflict ]; then
    bad=1
    echo "  the hunks that do not match (patch --dry-run):" >&2
    patch -p1 -d "$target" -F0 -f --no-backup-if-mismatch -r - --dry-run < "$p" 2>&1 | sed 's/^/    /' >&2 || true
  fi
done
if [ $bad -ne 0 ]; then
  die "nothing changed: a patch does not apply to $target; fix: use a Megatron-LM version listed in" \
      "patches/README.md, or make the change by hand as described there"
fi

case $mode in
  check) ;;
  apply)
    for p in "${patches[@]}"; do
      if [ "${state[$p]}" = pending ]; then run_patch "$p"; echo "applied $(basename "$p")"; fi
    done ;;
  reverse)
    for p in "${patches[@]}"; do
      if [ "${state[$p]}" = applied ]; then run_patch "$p" -R; echo "reversed $(basename "$p")"; fi
    done ;;
esac
