#!/usr/bin/env bash
# Runs part of the Python suite against xccl._C built with AddressSanitizer and
# UndefinedBehaviorSanitizer (XCCL_SANITIZE=address), LeakSanitizer on.
#
#   tests/san/run-python.sh                 the subset CI runs (SAN_TESTS below)
#   tests/san/run-python.sh tests/test_x.py -k y    any pytest arguments instead
#
# How the pieces fit:
# - the module is built into build/san-py/ (never over python/xccl/_C*.so) and put with a copy
#   of python/xccl/ in build/san-py/pkg, first on PYTHONPATH;
# - every process runs with the ASan runtime preloaded (LD_PRELOAD; a sanitized module cannot
#   load otherwise) and PYTHONMALLOC=malloc (LeakSanitizer does not scan pymalloc's arenas, so
#   memory held only by small Python objects would look leaked). The real interpreter is run,
#   not a pyenv shim (a bash script, which would be run under ASan too);
# - the rank processes of tests/harness.py fork from its fork server, which this environment
#   starts, so they have the runtime and the options too; they end with os._exit, which skips
#   LeakSanitizer at exit, so the harness runs the check in each rank (XCCL_TEST_LSAN=1) at
#   its start and its end, and a leak new since the start fails the test. An ASan or UBSan error kills the rank (halt_on_error, and the module
#   is built with -fno-sanitize-recover=undefined), which fails the test too;
# - tests/san/sitecustomize.py runs the other processes' leak check at exit while the
#   interpreter is still whole, and loads numpy and torch with LeakSanitizer off;
# - every report of every process goes to a file under $SAN_LOG_DIR: any file there after the
#   run fails it, also one from a process whose exit status no test looks at.
# - tests/san/lsan.supp: the leak suppressions (frames outside xccl only).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD

# A subset that fits CI (~3 min on 2 cores): collectives over both transports, point-to-point
# and objects, subgroups, failures (a killed peer, a mismatch), shared memory
# (a killed rank, destroy and re-init), the DLPack/buffer layer in-process, re-initialisation,
# the torch backend, and this directory's self-checks. Any pytest arguments replace it.
SAN_TESTS=(
    "tests/test_api_collectives.py::test_collectives_full[2]"
    tests/test_api_collectives.py::test_collectives_backends
    tests/test_api_collectives.py::test_grad_and_futures
    "tests/test_api_p2p_objects.py::test_p2p[2]"
    "tests/test_api_p2p_objects.py::test_object_collectives[3-4]"
    "tests/test_api_groups.py::test_new_group_and_friends[4]"
    tests/test_failures.py::test_killed_peer_is_named
    tests/test_failures.py::test_mismatch_named_on_every_rank
    tests/test_shm.py::test_killed_rank_mid_cma_all_reduce
    tests/test_shm.py::test_destroy_and_reinit_leave_nothing
    tests/test_dlpack.py
    tests/test_cuda_fake.py
    tests/test_reinit.py
    "tests/test_torch_backend.py::test_collectives[2]"
    tests/test_torch_backend.py::test_p2p
    tests/test_torch_backend.py::test_futures_complete_on_their_own
    tests/san/test_san_selfcheck.py
)

PY=$("${PYTHON:-python}" -c 'import sys; print(sys.executable)')  # the binary, not a shim
ASAN_RT=$(gcc -print-file-name=libasan.so)
if [ ! -e "$ASAN_RT" ]; then
    echo "run-python.sh: gcc has no libasan.so ($ASAN_RT)" >&2
    exit 2
fi

echo "=== building xccl._C with XCCL_SANITIZE=address into build/san-py"
mkdir -p build/san-py
XCCL_SANITIZE=address "$PY" setup.py -q build_ext --build-lib build/san-py/lib \
    --build-temp build/san-py/tmp >build/san-py/build.log 2>&1 || {
    cat build/san-py/build.log
    exit 1
}
PKG=build/san-py/pkg
rm -rf "$PKG"
mkdir -p "$PKG"
cp -r python/xccl "$PKG/"
find "$PKG" -name __pycache__ -prune -exec rm -rf {} +
rm -f "$PKG"/xccl/_C*.so
cp build/san-py/lib/xccl/_C*.so "$PKG/xccl/"

SAN_LOG_DIR=${SAN_LOG_DIR:-$ROOT/build/san-py/reports}
rm -rf "$SAN_LOG_DIR"
mkdir -p "$SAN_LOG_DIR"

# libstdc++ right after the ASan runtime: its __cxa_throw interceptor needs the real one
# loaded at startup, or torch's first C++ exception stops the process (CHECK failed:
# real___cxa_throw != 0).
STDCXX=$(gcc -print-file-name=libstdc++.so.6)
export LD_PRELOAD="$ASAN_RT $STDCXX"
export PYTHONMALLOC=malloc
export PYTHONPATH=$ROOT/tests/san:$ROOT/$PKG
export XCCL_TEST_LSAN=1
export XCCL_REINIT_ROUNDS=${XCCL_REINIT_ROUNDS:-20}  # tests/test_reinit.py: 200 without ASan
# leak_check_at_exit=0: Python processes run the check themselves, while the interpreter is
# whole (sitecustomize.py, harness.py); other programs the tests start (git, ...) do not;
# detect_odr_violation=0: torch's libraries define some globals twice (not xccl's);
# allocator_may_return_null: tests ask for absurd sizes and expect MemoryError, not a crash.
export ASAN_OPTIONS=detect_leaks=1:leak_check_at_exit=0:halt_on_error=1:detect_odr_violation=0:allocator_may_return_null=1:log_path=$SAN_LOG_DIR/asan
export LSAN_OPTIONS=suppressions=$ROOT/tests/san/lsan.supp:print_suppressions=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$SAN_LOG_DIR/ubsan

"$PY" -c 'import xccl._C, sys; f = xccl._C.__file__; print("xccl._C:", f)
sys.exit(0 if "/build/san-py/" in f else "run-python.sh: not the sanitized module")'

if [ $# -eq 0 ]; then
    set -- "${SAN_TESTS[@]}"
fi
rc=0
"$PY" -m pytest -q -p no:cacheprovider --durations=8 "$@" || rc=$?

reports=$(find "$SAN_LOG_DIR" -type f | sort)
if [ -n "$reports" ]; then
    for f in $reports; do
        echo "=== sanitizer report $f"
        cat "$f"
    done
    echo "run-python.sh: $(echo "$reports" | wc -l) sanitizer report(s): FAILED"
    [ "$rc" -ne 0 ] || rc=1
else
    echo "run-python.sh: no sanitizer report"
fi
exit "$rc"
