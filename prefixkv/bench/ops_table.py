"""The tables ``prefixkv bench ops`` prints: its rows, their ratios to the first row, and our
time over each peer's (SGLang rows against our ``+array`` rows of the same block size, vLLM rows
against ``hash:sha256-bs16``), with notes on what the peers' figures count."""

from __future__ import annotations

from dataclasses import dataclass

from prefixkv.bench import ops_peers

__all__ = ["EVICT_TOKENS", "OpsRow", "format_table"]


@dataclass(slots=True)
class OpsRow:
    """One index's medians (microseconds), what its eviction freed, and memory (bytes per cached
    prefix; ``None`` where it cannot be measured). ``evict_tokens`` is the median of tokens
    freed per evict call; ``evict_units`` the mean of leaves (vLLM: blocks) freed per call, or
    ``None`` where the index does not say. ``note`` says what a peer's figures count."""

    index: str
    match_us: float
    insert_us: float
    evict_us: float
    evict_tokens: float
    evict_units: float | None
    bytes_per_prefix: float | None
    note: str = ""


EVICT_TOKENS = 10 * 1024
"""Tokens each evict call asks for: 10 leaves of the workload's 1,024-token prompts."""


def _fmt_bytes(b: float | None) -> str:
    return "n/a" if b is None else f"{b:.0f}"


def _fmt_freed(r: OpsRow) -> str:
    units = "" if r.evict_units is None else f"/{r.evict_units:.1f}"
    return f"{r.evict_tokens:.0f}{units}"


def format_table(rows: list[OpsRow]) -> str:
    """A readable table with ratios against the first row (the baseline); when peer rows are
    present, a second table of our speedup over each peer, and notes on the peers' units."""
    base = rows[0]
    head = (f"{'index':<32}{'match us':>10}{'insert us':>11}{'evict us':>10}"
            f"{'freed tok/leaves':>18}{'B/prefix':>10}   speedup vs {base.index} "
            "(match/insert/evict)")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.index:<32}{r.match_us:>10.1f}{r.insert_us:>11.1f}{r.evict_us:>10.1f}"
            f"{_fmt_freed(r):>18}{_fmt_bytes(r.bytes_per_prefix):>10}   "
            f"{base.match_us / r.match_us:6.2f}x {base.insert_us / r.insert_us:6.2f}x "
            f"{base.evict_us / r.evict_us:7.2f}x"
        )
    lines.append(f"evict: each call asks for {EVICT_TOKENS:,} tokens (10 leaves of 1,024); "
                 "freed tok/leaves: median tokens and mean leaves (vLLM: blocks) per call")
    peers = [r for r in rows if ops_peers.is_peer_kind(r.index)]
    if peers:
        lines += ["", _format_vs_peers(rows, peers)]
    return "\n".join(lines)


def _ours_for(peer: str, ours: dict[str, OpsRow]) -> OpsRow | None:
    """Our row to compare a peer with: same block size, array input for SGLang, sha256 hash
    index for vLLM."""
    name, _, bs, _ = ops_peers.parse_peer(peer)
    wanted = (["hash:sha256-bs16"] if name == "vllm"
              else [f"radix-bs{bs}+array", f"radix-bs{bs}"])
    return next((ours[k] for k in wanted if k in ours), None)


def _format_vs_peers(rows: list[OpsRow], peers: list[OpsRow]) -> str:
    ours = {r.index: r for r in rows if not ops_peers.is_peer_kind(r.index)}
    head = (f"{'peer':<32}{'ours':<20}  our time / peer's (match/insert/evict; < 1: ours "
            "faster)")
    lines = [head, "-" * len(head)]
    for p in peers:
        o = _ours_for(p.index, ours)
        ratios = ("   (no comparable row of ours)" if o is None else
                  f"{o.match_us / p.match_us:7.2f}x {o.insert_us / p.insert_us:6.2f}x "
                  f"{o.evict_us / p.evict_us:7.2f}x")
        lines.append(f"{p.index:<32}{o.index if o else '-':<20}{ratios}")
    families = sorted({"vllm" if p.index.startswith("vllm") else "sglang" for p in peers})
    lines += [""] + [f"* {ops_peers.NOTES[f]}" for f in families]
    return "\n".join(lines)
