"""The router benchmark's report: the text table and the computed-tokens vs imbalance plot.

Kept apart from :mod:`prefixkv.bench.route.run` (which runs the replays) so the figures can be
redrawn from ``--json`` files (several runs are merged):
``python -m prefixkv.bench.route.report a.json b.json --plot route.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

__all__ = ["format_table", "plot_results"]

Row = Mapping[str, Any]


_REQUIRED = object()


def _get(r: Any, name: str, default: Any = _REQUIRED) -> Any:
    if default is not _REQUIRED:  # a field older --json files lack
        return r.get(name, default) if isinstance(r, Mapping) else getattr(r, name, default)
    return r[name] if isinstance(r, Mapping) else getattr(r, name)


def max_over_mean(r: Any) -> float:
    """Requests of the busiest worker over the mean per worker: 1.0 is even, ``workers`` is
    everything on one (finite where max/min is not)."""
    counts = list(_get(r, "per_worker").values())
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 0.0


def format_table(results: Sequence[Any]) -> str:
    """A plain-text table (rows: ``PolicyResult`` or its dict), computed tokens relative to
    cache_aware in the same workload (to the first ``prefixkv`` row in a side by side)."""
    base: dict[str, int] = {}
    for r in results:
        if _get(r, "policy") in ("cache_aware", "prefixkv"):
            base.setdefault(_get(r, "workload"), _get(r, "computed_tokens"))
    lines = [(f"{'workload':<13} {'policy':<16} {'reqs':>5} {'prompt':>8} {'computed':>9} "
              f"{'vs CA':>6} {'cached':>7} {'req/s':>6} {'p50 s':>6} {'p99 s':>6} "
              f"{'pol us':>6} {'rtr ms':>6} {'rss MB':>6} {'max/min':>7} {'max/avg':>7}  per worker  "
              f"decisions")]
    for r in results:
        b = base.get(_get(r, "workload"))
        rel = f"{_get(r, 'computed_tokens') / b:.2f}x" if b else "-"
        cpu = _get(r, "router_cpu_ms")
        rss = _get(r, "rss_mb", None)
        lines.append(
            f"{_get(r, 'workload'):<13} {_get(r, 'policy'):<16} {_get(r, 'requests'):>5} "
            f"{_get(r, 'prompt_tokens'):>8} {_get(r, 'computed_tokens'):>9} {rel:>6} "
            f"{_get(r, 'cached_share'):>7.1%} {_get(r, 'requests_per_s'):>6.2f} "
            f"{_get(r, 'p50_s'):>6.2f} {_get(r, 'p99_s'):>6.2f} "
            f"{_get(r, 'policy_cpu_us'):>6.0f} {'-' if cpu is None else f'{cpu:.2f}':>6} "
            f"{'-' if rss is None else f'{rss:.0f}':>6} "
            f"{_get(r, 'max_min_load'):>7.2f} {max_over_mean(r):>7.2f}  {list(_get(r, 'per_worker').values())}  "
            + " ".join(f"{k}={v}" for k, v in sorted(_get(r, "reasons").items()))
        )
    return "\n".join(lines)


def progress(result: Any) -> None:
    """Print ``result``'s table row to stderr as soon as it is measured."""
    print(format_table([result]).splitlines()[1], file=sys.stderr, flush=True)


def report(results: Sequence[Any], json_path: str | None) -> None:
    """Print the table of ``results`` (dataclasses) and write them to ``json_path`` as JSON."""
    print(format_table(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)


def plot_results(results: Sequence[Any], path: str) -> None:
    """One panel per workload: computed prompt tokens (y) against the busiest worker's requests
    over the mean (x), one marker per policy (shared legend). Writes a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(_get(r, "workload") for r in results))
    cols = min(3, len(workloads))
    rows_n = -(-len(workloads) // cols)
    fig, grid = plt.subplots(rows_n, cols, figsize=(5.2 * cols, 4.0 * rows_n + 0.6),
                             squeeze=False)
    axes = [list(grid.flat)]
    for spare in axes[0][len(workloads):]:
        spare.set_visible(False)
    policies = list(dict.fromkeys(_get(r, "policy") for r in results))
    markers = "osD^vP*X<>"
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    style = {p: (markers[i % len(markers)], colors[i % len(colors)])
             for i, p in enumerate(policies)}
    for ax, w in zip(axes[0], workloads, strict=False):
        rows = [r for r in results if _get(r, "workload") == w]
        for r in rows:
            marker, color = style[_get(r, "policy")]
            ax.scatter([max_over_mean(r)], [_get(r, "computed_tokens")], s=70, marker=marker,
                       color=color, alpha=0.8, label=_get(r, "policy"))
        ax.set_title(f"{w} ({len(_get(rows[0], 'per_worker'))} workers)")
        ax.set_xlabel("busiest worker's requests / mean (1 = even)")
        ax.set_ylabel("computed prompt tokens")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    legend: dict[str, Any] = {}  # every policy once, from whichever panel shows it
    for ax in axes[0][: len(workloads)]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=len(policies),
               fontsize=8)
    fig.suptitle("prefixkv bench route: computed tokens vs load imbalance (loaded 2-core machine)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.06 / rows_n, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Redraw the table and (``--plot``) the figure from a ``prefixkv bench route --json``."""
    p = argparse.ArgumentParser(prog="python -m prefixkv.bench.route.report")
    p.add_argument("json_paths", nargs="+", metavar="JSON")
    p.add_argument("--plot", default=None, metavar="PNG")
    args = p.parse_args(argv)
    rows: list[Row] = []
    for path in args.json_paths:
        with open(path) as f:
            rows.extend(json.load(f))
    print(format_table(rows))
    if args.plot:
        plot_results(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
