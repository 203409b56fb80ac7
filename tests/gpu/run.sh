#!/usr/bin/env bash
# What only a GPU can prove, then the benchmark, in one command from any folder
# (tests/gpu/README.md):
#   bash tests/gpu/run.sh [--quick | --side-by-side] [--seconds S] [--no-compile] [--results DIR]
#                         [--list FILE] [--test-budget S] [--tests-only] [--plan] [bench options]
# --quick         the tests of tests/gpu/quick.txt in their order, then bench.py's quick table,
#                 in 540 s unless --seconds says otherwise; what a budget cuts is listed as not run
# --side-by-side  instead of the tests and the benchmark: dlojz beside torchvision's reference
#                 train.py (tests/gpu/side_by_side.py, the reference copied into
#                 .ref/classification), side.md, in 225 s unless --seconds says otherwise
# --seconds S     what this call may take, every stage together (the lent node: the device time
#                 left, less 15 s); each stage's limit follows from it (the plan below)
# --plan          print that plan (JSON: the stages' seconds, the list's planned seconds) and stop
# --no-compile    the torch.compile tests and rows left out (no C compiler or Python headers)
# --results DIR   env.txt, log.txt (everything printed), progress.txt (each test as it starts and
#                 ends), junit.xml, summary.md (each test by name), bench.md: six files (the lent
#                 node returns eight at most); default runs/gpu-<date>-<time>
# --list FILE     the tests to run, in their order: a pytest node id a line, then optionally its
#                 planned seconds and 'measured' or 'estimated' (results.entries); --quick's is
#                 tests/gpu/quick.txt
# --test-budget S no test starts after S seconds (pytest-timeout's --session-timeout: the stage
#                 ends between two tests; default: from --seconds); SIGINT 40 s later stops a test
#                 still running, which the record names (progress.txt), and SIGKILL 20 s after that
# --tests-only    no benchmark
# Exit code: 0 when every test that ran passed (or was skipped) and every benchmark row that ran
# completed, 1 otherwise, 2 for options that cannot work; what a budget left out is listed, and is
# no failure.
# PYTHON=/path/to/python picks the interpreter (default: python on PATH, else python3). Wheels in
# .whl/ (tests/gpu/wheels.sh fetches those the lent node lacks) are installed into a folder of their
# own, for this command only.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-$(command -v python || command -v python3)}

# The plan's seconds beside the stages' own limits. The first GPU run (BENCHMARKS.md, 2026-11-26)
# took 15 s from its start to its first test with one wheel; the 28 MB of wheels nvImageCodec
# brings, and its import, add about 10 (estimated).
START_S=25    # the CUDA check, the wheels, env.txt, pytest's imports and collection
CLOSE_S=10    # results.py, the tables printed, the results folder sent back
INT_S=40      # a test still running this long after the test budget gets SIGINT,
KILL_S=20     # and SIGKILL this long after that
JPEG_S=20     # the bench's synthetic JPEGs, made before its clock: 2,720 at 46 ms each on one
              # core here (F5 of issue 56's review), ~10 s on 16 cores with the links (estimated)
# the quick bench's first three rows (issue 56's review, Part 2, estimated): fake data eager
# (15-25 s), CUDA graphs' cold compile (70-110), nvImageCodec's loader alone and training (40-60)
BENCH_S=190
ROW_S=60      # no benchmark row starts later than this before the bench's limit (a JPEG row)
# From this many seconds left the bench runs 60 steps (its loader-alone rows time 28 batches after
# 16 workers' 32 of warm-up), below 40 (8 timed). A row's time is mostly its start and compile:
# fewer steps save seconds, the budgets cut rows.
LONG_S=200
# side_by_side.py runs 100 steps from this many seconds (the review's estimate for its three runs:
# 130 to 205 s), below 60 (the reference's PIL loader reads ~2,500 img/s: ~5 s less a run)
SIDE_LONG_S=190
MIN_TESTS_S=30    # a shorter test budget is refused: no call is worth a start for less
SIDE_DEFAULT_S=225  # --side-by-side without --seconds: its 190 s limit, the check and the close
QUICK_DEFAULT_S=540  # --quick without --seconds: the lent node's first call (at most ~9 min)

quick=0 side=0 compile=1 tests_only=0 plan_only=0 results='' list='' test_budget='' seconds=''
bench=()
while [ $# -gt 0 ]; do
    case $1 in
        --quick) quick=1; bench+=(--quick) ;;
        --side-by-side) side=1 ;;
        --no-compile) compile=0 ;;
        --tests-only) tests_only=1 ;;
        --plan) plan_only=1 ;;
        --results) results=${2:?--results needs a folder}; shift ;;
        --list) list=${2:?--list needs a file of test ids}; shift ;;
        --test-budget) test_budget=${2:?--test-budget needs seconds}; shift ;;
        --seconds) seconds=${2:?--seconds needs the seconds this call may take}; shift ;;
        *) bench+=("$1") ;;
    esac
    shift
