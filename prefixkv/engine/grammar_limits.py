"""Bounds on what a request may hand the grammar compiler, checked before anything compiles.

llguidance compiles a grammar recursively in native code: a long enough chain (``$ref`` ->
``$ref`` -> ..., a Lark rule per step) overflows the thread's stack and takes the whole process
down, and a huge grammar (100k choices) takes tens of seconds and may end in a Rust panic. The
numbers below are far above what real schemas and grammars use (OpenAI's structured outputs
allow 10 nesting levels and 1,000 enum values) and well under what compiles in a second:

================================  ==========  ============================================
what                              limit       counted how
================================  ==========  ============================================
schema, grammar or choices text   256 KiB     the schema's compact JSON; all choices together
regex                             64 KiB      the pattern's length
schema nesting                    128         JSON depth of the schema document
``$ref``                          1,000       every ``$ref`` in the schema
``anyOf`` / ``oneOf`` / ``allOf`` 1,024       branches, all together
``enum`` / ``const`` values       4,096       all together
choices (``guided_choice``)       4,096       strings
grammar rules (Lark / GBNF)       1,000       rule and terminal definitions
================================  ==========  ============================================

A bound that fails is a ``ValueError`` naming it; the server answers it as a 400 naming the
request field. What passes still compiles in a guarded child process first
(:mod:`prefixkv.engine.grammar_guard`), so a combination the bounds do not foresee costs only
its own request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """The bounds a structured-output constraint must stay within (see the module table)."""

    max_bytes: int = 256 * 1024
    max_regex_bytes: int = 64 * 1024
    max_depth: int = 128
    max_refs: int = 1_000
    max_branches: int = 1_024
    max_enum_values: int = 4_096
    max_choices: int = 4_096
    max_rules: int = 1_000


LIMITS = GrammarLimits()
"""The limits every :class:`~prefixkv.engine.structured_output.StructuredOutputsParams` is held to."""

# a rule or terminal definition at the start of a line: Lark ``name:``, ``?name:``, ``NAME.2:``
# and GBNF ``name ::=``
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:\.[ \t]*-?\d+[ \t]*)?(?::|::=)", re.MULTILINE)


def parse_schema(text: str) -> Any:
    """A JSON schema given as a string, parsed; ``ValueError`` for bad or too deeply nested
    JSON (Python's parser raises ``RecursionError`` there, which must never look like a fault)."""
    if len(text) > LIMITS.max_bytes:
        raise ValueError(f"the JSON schema is {len(text):,} characters; at most {LIMITS.max_bytes:,}")
    _check_text_depth(text)
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"the JSON schema nests deeper than {LIMITS.max_depth}") from None
    except ValueError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None


def _check_text_depth(text: str) -> None:
    """Refuse JSON text whose brackets nest too deep, before a recursive parser sees it."""
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > LIMITS.max_depth:
                raise ValueError(f"the JSON schema nests deeper than {LIMITS.max_depth}")
        elif ch in "]}":
            depth -= 1


def check_schema(schema: Any) -> None:
    """``ValueError`` naming the bound a schema (parsed JSON) exceeds. Walks it without
    recursion, so any depth is safe to check."""
    refs = branches = enums = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > LIMITS.max_depth:
            raise ValueError(f"the JSON schema nests deeper than {LIMITS.max_depth}")
        if isinstance(node, Mapping):
            refs += "$ref" in node
            for key in ("anyOf", "oneOf", "allOf"):
                if isinstance(node.get(key), list):
                    branches += len(node[key])
            if isinstance(node.get("enum"), list):
                enums += len(node["enum"])
            enums += "const" in node
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    if refs > LIMITS.max_refs:
        raise ValueError(f"the JSON schema has {refs:,} $ref; at most {LIMITS.max_refs:,}")
    if branches > LIMITS.max_branches:
        raise ValueError(f"the JSON schema has {branches:,} anyOf/oneOf/allOf branches; "
                         f"at most {LIMITS.max_branches:,}")
    if enums > LIMITS.max_enum_values:
        raise ValueError(f"the JSON schema has {enums:,} enum/const values; "
                         f"at most {LIMITS.max_enum_values:,}")
    size = len(json.dumps(schema, separators=(",", ":")))  # depth checked: no recursion limit
    if size > LIMITS.max_bytes:
        raise ValueError(f"the JSON schema is {size:,} characters; at most {LIMITS.max_bytes:,}")


def check_grammar(text: str) -> None:
    """``ValueError`` if a Lark / GBNF grammar is too large or has too many rules."""
    if len(text) > LIMITS.max_bytes:
        raise ValueError(f"the grammar is {len(text):,} characters; at most {LIMITS.max_bytes:,}")
    rules = len(_RULE.findall(text))
    if rules > LIMITS.max_rules:
        raise ValueError(f"the grammar has {rules:,} rules; at most {LIMITS.max_rules:,}")


def check_regex(pattern: str) -> None:
    """``ValueError`` if a regex is too long."""
    if len(pattern) > LIMITS.max_regex_bytes:
        raise ValueError(f"the regex is {len(pattern):,} characters; at most {LIMITS.max_regex_bytes:,}")


def check_choices(choices: Sequence[str]) -> None:
    """``ValueError`` if there are too many choices or their text is too large."""
    if len(choices) > LIMITS.max_choices:
        raise ValueError(f"{len(choices):,} choices; at most {LIMITS.max_choices:,}")
    size = sum(len(c) for c in choices)
    if size > LIMITS.max_bytes:
        raise ValueError(f"the choices hold {size:,} characters; at most {LIMITS.max_bytes:,}")
