"""prefixkv bench hostile: what one hostile request costs every other client of a server.

Issue 40's battery (items 4 and 5): a 10 MB body on every prompt route, 100k tiny chat
messages, 100k ``stop`` strings with ``n=64``, 100k ``logit_bias`` entries, 32 slow
``stop_regex`` patterns, a lone surrogate. First a victim (an 8-token greedy completion) is timed
alone; then each case is posted while the victim loops beside it on its own connection. Per
case: the status, the time to the answer, the answer's size, the server's RSS before, at its
peak during the request (sampled every 10 ms) and after (``/proc/PID/status``, with ``--pid``
or when the benchmark starts the server), and the victim's p50 / max over its requests that
overlapped the hostile one, the server's worst event-loop stall and the CPU time the server and
the sender (this process) ran meanwhile. The victim loops in a process of its own for the whole
run (``hostile_victim.py``; its "alone" figure is its first requests, before any case), so the
benchmark's own sending and sampling do not slow it; on a small machine they still take CPU
from the server, so ``--pin`` runs every case a second time with the sender on one CPU and the
server and victim on the others (a client on another machine), printing both. The target
(issue 40): every case answered in under a second, under 100 MB of extra memory, and the
victim's slowest request within 2x its slowest alone; each line says which of the three held
(the machine's other load moves the victim's figures too: compare runs of one session, and
repeat).

Without ``--url`` it starts ``prefixkv serve`` (the demo model, or ``--model``) on a free
loopback port and stops it after. Only loopback or your own servers: it sends what it says.

    python -m prefixkv.bench.hostile
    prefixkv bench hostile --url http://127.0.0.1:8000 --pid 1234 --only /tokenize
    prefixkv bench hostile --only /v1/completions /generate stop_regex --pin
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from prefixkv.bench.hostile_victim import VICTIM, Latencies, Pinning, Victim, process_cpu_s
from prefixkv.bench.load import rss_mb
from prefixkv.router.local import free_port, stop_processes

__all__ = ["VICTIM", "Case", "CaseResult", "HostileReport", "Latencies", "Pinning",
           "add_arguments", "default_cases", "main", "run_from_args", "run_hostile"]

@dataclass(frozen=True, slots=True)
class Case:
    """One hostile request: a label, the route, the raw body (sent as JSON)."""

    label: str
    path: str
    body: bytes

    @classmethod
    def of(cls, label: str, path: str, payload: Any) -> Case:
        """A case whose body is ``payload`` encoded as JSON."""
        return cls(label, path, json.dumps(payload).encode())


def default_cases(big_mb: float = 10.0) -> list[Case]:
    """Issue 40's battery; ``big_mb`` sizes the big bodies (the issue's: 10 MB)."""
    big = "word " * int(big_mb * 200_000)
    user = [{"role": "user", "content": big}]
    return [
        Case.of("completions, big prompt", "/v1/completions", {"prompt": big, "max_tokens": 1}),
        Case.of("chat, big message", "/v1/chat/completions", {"messages": user}),
        Case.of("messages, big message", "/v1/messages", {"messages": user, "max_tokens": 1}),
        Case.of("count_tokens, big message", "/v1/messages/count_tokens", {"messages": user}),
        Case.of("responses, big input", "/v1/responses", {"input": big}),
        Case.of("tokenize, big prompt", "/tokenize", {"prompt": big}),
        Case.of("tokenize, big message", "/tokenize", {"messages": user}),
        Case.of("generate, big text", "/generate",
                {"text": big, "sampling_params": {"max_new_tokens": 1}}),
        Case.of("chat, 100k tiny messages", "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "w " * 50}] * 100_000}),
        Case.of("100k stop strings, n=64", "/v1/completions",
                {"prompt": "hi", "n": 64, "max_tokens": 32,
                 "stop": [f"s{i}" for i in range(100_000)]}),
        Case.of("100k logit_bias entries", "/v1/completions",
                {"prompt": "hi", "max_tokens": 1,
                 "logit_bias": {str(i): 1.0 for i in range(100_000)}}),
        Case.of("32 slow stop_regex, n=4", "/v1/completions",
                {"prompt": "hi", "n": 4, "max_tokens": 64, "ignore_eos": True,
                 "allowed_token_ids": [ord("a")],
                 "stop_regex": [f"^(a|aa)+{c}" for c in "0123456789bcdefghijklmnopqrstuvw"]}),
        # not hostile: the same request without stop regexes, what any batch-mate costs the victim
        Case.of("n=4, 64 tokens, no stop_regex (reference)", "/v1/completions",
                {"prompt": "hi", "n": 4, "max_tokens": 64, "ignore_eos": True,
                 "allowed_token_ids": [ord("a")]}),
        # the same with a lookahead: RE2 cannot run it, so the backtracking engine's budget does
        Case.of("32 slow lookahead stop_regex, n=4", "/v1/completions",
                {"prompt": "hi", "n": 4, "max_tokens": 64, "ignore_eos": True,
                 "allowed_token_ids": [ord("a")],
                 "stop_regex": [f"^(a|aa)+(?={c})" for c in "0123456789bcdefghijklmnopqrstuvw"]}),
        Case("tokenize, lone surrogate", "/tokenize", b'{"prompt": "\\ud800x"}'),
    ]


@dataclass(frozen=True, slots=True)
class CaseResult:
    """What one case cost: its answer, the server's memory, the victim beside it."""

    label: str
    path: str
    body_mb: float
    status: int
    seconds: float
    response_bytes: int
    excerpt: str
    victim: Latencies
    rss_before_mb: float | None = None
    rss_peak_mb: float | None = None
    rss_after_mb: float | None = None
    loop_stall_s: float | None = None
    """The server's worst event-loop lag while the case ran, as the upper bound of its
    ``prefixkv:event_loop_lag_seconds`` bucket (``None``: a server without the series)."""
    server_cpu_ms: float | None = None
    """CPU time the server's threads ran while the case ran (``None`` without a pid)."""
    sender_cpu_ms: float | None = None
    """CPU time the benchmark's own process (the sender) ran meanwhile."""

    @property
    def extra_mb(self) -> float | None:
        """Peak RSS during the request less RSS before it (``None`` without a pid)."""
        if self.rss_before_mb is None or self.rss_peak_mb is None:
            return None
        return self.rss_peak_mb - self.rss_before_mb


