"""Owns: the engine flags of ``serve`` (vLLM's names included), generated from EngineConfig.
Imports: prefixkv.config only.

The engine flags of ``prefixkv serve``, generated from :data:`prefixkv.config.OPTIONS`.

Every :class:`~prefixkv.config.EngineConfig` setting is one flag named after it
(``max_num_seqs`` -> ``--max-num-seqs``, ``kv_offload_size`` -> ``--kv-offload-size``) with the
config's default and help, so ``--help`` cannot drift from the code, except where
:data:`SERVE_DEFAULTS` gives the server its own default (as vLLM's OpenAI server does). ``MODEL``
is positional (``--model`` is the same). :func:`engine_kwargs` reads them back as
``EngineConfig.from_kwargs`` arguments.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from prefixkv.config import OPTIONS, Option

GROUPS = {
    "engine": "engine",
    "vllm": "vLLM-compatible engine flags",
    "tiers": "KV tiers (docs/tiers.md)",
}
_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str}
SERVE_DEFAULTS: dict[str, Any] = {"max_num_batched_tokens": 2048}
"""Server defaults that differ from :class:`~prefixkv.config.EngineConfig`'s (the ``LLM`` ones).
A step budget of 2,048 tokens is vLLM's OpenAI-server default on CPU (its ``LLM`` takes 4,096):
a long prompt prefills in 2,048-token chunks, so requests already decoding wait at most one such
chunk per token (demo model, a 4,000-token prompt: 160 ms -> 101-103 ms longest decode gap,
``prefixkv bench stall``)."""

ENV_DEFAULTS = {"kv_remote_secret": "PREFIXKV_KV_REMOTE_SECRET"}
"""Flags whose default is read from the environment (a secret is better kept out of ``ps``)."""


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Add MODEL, ``--model`` and one flag per engine setting, in groups."""
    model = OPTIONS["model"]
    p.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help=_escape(model.help_text))
    groups = {key: p.add_argument_group(title) for key, title in GROUPS.items()}
    groups["engine"].add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                                  help="same as the positional MODEL")
    for opt in OPTIONS.values():
        if opt.kind != "model":
            _add(groups[opt.group], opt)


def _add(g: argparse._ArgumentGroup, opt: Option) -> None:
    help_text = opt.help_text
    default = SERVE_DEFAULTS.get(opt.name, opt.default)
    if opt.name in ENV_DEFAULTS:
        default = os.environ.get(ENV_DEFAULTS[opt.name]) or default
    if opt.name in SERVE_DEFAULTS:
        help_text = f"{opt.help} (default: {default}; {opt.shown} for LLM)"
    kw: dict[str, Any] = {"dest": opt.name, "default": default, "help": _escape(help_text)}
    if opt.kind == "bool":
        kw["action"] = argparse.BooleanOptionalAction
    elif opt.kind == "list":
        kw.update(nargs="+", metavar=opt.metavar)
    else:
        kw["type"] = _TYPES[opt.kind]
        if opt.choices is not None:
            kw["choices"] = opt.choices
        if opt.metavar is not None:
            kw["metavar"] = opt.metavar
    g.add_argument(opt.flag, **kw)


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags as ``EngineConfig.from_kwargs`` arguments; resolves ``--model`` into
    ``args.model`` (``ValueError`` when it and the positional MODEL disagree)."""
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            raise ValueError(f"two models given: {args.model!r} and --model {args.model_flag!r}")
        args.model = args.model_flag
    return {name: getattr(args, name) for name in OPTIONS}
