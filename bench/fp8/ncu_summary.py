"""Side-by-side summaries of Nsight Compute CSV exports of two FP8 GEMM kernels (ours and
DeepGEMM's, or any two).

Two kinds of input, each the CSV the device scripts write:
  - `--details A.csv:ID B.csv:ID`: the details pages of wgmma_ncu.sh (`<tag>.csv`), one kernel by
    its ncu ID in each; prints every metric whose value differs, side by side.
  - `--source A.csv B.csv`: the source pages of wgmma_ncu_source.sh (`wgmma_source_<v>.csv`);
    prints, per SASS opcode, the warp-level instructions executed and the warp-stall samples of
    each kernel, then each kernel's stall reasons and hottest instructions.

Why: the question is where our kernel spends the cycles DeepGEMM's does not, and
these pages answer it only when read against each other.

    python3 bench/fp8/ncu_summary.py --source ours.csv deepgemm.csv --names ours,deepgemm
"""

from __future__ import annotations

import argparse
import collections
import csv
from pathlib import Path


def details(path: str, kernel_id: str) -> dict[tuple[str, str], str]:
    """(section, metric) -> 'value unit' for one kernel of a details-page CSV."""
    rows = csv.DictReader(line for line in Path(path).read_text().splitlines() if line.startswith('"'))
    return {
        (r["Section Name"], r["Metric Name"]): f"{r['Metric Value']} {r['Metric Unit']}".strip()
        for r in rows
        if r["ID"] == kernel_id and r["Metric Name"]
    }


def source_rows(path: str) -> list[dict[str, str]]:
    """The SASS rows of a source-page CSV (its first line names the kernel)."""
    lines = Path(path).read_text().splitlines()
    return list(csv.DictReader(lines[1:]))


def opcode(sass: str) -> str:
    """The opcode of one SASS instruction's text, without predicate guard or modifiers."""
    text = sass.strip()
    if text.startswith("@"):  # predicate guard
        text = text.split(None, 1)[1] if " " in text else ""
    return text.split()[0].split(".")[0] if text else "?"


def as_int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def print_details(a: tuple[str, str], b: tuple[str, str], names: list[str]) -> None:
    da, db = details(*a), details(*b)
    print(f"{'section':16s} {'metric':48s} {names[0]:>26s} {names[1]:>26s}")
    for key, value in da.items():
        if key in db and db[key] != value:
            print(f"{key[0][:16]:16s} {key[1][:48]:48s} {value:>26s} {db[key]:>26s}")


def print_source(paths: list[str], names: list[str], top: int) -> None:
    per_kernel = [source_rows(p) for p in paths]
    counts, samples = [], []
    for rows in per_kernel:
        c: collections.Counter[str] = collections.Counter()
        s: collections.Counter[str] = collections.Counter()
        for r in rows:
            op = opcode(r["Source"])
            c[op] += as_int(r["Instructions Executed"])
            s[op] += as_int(r["Warp Stall Sampling (All Samples)"])
        counts.append(c)
        samples.append(s)
    ops = sorted(set(counts[0]) | set(counts[1]), key=lambda k: -(counts[0][k] + counts[1][k]))
    print(f"warp instructions executed and stall samples per opcode ({names[0]} | {names[1]})")
    print(
        f"{'opcode':12s} {names[0]:>12s} {names[1]:>12s} {'difference':>12s}   {'samples':>8s} {'samples':>8s}"
    )
    for op in ops[:top]:
        a, b = counts[0][op], counts[1][op]
        print(f"{op:12s} {a:12d} {b:12d} {a - b:12d}   {samples[0][op]:8d} {samples[1][op]:8d}")
    print(f"{'total':12s} {sum(counts[0].values()):12d} {sum(counts[1].values()):12d}")
    for name, rows in zip(names, per_kernel, strict=True):
        stall_cols = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
        total = sum(as_int(r["Warp Stall Sampling (All Samples)"]) for r in rows)
        reasons = collections.Counter({c: sum(as_int(r[c]) for r in rows) for c in stall_cols})
        print(f"\n{name}: {total} stall samples; reasons (share of all samples)")
        for reason, n in reasons.most_common(8):
            print(f"   {reason:28s} {n:7d} {100 * n / max(total, 1):5.1f}%")
        print(f"{name}: hottest instructions (samples, executions, SASS, top reasons)")
        hot = sorted(rows, key=lambda r: -as_int(r["Warp Stall Sampling (All Samples)"]))[: top // 2]
        for r in hot:
            why = sorted(((as_int(r[c]), c) for c in stall_cols), reverse=True)[:2]
            why_text = ", ".join(f"{c} {n}" for n, c in why if n)
            print(
                f"   {as_int(r['Warp Stall Sampling (All Samples)']):6d} {as_int(r['Instructions Executed']):9d}  "
                f"{r['Source'].strip()[:58]:58s} {why_text}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--details", nargs=2, metavar="CSV:ID", help="two details-page kernels")
    ap.add_argument("--source", nargs=2, metavar="CSV", help="two source-page exports")
    ap.add_argument("--names", default="A,B", help="comma-separated column names")
    ap.add_argument("--top", type=int, default=30, help="opcodes (and twice the hot instructions) to list")
    args = ap.parse_args()
    names = args.names.split(",")
    if args.details:
        a, b = (tuple(x.rsplit(":", 1)) for x in args.details)
        print_details(a, b, names)  # type: ignore[arg-type]
    if args.source:
        print_source(args.source, names, args.top)


if __name__ == "__main__":
    main()
