#!/usr/bin/env python3
"""Summarizes a series written by tools/scripts/perf-series.sh: one line per command and
figure, with the median and range of `msgs_per_sec` and of `ratio` (where a baseline ran),
over all runs and over the runs taken in the machine's fast mode.

Usage: tools/scripts/perf-summary.py SERIES.jsonl

The mode of a run comes from `core_round_trip_ns` (`[before, after]`, see
tools/src/load/machine.rs). Each probe falls in one of three placements of the two vCPUs:
sibling (under 45 ns: two hardware threads of one core), fast (45-150 ns) and slow (150 ns or
more). A run is in a mode when both probes fall in it, "mixed" otherwise. The column `modes`
gives each run's: T sibling, F fast, S slow, M mixed, ? not probed (series older than the
probe). The second line of each figure is over the F runs only: ratios taken in different
placements are not comparable.
"""
import json
import statistics
import sys

SIBLING_BELOW_NS = 45
FAST_BELOW_NS = 150
# Keys that tell apart the figures one command prints (besides the workload name).
IDENTITY_KEYS = ("durability", "threads", "receivers", "blocks_per_ask", "baseline", "phase")


def mode(figure):
    probes = figure.get("core_round_trip_ns") or [None, None]
    if None in probes:
        return "?"
    before, after = (placement(probe) for probe in probes)
    return before if before == after else "M"


def placement(round_trip_ns):
    if round_trip_ns < SIBLING_BELOW_NS:
        return "T"
    return "F" if round_trip_ns < FAST_BELOW_NS else "S"


def rate(value):
    if value >= 1e6:
        return f"{value / 1e6:.1f} M/s"
    if value >= 1e3:
        return f"{value / 1e3:.1f} k/s"
    return f"{value:.1f} /s"


def spread(values, show):
    if not values:
        return "-"
    return f"{show(statistics.median(values))} [{show(min(values))}..{show(max(values))}]"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    groups = {}
    for line in open(sys.argv[1]):
        if not line.strip():
            continue
        figure = json.loads(line)
        identity = tuple((key, figure[key]) for key in IDENTITY_KEYS if key in figure)
        groups.setdefault((figure.get("cmd", "?"), figure["workload"], identity), []).append(figure)
    ratio = lambda value: f"{value:.2f}x"
    for (cmd, workload, identity), figures in groups.items():
        modes = "".join(sorted(mode(figure) for figure in figures))
        fast = [figure for figure in figures if mode(figure) == "F"]
        label = f"{cmd} | {workload} " + " ".join(f"{key}={value}" for key, value in identity)
        print(label)
        for name, chosen in (("all", figures), ("fast", fast)):
            if not chosen:
                continue
            rates = [figure["msgs_per_sec"] for figure in chosen]
            ratios = [figure["ratio"] for figure in chosen if figure.get("ratio") is not None]
            print(f"    {name:<4} modes {modes:<6} rate {spread(rates, rate):<36} "
                  f"ratio {spread(ratios, ratio)}")


if __name__ == "__main__":
    main()
