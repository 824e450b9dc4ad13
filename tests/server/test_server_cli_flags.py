"""The engine flags of ``prefixkv serve`` / ``engine start`` against EngineConfig: every config
field has one flag with the config's default and help, every engine flag is a config field,
and the defaults ``--help`` describes are the code's."""

from __future__ import annotations

import argparse

import pytest

from prefixkv.cache import make_cache
from prefixkv.cli import build_parser, main
from prefixkv.config import OPTIONS, EngineConfig
from prefixkv.cli.compat import seed004_args
from prefixkv.cli.flags import GROUPS, SERVE_DEFAULTS, engine_kwargs


def _sub(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.fixture(params=[("serve",), ("engine", "start")], ids=["serve", "engine-start"])
def command(request: pytest.FixtureRequest) -> argparse.ArgumentParser:
    return _sub(build_parser(), *request.param)


def test_every_config_field_has_its_flag(command: argparse.ArgumentParser) -> None:
    by_flag = {s: a for a in command._actions for s in a.option_strings}
    for opt in OPTIONS.values():
        if opt.name == "model":
            positional = next(a for a in command._actions if a.dest == "model")
            assert positional.default is None and positional.help == opt.help_text
            continue
        action = by_flag[opt.flag]
        assert action.dest == opt.name
        assert action.default == SERVE_DEFAULTS.get(opt.name, opt.default), opt.name
        assert action.help is not None
        if opt.name in SERVE_DEFAULTS:
            assert f"(default: {action.default}; {opt.shown} for LLM)" in action.help
        else:
            assert action.help.replace("%%", "%") == opt.help_text
        if opt.choices is not None:
            assert tuple(action.choices or ()) == opt.choices


def test_every_engine_flag_is_a_config_field(command: argparse.ArgumentParser) -> None:
    groups = [g for g in command._action_groups if g.title in GROUPS.values()]
    assert len(groups) == len(GROUPS)
    for g in groups:
        for action in g._group_actions:
            assert action.dest in OPTIONS or action.dest == "model_flag", action.option_strings


def test_no_flags_is_the_default_config_with_the_servers_step_budget(
        command: argparse.ArgumentParser) -> None:
    # vLLM's OpenAI server on CPU defaults to a 2,048-token step, its LLM to 4,096; so do we
    args = command.parse_args([])
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert config == EngineConfig.from_kwargs(max_num_batched_tokens=2048)
    assert config.scheduler.max_num_batched_tokens == 2048
    assert EngineConfig().scheduler.max_num_batched_tokens == 4096
    args = command.parse_args(["--max-num-batched-tokens", "4096"])
    assert EngineConfig.from_kwargs(**engine_kwargs(args)) == EngineConfig()


def test_flags_build_the_config() -> None:
    args = build_parser().parse_args([
        "serve", "some/model", "--block-size", "8", "--no-enable-prefix-caching",
        "--max-num-seqs", "4", "--seed", "7", "--kv-cache-memory", "1MiB", "--dtype", "auto",
        "--max-pinned-blocks", "3", "--schedule-policy", "lpm"])
    c = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert c.model.model == "some/model" and c.model.seed == 7 and c.model.dtype is None
    assert (c.cache.block_size, c.cache.enable_prefix_caching) == (8, False)
    assert (c.cache.kv_cache_memory, c.cache.max_pinned_blocks) == (1 << 20, 3)
    assert (c.scheduler.max_num_seqs, c.scheduler.schedule_policy) == (4, "lpm")
    start = build_parser().parse_args(["engine", "start", "--prefix-cache-size", "32"])
    assert EngineConfig.from_kwargs(**engine_kwargs(seed004_args(start))).cache.num_kv_blocks == 32


def test_help_defaults_are_the_codes() -> None:
    # "--max-pinned-blocks" once said "no limit" while the index used 20% of the pool
    assert "20% of the pool" in OPTIONS["max_pinned_blocks"].help_text
    assert make_cache(max_blocks=100, block_size=16).max_pinned_blocks == 20
    assert "10GiB" in OPTIONS["kv_disk_size"].help_text


def test_bad_flag_value_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--max-num-seqs", "0", "--port", "1"]) == 1
    assert "max_num_seqs" in capsys.readouterr().err


def test_docs_table_lists_every_serve_flag() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    serve = _sub(build_parser(), "serve")
    flags = [s for a in serve._actions for s in a.option_strings
             if s.startswith("--") and s not in ("--help", "--model") and not s.startswith("--no-")]
    missing = [f for f in flags if f"`{f}`" not in doc and f"`{f} " not in doc]
    assert not missing, f"docs/server.md does not list {missing}"
