#!/usr/bin/env bash
# What only a GPU can prove, then the benchmark, in one command from any folder
# (tests/gpu/README.md):
#   bash tests/gpu/run.sh [--quick | --side-by-side] [--no-compile] [--results DIR] [bench options]
# --quick         the tests of tests/gpu/quick.txt in their order and bench.py's quick rows, each
#                 stage under a time budget (7 min 41 s in all on one H100, measured); what a
#                 budget cuts is listed as not run
# --side-by-side  instead of the tests and the benchmark: dlojz beside torchvision's reference
#                 train.py (tests/gpu/side_by_side.py, the reference copied into
#                 .ref/classification), side.md, at most 4 minutes
# --no-compile    the torch.compile tests and rows left out (no C compiler or Python headers)
# --results DIR   env.txt, log.txt (everything printed), junit.xml, summary.md (each test by name),
#                 bench.md: five files (the lent node returns eight at most); default
#                 runs/gpu-<date>-<time>
# PYTHON=/path/to/python picks the interpreter (default: python on PATH, else python3). Wheels in
# .whl/ (tests/gpu/wheels.sh fetches those the lent node lacks) are installed into a folder of their
# own, for this command only.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$(command -v python || command -v python3)}
quick=0 side=0 compile=1 results='' bench=()
while [ $# -gt 0 ]; do
    case $1 in
        --quick) quick=1; bench+=(--quick) ;;
        --side-by-side) side=1 ;;
        --no-compile) compile=0 ;;
        --results) results=${2:?--results needs a folder}; shift ;;
        *) bench+=("$1") ;;
    esac
    shift
done
# No GPU, no tests: a node where torch sees no GPU (a driver older than the wheel's CUDA, a CPU-only
# torch) would otherwise report every test skipped and look green. The check prints torch's CUDA,
# the driver, the GPUs, the C compiler and Python's headers (Triton compiles with both), or one
# sentence saying what is missing.
check=$("$PY" tests/gpu/cuda_check.py $([ $compile = 1 ] && echo --compile) 2>&1) ||
    { echo "$check" >&2; exit 1; }
results=${results:-runs/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$results" || exit 1

stages() {
    echo "$check"
    local packages='torch|torchvision|numpy|pillow|simplejpeg|timm|nvidia-ml-py|triton|pytest\S*'
    packages="^($packages|nvidia-nvimgcodec\S*|nvidia-dali\S*) "
    { echo "$check"; nvidia-smi; "$PY" -m pip list 2>/dev/null | grep -iE "$packages"; } \
        > "$results/env.txt" 2>&1
    wheels=(.whl/*.whl)
    if [ -e "${wheels[0]}" ]; then
        site=$(mktemp -d "${TMPDIR:-/tmp}/dlojz-wheels.XXXXXX")
        trap 'rm -rf "$site"' EXIT
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --target "$site" "${wheels[@]}"; then
            export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
            echo "Installed for this command from .whl/: ${wheels[*]##*/}"
        else  # the checks still run, with dlojz's fallbacks (--decode pil without simplejpeg)
            echo "run.sh: warning: the wheels in .whl/ did not install (above);" \
                 "bash tests/gpu/wheels.sh VERSION fetches them for this node's Python."
        fi
    fi
    # a test skipped for want of CUDA is a failure (tests/gpu/conftest.py)
    export DLOJZ_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
    local status=0 tests=(tests/gpu) deselect=() limit=() per_test=()
    if [ $side = 1 ]; then  # its run folders stay on this machine; the table and the log come back
        timeout -s INT -k 10 230 "$PY" tests/gpu/side_by_side.py \
            --out "${TMPDIR:-/tmp}/dlojz-side-runs" > "$results/side.md" || status=$?
        echo
        cat "$results/side.md"
        echo "Results in $results (exit $status)."
        return $status
    fi
    if [ $quick = 1 ]; then
        mapfile -t tests < <(grep -v '^#' tests/gpu/quick.txt | grep .)
        limit=(timeout -s INT -k 20 250)  # SIGINT: pytest stops there and still writes junit.xml
        bench=(--steps 30 --budget 150 "${bench[@]}")  # the user's options come after, and win
    fi
    if [ $compile = 0 ]; then
        mapfile -t deselect < <(
            env -u DLOJZ_REQUIRE_GPU "$PY" -m pytest -q --collect-only -m "not slurm" \
                "${tests[@]}" |
            grep -E '^tests/gpu/.*-compile\]$' | sed 's/^/--deselect=/')
        bench+=(--no-compile)
    fi
    # a hung test ends, the rest runs
    "$PY" -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout 240)
    "${limit[@]}" "$PY" -m pytest -q -m "not slurm" -rfEs --durations=15 -p no:randomly \
        "${per_test[@]}" --junitxml="$results/junit.xml" "${deselect[@]}" "${tests[@]}" || status=$?
    # The table (stdout) is also kept in tests/gpu/last-bench.md, ready to paste into BENCHMARKS.md;
    # progress goes to stderr. A run that prints no table (no GPU, bad option) leaves the previous
    # file alone.
    local bench_limit=()
    [ $quick = 1 ] && bench_limit=(timeout -s INT -k 20 210)
    # the run folders stay on this machine (runs/bench-<time>); a failed run's log tail goes to
    # log.txt
    "${bench_limit[@]}" "$PY" tests/gpu/bench.py "${bench[@]}" > "$results/bench.md" ||
        status=$?
    [ -s "$results/bench.md" ] && cp "$results/bench.md" tests/gpu/last-bench.md
    echo
    cat "$results/bench.md"
    echo
    "$PY" tests/gpu/results.py "$results/junit.xml" $([ $quick = 1 ] && echo tests/gpu/quick.txt) |
        tee "$results/summary.md"
    echo "Results in $results (exit $status)."
    return $status
}
stages 2>&1 | tee "$results/log.txt"
exit "${PIPESTATUS[0]}"