done
for value in "$test_budget" "$seconds"; do
    if [ -n "$value" ] && ! [[ $value =~ ^[0-9]+$ ]]; then
        echo "run.sh: --test-budget and --seconds take whole seconds (got $value)." >&2
        exit 2
    fi
done
if [ -n "$list" ] && ! [ -r "$list" ]; then
    echo "run.sh: --list $list is not a readable file of test ids." >&2
    exit 2
fi
[ $quick = 1 ] && [ $side = 0 ] && [ -z "$list" ] && list=tests/gpu/quick.txt
[ -z "$seconds" ] && [ $side = 1 ] && seconds=$SIDE_DEFAULT_S
[ -z "$seconds" ] && [ $quick = 1 ] && seconds=$QUICK_DEFAULT_S

# a list's lines: comments, blank lines and CRs left out -> its node ids; its planned seconds
list_ids() { tr -d '\r' < "$1" | awk '$1 !~ /^#/ && NF { print $1 }'; }
list_plan() {  # -> "seconds (rounded up) tests lines-without-seconds"
    tr -d '\r' < "$1" | awk '$1 !~ /^#/ && NF { n++; s += $2; if ($2 !~ /^[0-9.]+$/) u++ }
        END { printf "%d %d %d\n", int(s) + (s > int(s)), n, u }'
}

# The plan: the stages' limits from --seconds. With the benchmark, the tests get what its first
# rows and its JPEG set leave, and the bench then takes whatever the tests left; tests alone keep
# their backstops inside the call.
side_s='' planned=0 listed=0 unplanned=0
[ -n "$list" ] && read -r planned listed unplanned < <(list_plan "$list")
if [ -n "$seconds" ] && [ $side = 1 ]; then
    side_s=$((seconds - START_S - CLOSE_S))
    if [ $side_s -lt 60 ]; then
        echo "run.sh: --seconds $seconds leaves $side_s s for the side by side, less than one" \
             "run's start and compile; give at least $((60 + START_S + CLOSE_S)) s." >&2
        exit 2
    fi
elif [ -n "$seconds" ] && [ -z "$test_budget" ]; then
    if [ $tests_only = 1 ]; then
        test_budget=$((seconds - START_S - INT_S - KILL_S - CLOSE_S))
        need=$((MIN_TESTS_S + START_S + INT_S + KILL_S + CLOSE_S))
    else
        test_budget=$((seconds - START_S - JPEG_S - BENCH_S - CLOSE_S))
        need=$((MIN_TESTS_S + START_S + JPEG_S + BENCH_S + CLOSE_S))
    fi
    if [ $test_budget -lt $MIN_TESTS_S ]; then
        echo "run.sh: --seconds $seconds leaves $test_budget s for the tests once the other" \
             "stages have theirs; give at least $need s$([ $tests_only = 0 ] &&
             echo ', or --tests-only')." >&2
        exit 2
    fi
fi
if [ $plan_only = 1 ]; then
    bench_s=null
    [ $tests_only = 0 ] && [ $side = 0 ] && [ -n "$seconds" ] && bench_s=$BENCH_S
    echo "{\"seconds\": ${seconds:-null}, \"test_budget_s\": ${test_budget:-null}," \
         "\"sigint_after_s\": $INT_S, \"sigkill_after_s\": $KILL_S, \"bench_s\": $bench_s," \
         "\"side_s\": ${side_s:-null}, \"list\": \"$list\", \"list_planned_s\": $planned," \
         "\"list_tests\": $listed, \"list_unplanned\": $unplanned}"
    exit 0
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

say_plan() {
    [ -z "$seconds" ] && return
    if [ $side = 1 ]; then
        echo "run.sh: $seconds s for this call: the side by side until $side_s s," \
             "$CLOSE_S to close."
        return
    fi
    local of=''
    [ -n "$list" ] && of=" ($list plans $planned s for $listed tests$([ "$unplanned" -gt 0 ] &&
        echo ", $unplanned of them without seconds"))"
    local then="then the bench's JPEG set (at most $JPEG_S s) and the benchmark with the time left"
    [ $tests_only = 1 ] && then='no benchmark'
    echo "run.sh: $seconds s for this call: tests until $test_budget s on pytest's clock$of," \
         "SIGINT $INT_S s later, SIGKILL $KILL_S after; $then; $CLOSE_S s to close."
    if [ "$planned" -gt "$test_budget" ]; then
        echo "run.sh: warning: $list plans $planned s, more than the $test_budget s of tests:" \
             "its last tests will be listed as not run."
    fi
}

