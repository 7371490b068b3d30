#!/usr/bin/env bash
# Everything of xccl that needs a GPU, in one command, on a machine with a GPU and no network:
#
#   tests/gpu/run.sh               # build in place, GPU tests, kernel check, GPU benchmark
#   tests/gpu/run.sh --quick       # the benchmark's quick mode (fewer sizes, shorter loops)
#   tests/gpu/run.sh --dry-run     # print the phases and their commands, run nothing
#
# Phases, each with a timeout taken from a total budget (XCCL_GPU_BUDGET_S, default 345 s, so
# that the whole run ends within 6 minutes); a phase that fails or times out is recorded and
# the next one still runs, so that one run yields all the evidence:
#   machine       facts: GPU, driver, nvcc, gcc, Python, torch, CuPy, cores, git commit
#   build         python3 setup.py build_ext --inplace --parallel 16 (XCCL_CUDA_ARCHS set to
#                 this GPU's architecture when setup.py knows the variable: a faster build)
#   cuda_info     xccl.cuda.is_available() and build_info() of the build
#   gpu_tests     python3 -m pytest -m gpu tests/gpu: xccl's API (2, 3 and 4 ranks sharing GPU 0)
#   torch_tests   tests/gpu/test_gpu_torch.py: torch.distributed on the "xcclc" backend, DDP and
#                 FSDP2 against gloo (2 ranks)
#   kernel_check  the GPU kernels against the CPU ones (make -C tests/c kernel_check, when
#                 tests/gpu/kernel_check.c is in the tree)
#   ddp           benchmarks/ddp_gpu.py: DDP and FSDP2 steps/s, xcclc against gloo (2 ranks)
#   compare       benchmarks/compare_gpu.py --np 2,4 with a deadline (the rest of the budget)
#   torch_suite   only when at least 60 s of the budget are left after compare (--quick, or a
#                 larger XCCL_GPU_BUDGET_S): torch's own distributed tests on CUDA tensors,
#                 xcclc against gloo (tests/torch_suite/run_suite.py --device cuda --gates gloo,
#                 world size = GPUs, so 1 on one GPU; the tests torch would skip for want of
#                 GPUs are set aside with their reasons; no test starts in its last 40 s;
#                 skipped without the expecttest module, which torch's test files import:
#                 install its wheel first, e.g. pip install --no-index --target /tmp/site)
# It needs no network (no pip). Everything is written under $OUT (default ./gpu-out): one log
# per phase, machine.txt, gpu_tests.xml, compare/gpu.md and gpu.json (the benchmark report
# with the issue's targets), torch_suite.json and summary.txt, which is also printed at the end.
#
# Exit status: 0 every phase passed; 1 a phase failed or timed out; 2 bad usage; 3 no GPU
# here (nothing was run). Environment: OUT, PYTHON (default python3), XCCL_GPU_BUDGET_S,
# XCCL_CUDA_ARCHS (default: this GPU's compute capability, e.g. 90).

set -u -o pipefail

usage() { sed -n '2,35p' "$0" | sed 's/^# \{0,1\}//'; }

QUICK=0
DRY=0
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        --dry-run) DRY=1 ;;
        -h | --help)
            usage
            exit 0
            ;;
        *)
            echo "tests/gpu/run.sh: unknown argument '$arg' (--quick, --dry-run, --help)" >&2
            exit 2
            ;;
    esac
done

cd "$(dirname "$0")/../.." || exit 2
ROOT=$(pwd)
PY=${PYTHON:-python3}
BUDGET=${XCCL_GPU_BUDGET_S:-345}
case "$BUDGET" in
    '' | *[!0-9]*)
        echo "tests/gpu/run.sh: XCCL_GPU_BUDGET_S must be a number of seconds, not '$BUDGET'" >&2
        exit 2
        ;;
esac
START=$(date +%s)
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

say() { echo "run.sh [$(($(date +%s) - START))s] $*"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }

# The GPU: nvidia-smi lists one, or torch sees one.
have_gpu() {
    if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi -L 2> /dev/null | grep -q '^GPU '; then
        return 0
    fi
    "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)' \
        > /dev/null 2>&1
}

if [ "$DRY" = 0 ] && ! have_gpu; then
    echo "tests/gpu/run.sh: no CUDA GPU on this machine (nvidia-smi lists none and torch sees" \
        "none): nothing was run" >&2
    exit 3
fi

OUT=${OUT:-$ROOT/gpu-out}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.txt

PHASES=()  # one line per phase: name, outcome, seconds, log
FAILED=0

