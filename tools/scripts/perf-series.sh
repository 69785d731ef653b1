#!/usr/bin/env bash
# The PERF.md series: every figure three times, back to back (the durable epoch figures of the
# issue's goal five times), one JSON object per line.
# Usage: tools/scripts/perf-series.sh [out.jsonl]   (after `cargo build --release --workspace`;
# summarize with tools/scripts/perf-summary.py out.jsonl;
# run it with nothing else busy on the machine: it measures for about eight to nine minutes in
# the fast placement, longer in the slow one).
#
# Every epoch row runs long enough for its bus run to last about a second or more at the
# rates of PERF.md (a message is one report or one commit: messages = 2 x partitions x
# epochs): 1 partition at ~12.8 M msgs/s, 8 000 000 epochs (16 M messages, ~1.25 s); 100 at
# ~217 M/s, 1 200 000 (240 M, ~1.1 s); 1000 at ~253 M/s, 150 000 (300 M, ~1.2 s); 10 000 at
# ~245 M/s, 15 000 (300 M, ~1.2 s). The run keeps 16 bytes of timestamps an epoch (24 with a
# WAL), counted in its peak RSS: 128 MiB of the 1-partition row's, under 25 MiB elsewhere;
# 8 000 000 is within the tool's cap of 2^24 epochs.
#
# The durable ratios (group commit and every-record, steady and varied offsets) come from
# `--baseline memory`: each run measures an in-memory run, the durable run and another
# in-memory run in one process, on the same stream, and reports the durable rate over the
# mean of the two in-memory ones (`ratio_to_memory`), so no pairing of separate runs is needed.
set -u
L="$(dirname "$0")/../../target/release/coordbus-load"
OUT=${1:-perf-series.jsonl}
: > "$OUT"
# A run that fails adds no line: say so, or the summary's medians quietly take fewer runs.
failed() {
    [ "$1" -eq 0 ] || echo "# FAILED (exit $1): $2" >&2
}
# `runs N ARGS...`: N runs of `L --json ARGS...`, each line tagged with the command and run.
runs() {
    local count=$1
    shift
    echo "# $*" >&2
    for i in $(seq "$count"); do
        "$L" --json "$@" 2>/dev/null | sed "s|^{|{\"cmd\":\"$*\",\"run\":$i,|" >> "$OUT"
        failed "${PIPESTATUS[0]}" "$* (run $i)"
    done
}
run() {
    runs 3 "$@"
}
run bus --messages 30000000
run bus --messages 30000000 --lanes 0
run bus --messages 30000000 --producers 2
run bus --messages 30000000 --producers 2 --lanes 0
run bus --messages 30000000 --producers 4
run bus --messages 30000000 --producers 8
run bus --messages 300000000 --batch 256 --baseline ring
run bus --messages 300000000 --batch 256
run ask --messages 1000000
run ask --messages 3000000 --in-flight 64
run epoch --partitions 1 --epochs 8000000 --baseline reference
run epoch --partitions 100 --epochs 1200000 --baseline reference
run epoch --partitions 1000 --epochs 150000 --baseline reference
run epoch --partitions 10000 --epochs 15000 --baseline reference
run epoch --partitions 1000 --epochs 150000 --producers 2
run epoch --partitions 1000 --epochs 150000 --producers 4
run state-store --producers 2
run state-store --producers 4
# The durable ratios at 1000 partitions, each against its own in-memory runs (three bus runs
# a command, about 4-5 s): group commit five times each, steady offsets (none in the log:
# second-order deltas) and varied ones (about 3 bytes an offset; PERF.md, "Forty-fifth
# session"), the issue's goal; every-record durability and a 2 ms group delay three times.
for offsets in steady varied; do
    runs 5 epoch --partitions 1000 --epochs 150000 --durability group --baseline memory \
        --offsets "$offsets"
done
for offsets in steady varied; do
    run epoch --partitions 1000 --epochs 150000 --durability every --baseline memory \
        --offsets "$offsets"
done
run epoch --partitions 1000 --epochs 150000 --durability group --group-delay-us 2000 \
    --baseline memory
run wal
run wal-recover
run blocks
run blocks --batch 1 --blocks 6000000 --recover-events 1000
