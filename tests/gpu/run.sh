#!/usr/bin/env bash
# The GPU checks, then the benchmark matrix, in one command from any folder:
#   bash tests/gpu/run.sh [bench.py options, e.g. --quick or --data-dir /path/imagenet]
# PYTHON=/path/to/python picks the interpreter (default: python on PATH, e.g. an activated venv).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
status=0
"$PY" -m pytest -q -m "not slurm" tests/gpu || status=$?
# The table (stdout) is also kept in tests/gpu/last-bench.md, ready to paste into BENCHMARKS.md; progress goes
# to stderr. A run that prints no table (no GPU, bad option) leaves the previous file alone.
table=$(mktemp)
"$PY" tests/gpu/bench.py "$@" | tee "$table" || status=$?
[ -s "$table" ] && cat "$table" > tests/gpu/last-bench.md
rm -f "$table"
exit $status
