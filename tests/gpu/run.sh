#!/usr/bin/env bash
# What only a GPU can prove, then the benchmark, in one command from any folder
# (tests/gpu/README.md):
#   bash tests/gpu/run.sh [--quick | --side-by-side] [--no-compile] [--results DIR] [--list FILE]
#                         [--test-budget S] [--tests-only] [bench options]
# --quick         the tests of tests/gpu/quick.txt in their order (160 s), then bench.py's quick
#                 table (rows start until 200 s); what a budget cuts is listed as not run
# --side-by-side  instead of the tests and the benchmark: dlojz beside torchvision's reference
#                 train.py (tests/gpu/side_by_side.py, the reference copied into
#                 .ref/classification), side.md, at most 190 s
# --no-compile    the torch.compile tests and rows left out (no C compiler or Python headers)
# --results DIR   env.txt, log.txt (everything printed), progress.txt (each test as it starts and
#                 ends), junit.xml, summary.md (each test by name), bench.md: six files (the lent
#                 node returns eight at most); default runs/gpu-<date>-<time>
# --list FILE     the tests to run, one pytest node id per line, in their order (a rerun of what
#                 failed); --quick's is tests/gpu/quick.txt
# --test-budget S no test starts after S seconds (pytest-timeout's --session-timeout: the stage
#                 ends between two tests); SIGINT 40 s later stops a test still running, which the
#                 record names (progress.txt), and SIGKILL 20 s after that
# --tests-only    no benchmark
# Exit code: 0 when every test that ran passed (or was skipped) and every benchmark row that ran
# completed, 1 otherwise; what a budget left out is listed, and is no failure.
# PYTHON=/path/to/python picks the interpreter (default: python on PATH, else python3). Wheels in
# .whl/ (tests/gpu/wheels.sh fetches those the lent node lacks) are installed into a folder of their
# own, for this command only.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$(command -v python || command -v python3)}
quick=0 side=0 compile=1 tests_only=0 results='' list='' test_budget='' bench=()
while [ $# -gt 0 ]; do
    case $1 in
        --quick) quick=1; bench+=(--quick) ;;
        --side-by-side) side=1 ;;
        --no-compile) compile=0 ;;
        --tests-only) tests_only=1 ;;
        --results) results=${2:?--results needs a folder}; shift ;;
        --list) list=${2:?--list needs a file of test ids}; shift ;;
        --test-budget) test_budget=${2:?--test-budget needs seconds}; shift ;;
        *) bench+=("$1") ;;
    esac
    shift
done
if [ -n "$test_budget" ] && ! [[ $test_budget =~ ^[0-9]+$ ]]; then
    echo "run.sh: --test-budget takes whole seconds (got $test_budget)." >&2
    exit 2
fi
if [ -n "$list" ] && ! [ -r "$list" ]; then
    echo "run.sh: --list $list is not a readable file of test ids." >&2
    exit 2
fi
# No GPU, no tests: a node where torch sees no GPU (a driver older than the wheel's CUDA, a CPU-only
# torch) would otherwise report every test skipped and look green. The check prints torch's CUDA,
# the driver, the GPUs, the C compiler and Python's headers (Triton compiles with both), or one
# sentence saying what is missing.
check=$("$PY" tests/gpu/cuda_check.py $([ $compile = 1 ] && echo --compile) 2>&1) ||
    { echo "$check" >&2; exit 1; }
