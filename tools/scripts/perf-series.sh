#!/usr/bin/env bash
# The PERF.md series: every figure three times, back to back (the durable epoch pair six times,
# alternated), one JSON object per line.
# Usage: tools/scripts/perf-series.sh [out.jsonl]   (after `cargo build --release --workspace`;
# summarize with tools/scripts/perf-summary.py out.jsonl;
# run it with nothing else busy on the machine: it measures for about seven minutes).
set -u
L="$(dirname "$0")/../../target/release/coordbus-load"
OUT=${1:-perf-series.jsonl}
: > "$OUT"
# A run that fails adds no line: say so, or the summary's medians quietly take fewer runs.
failed() {
    [ "$1" -eq 0 ] || echo "# FAILED (exit $1): $2" >&2
}
run() {
    echo "# $*" >&2
    for i in 1 2 3; do
        "$L" --json "$@" 2>/dev/null | sed "s|^{|{\"cmd\":\"$*\",\"run\":$i,|" >> "$OUT"
        failed "${PIPESTATUS[0]}" "$* (run $i)"
    done
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
run epoch --partitions 1 --epochs 100000 --baseline reference
for p in 100 1000 10000; do run epoch --partitions "$p" --baseline reference; done
run epoch --partitions 1000 --producers 2
run epoch --partitions 1000 --producers 4
run state-store --producers 2
run state-store --producers 4
# The durable ratio: six alternated pairs (three were too few: one run in a slow stretch moved
# the median by 0.1; PERF.md, EpochCoordinator, "Fourteenth session"), the 2 ms delay in three;
# and six pairs of `--offsets varied` (3 bytes an offset in the log, where the default steady
# offsets take none; PERF.md, "Forty-fifth session").
for i in 1 2 3 4 5 6; do
    for durability in none group; do
        "$L" --json epoch --partitions 1000 --epochs 100000 --durability "$durability" 2>/dev/null |
            sed "s|^{|{\"cmd\":\"epoch durability $durability\",\"run\":$i,|" >> "$OUT"
        failed "${PIPESTATUS[0]}" "epoch durability $durability (run $i)"
    done
    for durability in none group; do
        "$L" --json epoch --partitions 1000 --epochs 100000 --durability "$durability" \
            --offsets varied 2>/dev/null |
            sed "s|^{|{\"cmd\":\"epoch varied durability $durability\",\"run\":$i,|" >> "$OUT"
        failed "${PIPESTATUS[0]}" "epoch varied durability $durability (run $i)"
    done
    [ "$i" -gt 3 ] && continue
    "$L" --json epoch --partitions 1000 --epochs 100000 --durability group --group-delay-us 2000 \
        2>/dev/null | sed "s|^{|{\"cmd\":\"epoch durability group 2ms\",\"run\":$i,|" >> "$OUT"
    failed "${PIPESTATUS[0]}" "epoch durability group 2ms (run $i)"
done
# Every-record durability (syncs back to back, no group delay), three runs.
run epoch --partitions 1000 --epochs 100000 --durability every --baseline none
run wal
run wal-recover
run blocks
run blocks --batch 1 --blocks 6000000 --recover-events 1000
