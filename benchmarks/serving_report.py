"""What a run's results become: summary statistics, the printed table, the JSON and the PNG."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from serving_client import RequestResult


def stats_ms(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    arr = np.asarray(values) * 1000.0
    return {"mean": float(arr.mean()), "median": float(np.median(arr)), "p99": float(np.percentile(arr, 99))}


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Throughputs and latency statistics of one run (token counts from the server's usage)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.completion_tokens - 1) for r in ok if r.completion_tokens > 1]
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "output_len_mismatches": sum(1 for r in ok if r.completion_tokens != r.output_len),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "input_throughput": in_tokens / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "mean_concurrency": sum(r.latency for r in ok) / duration,
        "ttft_ms": stats_ms([r.ttft for r in ok]),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([x for r in ok for x in r.itl]),
        "e2e_latency_ms": stats_ms([r.latency for r in ok]),
    }


def per_request_table(results: Sequence[RequestResult]) -> dict[str, list[float | int]]:
    return {
        "prompt_tokens": [r.prompt_tokens for r in results],
        "completion_tokens": [r.completion_tokens for r in results],
        "requested_output": [r.output_len for r in results],
        "ttft_s": [round(r.ttft, 5) for r in results],
        "latency_s": [round(r.latency, 5) for r in results],
        "start_s": [round(r.start, 5) for r in results],
    }


def print_summary(title: str, s: dict[str, Any]) -> None:
    print(f"\n{'=' * 18} {title} {'=' * 18}")
    rows = [
        ("Successful / failed requests", f"{s['completed']} / {s['failed']}"),
        ("Outputs not of the asked length", s["output_len_mismatches"]),
        ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
        ("Total input / output tokens", f"{s['total_input_tokens']} / {s['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{s['input_throughput']:.1f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("Mean concurrency", f"{s['mean_concurrency']:.1f}"),
        ("Client CPU (cores, this process)", f"{s.get('client_cpu_share', 0.0):.2f}"),
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        st = s[name]
        rows.append(
            (
                f"{name[:-3].upper()} mean / median / p99 (ms)",
                f"{st['mean']:.1f} / {st['median']:.1f} / {st['p99']:.1f}",
            )
        )
    for k, v in rows:
        print(f"{k:<40}{v:>24}")
    for e in s["errors"]:
        print(f"  error: {e}")


def write_json(doc: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)


def print_and_write_report(report: dict[str, Any], path: str) -> None:
    """Prints a comparison's summary (everything but its per-run details) and saves it all."""
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    write_json(report, path)


def plot_series(docs: Sequence[dict[str, Any]]) -> Iterator[tuple[str, list[int], list[dict[str, Any]]]]:
    for doc in docs:
        runs = sorted(doc["runs"], key=lambda r: r["concurrency"])
        yield doc["label"], [r["concurrency"] for r in runs], runs


def write_png(docs: Sequence[dict[str, Any]], path: str, title: str = "") -> None:
    """Output throughput, and median TTFT / TPOT / E2E latency, against concurrency; one line per result."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no PNG written", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    panels = [
        ("output_throughput", "output tok/s", None),
        ("ttft_ms", "median TTFT (ms)", "median"),
        ("tpot_ms", "median TPOT (ms)", "median"),
        ("e2e_latency_ms", "median end-to-end (ms)", "median"),
    ]
    for label, xs, runs in plot_series(docs):
        for ax, (key, _, sub) in zip(axes, panels, strict=True):
            ys = [r[key][sub] if sub else r[key] for r in runs]
            ax.plot(xs, ys, marker="o", label=label)
    for ax, (_, ylabel, _) in zip(axes, panels, strict=True):
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylabel)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
