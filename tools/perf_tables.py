"""Writes docs/performance.md, and the table of current numbers in README.md, from
docs/results/current/*.json (schema: docs/results/current/README.md).

    python3 tools/perf_tables.py          # rewrite both
    python3 tools/perf_tables.py --check  # exit 1 if either differs from what it would write,
                                          # a file breaks the schema, or a number differs
                                          # from its source record

Standard library only (Python 3.11+).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CURRENT = ROOT / "docs" / "results" / "current"
PERFORMANCE = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
README_BEGIN = "<!-- perf-summary:begin (tools/perf_tables.py writes this table) -->"
README_END = "<!-- perf-summary:end -->"

# The areas, in the order docs/performance.md shows them: (key, heading, what is measured).
AREAS = (
    ("products", "Plain products",
     "One product through `jax_hopper.dot_general` (the default path: the dispatcher's pick of our kernel or "
     "XLA's dot) against `jnp.dot` (cuBLASLt) on the same inputs, f16 and bf16 operands, f32 accumulation, "
     "16-bit results. Where the default path is XLA's dot both columns run the same program: their ratio is "
     "the noise of two identical calls, and \"forced\" shows our kernel under policy `\"kernel\"`."),
    ("decode", "Decode (small M)",
     "Products of 1 to 64 rows against a weight, as a model's decode step runs them, with the weight evicted "
     "from L2 before each timed call (`--l2 cold`): a decode step streams its weights from HBM. Our kernel here "
     "is the small-M split-K kind; the dispatcher runs it where rows are not 16-byte aligned and the weight is "
     "read in place (an odd K), and leaves aligned decode products, and those whose padding would copy the "
     "weight (an odd vocabulary), to XLA."),
    ("mlp", "Fused MLP training step",
     "The training step of a transformer MLP block y = act(x w1 + b1) w2 + b2 + x: the gradients of all four "
     "parameters of 0.5 sum(y^2), as `jax_hopper.mlp` (fused epilogues forward, the activation's derivative "
     "and the bias gradient fused backward) or as two `jax_hopper.dense` calls, against the same block written "
     "in jnp. Shapes are tokens x d_model x d_ff. Every product of the step that the dispatcher does not fuse "
     "runs cuBLASLt on both sides."),
    ("lm_head", "LM head",
     "A language model's output layer: 16-bit hidden states times a 16-bit weight. With f32 logits "
     "(`preferred_element_type=jnp.float32`) and a cross-entropy loss, the training step's cotangent is f32; "
     "`jax_hopper.dot` rounds it to 16 bits for the backward products (docs/numerics.md), where `jnp.dot` "
     "multiplies it in TF32. With 16-bit logits, the product alone. Shapes are tokens x d_model x vocabulary "
     "for the steps, M x N x K for the product."),
    ("grouped", "Grouped products (ragged_dot)",
     "`jax_hopper.ragged_dot` and its two gradient products (shape `GxMxNxK`: G groups over M rows; `fwd` the "
     "product, `dlhs` the cotangent against the weights read transposed, `drhs` the ragged contraction, the "
     "weight gradient) against the fastest JAX alternative in the same process, by each clock: "
     "`jax.lax.ragged_dot` (XLA's lowering), jax's Pallas Mosaic-GPU kernels (`ragged_dot_mgpu`, "
     "`transposed_ragged_dot_mgpu`) at their best block configurations, and the Pallas Triton lowering; the MoE "
     "step against the same flax layer on `jax.lax.ragged_dot`."),
    ("tensor_parallel", "Tensor-parallel block (2 GPUs)",
     "`python3 tools/bench.py --shapes= --tp-mlp TxDxF --devices 2`: x @ W1 column-parallel, GELU, @ W2 "
     "row-parallel (XLA's all-reduce), ours against jnp in one jitted block, wall time of back-to-back calls; and "
     "the block sequence parallel, `jax_hopper.collective`'s rings (variant \"jax_hopper ring\") against jnp "
     "with jax's all_gather and psum_scatter."),
    ("host", "Host cost per call",
     "One jitted call of 32 dependent products, so that one Python dispatch covers 32 launches: where the "
     "kernels are short, the sustained (wall-clock) time per call against the kernel time shows what each "
     "launch costs the host."),
)
AREA_KEYS = tuple(key for key, _, _ in AREAS)

REQUIRED_FILE = ("schema", "area", "title", "description", "rows")
INHERITED = ("gpu", "jax", "commit", "date", "protocol", "source")
REQUIRED_ROW = ("shape", "dtype", "path", "clock", "ours_ms", "jnp_ms", "ratio")
CLOCK_FIELDS = {"kernel": ("kernel_ms", "kernel_ratio_vs_jnp"), "sustained": ("sustained_ms", "sustained_ratio_vs_jnp")}
RATIO_TOLERANCE = 0.01  # ratio against jnp_ms / ours_ms (rounded times)
MS_DIGITS, RATIO_DIGITS = 6, 4  # how the current files round their copies of the source numbers


class SchemaError(Exception):
    pass


def load_current(directory: pathlib.Path = CURRENT) -> list[dict]:
    """Every current file, its rows completed with the file's defaults, sorted by name."""
    files = []
    for path in sorted(directory.glob("*.json")):
        doc = json.loads(path.read_text())
        doc["name"] = path.name
        for key in REQUIRED_FILE:
            if key not in doc:
                raise SchemaError(f"{path.name}: no {key!r}")
        if doc["schema"] != 1:
            raise SchemaError(f"{path.name}: schema {doc['schema']}, this script reads 1")
        if doc["area"] not in AREA_KEYS:
            raise SchemaError(f"{path.name}: unknown area {doc['area']!r} (one of {AREA_KEYS})")
        rows = []
        for i, row in enumerate(doc["rows"]):
            full = {key: doc[key] for key in INHERITED if key in doc}
            full.update(row)
            for key in REQUIRED_ROW + INHERITED:
                if key not in full:
                    raise SchemaError(f"{path.name} row {i}: no {key!r} (in the row or the file)")
            if "record" not in full and full["source"].get("format") != "printed table":
                raise SchemaError(f"{path.name} row {i}: no 'record' (the source record's key)")
            if full["clock"] not in CLOCK_FIELDS:
                raise SchemaError(f"{path.name} row {i}: clock {full['clock']!r}")
            expected = full["jnp_ms"] / full["ours_ms"]
            if abs(expected / full["ratio"] - 1) > RATIO_TOLERANCE:
                raise SchemaError(f"{path.name} row {i}: ratio {full['ratio']} but jnp_ms / ours_ms = {expected:.4f}")
            rows.append(full)
        doc["rows"] = rows
        files.append(doc)
    return sorted(files, key=lambda d: (d.get("order", 100), d["name"]))


