#!/bin/bash
# PID 1 of the test VM, after the image's /sbin/xccl-init has mounted the control share
# (/xccl-ctl) that run-in-vm.sh fills: env (variables for the command, XCCL_VM_RXE_DEVS
# among them), share (the host directory's path), cmd (the command). It mounts the shared
# checkout at the same path, brings up the soft-RoCE devices, runs the command there with its
# stdout and stderr on two virtio-serial ports the host reads, writes the exit status to
# /xccl-ctl/rc and powers off. Setup failures go to /xccl-ctl/init-error.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root LANG=C.UTF-8

halt() {
    sync
    echo o >/proc/sysrq-trigger
    sleep 60
}
fail() {
    echo "$*" >/xccl-ctl/init-error
    halt
}

mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /tmp
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
hostname xccl-vm
printf "127.0.0.1 localhost\n127.0.1.1 xccl-vm\n::1 localhost\n" >/etc/hosts
ip link set lo up

set -a
. /xccl-ctl/env
set +a
SHARE=$(cat /xccl-ctl/share)
mkdir -p "$SHARE"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=mmap xcclshare "$SHARE" ||
    fail "cannot mount the host directory at $SHARE"

# Soft-RoCE: device rxeI on the dummy netdev dummyI, address 10.99.I.1/24, so each device has
# its own IPv4 GID (the VM has no network card; rxe carries traffic between processes that use
# one device through its loopback path).
modprobe -a virtio_console ib_uverbs rdma_rxe || fail "modprobe virtio_console ib_uverbs rdma_rxe failed"
modprobe dummy numdummies=0 || fail "modprobe dummy failed"
for ((i = 0; i < ${XCCL_VM_RXE_DEVS:-1}; i++)); do
    ip link add "dummy$i" type dummy &&
        ip addr add "10.99.$i.1/24" dev "dummy$i" &&
        ip link set "dummy$i" up &&
        rdma link add "rxe$i" type rxe netdev "dummy$i" ||
        fail "cannot create rxe$i on dummy$i"
done
for ((i = 0; i < ${XCCL_VM_RXE_DEVS:-1}; i++)); do
    for ((t = 0; t < 100; t++)); do
        grep -qs ACTIVE "/sys/class/infiniband/rxe$i/ports/1/state" && break
        sleep 0.1
    done
    grep -qs ACTIVE "/sys/class/infiniband/rxe$i/ports/1/state" || fail "rxe$i port 1 not active"
done
ulimit -l unlimited

port() { # the /dev node of the virtio-serial port named $1
    local p
    for p in /sys/class/virtio-ports/*; do
        [ "$(cat "$p/name")" = "$1" ] && echo "/dev/${p##*/}" && return
    done
    fail "no virtio-serial port $1"
}
OUT=$(port xccl.stdout)
ERR=$(port xccl.stderr)
cut -d' ' -f1 /proc/uptime >/xccl-ctl/ready
cd "$SHARE" || fail "cannot enter $SHARE"
bash /xccl-ctl/cmd >"$OUT" 2>"$ERR" </dev/null
echo $? >/xccl-ctl/rc.tmp && mv /xccl-ctl/rc.tmp /xccl-ctl/rc
halt
