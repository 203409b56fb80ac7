#!/usr/bin/env bash
# The GPU checks, then the benchmark matrix, in one command from any folder:
#   bash tests/gpu/run.sh [bench.py options, e.g. --quick or --data-dir /path/imagenet]
# PYTHON=/path/to/python picks the interpreter (default: python on PATH, e.g. an activated venv).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
# No GPU, no tests: a node where torch sees no GPU (a driver older than the wheel's CUDA, a CPU-only torch)
# would otherwise report every test skipped and look green. The check prints torch's CUDA, the driver and
# the GPUs, or one sentence saying what is missing.
"$PY" tests/gpu/cuda_check.py || exit 1
export DLOJZ_REQUIRE_GPU=1  # from here on, a test skipped for want of CUDA is a failure (tests/gpu/conftest.py)
status=0
"$PY" -m pytest -q -m "not slurm" tests/gpu || status=$?
# The table (stdout) is also kept in tests/gpu/last-bench.md, ready to paste into BENCHMARKS.md; progress goes
# to stderr. A run that prints no table (no GPU, bad option) leaves the previous file alone.
table=$(mktemp)
"$PY" tests/gpu/bench.py "$@" | tee "$table" || status=$?
[ -s "$table" ] && cat "$table" > tests/gpu/last-bench.md
rm -f "$table"
exit $status
