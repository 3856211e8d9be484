#!/bin/busybox sh
# dsec guest init (PID 1 of the initramfs): load modules, assemble the sandbox root from the
# read-only EROFS layer disks plus a tmpfs writable layer, then exec the guest agent.
#
# Kernel command line parameters read here:
#   dsec.layers=N     number of layer disks (virtio-blk serial "layer0".."layerN-1", bottom first)
#   dsec.disk_mb=M    size of the writable layer (tmpfs), MiB; ignored when a disk with serial
#                     "upper" exists (the vm tier): that ext4 disk is the writable layer
#   dsec.tty=1        the VGA console tty1 shows an interactive shell (vm tier display; the
#                     agent starts it)
# Any failure prints "dsec-init: FAILED ..." on the console and reboots, which with -no-reboot ends QEMU (the host sees QEMU
# exit and reports the console tail).
/bin/busybox mkdir -p /proc /sys /dev /newroot /rw /layers
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev

fail() {
    echo "dsec-init: FAILED $*" > /dev/console
    /bin/busybox reboot -f
}

for m in $(/bin/busybox cat /modules.order); do
    /bin/busybox insmod "/lib/modules/$m" || fail "insmod $m"
done
/bin/busybox rm -rf /lib/modules

layers=0
tty=0
disk_mb=64
for word in $(/bin/busybox cat /proc/cmdline); do
    case "$word" in
        dsec.layers=*) layers="${word#dsec.layers=}" ;;
        dsec.disk_mb=*) disk_mb="${word#dsec.disk_mb=}" ;;
        dsec.tty=*) tty="${word#dsec.tty=}" ;;
    esac
done

# find each layer disk by its virtio serial (probe order of virtio-mmio devices is not stable)
lower=""
i=0
while [ "$i" -lt "$layers" ]; do
    dev=""
    tries=0
    while [ -z "$dev" ] && [ "$tries" -lt 200 ]; do
        for s in /sys/block/vd*/serial; do
            [ -e "$s" ] || continue
            if [ "$(/bin/busybox cat "$s")" = "layer$i" ]; then
                dev="${s#/sys/block/}"
                dev="${dev%/serial}"
            fi
        done
        [ -n "$dev" ] || { tries=$((tries + 1)); /bin/busybox usleep 10000; }
    done
    [ -n "$dev" ] || fail "layer disk layer$i not found"
    /bin/busybox mkdir -p "/layers/$i"
    /bin/busybox mount -t erofs -o ro "/dev/$dev" "/layers/$i" || fail "mount layer$i ($dev)"
    if [ -z "$lower" ]; then lower="/layers/$i"; else lower="/layers/$i:$lower"; fi
    i=$((i + 1))
done
[ -n "$lower" ] || fail "no layers"

upper=""
for s in /sys/block/vd*/serial; do
    [ -e "$s" ] && [ "$(/bin/busybox cat "$s")" = "upper" ] && { upper="${s#/sys/block/}"; upper="${upper%/serial}"; }
done
if [ -n "$upper" ]; then
    /bin/busybox mount -t ext4 "/dev/$upper" /rw || fail "mount writable disk ($upper)"
else
    /bin/busybox mount -t tmpfs -o "size=${disk_mb}m,mode=0755" tmpfs /rw || fail "tmpfs"
fi
/bin/busybox mkdir -p /rw/upper /rw/work
/bin/busybox mount -t overlay -o "lowerdir=$lower,upperdir=/rw/upper,workdir=/rw/work" overlay /newroot \
    || fail "overlay"
for d in proc sys dev tmp run; do /bin/busybox mkdir -p "/newroot/$d"; done
/bin/busybox mount -t proc proc /newroot/proc
/bin/busybox mount -t sysfs sysfs /newroot/sys
/bin/busybox mount -t devtmpfs devtmpfs /newroot/dev
/bin/busybox mkdir -p /newroot/dev/pts /newroot/dev/shm
/bin/busybox mount -t devpts -o newinstance,ptmxmode=0666 devpts /newroot/dev/pts
/bin/busybox mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
/bin/busybox mount -t tmpfs -o mode=0755 tmpfs /newroot/run
/bin/busybox hostname sandbox
if [ "$tty" = "1" ] && [ -e /dev/tty1 ]; then
    # the agent runs the console's shell (a command like any other: under the guard)
    /bin/busybox dmesg -n 1
    /bin/busybox printf '\033[H\033[J' > /dev/tty1
fi
exec /agent /newroot
