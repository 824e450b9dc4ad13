"""Stop regexes (SGLang's ``stop_regex``): compiled once per request, searched in new output.

A pattern is Python ``re`` syntax. One RE2 can run with the same matches (most: literals,
classes, ``\\d \\w \\s``, groups, alternation, repeats, ``^``, a final ``$``) is searched by RE2
in time linear in the text (:mod:`prefixkv.engine.linear_regex`), so a pattern that would
backtrack catastrophically (``^(a|aa)+b``) costs what a plain one does. The rest (``\\b``,
lookarounds, back-references, flags) is compiled by the ``regex`` package (``re``-compatible),
whose searches take a timeout.

One request's searches in one engine step, over all its patterns and samples together, may take
:func:`step_budget` of CPU time (2 ms, plus 0.1 ms a sample: 2.4 ms at ``n=4``, 8.4 ms at
``n=64``; 1.5 ms less when one of its patterns needs the backtracking engine); a request past it
fails alone (the engine's failure isolation) instead of stalling the one engine thread every
other request waits on, whether one pattern backtracks catastrophically or many are each merely
slow. The budget is small because every other request's step waits for it: at 20 ms a step, 32
slow patterns held another client's 8-token request 4-5x its usual latency (``prefixkv bench
hostile``); at 2.4 ms, 2.2-2.7x; on RE2 the same patterns cost what the request without them
does (1.9-2.2x against 1.6-2.3x, the benchmark's sender on its own CPU).

Each step searches only where a *new* match can be: a match of at most ``width`` characters
that takes in some of the new token's text starts no earlier than ``width - 1`` characters
before it; one whose assertions look one character past it (``\\b``, ``\\B``, ``^``, ``$``,
``\\A``, ``\\Z``) may also end just before the new text and be new because of it, so it starts
no earlier than ``width`` before it. A pattern whose longest match is unbounded, or that looks
further outside its match (lookarounds, back-references), is searched from the start of the
checked text every step: still correct, linear in the output per step.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import regex

from prefixkv.engine.linear_regex import MAX_LINEAR_COST, LinearRegex, compile_linear, linear_cost

MAX_STOP_REGEX = 32
"""Most patterns one request may give (SGLang's limit)."""

MAX_STOP_REGEX_LEN = 256
"""Longest pattern, in characters (SGLang allows 256 bytes)."""

STOP_REGEX_STEP_BUDGET_S = 0.002
"""CPU time one request's stop-regex searches may take in one engine step, all patterns and
samples together, before the request is failed; plus :data:`STOP_REGEX_SAMPLE_BUDGET_S` a
sample (:func:`step_budget`)."""

STOP_REGEX_SAMPLE_BUDGET_S = 0.0001
"""Added to the step budget for each sample (``n``) of the request: 32 bounded patterns cost
about 1-3 us a search, so 64 samples need 2-6 ms a step."""

BACKTRACKING_STEP_BUDGET_S = 0.0005
"""The fixed part of the step budget (instead of :data:`STOP_REGEX_STEP_BUDGET_S`) of a request
with a pattern RE2 cannot run (searched by the backtracking ``regex`` package): such a pattern
can backtrack catastrophically, and a search whose cost grows step by step spends ~2.6 step
budgets before the step that fails the request, which every other request's steps wait out
(``prefixkv bench hostile``'s lookahead case). 32 bounded patterns take ~3 us a search on the
backtracking engine: 64 samples of them fit, barely (~6 ms of the 6.9 measured)."""

_PREEMPTION_SLACK_S = 0.0005
"""Added to a search's wall-clock timeout (the ``regex`` package times wall-clock, the budget
counts the engine thread's CPU time): a search that ran out of wall-clock time with CPU budget
left was paused by the OS and is tried again (:data:`_PREEMPTED_RETRIES` times at most)."""

_PREEMPTED_RETRIES = 3
"""Searches of one pattern tried again after a wall-clock timeout with CPU budget left."""

_MAX_WIDTH = 4096  # a longer bounded match is searched like an unbounded one


@dataclass(frozen=True, slots=True)
class StopRegex:
    """One compiled stop pattern; ``width``: its longest match in characters, ``None`` when
    unbounded or when it looks outside its match (then every search covers the checked text)."""

    pattern: str
    compiled: regex.Pattern[str]
    width: int | None
    reach: int = 0
    """Characters past the match its assertions look at (1 for ``\\b``, ``^``, ``$`` ...)."""
    linear: LinearRegex | None = None
    """The same pattern in RE2 (linear time), searched instead of ``compiled`` when there."""

    def found(self, text: str, check_from: int, new_from: int, budget: StepBudget) -> bool:
        """Whether ``text`` holds a match that was not there before its characters from
        ``new_from`` on arrived, looking no earlier than ``check_from``; the search's CPU time
        is taken from ``budget`` (``ValueError`` once it is spent)."""
        with budget.timing():
            return self._found(text, check_from, new_from, budget)

    def start(self, check_from: int, new_from: int) -> int:
        """Where a search for a new match starts (the module's window)."""
        if self.width is None:
            return check_from
        return max(check_from, new_from - self.width + 1 - self.reach)

    def _found(self, text: str, check_from: int, new_from: int, budget: StepBudget) -> bool:
        start = self.start(check_from, new_from)
        left = budget.left
        if left <= 0 and budget.spent():
            raise budget.spent_error(self.pattern)
        if self.linear is not None:
            try:
                return self.linear.found(text, start)
            except UnicodeEncodeError:
                pass  # a lone surrogate (never from the detokenizer): the regex package reads it
        for _ in range(_PREEMPTED_RETRIES + 1):
            try:
                return self.compiled.search(text, start,
                                            timeout=max(left, 0.0) + _PREEMPTION_SLACK_S) is not None
            except TimeoutError:
                if budget.spent():  # or paused by the OS: spent() reads the CPU clock
                    break
                left = budget.left
        raise budget.spent_error(self.pattern)


def first_match(patterns: Sequence[StopRegex], text: str, check_from: int, new_from: int,
                budget: StepBudget) -> StopRegex | None:
    """The first of ``patterns`` (in order) with a new match in ``text`` (see
    :meth:`StopRegex.found`), or ``None``; their searches' CPU time is taken from ``budget``
    (``ValueError`` once it is spent)."""
    with budget.timing():
        if budget.left <= 0 and budget.spent():
            raise budget.spent_error(patterns[-1].pattern)
        try:
            data: bytes | None = text.encode()  # once for every RE2 pattern of the sample
        except UnicodeEncodeError:  # a lone surrogate (never from the detokenizer)
            data = None
        ascii_only = data is not None and len(data) == len(text)
        for rx in patterns:  # an RE2 search is bounded (linear): the budget is checked per sample
            if rx.linear is not None and data is not None:
                start = rx.start(check_from, new_from)
                pos = start if ascii_only else len(data) - len(text[start:].encode())
                if rx.linear.search(data, pos):
                    return rx
            elif rx._found(text, check_from, new_from, budget):
                return rx
        return None


@dataclass(slots=True)
class StepBudget:
    """The search time (the engine thread's CPU time) one request may still spend on stop
    regexes in the current step.

    The thread's CPU clock is read once when a sample's searches begin and once when they end
    (:meth:`timing`): reading it is a system call (~0.6 us), more than an RE2 search of a step's
    new text. In between, :attr:`left` counts wall-clock time since the start (never less than
    the CPU time), and a search that times out reads the CPU clock (:meth:`settle`) to tell a
    spent budget from a pause by the OS."""

    used: float = 0.0
    limit: float = STOP_REGEX_STEP_BUDGET_S
    _cpu0: float | None = None  # CPU clock at the last settle while timing, else None
    _wall0: float = 0.0

    @property
    def left(self) -> float:
        """Seconds left in this step (while timing, wall-clock time since the last settle is
        counted as used)."""
        if self._cpu0 is None:
            return self.limit - self.used
        return self.limit - self.used - (time.perf_counter() - self._wall0)

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Take the CPU time of the ``with`` body from the budget (nested: the outer one)."""
        if self._cpu0 is not None:
            yield
            return
        self._cpu0, self._wall0 = time.thread_time(), time.perf_counter()
        try:
            yield
        finally:
            self.settle()
            self._cpu0 = None

    def spent(self) -> bool:
        """Whether no time is left, by the CPU clock (read only when :attr:`left`'s wall-clock
        count says so: a pause by the OS is not search time)."""
        if self.left > 0:
            return False
        self.settle()
        return self.left <= 0

    def settle(self) -> None:
        """Count the CPU time since the timing began (or last settled) as used."""
        if self._cpu0 is not None:
            now = time.thread_time()
            self.used += now - self._cpu0
            self._cpu0, self._wall0 = now, time.perf_counter()

    @classmethod
    def for_samples(cls, samples: int, *, backtracking: bool = False) -> StepBudget:
        """A fresh step's budget for a request of ``samples`` samples (:func:`step_budget`)."""
        return cls(limit=step_budget(samples, backtracking=backtracking))

    def spent_error(self, pattern: str) -> ValueError:
        """The error that fails the request (names the pattern being searched)."""
        shown = pattern if len(pattern) <= 64 else pattern[:61] + "..."
        return ValueError(
            f"stop_regex searches took longer than {self.limit * 1000:.1f} ms in one step (all "
            f"patterns and samples together; last searched: {shown!r}; catastrophic backtracking?)"
        )


def step_budget(samples: int, *, backtracking: bool = False) -> float:
    """CPU seconds one request of ``samples`` samples may search in one step; ``backtracking``:
    one of its patterns is searched by the ``regex`` package (:data:`BACKTRACKING_STEP_BUDGET_S`)."""
    fixed = BACKTRACKING_STEP_BUDGET_S if backtracking else STOP_REGEX_STEP_BUDGET_S
    return fixed + STOP_REGEX_SAMPLE_BUDGET_S * max(samples, 1)


def needs_backtracking(patterns: Sequence[StopRegex]) -> bool:
    """Whether one of ``patterns`` is searched by the backtracking ``regex`` package."""
    return any(rx.linear is None for rx in patterns)


def compile_stop_regex(value: str | Sequence[str] | None) -> tuple[StopRegex, ...]:
    """``stop_regex`` as compiled patterns; ``ValueError`` naming ``stop_regex`` when it is not
    a pattern or a list of them, holds too many or too long ones, or one does not compile."""
    if value is None:
        return ()
    patterns = [value] if isinstance(value, str) else value
    if isinstance(patterns, (bytes, bytearray)) or not isinstance(patterns, Sequence):
        raise ValueError(f"stop_regex must be a str, a list of str or None, got {value!r}")
    if len(patterns) > MAX_STOP_REGEX:
        raise ValueError(f"stop_regex holds at most {MAX_STOP_REGEX} patterns, got {len(patterns)}")
    out, linear_left = [], MAX_LINEAR_COST  # RE2 compile time, the request's patterns together
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError(f"stop_regex must hold non-empty strings, got {p!r}")
        if len(p) > MAX_STOP_REGEX_LEN:
            raise ValueError(f"stop_regex patterns are at most {MAX_STOP_REGEX_LEN} characters, "
                             f"got {len(p)}")
        try:
            compiled = regex.compile(p)
        except regex.error as exc:
            raise ValueError(f"stop_regex {p!r} is not a valid regular expression: {exc}") from exc
        least, most, reach = _widths(p)
        if least == 0 or compiled.fullmatch("") is not None:
            raise ValueError(f"stop_regex {p!r} matches the empty string (it would stop at once)")
        cost = linear_cost(p)
        linear = None
        if cost is not None and cost <= linear_left:
            linear = compile_linear(p)
            linear_left -= cost
        out.append(StopRegex(p, compiled, most, reach, linear))
    return tuple(out)


def _widths(pattern: str) -> tuple[int | None, int | None, int]:
    """The shortest and longest match of ``pattern`` and how far past it its assertions look;
    the longest is ``None`` when unbounded or when the pattern looks further than one character
    outside its match, both ``None`` for syntax the standard parser does not know (the
    ``regex`` package's own)."""
    try:
        parser: Any = getattr(re, "_parser")  # CPython 3.11+: the sre parser
        tree = parser.parse(pattern)
        least, most = tree.getwidth()
    except Exception:  # noqa: BLE001 - no parser, or regex-only syntax: search everything
        return None, None, 0
    reach = _reach(tree, parser)
    if most > _MAX_WIDTH or reach is None:
        return int(least), None, 0
    return int(least), int(most), reach


_OUTSIDE = {"ASSERT", "ASSERT_NOT", "GROUPREF", "GROUPREF_EXISTS", "GROUPREF_IGNORE",
            "GROUPREF_LOC_IGNORE", "GROUPREF_UNI_IGNORE"}
"""Nodes that may look any distance outside the match (lookarounds, back-references)."""


def _reach(tree: Any, parser: Any) -> int | None:
    """How many characters past its match the parsed pattern looks: 0, 1 for position
    assertions (``AT``: ``\\b``, ``\\B``, ``^``, ``$``, ``\\A``, ``\\Z``, each looking at the
    neighbouring character at most), ``None`` for lookarounds and back-references."""
    reach = 0
    for op, av in tree:
        name = str(op)
        if name in _OUTSIDE:
            return None
        if name == "AT":
            reach = 1
        for x in av if isinstance(av, (tuple, list)) else (av,):
            for sub in x if isinstance(x, list) else [x]:
                if isinstance(sub, parser.SubPattern):
                    inner = _reach(sub, parser)
                    if inner is None:
                        return None
                    reach = max(reach, inner)
    return reach
