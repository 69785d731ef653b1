#!/usr/bin/env python3
"""Summarizes a series written by tools/scripts/perf-series.sh: per command and figure, the
median and [min..max] of every figure PERF.md reports, over all runs and over the runs taken in
the machine's fast mode.

Usage: tools/scripts/perf-summary.py SERIES.jsonl

Each figure's lines (those its runs carry; see FIGURES below): msgs/s, epochs/s and bytes/s, the
ratio to its baseline (`ratio`: the reference model, the in-memory bus runs of `--baseline
memory`, or the workload's own) with the baseline's rate, how far the reference model got
(`baseline_epochs`), the in-memory runs of `--baseline memory` (their mean, each one's rate and
commit p50: hundreds of microseconds when the coordinator set the pace, microseconds when a
producer did), the commit latency percentiles (`p50_ns`..), the durable commit latency
(`durable_p50_ns`..), the ratio of latencies where a workload reports one (`latency_ratio`), and
the peak resident memory (`peak_rss_mib`, `process_peak_rss_mib`, with `rss_at_start_mib`).

The mode of a run comes from `core_round_trip_ns` (`[before, after]`, see
tools/src/load/machine.rs). Each probe falls in one of three placements of the two vCPUs:
sibling (under 45 ns: two hardware threads of one core), fast (45-150 ns) and slow (150 ns or
more). A run is in a mode when both probes fall in it, "mixed" otherwise. The column `modes`
gives each run's: T sibling, F fast, S slow, M mixed, ? not probed (series older than the
probe). The second block of each figure is over the F runs only: ratios taken in different
placements are not comparable.
"""
import json
import statistics
import sys

SIBLING_BELOW_NS = 45
FAST_BELOW_NS = 150
# Keys that tell apart the figures one command prints (besides the workload name).
IDENTITY_KEYS = ("durability", "threads", "receivers", "blocks_per_ask", "baseline", "phase")


def scaled(value, unit, prefixes):
    """`value` in `unit` with the first of `prefixes` ((factor, prefix, decimals), largest
    first) that it reaches."""
    for factor, prefix, decimals in prefixes:
        if value >= factor:
            return f"{value / factor:.{decimals}f} {prefix}{unit}"
    return f"{value:.1f} {unit}"


def rate(value):
    return scaled(value, "/s", ((1e6, "M", 1), (1e3, "k", 1)))


def byte_rate(value):
    return scaled(value, "B/s", ((1e9, "G", 2), (1e6, "M", 1), (1e3, "k", 1)))


def duration(ns):
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} us"
    return f"{ns:.0f} ns"


def times(value):
    return f"{value:.3f}x" if value < 10 else f"{value:.0f}x"


def mib(value):
    return f"{value:.1f} MiB"


def count(value):
    return f"{value:.0f}"


# The figures summarized, in the order printed: (label, JSON key, how to show a value). A line
# is printed only for the keys a command's runs carry.
FIGURES = (
    ("msgs/s", "msgs_per_sec", rate),
    ("epochs/s", "epochs_per_sec", rate),
    ("bytes/s", "bytes_per_sec", byte_rate),
    ("ratio", "ratio", times),
    ("baseline msgs/s", "baseline_msgs_per_sec", rate),
    ("baseline epochs", "baseline_epochs", count),
    ("latency ratio", "latency_ratio", times),
    ("in memory msgs/s", "memory_msgs_per_sec", rate),
    ("in memory before", "memory_before_msgs_per_sec", rate),
    ("in memory after", "memory_after_msgs_per_sec", rate),
    ("in memory before p50", "memory_before_p50_ns", duration),
    ("in memory after p50", "memory_after_p50_ns", duration),
    ("p50", "p50_ns", duration),
    ("p99", "p99_ns", duration),
    ("p99.9", "p999_ns", duration),
    ("durable p50", "durable_p50_ns", duration),
    ("durable p99", "durable_p99_ns", duration),
    ("durable p99.9", "durable_p999_ns", duration),
    ("peak RSS", "peak_rss_mib", mib),
    ("process peak RSS", "process_peak_rss_mib", mib),
    ("RSS at start", "rss_at_start_mib", mib),
)


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
    for (cmd, workload, identity), figures in groups.items():
        fast = [figure for figure in figures if mode(figure) == "F"]
        label = f"{cmd} | {workload} " + " ".join(f"{key}={value}" for key, value in identity)
        print(label)
        for name, chosen in (("all", figures), ("fast", fast)):
            if not chosen:
                continue
            modes = "".join(sorted(mode(figure) for figure in chosen))
            print(f"    {name}: {len(chosen)} runs, modes {modes}")
            for title, key, show in FIGURES:
                values = [figure[key] for figure in chosen if figure.get(key) is not None]
                if values:
                    print(f"        {title:<21} {spread(values, show)}")


if __name__ == "__main__":
    main()
