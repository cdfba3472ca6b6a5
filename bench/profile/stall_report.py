"""Summarises a CSV from profile_stalls.sh: the share of each stall reason, the share of the
samples by how often an instruction ran (the inner loop, once per tile, the producer...), and the
instructions with the most samples, each with its top reasons.
Usage: python3 bench/profile/stall_report.py FILE.csv [TOP]"""
import collections
import csv
import sys


def number(text):
    try:
        return float(text)
    except ValueError:
        return 0.0


def main():
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    rows = list(csv.reader(open(path)))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    columns = {name: i for i, name in enumerate(rows[header])}
    data = rows[header + 1:]
    reasons = [c for c in columns if c.startswith("stall_") and "Not Issued" not in c]
    samples_col, executed_col = columns["Warp Stall Sampling (All Samples)"], columns["Instructions Executed"]
    total = sum(number(r[samples_col]) for r in data) or 1.0

    by_reason = collections.Counter()
    by_count = collections.Counter()
    for r in data:
        for c in reasons:
            by_reason[c] += number(r[columns[c]])
        by_count[int(number(r[executed_col]))] += number(r[samples_col])
    print(f"{path}: {int(total)} samples")
    print("by reason:", ", ".join(f"{c[6:]} {v / total:.1%}" for c, v in by_reason.most_common(8)))
    print("by times executed (per warp):",
          ", ".join(f"{n}x {v / total:.1%}" for n, v in by_count.most_common(6)))
    print(f"top {top} instructions (index in the CSV, share, executions, SASS, top reasons):")
    ranked = sorted(range(len(data)), key=lambda i: -number(data[i][samples_col]))[:top]
    for i in ranked:
        r = data[i]
        why = sorted(((number(r[columns[c]]), c[6:]) for c in reasons), reverse=True)[:2]
        print(f"{i:6d} {number(r[samples_col]) / total:6.2%} {r[executed_col]:>9s}  {r[1].strip()[:64]:64s} "
              + ", ".join(f"{name} {int(v)}" for v, name in why))


if __name__ == "__main__":
    main()
