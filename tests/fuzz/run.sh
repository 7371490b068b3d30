#!/usr/bin/env bash
# Builds every fuzz harness with libFuzzer + ASan/UBSan (clang) and runs each for a fixed time.
#
#   tests/fuzz/run.sh [--seconds N] [HARNESS...]     (default: 20 s each, every harness)
#   e.g. tests/fuzz/run.sh --seconds 600 store_server shm_ring
#
# One allocation over 256 MiB fails the run too (-malloc_limit_mb): no input of these sizes
# may make xccl allocate that much on a peer's word.
# Each run starts from the committed seeds (corpus/<h>/), the regressions (regress/<h>/) and what
# earlier runs on this machine found (build/fuzz/work/corpus/<h>/, where new inputs go); the
# repository's corpus is never written. A crash, leak, sanitizer report, failed FUZZ_CHECK or
# input slower than 30 s fails the harness: its input is saved under
# build/fuzz/work/artifacts/<h>/ and the log's tail is printed. To keep a found input as a
# regression: fix the bug, then copy the input to regress/<h>/ (replayed by tests/test_fuzz.py).
# Prints executions, executions per second, coverage (edges) and features per harness; exits
# non-zero if any harness failed.
set -euo pipefail

cd "$(dirname "$0")"
secs=20
harnesses=()
while [ $# -gt 0 ]; do
    case "$1" in
    --seconds)
        secs=$2
        shift 2
        ;;
    --seconds=*)
        secs=${1#--seconds=}
        shift
        ;;
    -h | --help)
        sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
    -*)
        echo "run.sh: unknown option $1" >&2
        exit 2
        ;;
    *)
        harnesses+=("${1#fuzz_}")
        shift
        ;;
    esac
done
if [ ${#harnesses[@]} -eq 0 ]; then
    for f in fuzz_*.c; do
        h=${f#fuzz_}
        harnesses+=("${h%.c}")
    done
fi
for h in "${harnesses[@]}"; do
    if [ ! -f "fuzz_$h.c" ]; then
        echo "run.sh: no harness fuzz_$h.c" >&2
        exit 2
    fi
done

if ! command -v clang >/dev/null || [ ! -f "$(clang -print-file-name=libclang_rt.fuzzer-x86_64.a)" ]; then
    echo "run.sh: clang with libFuzzer is needed: apt-get install -y clang libclang-rt-dev" >&2
    exit 2
fi
make -s -j"$(nproc)" H="${harnesses[*]/#/fuzz_}"

bin=../../build/fuzz
work=$bin/work
failed=0
printf '%-14s %6s %12s %9s %6s %7s  %s\n' harness seconds execs exec/s cov ft result
for h in "${harnesses[@]}"; do
    mkdir -p "$work/corpus/$h" "$work/artifacts/$h"
    dirs=("$work/corpus/$h")
    for d in "corpus/$h" "regress/$h"; do
        [ -d "$d" ] && dirs+=("$d")
    done
    log=$work/$h.log
    rc=0
    "$bin/fuzz_$h" -max_total_time="$secs" -timeout=30 -rss_limit_mb=2560 -malloc_limit_mb=256 -print_final_stats=1 \
        -artifact_prefix="$work/artifacts/$h/" "${dirs[@]}" >"$log" 2>&1 || rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    eps=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
    cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -n 1 || true)
    result=ok
    if [ "$rc" -ne 0 ]; then
        result="FAILED (exit $rc)"
        failed=1
    fi
    printf '%-14s %6s %12s %9s %6s %7s  %s\n' "$h" "$secs" "${execs:-?}" "${eps:-?}" \
        "$(echo "$cov" | awk '{print $2}')" "$(echo "$cov" | awk '{print $4}')" "$result"
    if [ "$rc" -ne 0 ]; then
        grep -E 'ERROR|runtime error|fuzz check failed|SUMMARY|Test unit written' "$log" | head -n 12 | sed 's/^/    /'
        echo "    full log: $log"
    fi
done
exit "$failed"
