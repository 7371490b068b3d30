#!/usr/bin/env bash
# tests/rdma/run-in-vm.sh [options] [--] [CMD...]
#
# Runs CMD in a Debian VM that has real RDMA verbs devices (the kernel's soft-RoCE, rdma_rxe)
# and exits with CMD's status. The checkout is shared into the VM at the same absolute path and
# is CMD's working directory; PYTHONPATH=python there, so the VM's python3 imports the xccl
# extension built here (built first: python3 setup.py build_ext --inplace; the host needs
# libibverbs-dev for the ibverbs transport to be compiled in). CMD runs as root, with numpy and
# pytest available; several words are joined as a shell command. Default CMD: the RDMA suite,
# python3 -m pytest -q -p no:cacheprovider tests/rdma.
#
# Options:
#   -d N     soft-RoCE devices rxe0..rxe(N-1) (default 2; 0: none), rxeI on netdev dummyI
#            with address 10.99.I.1/24 (GID index 1 is that address's RoCE v2 entry)
#   -c N     virtual CPUs (default: this machine's, nproc)
#   -m MB    memory (default 4096)
#   -t SECS  limit for the whole run, boot included (default 1200): exit status 124
#   -e K=V   an environment variable for CMD (repeatable)
#   -v       print the end of the guest's console log after the run
# Environment: XCCL_VM_IMAGE, the image directory (default ~/.cache/xccl/rdma-vm; made or
# refreshed by build-image.sh, which needs root, about 2 minutes the first time).
# Exit status: CMD's; 124 when the limit passed; 125 when the VM or its setup failed.
#
# The VM runs under qemu's software emulation (TCG), 10-50x slower than native: KVM is not
# used. It has no network card: nothing leaves it.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
IMG=${XCCL_VM_IMAGE:-${XDG_CACHE_HOME:-$HOME/.cache}/xccl/rdma-vm}
DEVS=2 CPUS=$(nproc) MEM=4096 LIMIT=1200 VERBOSE=
ENVS=()
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }
while getopts "d:c:m:t:e:vh" o; do
    case $o in
    d) DEVS=$OPTARG ;;
    c) CPUS=$OPTARG ;;
    m) MEM=$OPTARG ;;
    t) LIMIT=$OPTARG ;;
    e) ENVS+=("$OPTARG") ;;
    v) VERBOSE=1 ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
[ "${1:-}" = -- ] && shift
CMD=${*:-python3 -m pytest -q -p no:cacheprovider tests/rdma}
for v in "$DEVS" "$CPUS" "$MEM" "$LIMIT"; do
    [[ $v =~ ^[0-9]+$ ]] || { echo "run-in-vm: '$v' is not a number" >&2; exit 2; }
done

"$HERE/build-image.sh" "$IMG" || { echo "run-in-vm: image build failed" >&2; exit 125; }
if ! log=$(cd "$REPO" && python3 setup.py build_ext --inplace -q 2>&1); then
    printf '%s\n' "$log" >&2
    echo "run-in-vm: building the extension failed" >&2
    exit 125
fi

CTL=$(mktemp -d /tmp/xccl-vm.XXXXXX)
QPID= TAILS=()
cleanup() {
    if [ -n "$QPID" ]; then kill "$QPID" 2>/dev/null || true; fi
    rm -rf "$CTL"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cp "$HERE/guest-init.sh" "$CTL/guest-init.sh"
printf '%s\n' "$REPO" >"$CTL/share"
printf '%s\n' "$CMD" >"$CTL/cmd"
{
    echo "XCCL_VM_RXE_DEVS=$DEVS"
    echo "PYTHONPATH=python"
    echo "PYTHONDONTWRITEBYTECODE=1" # the checkout is the host's: leave no root-owned caches
    for kv in ${ENVS[@]+"${ENVS[@]}"}; do printf '%s=%q\n' "${kv%%=*}" "${kv#*=}"; done
} >"$CTL/env"
: >"$CTL/stdout"
: >"$CTL/stderr"

esc() { printf '%s' "${1//,/,,}"; } # a comma inside a qemu option value is doubled
T0=$SECONDS
qemu-system-x86_64 -machine q35 -accel tcg,thread=multi -cpu max -smp "$CPUS" -m "$MEM" \
    -kernel "$IMG/vmlinux" -initrd "$IMG/initrd.img" \
    -append "root=/dev/vda console=ttyS0 quiet loglevel=3 panic=-1 init=/sbin/xccl-init" \
    -drive "file=$(esc "$IMG/rootfs.img"),if=virtio,format=raw,snapshot=on" \
    -nic none -display none -monitor none -no-reboot \
    -serial "file:$CTL/console.log" \
    -virtfs "local,path=$(esc "$CTL"),mount_tag=xcclctl,security_model=none,multidevs=remap" \
    -virtfs "local,path=$(esc "$REPO"),mount_tag=xcclshare,security_model=none,multidevs=remap" \
    -device virtio-serial-pci \
    -chardev "file,id=out,path=$CTL/stdout" -device virtserialport,chardev=out,name=xccl.stdout \
    -chardev "file,id=err,path=$CTL/stderr" -device virtserialport,chardev=err,name=xccl.stderr \
    >"$CTL/qemu.log" 2>&1 &
QPID=$!
tail -n +1 -s 0.2 -f --pid="$QPID" "$CTL/stdout" &
TAILS+=($!)
tail -n +1 -s 0.2 -f --pid="$QPID" "$CTL/stderr" >&2 &
TAILS+=($!)
timed_out=
while kill -0 "$QPID" 2>/dev/null; do
    if [ $((SECONDS - T0)) -ge "$LIMIT" ]; then
        timed_out=1
        kill "$QPID"
        break
    fi
    sleep 0.5
done
wait "$QPID" 2>/dev/null || true
QPID=
wait "${TAILS[@]}" 2>/dev/null || true

ready=$(cat "$CTL/ready" 2>/dev/null || echo "?")
echo "run-in-vm: ${DEVS} rxe device(s) ready ${ready} s after boot; ${CPUS} vCPU TCG; wall $((SECONDS - T0)) s" >&2
if [ -n "$VERBOSE" ] || [ ! -f "$CTL/rc" ]; then
    {
        echo "---- guest console (end)"
        tail -n 40 "$CTL/console.log" 2>/dev/null || true
        echo "---- qemu"
        tail -n 20 "$CTL/qemu.log"
    } >&2
fi
if [ -f "$CTL/rc" ]; then exit "$(cat "$CTL/rc")"; fi
if [ -n "$timed_out" ]; then
    echo "run-in-vm: the run passed its limit of ${LIMIT} s" >&2
    exit 124
fi
[ -f "$CTL/init-error" ] && echo "run-in-vm: guest setup failed: $(cat "$CTL/init-error")" >&2
exit 125