# The benchmark with the time the call has left (all of it without --seconds): its JPEG set first,
# under a limit of its own, then the rows, none starting in its last ROW_S seconds.
benchmark() {
    local steps=() limit=() budget=() making=() left
    if [ -n "$seconds" ]; then
        left=$((seconds - CLOSE_S - SECONDS))
        if [ $left -lt $((ROW_S + 10)) ]; then
            echo "run.sh: $left s left: no benchmark (a row takes about $ROW_S s)." |
                tee "$results/bench.md"
            return 0
        fi
        steps=(--steps $([ $((left - JPEG_S)) -ge $LONG_S ] && echo 60 || echo 40))
        making=(timeout -s INT -k 5 $JPEG_S)
    fi
    # the user's options come after, and win
    "${making[@]}" "$PY" tests/gpu/bench.py "${steps[@]}" "${bench[@]}" --make-data ||
        echo "run.sh: warning: the bench's JPEG set was not made (above); its first JPEG row" \
             "makes it, inside its clock."
    if [ -n "$seconds" ]; then
        left=$((seconds - CLOSE_S - SECONDS))
        budget=(--budget $((left - 10 - ROW_S)))
        # its exit code, not timeout's 124: interrupted, bench.py names the row it stopped and
        # fails only for rows that failed
        limit=(timeout --preserve-status -s INT -k 10 $((left - 10)))
        echo "run.sh: the benchmark has $left s: ${steps[*]}, no row after $((left - 10 - ROW_S))" \
             "s, SIGINT at $((left - 10)) s."
    fi
    # The table (stdout) is also kept in tests/gpu/last-bench.md, ready to paste into
    # BENCHMARKS.md; progress goes to stderr. A run that prints no table (no GPU, bad option)
    # leaves the previous file alone. The run folders stay on this machine (runs/bench-<time>);
    # a failed run's log tail goes to log.txt.
    local status=0
    "${limit[@]}" "$PY" tests/gpu/bench.py "${steps[@]}" "${budget[@]}" "${bench[@]}" \
        > "$results/bench.md" || status=$?
    if [ "$status" -gt 128 ]; then
        echo "run.sh: bench.py was killed (signal $((status - 128))) after its time limit;" \
             "bench.md holds what it printed before."
        status=1
    fi
    [ -s "$results/bench.md" ] && cp "$results/bench.md" tests/gpu/last-bench.md
    echo
    cat "$results/bench.md"
    return $status
}

stages() {
    echo "$check"
    say_plan
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
        local status=0 left=$((seconds - CLOSE_S - SECONDS - 10))
        timeout --preserve-status -s INT -k 10 $left "$PY" tests/gpu/side_by_side.py \
            --steps $([ $left -ge $SIDE_LONG_S ] && echo 100 || echo 60) \
            --out "${TMPDIR:-/tmp}/dlojz-side-runs" > "$results/side.md" || status=$?
        echo
        cat "$results/side.md"
        echo "Results in $results (exit $status)."
        return $((status != 0))
    fi
    local tests=(tests/gpu) deselect=() session=() per_test=() limit=()
    local tests_status=0 bench_status=0
    if [ -n "$list" ]; then
        mapfile -t tests < <(list_ids "$list")
        if [ ${#tests[@]} -eq 0 ]; then
            echo "run.sh: --list $list names no test (one pytest node id a line)."
            return 2
        fi
        export DLOJZ_GPU_LIST=$list  # tests/gpu/conftest.py: a test's limit from its seconds
    fi
    if [ $compile = 0 ]; then
        mapfile -t deselect < <(
            env -u DLOJZ_REQUIRE_GPU "$PY" -m pytest -q --collect-only -m "not slurm" \
                "${tests[@]}" |
            grep -E '^tests/gpu/.*(-compile\]|::test_cuda_graphs_keep_the_gpu_busy)$' |
            sed 's/^/--deselect=/')
        bench+=(--no-compile)
    fi
    # a hung test ends, the rest runs; the session stops between tests once its budget is spent
    if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
        per_test=(--timeout 120)  # results.timeout_for's default; a list's slow tests get more
        [ -n "$test_budget" ] && session=(--session-timeout "$test_budget")
    elif [ -n "$test_budget" ]; then
        echo "run.sh: warning: pytest-timeout is not installed (bash tests/gpu/wheels.sh" \
             "fetches it): the test budget ends with SIGINT into a running test, which the" \
             "record names as stopped."
    fi
    # the backstop: a test still running INT_S after the budget gets SIGINT (dlojz gives the
    # interrupt back to pytest, which writes junit.xml), SIGKILL KILL_S later
    [ -n "$test_budget" ] &&
        limit=(timeout --preserve-status -s INT -k $KILL_S $((test_budget + INT_S)))
    rm -f "$results/progress.txt" "$results/junit.xml"  # a reused folder's record is not this run's
    DLOJZ_GPU_PROGRESS="$results/progress.txt" "${limit[@]}" "$PY" -m pytest -q -m "not slurm" \
        -rfEs --durations=15 -p no:randomly "${per_test[@]}" "${session[@]}" \
        --junitxml="$results/junit.xml" "${deselect[@]}" "${tests[@]}"
    echo
    "$PY" tests/gpu/results.py "$results/junit.xml" --progress "$results/progress.txt" \
        ${list:+--list "$list"} > "$results/summary.md" || tests_status=$?
    if [ $tests_only = 0 ]; then
        benchmark || bench_status=$?
    fi
    echo
    cat "$results/summary.md"
    echo "Results in $results (tests: exit $tests_status, benchmark: exit $bench_status)."
    return $(( tests_status != 0 || bench_status != 0 ))
}
stages 2>&1 | tee "$results/log.txt"
exit "${PIPESTATUS[0]}"
