"""Owns: ``prefixkv cache ...``: a client of a server's or a router's cache admin routes.
Imports: prefixkv.wire (the fan-out rows); talks HTTP, imports no server or router code.

``prefixkv cache stats | pin | unpin | lookup | list-pinned | reset``: seed 004's cache commands
(``lookup``: where a prompt's prefix is cached, per tier).

A client of a running ``prefixkv serve`` (``--url``, default ``$PREFIXKV_BASE_URL`` or
http://127.0.0.1:8000) or of ``prefixkv route``, whose admin routes answer with every worker's
answer (:mod:`prefixkv.router.admin`): those are printed worker by worker, each one as a
server's would be, or its error; the exit status is 1 when a worker failed. Failures of the
call itself raise ``ValueError`` / ``OSError`` / ``RuntimeError`` with one clear line, which
``prefixkv.cli.main`` prints before exiting with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from typing import Any

from prefixkv.wire.fanout import worker_rows

DEFAULT_URL = "http://127.0.0.1:8000"


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``cache`` and its commands to the ``prefixkv`` parser."""
    p = sub.add_parser("cache", help="inspect and manage a running server's prefix cache",
                       description="Cache commands against a running `prefixkv serve`, or "
                                   "`prefixkv route` (every worker's answer, one by one).")
    csub = p.add_subparsers(dest="cache_command", metavar="CACHE_COMMAND", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--url", default=os.environ.get("PREFIXKV_BASE_URL", DEFAULT_URL),
                       help=f"server base URL (default: $PREFIXKV_BASE_URL or {DEFAULT_URL})")
        q.add_argument("--api-key", default=os.environ.get("PREFIXKV_ADMIN_API_KEY")
                       or os.environ.get("PREFIXKV_API_KEY"),
                       help="the server's admin key, or its API key when it has no admin key "
                            "(default: $PREFIXKV_ADMIN_API_KEY, else $PREFIXKV_API_KEY)")
        q.add_argument("--json", action="store_true", help="print the raw JSON response")
        q.add_argument("--timeout", type=float, default=600.0,
                       help="seconds to wait for the server (default 600)")

    def prefix(q: argparse.ArgumentParser) -> None:
        which = q.add_mutually_exclusive_group(required=True)
        which.add_argument("--tokens", help='token ids, comma separated: "1,2,3"')
        which.add_argument("--text", help="text, tokenized as a completion prompt")
        q.add_argument("--cache-salt", default=None, help="tenant namespace (cache_salt)")

    q = csub.add_parser("stats", help="print prefix cache statistics")
    common(q)
    q.set_defaults(func=_cache_stats)
    q = csub.add_parser("pin", help="compute (if needed) and pin a prefix against eviction")
    common(q)
    prefix(q)
    q.add_argument("--description", default=None, help="a note shown by list-pinned")
    q.add_argument("--ttl", type=float, default=None, metavar="SECONDS",
                   help="soft-retain instead of pinning: kept this long after its last hit, "
                        "evicted only after every unretained block (default with --priority: 300)")
    q.add_argument("--priority", type=int, default=None,
                   help="soft-retain at this priority, 0-100: lower priorities go first among "
                        "retained blocks (default with --ttl: 100)")
    q.set_defaults(func=_cache_pin)
    q = csub.add_parser("unpin", help="unpin a pinned prefix")
    common(q)
    prefix(q)
    q.set_defaults(func=_cache_unpin)
    q = csub.add_parser("lookup", help="where a prefix is cached: the pool and each KV tier")
    common(q)
    prefix(q)
    q.set_defaults(func=_cache_lookup)
    q = csub.add_parser("list-pinned", help="list pinned prefixes")
    common(q)
    q.set_defaults(func=_cache_list_pinned)
    q = csub.add_parser("reset", help="unpin everything and drop all unused cached blocks")
    common(q)
    q.add_argument("--tiers", default="local", nargs="?", const="all",
                   help="lower KV tiers to clear too: local (host tier, default), all (also disk "
                        "and the shared remote; a bare --tiers), none, or names: "
                        "host,disk,remote")
    q.set_defaults(func=_cache_reset)


