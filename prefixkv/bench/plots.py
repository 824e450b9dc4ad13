"""Charts for the benchmarks (matplotlib, Agg backend: no display needed).

:func:`plot_hit_rates` draws token hit rate against cache capacity, one line per policy, with
the unbounded cache as a dashed ceiling, like Mooncake FAST'25 Figure 9.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path

from prefixkv.bench.trace import TraceRow, format_tokens


def plot_hit_rates(rows: Sequence[TraceRow], path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG of hit rate vs capacity (log x axis) to ``path``; returns the path.

    Rows with ``capacity_tokens=None`` (the unbounded cache) become a horizontal line.
    ``ValueError`` if no row has a finite capacity.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [(r.policy, r.capacity_tokens, r.hit_rate) for r in rows
              if r.capacity_tokens is not None]
    if not finite:
        raise ValueError("rows: need at least one row with a finite capacity_tokens to plot")
    out = Path(path)
    fig, ax = plt.subplots(figsize=(7.0, 4.5), dpi=120)
    try:
        markers = "os^Dvx*"
        for i, policy in enumerate(dict.fromkeys(p for p, _, _ in finite)):
            pts = sorted((c, h) for p, c, h in finite if p == policy)
            xs = [p[0] for p in pts]
            ys = [p[1] for p in pts]
            style = "--" if policy == "belady" else "-"
            ax.plot(xs, ys, style, marker=markers[i % len(markers)], markersize=5,
                    label=policy, alpha=0.9)
        for r in rows:
            if r.capacity_tokens is None:
                ax.axhline(r.hit_rate, color="gray", linestyle=":",
                           label=f"unbounded ({r.hit_rate:.3f})")
                break
        caps = sorted({c for _, c, _ in finite})
        ax.set_xscale("log")
        ax.set_xticks(caps)
        ax.set_xticklabels([format_tokens(c) for c in caps])
        ax.minorticks_off()
        ax.set_xlabel("cache capacity (tokens)")
        ax.set_ylabel("token hit rate")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.set_title(title or "Prefix cache hit rate vs capacity")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out


def plot_expert_history(rows: Sequence[TraceRow], path: str | Path, *, end_time: float,
                        title: str | None = None, xlabel: str = "clock",
                        request_times: Sequence[float] | None = None) -> Path:
    """Write a PNG of the expert an adaptive policy chose over time, one panel per row that has
    an ``expert_history`` (clock time on x, from 0 to ``end_time``); returns the path.

    With ``request_times`` (the clock time of each request, non-decreasing), x is the number
    of requests served instead (each switch placed at the first request at or after its
    time), so bursts of requests get the room they take in the hit rate.
    ``ValueError`` if no row has an expert history.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.expert_history]
    if not rows:
        raise ValueError("rows: no row has an expert_history (run an adaptive policy)")
    from prefixkv.cache.policy_experts import EXPERTS

    seen = {e for r in rows for _, e in (r.expert_history or ())}
    names = [e for e in EXPERTS if e in seen] + sorted(seen - set(EXPERTS))
    out = Path(path)
    fig, axes = plt.subplots(len(rows), 1, figsize=(8.0, 1.2 + 1.1 * len(rows)), dpi=120,
                             sharex=True, squeeze=False)
    try:
        for ax, r in zip(axes[:, 0], rows):
            hist = list(r.expert_history or ())
            xs = [max(0.0, t) if t != float("-inf") else 0.0 for t, _ in hist] + [end_time]
            if request_times is not None:
                xs = [float(bisect.bisect_left(request_times, x)) for x in xs[:-1]]
                xs.append(float(len(request_times)))
            ys = [names.index(e) for _, e in hist]
            ys.append(ys[-1])
            ax.step(xs, ys, where="post", color="tab:blue")
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels(names, fontsize=8)
            ax.set_ylim(-0.5, len(names) - 0.5)
            cap = format_tokens(r.capacity_tokens) if r.capacity_tokens else "unbounded"
            share = ", ".join(f"{k} {v:.0%}" for k, v in (r.expert_share or {}).items())
            ax.set_title(f"{r.policy} @ {cap} tokens: hit rate {r.hit_rate:.4f} ({share})",
                         fontsize=9, loc="left")
            ax.grid(True, alpha=0.3)
        axes[-1, 0].set_xlabel(xlabel)
        fig.suptitle(title or "expert chosen over time", fontsize=10)
        fig.tight_layout()
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out