def _records(source: dict, cache: dict) -> list[dict]:
    path = ROOT / source["file"]
    if path not in cache:
        cache[path] = json.loads(path.read_text())
    node = cache[path]
    for part in (source.get("part") or "").split("."):
        if part:
            node = node[part]
    return node["rows"]


def _is_record(record: dict, key: dict) -> bool:
    """Whether a source record has the key's batch, m, n, k, layout and dtype (a batch of 0
    and none are the same)."""
    return all((record.get(k) or 0) == (v or 0) if k == "batch" else record.get(k) == v for k, v in key.items())


def check_sources(files: list[dict]) -> list[str]:
    """Each row's numbers against its source record (rows from printed tables excepted)."""
    problems, cache = [], {}
    for doc in files:
        for i, row in enumerate(doc["rows"]):
            source = row["source"]
            where = f"{doc['name']} row {i} ({row['shape']} {row['dtype']} {row['clock']})"
            if not (ROOT / source["file"]).exists():
                problems.append(f"{where}: source {source['file']} does not exist")
                continue
            if source.get("format") == "printed table":
                continue
            matching = {record["variant"]: record for record in _records(source, cache)
                        if _is_record(record, row["record"])}
            ms, ratio = CLOCK_FIELDS[row["clock"]]
            pairs = [("ours", "ours_ms", "ratio"), ("jnp", "jnp_ms", None), ("forced", "forced_ms", "forced_ratio")]
            for role, ms_key, ratio_key in pairs:
                if role not in source or ms_key not in row:
                    if ms_key in row:
                        problems.append(f"{where}: {ms_key} given but the source names no {role!r} variant")
                    continue
                record = matching.get(source[role])
                if record is None:
                    problems.append(f"{where}: no record of variant {source[role]!r} in {source['file']}")
                    continue
                if round(record[ms], MS_DIGITS) != row[ms_key]:
                    problems.append(f"{where}: {ms_key} {row[ms_key]} but the source has {record[ms]}")
                if ratio_key and round(record[ratio], RATIO_DIGITS) != row[ratio_key]:
                    problems.append(f"{where}: {ratio_key} {row[ratio_key]} but the source has {record[ratio]}")
    return problems


