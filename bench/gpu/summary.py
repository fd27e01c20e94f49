"""The device run's figures in one place: summary.json beside the benchmarks' JSON documents,
and a short table on stdout (the device reply keeps only the end of the output).

    python -m bench.gpu.summary OUT_DIR STEPS_TSV
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def steps(path: Path) -> list[dict[str, Any]]:
    """The run script's step records: name, rc (or 'skipped'), seconds, limit."""
    rows: list[dict[str, Any]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        name, rc, seconds, limit = [*line.split("\t"), "", "", ""][:4]
        rows.append({"step": name, "rc": rc, "s": seconds, "limit_s": limit})
    return rows


def load(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def ceiling_rows(out: Path) -> list[dict[str, Any]]:
    """One row per concurrency from every ceiling-c*.json."""
    rows: list[dict[str, Any]] = []
    for path in sorted(out.glob("ceiling-c*.json")):
        doc = load(path)
        if doc is None:
            continue
        for c, cell in doc.get("results", {}).items():
            http = cell.get("http", {})
            rows.append(
                {
                    "c": int(c),
                    "transformers_tok_s": cell.get("transformers", {}).get("tok_s"),
                    "engine_tok_s": cell.get("engine", {}).get("tok_s"),
                    "http_tok_s": http.get("tok_s"),
                    "http_over_offline_max": cell.get("http_over_offline_max"),
                    "engine_over_transformers": cell.get("engine_over_transformers"),
                    "engine_mean_batch": cell.get("engine", {}).get("mean_batch"),
                    "http_mean_batch": http.get("mean_batch"),
                    "http_ttft_ms": http.get("ttft_ms"),
                    "http_errors": sum((http.get("errors") or {}).values()),
                }
            )
    return sorted(rows, key=lambda row: row["c"])


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'C':>5} {'transformers':>12} {'engine':>9} {'http':>9} {'http/max':>8} "
    head += f"{'eng/tf':>7} {'batch e/h':>11} {'ttft p50/p99 ms':>17} {'err':>4}"
    lines = [head]
    for r in rows:
        ttft = r["http_ttft_ms"] or {}
        lines.append(
            f"{r['c']:>5} {r['transformers_tok_s']!s:>12} {r['engine_tok_s']!s:>9} "
            f"{r['http_tok_s']!s:>9} {r['http_over_offline_max']!s:>8} "
            f"{r['engine_over_transformers']!s:>7} "
            f"{r['engine_mean_batch']!s:>5}/{r['http_mean_batch']!s:<5} "
            f"{ttft.get('p50')!s:>8}/{ttft.get('p99')!s:<8} {r['http_errors']!s:>4}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    out, steps_tsv = Path(argv[0]), Path(argv[1])
    model = load(out / "model.json")
    first = next((load(p) for p in sorted(out.glob("ceiling-c*.json"))), None)
    workload = None
    if first is not None:
        workload = {k: first.get(k) for k in ("device", "dtype", "prompt_words", "max_tokens")}
    rows = ceiling_rows(out)
    done = steps(steps_tsv)
    vllm = load(out / "vllm.json")
    summary = {
        "steps": done,
        "model": model,
        "workload": workload,
        "engine_ceiling": rows,
        "vllm": vllm,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print("== steps: " + ", ".join(f"{s['step']} rc={s['rc']} {s['s']}s" for s in done))
    if model:
        millions = model["parameters"] / 1e6
        print(f"== model: {millions:.1f} M params, {model['dtype']}, {model['shape']}")
    print(f"== workload: {workload}")
    print("== engine ceiling, output tokens/s (tokenyard HTTP vs the engine alone):")
    print(table(rows) if rows else "(no engine-ceiling result)")
    if vllm:
        print("== vllm ratios:", json.dumps(vllm.get("ratios")))


if __name__ == "__main__":
    main(sys.argv[1:])
