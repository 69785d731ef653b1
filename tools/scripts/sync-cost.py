#!/usr/bin/env python3
"""What one durable write costs this machine in CPU, by I/O method.

For each method, writes GROUPS groups of BYTES bytes back to back into a fresh file in DIR,
making each durable before the next, and reports per group the wall time and the machine's
kernel CPU time (system + irq + softirq over all cores, from /proc/stat: so the kernel's
workers, interrupts and the VM's exits count too, which a process's own rusage would miss).
User time is left out: it is this interpreter's, not the I/O's. Run it on an otherwise idle
machine.

Methods (every one ends with the group on the disk and the disk's cache flushed):
  buffered-fallocated   pwrite into a posix_fallocate'd file (unwritten extents, as the WAL's
                        segments are) + fdatasync: the WAL's path today
  buffered-written      the same into a file written with zeros beforehand (no extent
                        conversion)
  direct-fallocated     O_DIRECT pwrite into a posix_fallocate'd file + fdatasync
  direct-written        O_DIRECT pwrite into a file written beforehand + fdatasync
  direct-written-dsync  O_DIRECT pwritev2(RWF_DSYNC) into a file written beforehand: one
                        system call, no page cache, nothing left for a sync to find

Usage: tools/scripts/sync-cost.py [DIR] [BYTES] [GROUPS]   (defaults: $TMPDIR or /tmp,
102400, 3000; 100 KiB is about one group of the durable epoch run at 1000 partitions)
"""
import mmap
import os
import sys
import tempfile
import time

METHODS = ["buffered-fallocated", "buffered-written", "direct-fallocated", "direct-written",
           "direct-written-dsync"]


def kernel_and_total_ticks():
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq = fields[:7]
    kernel = system + irq + softirq
    return kernel, kernel + user + nice + idle + iowait


def prepare(path, size, written):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    if written:
        zeros = bytes(1 << 22)
        for offset in range(0, size, len(zeros)):
            os.pwrite(fd, zeros[: min(len(zeros), size - offset)], offset)
    else:
        os.posix_fallocate(fd, 0, size)
    os.fsync(fd)
    os.close(fd)
    directory = os.open(os.path.dirname(path), os.O_RDONLY)
    os.fsync(directory)
    os.close(directory)


def measure(method, directory, group_bytes, groups):
    path = os.path.join(directory, f"sync-cost-{os.getpid()}.dat")
    direct, dsync = method.startswith("direct"), method.endswith("dsync")
    prepare(path, group_bytes * groups, written="written" in method)
    fd = os.open(path, os.O_RDWR | (os.O_DIRECT if direct else 0))
    buffer = mmap.mmap(-1, group_bytes)  # page-aligned, as O_DIRECT needs
    buffer.write(b"x" * group_bytes)
    os.sync()
    time.sleep(0.2)  # let the preparation's writeback settle (not a wait for a result)
    kernel0, total0 = kernel_and_total_ticks()
    began = time.monotonic()
    try:
        for group in range(groups):
            offset = group * group_bytes
            if dsync:
                written = os.pwritev(fd, [buffer], offset, os.RWF_DSYNC)
            else:
                written = os.pwritev(fd, [buffer], offset)
                os.fdatasync(fd)
            if written != group_bytes:
                raise OSError(f"short write: {written} of {group_bytes} bytes at {offset}")
    finally:
        elapsed = time.monotonic() - began
        kernel1, total1 = kernel_and_total_ticks()
        os.close(fd)
        os.unlink(path)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    kernel_us = (kernel1 - kernel0) * tick / groups * 1e6
    wall_us = elapsed / groups * 1e6
    share = (kernel1 - kernel0) / max(1, total1 - total0) * os.cpu_count()
    print(f"{method:22} {group_bytes:>8} B  wall {wall_us:7.1f} us/group  kernel CPU "
          f"{kernel_us:7.1f} us/group  = {share:4.2f} cores while syncing back to back")


def main():
    directory = sys.argv[1] if len(sys.argv) > 1 else tempfile.gettempdir()
    group_bytes = int(sys.argv[2]) if len(sys.argv) > 2 else 102400
    groups = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
    if group_bytes % 4096:
        sys.exit(f"BYTES must be a multiple of 4096 for O_DIRECT, not {group_bytes}")
    for method in METHODS:
        measure(method, directory, group_bytes, groups)


if __name__ == "__main__":
    main()
