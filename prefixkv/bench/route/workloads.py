"""The router benchmark's workloads: named presets of scripted sessions and worker pools.

- ``chat``: multi-turn chat, a short shared system prompt, every session's history distinct.
- ``shared_prefix``: few-shot / long document: every user's prompt starts with the same long
  text (``system_words`` words) and asks a couple of short questions.
- ``eviction``: shorter chat sessions over workers with small KV pools (``--num-kv-blocks 64``,
  1,024 tokens each: four sessions of up to ~800 tokens per worker), so the working set exceeds
  the caches and eviction decides.

A flag given on the command line (``--users``, ``--turns``, the word counts, ``--worker-args``)
overrides the preset's value in every workload run.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, replace

__all__ = ["WORKLOADS", "Workload", "WorkloadSpec", "make_workload", "resolve"]

_WORDS = ["cache", "prefix", "token", "block", "radix", "tree", "router", "worker", "latency", "throughput", "prompt", "session", "system", "user", "answer", "question", "model", "layer", "attention", "memory", "batch", "queue", "schedule", "evict", "reuse", "hit", "miss", "share", "load", "balance", "request", "stream", "decode", "prefill", "kernel", "tensor", "page"]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A workload's sessions and the flags its launched workers get."""

    name: str
    users: int
    turns: int
    system_words: int
    user_words: int
    assistant_words: int
    worker_args: str


WORKLOADS = {
    "chat": WorkloadSpec("chat", 16, 12, 12, 20, 8, "--block-size 16 --num-kv-blocks 320"),
    "shared_prefix": WorkloadSpec("shared_prefix", 16, 2, 250, 12, 4,
                                  "--block-size 16 --num-kv-blocks 320"),
    "eviction": WorkloadSpec("eviction", 16, 4, 12, 20, 4, "--block-size 16 --num-kv-blocks 64"),
}


def resolve(name: str, args: argparse.Namespace) -> WorkloadSpec:
    """The preset ``name`` with the command line's overrides (flags left at ``None`` keep it)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {list(WORKLOADS)}, got {name!r}")
    spec = WORKLOADS[name]
    changes = {f: getattr(args, f) for f in ("users", "turns", "system_words", "user_words",
                                            "assistant_words", "worker_args")
               if getattr(args, f, None) is not None}
    return replace(spec, **changes)


@dataclass(frozen=True, slots=True)
class Workload:
    """The scripted sessions: ``sessions[i]`` is a list of (user, assistant) turns."""

    system: str
    sessions: list[list[tuple[str, str]]]


def _text(rng: random.Random, n_words: int, tag: str) -> str:
    return tag + " " + " ".join(rng.choice(_WORDS) for _ in range(n_words))


def make_workload(users: int, turns: int, *, system_words: int, user_words: int,
                  assistant_words: int, seed: int = 0) -> Workload:
    """Deterministic sessions from ``seed`` (every session's text is distinct)."""
    rng = random.Random(seed)
    system = _text(rng, system_words, "You are a helpful assistant.")
    sessions = [
        [(_text(rng, user_words, f"[user {u} turn {t}]"), _text(rng, assistant_words, "Sure."))
         for t in range(turns)]
        for u in range(users)
    ]
    return Workload(system, sessions)


def workload_of(spec: WorkloadSpec, seed: int = 0) -> Workload:
    """The sessions ``spec`` describes (:func:`make_workload` with its sizes)."""
    return make_workload(spec.users, spec.turns, system_words=spec.system_words,
                         user_words=spec.user_words, assistant_words=spec.assistant_words,
                         seed=seed)