def _request(args: argparse.Namespace, method: str, path: str,
             body: dict[str, Any] | None = None) -> dict[str, Any]:
    """Call the server; a non-2xx answer or an unreachable server raises with one line."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.rstrip("/") + path
    try:
        r = httpx.request(method, url, json=body, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        raise OSError(f"cannot reach the server at {args.url}: {exc}") from exc
    try:
        data = r.json()
    except ValueError:
        data = None
    if r.status_code >= 400 and worker_rows(data) is None:
        msg = (data or {}).get("error", {}).get("message") if isinstance(data, dict) else None
        raise RuntimeError(f"{r.status_code} from {url}: {msg or r.text.strip()[:200]}")
    if isinstance(data, dict):
        return data
    raise RuntimeError(f"unexpected response from {url}: {r.text.strip()[:200]}")


def _prefix_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if args.tokens is not None:
        try:
            ids = [int(t) for t in args.tokens.replace(" ", "").split(",") if t != ""]
        except ValueError as exc:
            raise ValueError(f'--tokens must be comma separated ints like "1,2,3", '
                             f"got {args.tokens!r}") from exc
        if not ids or any(i < 0 for i in ids):
            raise ValueError(f"--tokens must hold non-negative ints, got {args.tokens!r}")
        body["token_ids"] = ids
    else:
        body["text"] = args.text
    if args.cache_salt is not None:
        body["cache_salt"] = args.cache_salt
    return body


def _show(args: argparse.Namespace, data: dict[str, Any], render: Callable[[Any], str]) -> int:
    """Print a server's answer as ``render`` words it (or the JSON); a router's, worker by
    worker, each answer or its error. Exit status 1 when a worker failed."""
    if args.json:
        print(json.dumps(data, indent=2))
    rows = worker_rows(data)
    if rows is None:
        if not args.json:
            print(render(data))
        return 0
    failed = 0
    for w in rows:
        ok = 200 <= w["status"] < 300 and isinstance(w["body"], dict)
        failed += not ok
        if args.json:
            continue
        if ok:
            text = render(w["body"])
        else:
            err = w["body"].get("error") if isinstance(w["body"], dict) else None
            text = f"error {w['status']}: {(err or {}).get('message') or w['body']}"
        print(f"worker {w['worker']}:\n" + "\n".join(f"  {line}" for line in text.splitlines()))
    return 1 if failed else 0


def _cache_stats(args: argparse.Namespace) -> int:
    return _show(args, _request(args, "GET", "/v1/cache/stats"), _stats_text)


def _stats_text(d: dict[str, Any]) -> str:
    c = d.get("cache")
    lines = ["Prefix Cache Statistics:"]
    if c is None:
        lines.append("  Prefix caching: disabled")
    else:
        lines += [
            f"  Index: {c['index']} (block size {c['block_size']}, policy {c['policy']})",
            (f"  Total Entries: {c['cached_blocks']} blocks ({c['pinned_blocks']} pinned, "
             f"{c['locked_blocks']} in use), {c['num_nodes']} nodes"),
            (f"  Hit Rate: {100 * c['query_hit_rate']:.1f}% of lookups, "
             f"{100 * c['token_hit_rate']:.1f}% of tokens ({c['hits']}/{c['queries']} lookups)"),
            f"  Avg Match Length: {c['avg_match_length']:.1f} tokens",
            f"  Avg Query Time: {c['avg_match_us']:.1f}µs",
            f"  Memory Usage: {_size(c['memory_bytes'])} (index metadata)",
            f"  Evictions: {c['evicted_blocks']} blocks in {c['evictions']} calls",
        ]
    lines += [
        f"  KV Blocks: {d['num_free_blocks']} free of {d['num_kv_blocks']}",
        (f"  Requests: {d['num_running']} running, {d['num_waiting']} waiting, "
         f"{d['num_requests_finished']} finished"),
        (f"  Prompt Tokens: {d['num_prompt_tokens']} ({d['num_cached_prompt_tokens']} from "
         f"cache, {100 * d['prefix_cache_hit_rate']:.1f}%)"),
    ]
    for t in d.get("tiers") or []:  # lower KV tiers (docs/tiers.md)
        cap = f"/{t['capacity_blocks']}" if t["capacity_blocks"] else ""
        mean = 1000 * t["load_seconds"] / t["hits"] if t["hits"] and t["tier"] != "pool" else 0.0
        lines.append(
            f"  Tier {t['tier']}: {t['hits']} block hits ({t['hit_tokens']} tokens"
            + (f", {mean:.2f}ms/block" if mean else "") + f"), holds {t['occupancy_blocks']}"
            f"{cap} blocks, {t['evictions']} evictions, {t['errors']} errors")
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f}MB" if n >= 2**20 else f"{n / 2**10:.1f}KB"


def _cache_pin(args: argparse.Namespace) -> int:
    body = _prefix_body(args)
    if args.description is not None:
        body["description"] = args.description
    if args.ttl is not None:
        body["ttl_s"] = args.ttl
    if args.priority is not None:
        body["priority"] = args.priority
    try:
        d = _request(args, "POST", "/v1/cache/pin", body)
    except RuntimeError as exc:
        short = _SHORTER.search(str(exc))
        if short is None:
            raise
        return _nothing_to_pin(args, int(short.group(1)), int(short.group(2)))
    rows = worker_rows(d)
    errors = [] if rows is None else [json.dumps(w["body"]) for w in rows if w["status"] == 400]
    shorts = [m for m in map(_SHORTER.search, errors) if m is not None]
    if rows and len(shorts) == len(rows):  # a router: every worker said the same
        return _nothing_to_pin(args, int(shorts[0].group(1)), int(shorts[0].group(2)))
    sent = len(body.get("token_ids") or [])

    def text(p: dict[str, Any]) -> str:
        if p.get("retained"):
            return (f"retained {p['num_blocks']} blocks at priority {p['priority']} for "
                    f"{p['ttl_s']:g} s after each hit")
        note = ""
        if sent > p["num_tokens"]:
            note = (f"; the last {sent - p['num_tokens']} of the {sent} tokens were not pinned "
                    "(a partial block: only whole blocks are cached)")
        return (f"pinned {p['num_tokens']} tokens ({p['num_blocks']} blocks)"
                + (f": {p['description']}" if p.get("description") else "") + note)

    return _show(args, d, text)


_SHORTER = re.compile(r"prefix of (\d+) tokens is shorter than one block \((\d+)\)")


def _nothing_to_pin(args: argparse.Namespace, tokens: int, block_size: int) -> int:
    """A prefix shorter than one block: not an error (the README's system prompt is 6 tokens
    on SmolLM2, 16 to a block) but nothing to pin; say so, the minimum, and what to do."""
    message = (f"nothing pinned: the prefix is {tokens} tokens, shorter than one "
               f"{block_size}-token KV block (the cache keeps whole blocks only, and a prefix "
               f"this short costs next to nothing to recompute); pin a longer text, at least "
               f"{block_size} tokens, such as the whole system prompt")
    if args.json:
        print(json.dumps({"num_tokens": 0, "num_blocks": 0, "prompt_tokens": tokens,
                          "block_size": block_size, "message": message}, indent=2))
    else:
        print(message)
    return 0


def _cache_unpin(args: argparse.Namespace) -> int:
    return _show(args, _request(args, "POST", "/v1/cache/unpin", _prefix_body(args)),
                 lambda _: "unpinned")


def _cache_lookup(args: argparse.Namespace) -> int:
    def text(d: dict[str, Any]) -> str:
        parts = ", ".join(f"{name} {n}" for name, n in d["tiers"].items())
        return f"{d['cached_tokens']} of {d['prompt_tokens']} prompt tokens cached ({parts})"

    return _show(args, _request(args, "POST", "/v1/cache/lookup", _prefix_body(args)), text)


def _cache_list_pinned(args: argparse.Namespace) -> int:
    return _show(args, _request(args, "GET", "/v1/cache/pinned"), _pinned_text)


def _pinned_text(d: dict[str, Any]) -> str:
    rows = d["data"]
    if not rows:
        return "no pinned prefixes"
    lines = [f"{'TOKENS':>7} {'BLOCKS':>6}  {'CACHE_SALT':<12} {'DESCRIPTION':<28} FIRST TOKEN IDS"]
    for r in rows:
        head = ",".join(str(t) for t in r["token_ids"][:8]) + ("..." if r["num_tokens"] > 8 else "")
        ns = "-" if r["cache_salt"] is None else r["cache_salt"]
        lines.append(f"{r['num_tokens']:>7} {r['num_blocks']:>6}  {ns:<12} "
                     f"{(r['description'] or '-'):<28} {head}")
    return "\n".join(lines)


def _cache_reset(args: argparse.Namespace) -> int:
    def text(d: dict[str, Any]) -> str:
        tiers = "".join(f", {k}: {'unreachable' if v is None else v}"
                        for k, v in d.get("tiers", {}).items())
        return f"cache reset ({d['freed_blocks']} blocks freed{tiers})"

    return _show(args, _request(args, "POST", "/v1/cache/reset", {"tiers": args.tiers}), text)
