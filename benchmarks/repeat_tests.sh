#!/usr/bin/env bash
# Run one pytest selection N times in a row and count the runs that pass: a flaky test shows up as a failed run.
#
#   bash benchmarks/repeat_tests.sh N [pytest arguments...]
#   bash benchmarks/repeat_tests.sh 20 tests/test_resume.py tests/test_distributed.py
#
# Prints one line per run (its pytest summary and seconds) and the count; each run's full output is kept in
# $REPEAT_LOGS (default: a temporary directory, named at the end). Exit status 0 only when every run passed.
set -uo pipefail
n=${1:?usage: repeat_tests.sh N [pytest arguments...]}
shift
logs=${REPEAT_LOGS:-$(mktemp -d /tmp/repeat-tests.XXXX)}
mkdir -p "$logs"
echo "python -m pytest -q -p no:cacheprovider$(printf ' %q' "$@")   x $n   ($(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null), $(nproc) cores)"
passed=0
for i in $(seq "$n"); do
  start=$SECONDS
  if python -m pytest -q -p no:cacheprovider "$@" > "$logs/run-$i.txt" 2>&1; then
    passed=$((passed + 1)); verdict=passed
  else
    verdict=FAILED
  fi
  echo "run $i: $verdict: $(grep -E '(passed|failed|error)' "$logs/run-$i.txt" | tail -1) [$((SECONDS - start)) s]"
done
echo "$passed of $n runs passed; logs in $logs"
[ "$passed" -eq "$n" ]