@dataclass(slots=True)
class HostileReport:
    """The victim alone, then every case; whether the server answered ``/health`` after."""

    alone: Latencies
    results: list[CaseResult] = field(default_factory=list)
    healthy_after: bool = False
    pinning: Pinning | None = None

    def targets(self, result: CaseResult) -> dict[str, bool]:
        """Issue 40's three targets for one case: answered in under a second, under 100 MB
        extra (true when unknown), the victim's max within 2x its max alone."""
        extra = result.extra_mb
        return {"fast": result.seconds < 1.0,
                "memory": extra is None or extra < 100.0,
                "victim": result.victim.errors == 0 and result.victim.max_s <= 2 * self.alone.max_s}


@contextmanager
def _looping(action: Callable[[], None], pause_s: float = 0.0) -> Iterator[None]:
    """Run ``action`` over and over on a thread while the ``with`` body runs (then once more
    finishes)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            action()
            if pause_s:
                stop.wait(pause_s)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_case(url: str, case: Case, victim: Victim, *, pid: int | None = None,
             settle_s: float = 0.3, headers: dict[str, str] | None = None) -> CaseResult:
    """Post ``case`` while ``victim`` loops on ``url``; the victim's figures are over its
    requests that overlapped the hostile one (the ``settle_s`` before it if none did)."""
    peak: list[float] = []

    def sample() -> None:
        rss = rss_mb(pid)
        if rss is not None:
            peak.append(rss)

    time.sleep(settle_s)
    before = rss_mb(pid)
    lag_before = loop_lag_buckets(url, headers)
    with _looping(sample, pause_s=0.01):
        cpu = process_cpu_s(pid), process_cpu_s(os.getpid())
        start = time.monotonic()
        resp = httpx.post(url + case.path, content=case.body, timeout=600,
                          headers={"content-type": "application/json", **(headers or {})})
        end = time.monotonic()
        cpu_after = process_cpu_s(pid), process_cpu_s(os.getpid())
    after = rss_mb(pid)
    server_ms, sender_ms = ((None if b is None or a is None else (a - b) * 1e3)
                            for b, a in zip(cpu, cpu_after))
    stall = worst_bucket(lag_before, loop_lag_buckets(url, headers))
    time.sleep(settle_s)
    during = victim.window(start, end)
    if during.n == 0:
        during = victim.window(start - settle_s, end)
    return CaseResult(
        label=case.label, path=case.path, body_mb=len(case.body) / 1e6, status=resp.status_code,
        seconds=end - start, response_bytes=len(resp.content),
        excerpt=resp.text[:110].replace("\n", " "), victim=during,
        rss_before_mb=before, rss_peak_mb=max([*peak, after]) if after is not None else None,
        rss_after_mb=after, loop_stall_s=stall, server_cpu_ms=server_ms, sender_cpu_ms=sender_ms)


def loop_lag_buckets(url: str, headers: dict[str, str] | None = None) -> dict[float, float]:
    """The server's ``prefixkv:event_loop_lag_seconds`` buckets (upper bound -> cumulative
    count, summed over its labels); empty when ``/metrics`` does not have them."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", timeout=30, headers=headers).text
    except httpx.HTTPError:
        return {}
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "prefixkv:event_loop_lag_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                out[le] = out.get(le, 0.0) + sample.value
    return out


