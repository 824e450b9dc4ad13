"""Stop regexes searched in linear time: a pattern RE2 can run is handed to RE2, unchanged in
what it matches.

Python's regular expression engines (``re``, the ``regex`` package) backtrack: ``^(a|aa)+b``
takes exponential time on a run of ``a``, so a request's stop patterns could hold the one
engine thread (the per-step budget of :mod:`prefixkv.engine.stop_regex` bounds it, but every
other request's step still waits out that budget). RE2 (``google-re2``) runs any pattern it
accepts in time linear in the text, so such a pattern costs what a plain one does.

RE2's syntax and classes differ from Python's (``\\d``, ``\\w``, ``\\s`` and ``\\b`` are ASCII in
RE2, ``$`` does not match before a final newline, escapes differ), so the pattern text is never
handed over as it is. :func:`compile_linear` parses it with Python's own parser and writes an
RE2 pattern from the parse tree, node by node, only from constructs whose matches are the same
in both engines: literals as ``\\x{...}``; character classes as explicit code-point ranges (a
class such as ``\\w`` is taken from the ``regex`` package itself, which the fallback uses, so it
matches the same characters); ``.`` (``(?s)`` too), groups, alternation, greedy and lazy repeats
(at most 1,000, RE2's bound); ``^`` / ``\\A``, ``\\Z``, and ``$`` as the pattern's last element.
Anything else (``\\b``, ``\\B``, lookarounds, back-references, possessive repeats, atomic groups,
``(?i)``, ``(?m)``, ``(?a)`` and other flags, syntax only the ``regex`` package reads) returns
``None``: that pattern is searched by the ``regex`` package under the step budget, as before.
A stop regex only asks *whether* a new match exists, never where or which, so leftmost-first
against leftmost-longest and greedy against lazy make no difference.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import regex

try:  # the low-level matcher skips the wrapper's str bookkeeping (0.7 us a search against 2.5)
    import re2
except ImportError:  # pragma: no cover - a dependency; without it every pattern backtracks
    re2 = None

__all__ = ["LinearRegex", "compile_linear", "linear_cost", "to_re2", "translate"]

MAX_MEM = 1 << 20
"""RE2's memory budget per pattern (program and DFA cache); past it RE2 falls back to its
slower linear NFA, and a pattern whose program alone does not fit is not compiled (the
backtracking search takes it). 32 patterns a request: 32 MiB at most."""

MAX_LINEAR_COST = 64 * 1024
"""The most :func:`linear_cost` one request's patterns may have together on RE2 (the rest go to
the backtracking engine): RE2 compiles ~40-50 ns a unit, and the compile runs where the request
is validated, on the server's event loop, so one request holds it ~3 ms at most (``\\w{200}``
alone would take RE2 6 ms only to give up)."""

_MAX_COUNT = 1000  # RE2 refuses repeat counts above this
_UNICODE = 32  # re.UNICODE: the default for str patterns
_VERBOSE = 64  # re.VERBOSE: only changes how the pattern is read
_DOTALL = 16  # re.DOTALL: ``.`` matches a newline
_LAST_CODE_POINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)  # never in UTF-8 text: left out of every class


@dataclass(frozen=True, slots=True)
class LinearRegex:
    """A pattern RE2 runs with the same matches as the ``regex`` package; :meth:`found`."""

    pattern: str
    re2_pattern: str
    _program: Any
    _anchor: Any

    def found(self, text: str, start: int) -> bool:
        """Whether ``text`` holds a match starting at character ``start`` or later (the text
        before ``start`` is context for ``^``, as ``regex.search(text, start)`` takes it);
        ``UnicodeEncodeError`` for a text holding a lone surrogate (not UTF-8)."""
        data = text.encode()
        pos = start if len(data) == len(text) else len(data) - len(text[start:].encode())
        return self.search(data, pos)

    def search(self, data: bytes, pos: int) -> bool:
        """:meth:`found` on the text's UTF-8 ``data`` from byte ``pos`` (a character's start)."""
        return bool(self._program.Match(self._anchor, data, pos, len(data))[0][0] >= 0)


@functools.lru_cache(maxsize=64)  # 64 programs of at most MAX_MEM
def compile_linear(pattern: str) -> LinearRegex | None:
    """``pattern`` (Python syntax) compiled by RE2 with the same matches, or ``None`` when it
    uses a construct the two engines read differently or RE2 cannot compile it (cached: a
    client sends the same patterns with every request, and a class such as ``\\w`` takes RE2
    ~0.6 ms to compile)."""
    translated = to_re2(pattern)
    cost = linear_cost(pattern)
    if translated is None or cost is None or cost > MAX_LINEAR_COST or re2 is None:
        return None
    options = re2.Options()
    options.log_errors = False
    options.max_mem = MAX_MEM
    try:
        wrapper = re2.compile(translated, options)
        program, anchor = wrapper._regexp, re2._Anchor.UNANCHORED
    except (re2.error, AttributeError):  # too large for MAX_MEM; another wrapper version
        return None
    return LinearRegex(pattern, translated, program, anchor)


def to_re2(pattern: str) -> str | None:
    """The RE2 pattern matching what ``pattern`` matches, or ``None`` (see the module)."""
    found = translate(pattern)
    return None if found is None else found[0]


def linear_cost(pattern: str) -> int | None:
    """What compiling ``pattern`` on RE2 costs, as the length of its RE2 text with every
    counted repeat written out (RE2 copies ``x{3}`` into ``xxx``; a class such as ``\\w`` is
    ~12,000 characters and takes RE2 ~0.6 ms to compile); ``None`` when it does not translate
    or costs more than :data:`MAX_LINEAR_COST`."""
    found = translate(pattern)
    return None if found is None else found[1]


@functools.lru_cache(maxsize=256)  # texts of at most MAX_LINEAR_COST
def translate(pattern: str) -> tuple[str, int] | None:
    """:func:`to_re2` and :func:`linear_cost` together (cached)."""
    parser: Any = getattr(re, "_parser", None)
    if parser is None:  # pragma: no cover - CPython 3.11+ has it
        return None
    try:
        tree = parser.parse(pattern)
    except Exception:  # noqa: BLE001 - syntax only the regex package reads
        return None
    flags = tree.state.flags & ~(_UNICODE | _VERBOSE)
    if flags & ~_DOTALL:
        return None
    try:
        return _seq(list(tree), dotall=bool(flags & _DOTALL), last=True)
    except _Unsupported:
        return None


class _Unsupported(Exception):
    """A construct RE2 would match differently."""


_Piece = tuple[str, int]  # RE2 text, its length with counted repeats written out


def _seq(items: list[Any], *, dotall: bool, last: bool) -> _Piece:
    """A sequence of nodes; ``last``: it ends the pattern (``$`` may close it)."""
    out = []
    for i, (op, av) in enumerate(items):
        name = str(op)
        if name == "AT" and str(av) == "AT_END" and last and i == len(items) - 1:
            text = r"(?:\n?\z)"  # end, or before a final newline: nothing follows it
            out.append((text, len(text)))
        else:
            out.append(_node(name, av, dotall=dotall))
    size = sum(n for _, n in out)
    if size > MAX_LINEAR_COST:  # never compiled: stop writing it
        raise _Unsupported("size")
    return "".join(t for t, _ in out), size


def _leaf(text: str) -> _Piece:
    return text, len(text)


def _node(name: str, av: Any, *, dotall: bool) -> _Piece:
    if name == "LITERAL":
        return _leaf(_char(av))
    if name == "NOT_LITERAL":
        return _leaf(_ranges(_complement([(av, av)])))
    if name == "ANY":
        return _leaf("(?s:.)" if dotall else ".")
    if name == "IN":
        return _leaf(_class_text(tuple(av)))
    if name == "BRANCH":
        alts = [_seq(list(b), dotall=dotall, last=False) for b in av[1]]
        return "(?:" + "|".join(t for t, _ in alts) + ")", 4 + sum(n + 1 for _, n in alts)
    if name == "SUBPATTERN":
        _group, add, remove, sub = av
        if add or remove:
            raise _Unsupported(name)
        text, size = _seq(list(sub), dotall=dotall, last=False)
        return "(?:" + text + ")", size + 4
    if name in ("MAX_REPEAT", "MIN_REPEAT"):
        low, high, sub = av
        unbounded = str(high) == "MAXREPEAT"
        if low > _MAX_COUNT or (not unbounded and high > _MAX_COUNT):
            raise _Unsupported("count")
        count = ({0: "*", 1: "+"}.get(low, f"{{{low},}}") if unbounded else
                 "?" if (low, high) == (0, 1) else f"{{{low},{high}}}")
        lazy = "?" if name == "MIN_REPEAT" else ""
        text, size = _seq(list(sub), dotall=dotall, last=False)
        copies = max(1, low if unbounded else high)  # RE2 writes x{2,} as xx+, x{1,3} as x(x(x)?)?
        if (size + 4) * copies > MAX_LINEAR_COST:
            raise _Unsupported("size")
        return "(?:" + text + ")" + count + lazy, (size + 4) * copies
    if name == "AT":
        at = str(av)
        if at in ("AT_BEGINNING", "AT_BEGINNING_STRING"):  # no (?m): both are the text's start
            return _leaf(r"\A")
        if at == "AT_END_STRING":
            return _leaf(r"\z")
    raise _Unsupported(name)  # \b, \B, $ inside, lookarounds, back-references, possessive ...


def _char(code: int) -> str:
    return f"\\x{{{code:x}}}"


Ranges = list[tuple[int, int]]


@functools.lru_cache(maxsize=256)
def _class_text(items: tuple[tuple[Any, Any], ...]) -> str:
    """The RE2 class of a ``[...]`` (or ``\\d``-like) item list (cached: ``\\w`` is ~12,000
    characters to write)."""
    return _ranges(list(_class_spans(items)))


def _class_spans(items: tuple[tuple[Any, Any], ...]) -> tuple[tuple[int, int], ...]:
    """The code points a ``[...]`` item list matches."""
    negate, spans = False, []
    for op, av in items:
        name = str(op)
        if name == "NEGATE":
            negate = True
        elif name == "LITERAL":
            spans.append((av, av))
        elif name == "RANGE":
            spans.append(av)
        elif name == "CATEGORY":
            spans.extend(_category(str(av)))
        else:
            raise _Unsupported(name)
    merged = _merge(spans)
    return tuple(_complement(merged) if negate else merged)


def _ranges(spans: Ranges) -> str:
    """An RE2 class of ``spans`` (surrogates left out); one that matches nothing stays one."""
    parts = []
    for lo, hi in spans:
        for a, b in _without_surrogates(lo, hi):
            parts.append(_char(a) if a == b else f"{_char(a)}-{_char(b)}")
    return "[" + "".join(parts) + "]" if parts else r"[^\x00-\x{10ffff}]"


def _without_surrogates(lo: int, hi: int) -> list[tuple[int, int]]:
    s_lo, s_hi = _SURROGATES
    if hi < s_lo or lo > s_hi:
        return [(lo, hi)]
    return [(a, b) for a, b in ((lo, s_lo - 1), (s_hi + 1, hi)) if a <= b]


def _merge(spans: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(spans: Ranges) -> Ranges:
    out, next_lo = [], 0
    for lo, hi in _merge(spans):
        if lo > next_lo:
            out.append((next_lo, lo - 1))
        next_lo = hi + 1
    if next_lo <= _LAST_CODE_POINT:
        out.append((next_lo, _LAST_CODE_POINT))
    return out


_CATEGORIES = {"CATEGORY_DIGIT": r"\d", "CATEGORY_SPACE": r"\s", "CATEGORY_WORD": r"\w"}


def _category(name: str) -> Ranges:
    """``\\d``, ``\\s``, ``\\w`` and their negations as the ``regex`` package matches them."""
    positive = name.replace("_NOT_", "_")
    if positive not in _CATEGORIES:
        raise _Unsupported(name)  # locale / ASCII-only categories: never made by str patterns
    spans = _category_spans(_CATEGORIES[positive])
    return list(spans) if positive == name else _complement(list(spans))


@functools.cache
def _category_spans(escape: str) -> tuple[tuple[int, int], ...]:
    """Every code point ``escape`` matches, as ranges (computed once: ~10 ms)."""
    compiled = regex.compile(escape + "+")
    spans = []
    for lo, hi in ((0, _SURROGATES[0] - 1), (_SURROGATES[1] + 1, _LAST_CODE_POINT)):
        text = np.arange(lo, hi + 1, dtype="<u4").tobytes().decode("utf-32-le")
        spans += [(lo + m.start(), lo + m.end() - 1) for m in compiled.finditer(text)]
    return tuple(spans)