# phase NAME CAP RESERVE COMMAND...: runs COMMAND with a timeout of CAP seconds, less if the
# budget left minus RESERVE (what the later phases need at least) is smaller, never under
# 10 s. Its output goes to $OUT/NAME.log; the outcome is recorded; the script goes on.
phase() {
    local name=$1 cap=$2 reserve=$3
    shift 3
    local t=$(($(left) - reserve))
    if [ "$t" -gt "$cap" ]; then t=$cap; fi
    if [ "$t" -lt 10 ]; then t=10; fi
    local log=$OUT/$name.log
    say "$name (timeout ${t}s): $*"
    if [ "$DRY" = 1 ]; then
        PHASES+=("$(printf '%-13s %-26s %5s  %s' "$name" "dry run" "-" "$*")")
        return 0
    fi
    local t0 rc
    t0=$(date +%s)
    echo "\$ $*" > "$log"
    timeout -k 15 "$t" "$@" < /dev/null >> "$log" 2>&1
    rc=$?
    local dt=$(($(date +%s) - t0)) status
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMED OUT after ${t}s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    if [ "$rc" != 0 ]; then
        FAILED=1
        echo "---- last lines of $log" >&2
        tail -n 25 "$log" >&2
        echo "----" >&2
    fi
    say "$name: $status (${dt}s)"
    PHASES+=("$(printf '%-13s %-26s %4ss  %s' "$name" "$status" "$dt" "$log")")
    return "$rc"
}

skip() {  # skip NAME WHY
    say "$1: skipped: $2"
    PHASES+=("$(printf '%-13s %-26s %5s  %s' "$1" "skipped" "-" "$2")")
}

# ---- machine facts --------------------------------------------------------------------------
machine_facts() {
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "host: $(uname -n); kernel $(uname -r); cores: $(nproc)"
    echo "git: $(git rev-parse HEAD 2> /dev/null || echo '?') $(git status --short 2> /dev/null | wc -l) changed files"
    echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1)"
    "$PY" -c 'import torch; print("torch:", torch.__version__, "cuda", torch.version.cuda)' 2>&1
    "$PY" -c 'import cupy; print("cupy:", cupy.__version__)' 2>&1 | tail -n 1
    local nvcc
    nvcc=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
    echo "nvcc: $("$nvcc" --version 2>&1 | tail -n 2 | head -n 1) ($nvcc)"
    echo "gcc: $(gcc --version 2>&1 | head -n 1)"
    if command -v nvidia-smi > /dev/null 2>&1; then
        nvidia-smi --query-gpu=index,name,driver_version,memory.total,compute_cap --format=csv 2>&1
        nvidia-smi 2>&1
    else
        echo "nvidia-smi: not found"
    fi
}
if [ "$DRY" = 0 ]; then
    machine_facts > "$OUT/machine.txt" 2>&1
fi

# ---- build ----------------------------------------------------------------------------------
ARCHS=${XCCL_CUDA_ARCHS:-}
if [ -z "$ARCHS" ] && [ "$DRY" = 0 ] && command -v nvidia-smi > /dev/null 2>&1; then
    ARCHS=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader -i 0 2> /dev/null | tr -d ' .\r')
    case "$ARCHS" in *[!0-9]* | '') ARCHS= ;; esac
fi
BUILD_ENV=()
if grep -q XCCL_CUDA_ARCHS setup.py; then
    BUILD_ENV=("XCCL_CUDA_ARCHS=${ARCHS:-90}")
fi
phase build 150 190 env ${BUILD_ENV[@]+"${BUILD_ENV[@]}"} "$PY" setup.py build_ext --inplace --parallel 16

phase cuda_info 30 170 "$PY" -c 'import json, xccl, xccl.cuda as c; print("xccl", xccl.__version__, xccl.__file__); print("is_available:", c.is_available()); print(json.dumps(c.build_info(), indent=1, default=str))'

# ---- GPU tests ------------------------------------------------------------------------------
if compgen -G "tests/gpu/test_*.py" > /dev/null; then
    phase gpu_tests 110 180 "$PY" -m pytest -m gpu tests/gpu --ignore=tests/gpu/test_gpu_torch.py \
        -v -rfEs --durations=15 -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml"
    if [ -f tests/gpu/test_gpu_torch.py ]; then
        phase torch_tests 110 110 "$PY" -m pytest -m gpu tests/gpu/test_gpu_torch.py -v -rfEs \
            --durations=10 -p no:cacheprovider --junitxml="$OUT/torch_tests.xml"
    fi
else
    skip gpu_tests "no tests/gpu/test_*.py in this tree"
fi

# ---- kernel check ---------------------------------------------------------------------------
if [ -f tests/gpu/kernel_check.c ] && grep -q '^kernel_check:' tests/c/Makefile 2> /dev/null; then
    phase kernel_check 60 90 env ${BUILD_ENV[@]+"${BUILD_ENV[@]}"} make -C tests/c -j 16 kernel_check
elif [ -f tests/gpu/kernel_check.py ]; then
    phase kernel_check 60 90 "$PY" tests/gpu/kernel_check.py
else
    skip kernel_check "no kernel checker (tests/gpu/kernel_check.c with a tests/c target, or .py)"
fi

