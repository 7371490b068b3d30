#!/usr/bin/env bash
# build-image.sh DIR: builds, once, the Debian VM image that tests/rdma/run-in-vm.sh boots.
#
# The image is Debian 12 (like the host, so an extension built on the host imports in it) with
# the stock kernel (its rdma_rxe module is the soft-RoCE device), rdma-core's user space, and
# python3 with numpy and pytest. What the guest does at boot is not baked in: its PID 1 only
# mounts the control share and runs the guest-init.sh that run-in-vm.sh puts there, so that
# script can change without a rebuild.
#
# DIR gets: vmlinux (the kernel, uncompressed, for qemu's faster PVH boot), initrd.img (busybox
# and the modules that mount the root disk), rootfs.img (raw ext4, booted with -snapshot, never
# written), manifest.txt (package versions), debs/ (the .deb cache) and stamp (the cache key:
# the sha256 of this script, the package list and the apt sources; when it matches, nothing is
# done). Concurrent calls are safe (flock). Needs root; installs its host tools with apt-get.
# Downloads Debian packages only, from the mirrors this machine's apt already uses.
set -euo pipefail

OUT=${1:?usage: build-image.sh DIR}
SUITE=bookworm
PKGS=(
    linux-image-amd64 kmod busybox-static iproute2 procps
    rdma-core ibverbs-providers ibverbs-utils libibverbs-dev
    python3 python3-numpy python3-pytest python3-pytest-timeout
)

log() { printf '[build-image %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

[ "$(id -u)" = 0 ] || die "must run as root (mmdebstrap, mke2fs -d)"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec 9>"$OUT/.lock"
flock 9

# The Debian stanzas of this machine's apt sources (deb822 first, then the one-line format).
SOURCES=$(
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] && awk -v RS= -v ORS='\n\n' '/debian/' "$f" | grep -v '^#'
    done
    true
)
if [ -n "$SOURCES" ]; then
    SRC_FILE=$OUT/sources.sources
elif [ -f /etc/apt/sources.list ]; then
    SOURCES=$(grep -E '^deb[[:space:]].*debian' /etc/apt/sources.list || true)
    SRC_FILE=$OUT/sources.list
fi
[ -n "$SOURCES" ] || die "no Debian apt source configured on this machine"

KEY=$({ cat "${BASH_SOURCE[0]}"; echo "${PKGS[*]}"; echo "$SOURCES"; } | sha256sum | cut -d' ' -f1)
if [ -f "$OUT/stamp" ] && [ "$(cat "$OUT/stamp")" = "$KEY" ]; then
    exit 0
fi

