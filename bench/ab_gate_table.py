#!/usr/bin/env python3
"""The table of an A/B through the speed gate (bench/ab_compare.sh with AB_GATE=1): reads
FOLDER/gate_<side>.<pass>.csv (the gate's --out: one measured figure per row and pass) and prints,
per row, each side's figures over the passes and each side's median over side a's.

    python3 bench/ab_gate_table.py FOLDER
"""
import csv
import glob
import os
import re
import statistics
import sys


def read_runs(folder):
    """{side: {(row, pass): [figure per run, in pass order]}} from the gate CSVs in folder."""
    runs = {}
    pattern = re.compile(r"gate_([a-h])\.(\d+)\.csv$")
    found = sorted(((m.group(1), int(m.group(2)), path) for path in glob.glob(os.path.join(folder, "gate_*.csv"))
                    for m in [pattern.search(path)] if m))
    for side, _, path in found:
        with open(path) as f:
            for record in csv.DictReader(f):
                if record["value"]:
                    runs.setdefault(side, {}).setdefault((record["row"], record["pass"]), []).append(
                        float(record["value"]))
    return runs


def table(runs):
    """Markdown lines: row, pass, each side's figures ('/'-joined), each other side's median over a's."""
    sides = sorted(runs)
    if not sides:
        return ["ab_gate_table: no gate_<side>.<pass>.csv found"]
    keys = [key for key in runs[sides[0]]] + [key for s in sides[1:] for key in runs[s] if key not in runs[sides[0]]]
    head = ["row", "pass"] + sides + [f"{s}/{sides[0]}" for s in sides[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in dict.fromkeys(keys):
        figures = [runs[s].get(key, []) for s in sides]
        cells = [" / ".join(f"{v:.1f}" for v in values) or "-" for values in figures]
        base = statistics.median(figures[0]) if figures[0] else None
        ratios = [f"{statistics.median(values) / base:.3f}" if base and values else "-" for values in figures[1:]]
        lines.append("| " + " | ".join([key[0], key[1]] + cells + ratios) + " |")
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print("\n".join(table(read_runs(sys.argv[1]))))