def _ms(value: float) -> str:
    return f"{value:.4g}" if value < 1000 else f"{value:.0f}"


def _protocol(row: dict) -> str:
    p = row["protocol"]
    if row["clock"] == "kernel":
        return f"kernel time, L2 {p['l2']}, median of {p['kernel_samples']}"
    rounds = p["sustained_rounds"]
    return f"sustained, {rounds} round{'s' if rounds != 1 else ''}"


def _shape(row: dict) -> str:
    layout = row.get("layout")
    return row["shape"] + (f" {layout.upper()}" if layout and layout != "nn" else "")


def _path(row: dict) -> str:
    return row["path"] + (f", {row['kind']}" if row.get("kind") else "")


def _source_line(doc: dict) -> list[str]:
    """The list entry for one file: what ran and where its numbers come from."""
    runs = sorted({(r["commit"], r["date"], r["gpu"], r["jax"], r["source"]["file"], _protocol_summary(r["protocol"]))
                   for r in doc["rows"]})
    lines = [f"- **{doc['title']}** (`docs/results/current/{doc['name']}`). {doc['description']}"]
    for commit, date, gpu, jax, file, protocol in runs:
        lines.append(f"  - {commit}, {date}, {gpu}, jax {jax}, {protocol}: `{file}`")
    return lines


def _protocol_summary(p: dict) -> str:
    rounds = p["sustained_rounds"]
    text = (f"kernel time median of {p['kernel_samples']} (L2 {p['l2']}), "
            f"sustained {rounds} round{'s' if rounds != 1 else ''}")
    if "sustained_order" in p:
        text += f" ({p['sustained_order']})"
    return text


# The comparison column's heading where it is not jnp.dot (or jnp's own block).
COMPARISON = {"grouped": "JAX's fastest ms"}