need=()
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v mke2fs >/dev/null || need+=(e2fsprogs)
command -v cpio >/dev/null || need+=(cpio)
command -v xz >/dev/null || need+=(xz-utils)
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || need+=(debian-archive-keyring)
if [ ${#need[@]} -gt 0 ]; then
    log "installing host tools: ${need[*]}"
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >&2
fi

T0=$SECONDS
WORK=$OUT/.work
rm -rf "$WORK" "$OUT/stamp"
mkdir -p "$WORK/initrd"/{bin,dev,proc,sys,newroot,mods} "$OUT/debs"
ROOT=$WORK/rootfs
printf '%s\n' "$SOURCES" >"$SRC_FILE"

# PID 1 of the guest: the minimum to reach the control share, then the script found there.
cat >"$WORK/xccl-init" <<'INIT'
#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mkdir -p /xccl-ctl
modprobe -a 9p 9pnet_virtio
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 xcclctl /xccl-ctl \
    && exec /bin/bash /xccl-ctl/guest-init.sh
echo "xccl-init: cannot mount the control share" >/dev/ttyS0
echo o >/proc/sysrq-trigger
sleep 60
INIT

log "mmdebstrap $SUITE with ${PKGS[*]}"
INCLUDE=$(IFS=,; echo "${PKGS[*]}")
mmdebstrap --variant=minbase --mode=root --format=directory --include="$INCLUDE" \
    --aptopt='APT::Install-Recommends "false"' \
    --aptopt='Acquire::Check-Valid-Until "false"' \
    --aptopt='Acquire::Retries "3"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --essential-hook='mkdir -p "$1/etc/initramfs-tools/conf.d"; echo "MODULES=list" > "$1/etc/initramfs-tools/conf.d/xccl.conf"' \
    --setup-hook='mkdir -p "$1/var/cache/apt/archives/partial"' \
    --setup-hook="sync-in '$OUT/debs' /var/cache/apt/archives/" \
    --customize-hook="sync-out /var/cache/apt/archives '$OUT/debs'" \
    --customize-hook="copy-in '$WORK/xccl-init' /sbin/" \
    --customize-hook='chmod 755 "$1/sbin/xccl-init"; echo xccl-vm > "$1/etc/hostname"' \
    "$SUITE" "$ROOT" "$SRC_FILE" >"$OUT/build.log" 2>&1 ||
    { tail -n 30 "$OUT/build.log" >&2; die "mmdebstrap failed (log: $OUT/build.log)"; }
rm -rf "$OUT/debs/lock" "$OUT/debs/partial"

KVER=$(ls "$ROOT/lib/modules" | sort -V | tail -n 1)
MODDIR=$ROOT/lib/modules/$KVER
find "$MODDIR" -name 'rdma_rxe.ko*' | grep -q . || die "the kernel has no rdma_rxe module"
chroot "$ROOT" dpkg-query -W -f '${Package} ${Version}\n' >"$WORK/manifest.txt"

# initrd: busybox inserts the modules that mount the virtio ext4 root (each after its
# dependencies, which modules.dep lists deepest last), then switch_root to /sbin/xccl-init.
# (Debian's own initrd runs udev: seconds more per boot under emulation.)
mods=
for want in virtio_pci virtio_blk crc32c_generic ext4; do
    line=$(grep -E "/$want\.ko:" "$MODDIR/modules.dep" | head -n 1) ||
        die "module $want not found uncompressed in modules.dep"
    for rel in $(echo "${line#*:}" | tr ' ' '\n' | tac) "${line%%:*}"; do
        m=$(basename "$rel" .ko)
        case " $mods " in *" $m "*) continue ;; esac
        cp "$MODDIR/$rel" "$WORK/initrd/mods/$m.ko"
        mods="$mods $m"
    done
done
cp "$ROOT/bin/busybox" "$WORK/initrd/bin/busybox"
cat >"$WORK/initrd/init" <<EOS
#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t devtmpfs dev /dev
for m in $mods; do /bin/busybox insmod /mods/\$m.ko || echo "initrd: insmod \$m failed"; done
i=0; while [ ! -b /dev/vda ] && [ \$i -lt 200 ]; do /bin/busybox sleep 0.05; i=\$((i + 1)); done
/bin/busybox mount -t ext4 /dev/vda /newroot || { echo "initrd: cannot mount /dev/vda"; exit 1; }
/bin/busybox mount --move /dev /newroot/dev
/bin/busybox umount /proc
exec /bin/busybox switch_root /newroot /sbin/xccl-init
EOS
chmod 755 "$WORK/initrd/init"
(cd "$WORK/initrd" && find . | cpio -o -H newc --quiet) >"$WORK/initrd.img"

# The bzImage's payload is xz: the uncompressed ELF boots by PVH, without the real-mode stub
# and the decompression (about 7 s of emulated time per boot).
off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$ROOT/boot/vmlinuz-$KVER" | head -n 1 | cut -d: -f1)
[ -n "$off" ] || die "no xz payload in vmlinuz-$KVER"
tail -c +$((off + 1)) "$ROOT/boot/vmlinuz-$KVER" | xz -dc --single-stream >"$WORK/vmlinux" 2>/dev/null ||
    true # trailing data after the xz stream makes xz complain; the ELF is checked next
[ "$(head -c 4 "$WORK/vmlinux" | od -An -c | tr -d ' ')" = '177ELF' ] || die "vmlinux extraction failed"

SIZE_MB=$(($(du -sm "$ROOT" | cut -f1) + 1024)) # sparse; room for the tests' /tmp is in RAM anyway
mke2fs -q -t ext4 -L xcclroot -d "$ROOT" -F "$WORK/rootfs.img" "${SIZE_MB}M"
for f in vmlinux initrd.img rootfs.img manifest.txt; do mv -f "$WORK/$f" "$OUT/$f"; done
rm -rf "$WORK" "$SRC_FILE"
echo "$KEY" >"$OUT/stamp"
log "built in $((SECONDS - T0)) s: kernel $KVER, rootfs $(du -sh "$OUT/rootfs.img" | cut -f1) on disk"
