#!/bin/bash
# Durable-versus-in-memory ratio of the epoch workload, alternated: for each round and each
# binary given, one in-memory run and one group-commit run of
#   BIN --json epoch --partitions 1000 --epochs 20000 --producers 1 --baseline none
#       --durability none|group
# then, per binary, the medians and the ratio of the medians, and each round's own ratio.
# Alternating binaries round by round is what makes two binaries comparable on this shared,
# bimodal machine (a binary measured an hour later can read 10% apart for no reason).
# The machine's mode is in each run's `core_round_trip_ns` (the load tool probes how long a
# cache line takes between the two cores, before and after the run). Each probe falls in one of
# three placements of the two vCPUs: "sibling" under 45 ns (two hardware threads of one core),
# "fast" 45-150 ns, "slow" 150 ns or more; a run is in a mode when both probes fall in it,
# "mixed" otherwise. The summary gives the medians over all runs and again per mode; compare
# ratios within a mode, and check that the in-memory runs were backlogged (a commit p50 of
# hundreds of us; PERF.md, EpochCoordinator, "Thirteenth session").
#
# With one producer the in-memory run may be the producer's rate rather than the coordinator's
# (not backlogged: commit p50s of tens of us on a fast VM); PRODUCERS=2 backlogs it (PERF.md,
# "Thirty-second session").
#
# Usage: [EPOCHS=N] [PRODUCERS=P] [OFFSETS=steady|varied] \
#     tools/scripts/epoch-durable-ab.sh ROUNDS BIN [BIN...]
#   (EPOCHS: default 20000; PRODUCERS: default 1; OFFSETS: passed as `--offsets` when set,
#   else the binary's default, steady: builds from before the flag have no `--offsets`)
#   (a BIN may be a wrapper script, e.g. one that sets TMPDIR=/dev/shm for a WAL on tmpfs)
# A failed run is left out and named on stderr; a round without both of a binary's runs shows
# as None in its per-round list. Exits 1 if a binary has no round with both runs.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 ROUNDS BIN [BIN...]" >&2
    exit 2
fi
ROUNDS=$1
shift
# The placement classifier is perf-summary.py's (one copy of its thresholds).
SUMMARY="$(dirname "$0")/perf-summary.py"
OUT=$(mktemp)
ERR=$(mktemp)
trap 'rm -f "$OUT" "$ERR"' EXIT
FAILED=0
for round in $(seq "$ROUNDS"); do
    for bin in "$@"; do
        for durability in none group; do
            # A failed run is reported (with the end of its stderr) and left out; the sitting
            # goes on.
            if ! "$bin" --json epoch --partitions 1000 --epochs "${EPOCHS:-20000}" \
                --producers "${PRODUCERS:-1}" --baseline none --durability "$durability" \
                ${OFFSETS:+--offsets "$OFFSETS"} 2>"$ERR" |
                python3 -c "import json, runpy, sys
mode = runpy.run_path('$SUMMARY')['mode']
names = {'T': 'sibling', 'F': 'fast', 'S': 'slow', 'M': 'mixed', '?': 'unknown'}
for figure in map(json.loads, sys.stdin):
    print('$round', '$bin', '$durability', figure['msgs_per_sec'], names[mode(figure)],
          figure['p50_ns'])" \
                >> "$OUT"; then
                echo "left out: a failed run ($bin, --durability $durability):" \
                    "$(tail -n 3 "$ERR")" >&2
                FAILED=$((FAILED + 1))
            fi
        done
    done
done
python3 - "$OUT" "$FAILED" "$ROUNDS" "$@" <<'PY'
import statistics, sys
ROUNDS = int(sys.argv[3])
rows, memory_p50_us, by_round = {}, {}, {}
for line in open(sys.argv[1]):
    round_, binary, durability, rate, mode, p50_ns = line.split()
    by_round.setdefault(binary, {}).setdefault(int(round_), {})[durability] = float(rate)
    for key in ("all", mode):
        runs = rows.setdefault(binary, {}).setdefault(key, {})
        runs.setdefault(durability, []).append(float(rate))
        if durability == "none":
            memory_p50_us.setdefault((binary, key), []).append(round(float(p50_ns) / 1e3))
if sys.argv[2] != "0":
    print(f"{sys.argv[2]} failed runs left out (above)")
incomplete = []
for binary in sys.argv[4:]:
    pairs = by_round.get(binary, {})
    # A round without both runs shows as None, so that positions stay round numbers.
    rounds = [
        round(pair["group"] / pair["none"], 2) if len(pair) == 2 else None
        for pair in (pairs.get(number, {}) for number in range(1, ROUNDS + 1))
    ]
    if all(ratio is None for ratio in rounds):
        incomplete.append(binary)
        print(f"{binary}: no round with both runs")
        continue
    for mode in ("all", "fast", "sibling", "slow", "mixed", "unknown"):
        runs = rows.get(binary, {}).get(mode, {})
        memory, durable = runs.get("none", []), runs.get("group", [])
        if not memory or not durable:
            continue
        print(f"{binary} [{mode}: {len(memory)} + {len(durable)} runs]: "
              f"in memory {statistics.median(memory) / 1e6:.1f} M/s "
              f"(commit p50s {memory_p50_us[(binary, mode)]} us), "
              f"group commit {statistics.median(durable) / 1e6:.1f} M/s, "
              f"ratio of medians {statistics.median(durable) / statistics.median(memory):.3f}"
              + (f", per round {rounds}" if mode == "all" else ""))
sys.exit(1 if incomplete else 0)
PY