results=${results:-runs/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$results" || exit 1
results=$(cd "$results" && pwd)

stages() {
    echo "$check"
    local packages='torch|torchvision|numpy|pillow|simplejpeg|timm|nvidia-ml-py|triton|pytest\S*'
    packages="^($packages|nvidia-nvimgcodec\S*|nvidia-nvjpeg\S*|nvidia-dali\S*) "
    wheels=(.whl/*.whl)
    if [ -e "${wheels[0]}" ]; then
        site=$(mktemp -d "${TMPDIR:-/tmp}/dlojz-wheels.XXXXXX")
        trap 'rm -rf "$site"' EXIT
        local install=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir)
        if "${install[@]}" --target "$site" "${wheels[@]}"; then
            export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
            echo "Installed for this command from .whl/: ${wheels[*]##*/}"
        else  # one at a time, each in a folder of its own (pip --target skips a folder that exists)
            echo "run.sh: warning: the wheels in .whl/ did not install together (above);" \
                 "one by one:"
            for wheel in "${wheels[@]}"; do
                local one
                one=$(mktemp -d "$site/one.XXXXXX")
                if "${install[@]}" --target "$one" "$wheel"; then
                    export PYTHONPATH="$one${PYTHONPATH:+:$PYTHONPATH}"
                    echo "Installed ${wheel##*/}"
                else  # the checks still run, with dlojz's fallbacks (torchvision's decoder, PIL)
                    echo "run.sh: warning: ${wheel##*/} did not install; bash tests/gpu/wheels.sh" \
                         "fetches the wheels for this node's Python and CUDA."
                fi
            done
        fi
    fi
    { echo "$check"; nvidia-smi; "$PY" -m pip list 2>/dev/null | grep -iE "$packages"; } \
        > "$results/env.txt" 2>&1
    # a test skipped for want of CUDA is a failure (tests/gpu/conftest.py)
    export DLOJZ_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
    if [ $side = 1 ]; then  # its run folders stay on this machine; the table and the log come back
        local status=0
        timeout --preserve-status -s INT -k 10 190 "$PY" tests/gpu/side_by_side.py \
            --out "${TMPDIR:-/tmp}/dlojz-side-runs" > "$results/side.md" || status=$?
        echo
        cat "$results/side.md"
        echo "Results in $results (exit $status)."
        return $((status != 0))
    fi
    local tests=(tests/gpu) deselect=() session=() per_test=() limit=()
    local tests_status=0 bench_status=0
    [ $quick = 1 ] && [ -z "$list" ] && list=tests/gpu/quick.txt
    [ $quick = 1 ] && [ -z "$test_budget" ] && test_budget=160
    if [ -n "$list" ]; then  # one id a line; comments, blank lines, CRs and edge spaces left out
        mapfile -t tests < <(tr -d '\r' < "$list" | sed 's/^[[:space:]]*//; s/[[:space:]]*$//' |
                             grep -v '^#' | grep .)
        if [ ${#tests[@]} -eq 0 ]; then
            echo "run.sh: --list $list names no test (one pytest node id a line)."
            return 2
        fi
    fi
    if [ $compile = 0 ]; then
        mapfile -t deselect < <(
            env -u DLOJZ_REQUIRE_GPU "$PY" -m pytest -q --collect-only -m "not slurm" \
                "${tests[@]}" |
            grep -E '^tests/gpu/.*-compile\]$' | sed 's/^/--deselect=/')
        bench+=(--no-compile)
    fi
    # a hung test ends, the rest runs; the session stops between tests once its budget is spent
    if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
        per_test=(--timeout 120)
        [ -n "$test_budget" ] && session=(--session-timeout "$test_budget")
    elif [ -n "$test_budget" ]; then
        echo "run.sh: warning: pytest-timeout is not installed (bash tests/gpu/wheels.sh" \
             "fetches it): the test budget ends with SIGINT into a running test, which the" \
             "record names as stopped."
    fi
    # the backstop: a test still running 40 s after the budget gets SIGINT (dlojz gives the
    # interrupt back to pytest, which writes junit.xml), SIGKILL 20 s later
    [ -n "$test_budget" ] && limit=(timeout --preserve-status -s INT -k 20 $((test_budget + 40)))
    rm -f "$results/progress.txt" "$results/junit.xml"  # a reused folder's record is not this run's
    DLOJZ_GPU_PROGRESS="$results/progress.txt" "${limit[@]}" "$PY" -m pytest -q -m "not slurm" \
        -rfEs --durations=15 -p no:randomly "${per_test[@]}" "${session[@]}" \
        --junitxml="$results/junit.xml" "${deselect[@]}" "${tests[@]}"
    echo
    "$PY" tests/gpu/results.py "$results/junit.xml" --progress "$results/progress.txt" \
        ${list:+--list "$list"} > "$results/summary.md" || tests_status=$?
    if [ $tests_only = 0 ]; then
        # The table (stdout) is also kept in tests/gpu/last-bench.md, ready to paste into
        # BENCHMARKS.md; progress goes to stderr. A run that prints no table (no GPU, bad option)
        # leaves the previous file alone. The run folders stay on this machine (runs/bench-<time>);
        # a failed run's log tail goes to log.txt.
        local bench_limit=()
        if [ $quick = 1 ]; then
            bench=(--steps 40 --budget 200 "${bench[@]}")  # the user's options come after, and win
            # its exit code, not timeout's 124: interrupted, bench.py names the row it stopped and
            # fails only for rows that failed
            bench_limit=(timeout --preserve-status -s INT -k 20 260)
        fi
        "${bench_limit[@]}" "$PY" tests/gpu/bench.py "${bench[@]}" > "$results/bench.md" ||
            bench_status=$?
        if [ "$bench_status" -gt 128 ]; then
            echo "run.sh: bench.py was killed (signal $((bench_status - 128))) after its time" \
                 "limit; bench.md holds what it printed before."
            bench_status=1
        fi
        [ -s "$results/bench.md" ] && cp "$results/bench.md" tests/gpu/last-bench.md
        echo
        cat "$results/bench.md"
    fi
    echo
    cat "$results/summary.md"
    echo "Results in $results (tests: exit $tests_status, benchmark: exit $bench_status)."
    return $(( tests_status != 0 || bench_status != 0 ))
}
stages 2>&1 | tee "$results/log.txt"
exit "${PIPESTATUS[0]}"