def worst_bucket(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The smallest bucket bound holding every observation made from ``before`` to ``after``
    (``inf``: one was past the last bound; ``None``: no series, or nothing observed)."""
    if not before or not after:
        return None
    bounds = sorted(after)
    total = after[bounds[-1]] - before.get(bounds[-1], 0.0)  # the +Inf bucket: every one
    if total <= 0:
        return None
    return next(le for le in bounds if after[le] - before.get(le, 0.0) >= total)


def run_hostile(url: str, cases: Sequence[Case], *, pid: int | None = None,
                alone_requests: int = 20, settle_s: float = 0.3,
                headers: dict[str, str] | None = None,
                on_alone: Callable[[Latencies], None] | None = None,
                on_result: Callable[[HostileReport, CaseResult], None] | None = None,
                pinning: Pinning | None = None) -> HostileReport:
    """Start the victim's process (5 warm-up requests), time ``alone_requests`` of its requests
    with nothing else sent, then run every case in order while it loops; the callbacks see each
    figure as it comes. With ``pinning`` (it needs ``pid``), the victim alone and every case run
    with the sender, the server and the victim on those CPUs."""
    if pinning is not None and pid is None:
        raise ValueError("pinning needs pid (the server's process id, to pin it)")
    victim = Victim(url, headers)
    try:
        with (nullcontext() if pinning is None or pid is None else
              pinning.applied(pid, victim.pid)):
            report = HostileReport(victim.count(alone_requests), pinning=pinning)
            if on_alone is not None:
                on_alone(report.alone)
            for case in cases:
                result = run_case(url, case, victim, pid=pid, settle_s=settle_s, headers=headers)
                report.results.append(result)
                if on_result is not None:
                    on_result(report, result)
    finally:
        victim.close()
    try:
        report.healthy_after = httpx.get(url + "/health", timeout=30).status_code == 200
    except httpx.HTTPError:
        report.healthy_after = False
    return report


def format_result(report: HostileReport, r: CaseResult) -> str:
    """One line per case, with the targets that held (+) and did not (-)."""
    mem = ("" if r.rss_before_mb is None or r.rss_peak_mb is None or r.rss_after_mb is None else
           f", RSS {r.rss_before_mb:.0f} -> peak {r.rss_peak_mb:.0f} -> {r.rss_after_mb:.0f} MB")
    marks = " ".join(("+" if ok else "-") + name for name, ok in report.targets(r).items())
    v = r.victim
    stall = ("" if r.loop_stall_s is None else
             f"; loop stall <= {r.loop_stall_s * 1e3:g} ms" if math.isfinite(r.loop_stall_s) else
             "; loop stall > 10 s")
    cpu = ("" if r.server_cpu_ms is None or r.sender_cpu_ms is None else
           f"; CPU server {r.server_cpu_ms:.0f} ms, sender {r.sender_cpu_ms:.0f} ms")
    return (f"{r.label} ({r.body_mb:.1f} MB, {r.path}): {r.status} in {r.seconds * 1e3:.0f} ms, "
            f"{r.response_bytes} B{mem}; victim n={v.n} p50 {v.p50_s * 1e3:.0f} ms "
            f"max {v.max_s * 1e3:.0f} ms errors {v.errors}{stall}{cpu} [{marks}] | {r.excerpt}")


@contextmanager
def served(model: str | None, *, timeout_s: float = 600.0) -> Iterator[tuple[str, int]]:
    """``prefixkv serve`` on a free loopback port for the ``with`` body: ``(url, pid)``."""
    port = free_port()
    cmd = [sys.executable, "-m", "prefixkv.cli", "serve", "--port", str(port),
           "--log-level", "warning", *([] if model is None else ["--model", model])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"prefixkv serve exited ({proc.returncode}): "
                                   f"{(proc.stderr.read() if proc.stderr else '')[-500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefixkv serve did not answer /health in {timeout_s:.0f} s")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        stop_processes([proc], timeout=30)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``prefixkv bench hostile`` flags."""
    p.add_argument("--url", help="a running server (default: start `prefixkv serve` on loopback)")
    p.add_argument("--pid", type=int, help="the server's process id, for its RSS (with --url)")
    p.add_argument("--model", help="the model of the server it starts (default: the demo model)")
    p.add_argument("--api-key", help="sent as a bearer token")
    p.add_argument("--big-mb", type=float, default=10.0, help="size of the big bodies (10)")
    p.add_argument("--only", nargs="+", metavar="TEXT",
                   help="run the cases whose label or route contains one of these")
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument("--pin", action="store_true",
                   help="after the usual run, run the cases again with the sender on one CPU and "
                        "the server + victim on the others (as a client on another machine); "
                        "both runs are printed (needs --pid with --url)")


def run_from_args(args: argparse.Namespace) -> int:
    """Print the victim alone and one line per case; exit 1 if the server was not healthy
    after."""
    cases = default_cases(args.big_mb)
    if args.only:
        cases = [c for c in cases if any(t in c.label or t in c.path for t in args.only)]
    headers = None if args.api_key is None else {"Authorization": f"Bearer {args.api_key}"}

    def alone(a: Latencies) -> None:
        print(f"victim alone: n={a.n} p50 {a.p50_s * 1e3:.0f} ms max {a.max_s * 1e3:.0f} ms "
              f"errors {a.errors}", flush=True)

    def go(url: str, pid: int | None, pinning: Pinning | None = None) -> HostileReport:
        return run_hostile(url, cases, pid=pid, headers=headers, on_alone=alone, pinning=pinning,
                           on_result=lambda rep, r: print(format_result(rep, r), flush=True))

    def both(url: str, pid: int | None) -> list[HostileReport]:
        reports = [go(url, pid)]  # unpinned first, always: the figure a deployment sees too
        if args.pin:
            pinning = Pinning.split()
            print(pinning.describe(), flush=True)
            reports.append(go(url, pid, pinning))
        return reports

    if args.pin and args.url is not None and args.pid is None:
        raise SystemExit("--pin with --url needs --pid (the server's process id, to pin it)")
    if args.url is None:
        with served(args.model) as (url, pid):
            reports = both(url, pid)
    else:
        reports = both(args.url, args.pid)
    healthy = all(r.healthy_after for r in reports)
    print(f"health after: {healthy}")
    if args.json is not None:
        data = _as_json(reports[0])
        if len(reports) > 1:
            data["pinned"] = _as_json(reports[1])
        args.json.write_text(json.dumps(data, indent=2))
    return 0 if healthy else 1


def _as_json(report: HostileReport) -> dict[str, Any]:
    rows = [{**asdict(r), "extra_mb": r.extra_mb, "targets": report.targets(r)}
            for r in report.results]
    pin = report.pinning
    cpus = None if pin is None else {"sender": sorted(pin.sender), "server": sorted(pin.server)}
    return {"alone": asdict(report.alone), "results": rows, "healthy_after": report.healthy_after,
            "cpus": cpus}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prefixkv.bench.hostile``."""
    p = argparse.ArgumentParser(prog="prefixkv bench hostile",
                                description=(__doc__ or "").split("\n")[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
