"""Summarizes the per-SASS-line stall samples that tools/ncu_fused.sh leaves
(source.csv.gz: `ncu --page source --csv --print-source sass`), kernel by kernel.

    python3 tools/ncu_source_summary.py OUT/source.csv.gz [TOP] [KERNEL LO HI]

Per kernel: samples by execution-count class. A persistent kernel's instructions fall
into classes by how often they run: once per K tile per warp (the mainloop, ~1e6 at
8192x16384x4096), once per tile per warp (the epilogue, ~3e4), once per warp (set-up,
and the idle warps' final cluster barrier, ~1e3). Comparing a kind's classes with the
plain product's shows whether its extra time is in the mainloop or the epilogue. Then
the TOP instructions by samples, with their dominant stall reasons. With KERNEL LO HI:
that kernel's instructions executed LO <= count < HI, by opcode and the top 25."""

import collections
import csv
import gzip
import re
import sys


def read(path):
    kernels, cur, header = [], None, None
    with gzip.open(path, "rt") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                cur = {"name": row[1], "rows": []}
                kernels.append(cur)
            elif row[0] == "Address":
                header = row
            elif cur is not None:
                x = dict(zip(header, row))
                x["s"] = int(x["Warp Stall Sampling (All Samples)"] or 0)
                x["e"] = int(x["Instructions Executed"] or 0)
                words = x["Source"].split()
                x["op"] = (words[1] if words and words[0].startswith("@") and len(words) > 1 else
                           words[0] if words else "")
                cur["rows"].append(x)
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    return kernels, reasons


def stalls(x, reasons, share=0.15):
    return ", ".join(f"{r[6:]}={x[r]}" for r in reasons if int(x[r] or 0) > x["s"] * share)


def summarize(kernels, reasons, top):
    for k in kernels:
        m = re.search(r"KernelKind\)(\d+), (\w+), \(jax_hopper::Major\)(\d), \(jax_hopper::Major\)(\d), \(int\)(\d)",
                      k["name"])
        rows = k["rows"]
        total = sum(x["s"] for x in rows) or 1
        label = f"kind {m.group(1)} {m.group(2)} majors {m.group(3)}{m.group(4)} stages {m.group(5)}" if m else \
            k["name"][:60]
        print(f"== {label}: {len(rows)} instructions, {total} samples")
        classes = collections.defaultdict(lambda: [0, 0, collections.Counter()])
        for x in rows:
            c = "0" if x["e"] == 0 else f"1e{len(str(x['e'])) - 1}"
            classes[c][0] += x["s"]
            classes[c][1] += 1
            for r in reasons:
                if int(x[r] or 0):
                    classes[c][2][r[6:]] += int(x[r])
        for c in sorted(classes):
            s, n, by = classes[c]
            print(f"  executed ~{c:>4}: {n:5d} instructions {s:7d} samples ({100 * s / total:5.1f}%)  " +
                  ", ".join(f"{a}={b}" for a, b in by.most_common(5)))
        for x in sorted(rows, key=lambda x: -x["s"])[:top]:
            print(f"    {x['Address'][-5:]} executed {x['e']:>8} samples {x['s']:6d}  "
                  f"{x['Source'].strip()[:60]:60s} {stalls(x, reasons)}")


def one_class(kernels, reasons, index, lo, hi):
    sel = [x for x in kernels[index]["rows"] if lo <= x["e"] < hi]
    print(f"\n-- kernel {index}: executed in [{lo}, {hi}): {len(sel)} instructions, "
          f"{sum(x['s'] for x in sel)} samples; by opcode:")
    by_op = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for x in sel:
        op = x["op"].split(".")[0]
        by_op[op][0] += x["s"]
        by_op[op][1] += 1
        for r in reasons:
            if int(x[r] or 0):
                by_op[op][2][r[6:]] += int(x[r])
    for op, (s, n, by) in sorted(by_op.items(), key=lambda t: -t[1][0])[:18]:
        print(f"   {op:12s} n={n:5d} samples={s:6d}  " + ", ".join(f"{a}={b}" for a, b in by.most_common(4)))
    for x in sorted(sel, key=lambda x: -x["s"])[:25]:
        print(f"    {x['Address'][-5:]} executed {x['e']:>8} samples {x['s']:6d}  "
              f"{x['Source'].strip()[:70]:70s} {stalls(x, reasons)}")


if __name__ == "__main__":
    kernels, reasons = read(sys.argv[1])
    summarize(kernels, reasons, int(sys.argv[2]) if len(sys.argv) > 2 else 12)
    if len(sys.argv) > 5:
        one_class(kernels, reasons, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