def area_table(rows: list[dict], comparison: str = "jnp.dot ms") -> list[str]:
    has_case = any("case" in r for r in rows)
    has_forced = any("forced_ms" in r for r in rows)
    head = (["case"] if has_case else []) + ["shape", "dtype", "default path", "protocol", "ours ms", comparison,
                                             "ratio"]
    head += (["our kernel forced: ms (ratio)"] if has_forced else []) + ["GPU", "commit"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        cells = ([r.get("case", "")] if has_case else []) + [
            _shape(r), r["dtype"], _path(r), _protocol(r), _ms(r["ours_ms"]), _ms(r["jnp_ms"]), f"{r['ratio']:.3f}"]
        if has_forced:
            cells.append(f"{_ms(r['forced_ms'])} ({r['forced_ratio']:.3f})" if "forced_ms" in r else "")
        cells += [r["gpu"].removeprefix("NVIDIA "), r["commit"]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def performance_md(files: list[dict]) -> str:
    out = [
        "# Performance",
        "",
        "<!-- Written by tools/perf_tables.py from docs/results/current/*.json: edit those, then run it. -->",
        "",
        "Current numbers of the default path (`jax_hopper` as a user calls it, policy `\"auto\"`) against `jnp.dot` "
        "or the same computation in jnp, in the same process. **ratio = jnp time / ours**: above 1 ours is faster. "
        "Two clocks, compared only with themselves: *kernel time* is the device time of every kernel one call "
        "launches (CUPTI, the median over interleaved samples; L2 *warm* leaves the operands as the profiler's "
        "untimed call just before leaves them, L2 *cold* evicts them first); *sustained* is wall time per call over "
        "back-to-back asynchronous calls, where the chip runs at its power limit. Sustained ratios within about 1% "
        "of 1.0 are a tie: two identical XLA programs read up to that far apart. Inputs are standard normal scaled "
        "by K^-1/4, rotated among enough sets that they do not all sit in L2. Each table's sources name the benchmark "
        "command that produced their records; [development.md](development.md) describes the benchmark and how to "
        "record results.",
        "",
        "Rows for other dispatcher decisions, and the measurements behind each rule, are in "
        "[docs/results/evidence/](results/evidence/README.md).",
    ]
    for key, heading, intro in AREAS:
        docs = [d for d in files if d["area"] == key]
        out += ["", f"## {heading}", "", intro, ""]
        if not docs:
            out.append("No measurement of the current code is recorded (no file in docs/results/current for this "
                       "area).")
            continue
        rows = [r for d in docs for r in d["rows"]]
        out += area_table(rows, COMPARISON.get(key, "jnp.dot ms"))
        out += ["", "Sources:", ""]
        for d in docs:
            out += _source_line(d)
    return "\n".join(out) + "\n"


def summary_table(files: list[dict]) -> str:
    """The README's table: rows with a `summary` label, kernel time and sustained side by side;
    our kernel's paths first (fastest first), then XLA's."""
    cases = {}
    for doc in files:
        for r in doc["rows"]:
            if "summary" in r:
                cases.setdefault((r["summary"], _shape(r), r["dtype"]), {})[r["clock"]] = r

    def rank(item):
        (label, shape, dtype), clocks = item
        row = clocks.get("kernel") or clocks["sustained"]
        return (row["path"].startswith("xla"), -row["ratio"], label, shape, dtype)

    lines = [README_BEGIN,
             "| case | shape | dtype | default path | ratio, kernel time | ratio, sustained | our kernel forced |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for (label, shape, dtype), clocks in sorted(cases.items(), key=rank):
        k, s = clocks.get("kernel"), clocks.get("sustained")
        kernel = f"{k['ratio']:.2f}x" if k else ""
        sustained = f"{s['ratio']:.2f}x" if s else ""
        forced = f"{k['forced_ratio']:.2f}x" if k and "forced_ratio" in k else ""
        lines.append(f"| {label} | {shape} | {dtype} | {_path(k or s)} | {kernel} | {sustained} | {forced} |")
    lines.append(README_END)
    return "\n".join(lines)


def readme_with_summary(readme: str, table: str) -> str:
    begin, end = readme.find(README_BEGIN), readme.find(README_END)
    if begin < 0 or end < begin:
        raise SchemaError(f"README.md has no {README_BEGIN!r} ... {README_END!r} block")
    return readme[:begin] + table + readme[end + len(README_END):]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if docs/performance.md or README.md is stale or a row is wrong")
    args = parser.parse_args(argv)
    try:
        files = load_current()
        problems = check_sources(files)
        performance = performance_md(files)
        readme = readme_with_summary(README.read_text(), summary_table(files))
    except (SchemaError, KeyError, ValueError) as e:
        print(f"perf_tables: {e}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"perf_tables: {problem}", file=sys.stderr)
    if args.check:
        stale = [p for p, text in ((PERFORMANCE, performance), (README, readme))
                 if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"perf_tables: {p.relative_to(ROOT)} is stale: run python3 tools/perf_tables.py", file=sys.stderr)
        return 1 if stale or problems else 0
    if problems:
        return 1
    PERFORMANCE.write_text(performance)
    README.write_text(readme)
    return 0


if __name__ == "__main__":
    sys.exit(main())
