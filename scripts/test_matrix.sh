#!/usr/bin/env bash
# tests/integrations on each transformers release of the test matrix (make test-matrix), in the
# release's environment .venv-tf<release>, MATRIX_JOBS releases at a time (default 1: on 2 cores two
# at a time took as long as one after the other, the tests being CPU-bound). Each release's output is shown
# whole once it ends, with its time; the end names every release that failed (exit 1). Stopped
# (SIGINT, SIGTERM), it ends every run it started, their process groups whole.
#
#   MATRIX_MARKS="not slow or matrix" MATRIX_JOBS=1 scripts/test_matrix.sh 5.6.0 5.10.4 ...
set -uo pipefail
cd "$(dirname "$0")/.."
JOBS="${MATRIX_JOBS:-1}"
MARKS="${MATRIX_MARKS:-not slow or matrix}"
[ $# -gt 0 ] || { echo "usage: $0 RELEASE [RELEASE ...]"; exit 2; }
logs=$(mktemp -d)
pids=()
stop() {
  for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
  exit 130
}
trap stop INT TERM
trap 'rm -rf "$logs"' EXIT

start_one() {  # a session of its own, so that stopping it reaches every process it started
  setsid bash -c '
    start=$(date +%s)
    PYTHONPATH="$PWD" ".venv-tf$1/bin/python" -m pytest -q -p no:cacheprovider -m "$2" tests/integrations > "$3/$1.log" 2>&1
    echo "$? $(( $(date +%s) - start ))" > "$3/$1.rc"
  ' _ "$1" "$MARKS" "$logs" &
  pids+=($!)
}

running=0
for v in "$@"; do
  if [ "$running" -ge "$JOBS" ]; then
    wait -n
    running=$((running - 1))
  fi
  echo "== tests/integrations ($MARKS) on transformers $v: started"
  start_one "$v"
  running=$((running + 1))
done
wait

failed=()
for v in "$@"; do
  read -r rc took < "$logs/$v.rc" 2>/dev/null || { rc=1; took="?"; }
  echo "== tests/integrations ($MARKS) on transformers $v: exit $rc in $took s"
  cat "$logs/$v.log" 2>/dev/null
  [ "$rc" -eq 0 ] || failed+=("$v")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "tests/integrations failed on transformers ${failed[*]}"
  exit 1
fi
