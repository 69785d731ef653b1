#!/usr/bin/env python3
"""Per-thread CPU accounting of one run: how long each thread ran, waited in the run queue, and
how often it was switched out (voluntarily, or preempted).

Usage: tools/scripts/thread-schedstat.py COMMAND [ARGS...]
  e.g. tools/scripts/thread-schedstat.py target/release/coordbus-load epoch --partitions 1000 \
       --epochs 100000 --baseline none --durability group

Samples /proc/PID/task/*/schedstat and status every 3 ms while COMMAND runs and prints, per
thread name (io_uring workers, `iou-wrk-*`, summed as one), the last values seen: run and
run-queue wait in milliseconds (schedstat fields 1 and 2) and the voluntary and involuntary
context switches. A thread that exits between samples loses at most its last 3 ms. Linux only.
"""
import glob
import subprocess
import sys
import tempfile
import time


def read_task(task):
    comm = open(task + "/comm").read().strip()
    run_ns, wait_ns = map(int, open(task + "/schedstat").read().split()[:2])
    status = open(task + "/status").read()
    voluntary = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    involuntary = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
    return comm, (run_ns, wait_ns, voluntary, involuntary)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    started = time.monotonic()
    # The child's output goes to a file, not a pipe: a pipe read only after the child exits
    # would fill (64 KiB, e.g. with a verbose RUST_LOG) and stall it.
    output = tempfile.TemporaryFile()
    child = subprocess.Popen(sys.argv[1:], stdout=output, stderr=subprocess.STDOUT)
    last = {}
    while child.poll() is None:
        for task in glob.glob(f"/proc/{child.pid}/task/*"):
            try:
                comm, values = read_task(task)
            except (OSError, IndexError, ValueError):
                continue  # the thread exited meanwhile
            last[(task, comm)] = values
        time.sleep(0.003)
    wall = time.monotonic() - started
    output.seek(0)
    sys.stdout.write(output.read().decode())
    totals = {}
    for (_, comm), values in last.items():
        name = "iou-wrk" if comm.startswith("iou-wrk") else comm
        total = totals.setdefault(name, [0, 0, 0, 0])
        for index, value in enumerate(values):
            total[index] += value
    print(f"wall {wall:.2f} s")
    for name, (run_ns, wait_ns, voluntary, involuntary) in sorted(
        totals.items(), key=lambda item: -item[1][0]
    ):
        print(
            f"{name:20} run {run_ns / 1e6:8.0f} ms  run-queue wait {wait_ns / 1e6:7.0f} ms  "
            f"voluntary {voluntary:7}  involuntary {involuntary:7}"
        )


if __name__ == "__main__":
    main()
