#!/bin/bash
# Durable-versus-in-memory ratio of the epoch workload, alternated: for each round and each
# binary given, one in-memory run and one group-commit run of
#   BIN --json epoch --partitions 1000 --epochs 20000 --baseline none --durability none|group
# then, per binary, the medians and the ratio of the medians, and each round's own ratio.
# Alternating binaries round by round is what makes two binaries comparable on this shared,
# bimodal machine (a binary measured an hour later can read 10% apart for no reason).
#
# Usage: tools/scripts/epoch-durable-ab.sh ROUNDS BIN [BIN...]
#   (a BIN may be a wrapper script, e.g. one that sets TMPDIR=/dev/shm for a WAL on tmpfs)
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 ROUNDS BIN [BIN...]" >&2
    exit 2
fi
ROUNDS=$1
shift
OUT=$(mktemp)
trap 'rm -f "$OUT"' EXIT
for _ in $(seq "$ROUNDS"); do
    for bin in "$@"; do
        for durability in none group; do
            "$bin" --json epoch --partitions 1000 --epochs 20000 --baseline none \
                --durability "$durability" 2>/dev/null |
                python3 -c "import json,sys
for figure in map(json.loads, sys.stdin): print('$bin', '$durability', figure['msgs_per_sec'])" \
                >> "$OUT"
        done
    done
done
python3 - "$OUT" "$@" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    binary, durability, rate = line.split()
    rows.setdefault(binary, {}).setdefault(durability, []).append(float(rate))
for binary in sys.argv[2:]:
    memory, durable = rows[binary]["none"], rows[binary]["group"]
    print(f"{binary}: in memory {statistics.median(memory) / 1e6:.1f} M/s, "
          f"group commit {statistics.median(durable) / 1e6:.1f} M/s, "
          f"ratio of medians {statistics.median(durable) / statistics.median(memory):.3f}, "
          f"per round {[round(d / m, 2) for m, d in zip(memory, durable)]}")
PY