# ---- training timing ------------------------------------------------------------------------
if [ -f benchmarks/ddp_gpu.py ]; then
    phase ddp 60 45 "$PY" benchmarks/ddp_gpu.py --steps 5 --timeout 25 --out "$OUT/ddp"
else
    skip ddp "no benchmarks/ddp_gpu.py in this tree"
fi

# ---- benchmark ------------------------------------------------------------------------------
# Its own deadline ends it first, with a report; ending the run in progress may take up to
# 15 s more (SIGTERM, SIGKILL after 5 s); the timeout, 25 s after the deadline, is a backstop.
DEADLINE=$(($(left) - 30))
if [ "$DEADLINE" -lt 45 ]; then DEADLINE=45; fi
COMPARE=("$PY" benchmarks/compare_gpu.py --np 2,4 --out "$OUT/compare" --deadline "$DEADLINE")
if [ "$QUICK" = 1 ]; then COMPARE+=(--quick); fi
phase compare $((DEADLINE + 25)) 0 "${COMPARE[@]}"

# ---- torch's own suite on CUDA tensors, with the time left ------------------------------------
# After every other phase and only with SUITE_MIN_S of the budget left. The suite's --budget
# (40 s less than the phase's timeout) stops it starting tests in time for the last one
# (--timeout 30) and its report; the tests it did not reach are reported "not run".
SUITE_MIN_S=60
SUITE_LEFT=$(left)
NGPU=1
if [ "$DRY" = 0 ] && command -v nvidia-smi > /dev/null 2>&1; then
    NGPU=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU ')
    if [ "$NGPU" -lt 1 ]; then NGPU=1; fi
fi
if [ ! -f tests/torch_suite/run_suite.py ]; then
    skip torch_suite "no tests/torch_suite/run_suite.py in this tree"
elif [ "$SUITE_LEFT" -lt "$SUITE_MIN_S" ]; then
    skip torch_suite "${SUITE_LEFT}s of the budget left, it needs ${SUITE_MIN_S}s"
elif [ "$DRY" = 0 ] && ! "$PY" -c 'import expecttest' > /dev/null 2>&1; then
    # torch's test files import it; the GPU image lacks it: carry its wheel (no network there)
    skip torch_suite "no expecttest module (torch's test files need it): install its wheel first"
else
    phase torch_suite "$SUITE_LEFT" 0 "$PY" tests/torch_suite/run_suite.py --device cuda \
        --gpus "$NGPU" --gates gloo --timeout 30 --budget $((SUITE_LEFT - 40)) \
        --json "$OUT/torch_suite.json"
fi

# ---- summary --------------------------------------------------------------------------------
{
    echo "tests/gpu/run.sh: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(($(date +%s) - START)) s," \
        "budget ${BUDGET} s, output in $OUT"
    if [ -f "$OUT/machine.txt" ]; then
        grep -E '^(host|git|python|torch|cupy|nvcc|gcc):' "$OUT/machine.txt"
        grep -A 1 '^index, name' "$OUT/machine.txt" | tail -n 1 | sed 's/^/gpu: /'
    fi
    echo
    for line in "${PHASES[@]}"; do echo "$line"; done
    if [ -f "$OUT/cuda_info.log" ]; then
        grep -m 1 '^is_available:' "$OUT/cuda_info.log" | sed 's/^/xccl.cuda./'
    fi
    for t in gpu_tests torch_tests; do
        if [ -f "$OUT/$t.log" ]; then
            echo
            echo "$t: $(grep -E '^=+ .*(passed|failed|error|skipped|no tests ran).* =+$' \
                "$OUT/$t.log" | tail -n 1)"
            grep -E '^(FAILED|ERROR) ' "$OUT/$t.log" | head -n 20
        fi
    done
    if [ -f "$OUT/kernel_check.log" ]; then
        echo
        echo "kernel check: $(grep -v '^\$ ' "$OUT/kernel_check.log" | grep -v '^make' | tail -n 1)"
    fi
    if [ -f "$OUT/ddp/ddp_gpu.md" ]; then
        echo
        cat "$OUT/ddp/ddp_gpu.md"
    fi
    if [ -f "$OUT/compare.log" ]; then
        echo
        grep -E '^# (target|report|xccl|gloo)' "$OUT/compare.log"
    fi
    if [ -f "$OUT/torch_suite.log" ]; then
        echo
        echo "torch_suite (torch's distributed tests on CUDA tensors, $OUT/torch_suite.json):"
        grep -E '^(backend |xcclc |gloo |passed on |set aside before|not run \()' \
            "$OUT/torch_suite.log"
    fi
    if [ "$DRY" = 0 ] && command -v nvidia-smi > /dev/null 2>&1; then
        echo
        echo "processes left on the GPU:"
        apps=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1)
        echo "${apps:-none}" | sed 's/^/  /'
    fi
} > "$SUMMARY"
echo
cat "$SUMMARY"
if [ "$DRY" = 1 ]; then
    exit 0
fi
exit "$FAILED"
