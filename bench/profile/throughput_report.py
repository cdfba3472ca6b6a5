"""One table from profile_throughput.sh's CSVs (ncu's details page): per call, the kernel's time and
the throughput of each unit as % of its peak, so the unit that bounds it shows at a glance.
Usage: throughput_report.py throughput_*.csv"""
import csv
import os
import sys

# (column, ncu section, ncu metric name); the first section that has the name wins.
COLUMNS = (
    ("time us", "GPU Speed Of Light Throughput", "Duration"),
    ("SM %", "GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    ("L1/shared %", "GPU Speed Of Light Throughput", "L1/TEX Cache Throughput"),
    ("L2 %", "GPU Speed Of Light Throughput", "L2 Cache Throughput"),
    ("DRAM %", "GPU Speed Of Light Throughput", "DRAM Throughput"),
    ("mem busy %", "Memory Workload Analysis", "Mem Busy"),
    ("max bandwidth %", "Memory Workload Analysis", "Max Bandwidth"),
    ("L2 hit %", "Memory Workload Analysis", "L2 Hit Rate"),
    ("issue slots busy %", "Compute Workload Analysis", "Issue Slots Busy"),
    ("L2 TB/s", None, "lts__t_bytes.sum.per_second"),
)


def read_metrics(path):
    """{(section, metric): (value, unit)} of the first kernel in an ncu --page details --csv file."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not quoted
    metrics = {}
    for row in csv.DictReader(lines):
        key = (row.get("Section Name", ""), row.get("Metric Name", ""))
        metrics.setdefault(key, (row.get("Metric Value", ""), row.get("Metric Unit", "")))
    return metrics


def value_of(metrics, section, name):
    for (sec, metric), (value, unit) in metrics.items():
        if metric == name and (section is None or sec == section):
            try:
                number = float(value.replace(",", ""))
            except ValueError:
                return value
            scale = {"ms": 1e3, "us": 1.0, "usecond": 1.0, "msecond": 1e3, "ns": 1e-3, "nsecond": 1e-3,
                     "byte/second": 1e-12, "Kbyte/second": 1e-9, "Mbyte/second": 1e-6, "Gbyte/second": 1e-3,
                     "Tbyte/second": 1.0}
            return f"{number * scale.get(unit, 1.0):.4g}" if name in ("Duration", "lts__t_bytes.sum.per_second") \
                else f"{number:.3g}"
    return "-"


def main(paths):
    print("| call | " + " | ".join(c[0] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for path in paths:
        metrics = read_metrics(path)
        call = os.path.basename(path).removeprefix("throughput_").removesuffix(".csv")
        if not metrics:
            print(f"| {call} | no metrics in {path} |")
            continue
        print(f"| {call} | " + " | ".join(value_of(metrics, sec, name) for _, sec, name in COLUMNS) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
