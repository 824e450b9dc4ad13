"""The README's Python examples run as written (tinygrad's habit: docs that cannot rot)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    """The offline blocks; those that talk to a server run in .ci/readme_examples.sh."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    offline = [b for b in blocks if "openai" not in b]
    assert offline, "README lost its examples"
    for code in offline:
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    commands = re.findall(r"^    (pip install .*)$", text, flags=re.MULTILINE)
    assert len(commands) == 2
    ci = (README.parent / ".ci" / "run").read_text()
    install, test = commands[1].split(" && ")
    assert install in ci and test in ci


def test_the_examples_extra_holds_every_package_the_client_examples_import():
    """`examples/*.py` and the README's server blocks import only the standard library, prefixkv
    and what the `examples` extra (named in the README) installs."""
    import ast
    import sys
    import tomllib

    from packaging.utils import canonicalize_name

    root = README.parent
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["examples"]
    provided = {canonicalize_name(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]) for r in extra}
    text = README.read_text()
    assert '-e ".[examples]"' in text and "-c constraints.txt" in text
    sources = [p.read_text() for p in sorted((root / "examples").glob("*.py"))]
    sources += [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
                if "openai" in b]
    imported = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported
                   if m not in sys.stdlib_module_names and m not in ("prefixkv", "__future__")}
    assert third_party and {canonicalize_name(m) for m in third_party} <= provided, third_party


def _readme_commands() -> tuple[dict[str, str], list[str]]:
    """The README's shell variables (``NAME="..."`` lines) and every ``prefixkv`` command it
    shows: indented lines and inline code (``cache reset --tiers`` is ``prefixkv cache ...``)."""
    text = README.read_text()
    variables = dict(re.findall(r'^    ([A-Z_]+)="([^"]*)"$', text, flags=re.MULTILINE))
    lines = re.findall(r"^    (prefixkv .*)$", text, flags=re.MULTILINE)
    lines += re.findall(r"`(prefixkv [^`]*)`", text)
    lines += ["prefixkv " + c for c in re.findall(r"`(cache [a-z-]+[^`]*)`", text)]
    return variables, lines


def test_every_prefixkv_command_in_the_readme_parses():
    """Issue 40: ``cache reset --tiers`` as the README wrote it was an argparse error."""
    import shlex

    from prefixkv.cli import build_parser

    variables, lines = _readme_commands()
    assert any(line.startswith("prefixkv cache reset --tiers") for line in lines)
    for line in lines:
        for name, value in variables.items():
            line = line.replace(f"${name}", value)
        argv = shlex.split(line, comments=True)[1:]
        if argv in (["bench"], ["cache"]):  # a command group named in prose
            continue
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"the README's `{line}` does not parse") from exc
    args = build_parser().parse_args(["cache", "reset", "--tiers"])
    assert args.tiers == "all"  # a bare --tiers: every lower tier
    assert build_parser().parse_args(["cache", "reset"]).tiers == "local"


def run_readme_cache_block(url: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run the README's ``prefixkv cache`` block (its variables substituted, each command
    through ``prefixkv.cli.main``, which must return 0) against the server at ``url``; returns
    what it printed."""
    import shlex

    from prefixkv.cli import main

    variables, _ = _readme_commands()
    text = README.read_text()
    block = text.split("Manage the cache from the command line:\n\n", 1)[1].split("\n\n", 1)[0]
    commands = [line[4:] for line in block.splitlines() if line.startswith("    prefixkv ")]
    assert len(commands) == 6, block
    printed = []
    for line in commands:
        for name, value in variables.items():
            line = line.replace(f"${name}", value)
        argv = shlex.split(line, comments=True)[1:]
        code = main([*argv, "--url", url])
        out = capsys.readouterr()
        assert code == 0, (line, out.out, out.err)
        printed.append(out.out)
    return "".join(printed)


def test_the_readme_cache_commands_run_as_written_on_the_demo_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import sys

    sys.path.insert(0, str(README.parent / "tests" / "server"))
    from server_live import start_server

    from prefixkv.engine import AsyncEngine

    engine = AsyncEngine.from_args(None, block_size=16, num_kv_blocks=128)
    live = start_server(engine)
    try:
        out = run_readme_cache_block(live.url, capsys)
    finally:
        live.stop()
        engine.shutdown()
    assert re.search(r"^pinned \d+ tokens \(\d+ blocks\): system prompt$", out, flags=re.M), out
    assert "unpinned" in out and "cache reset (" in out


@pytest.mark.slow
def test_the_readme_cache_commands_run_as_written_on_smollm2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On SmolLM2 the README's old system prompt was 6 tokens, under one block: the pin failed."""
    import socket
    import subprocess
    import sys

    from prefixkv.models.catalog import ensure_model

    try:
        ensure_model("smollm2-135m-instruct")
    except RuntimeError as exc:
        pytest.skip(f"cannot fetch smollm2-135m-instruct: {exc}")
    sys.path.insert(0, str(README.parent / "tests" / "server"))
    from server_live import wait_for_health

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "prefixkv.cli", "serve", "--model",
                             "smollm2-135m-instruct", "--port", str(port), "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", proc, timeout=300)
        out = run_readme_cache_block(f"http://127.0.0.1:{port}", capsys)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "pinned 16 tokens (1 blocks): system prompt" in out, out
    served = proc.stdout.read() if proc.stdout else ""
    assert "its tokenizer as a Hugging Face directory (guidellm / aiperf --tokenizer): " in served
    assert "unpinned" in out and "cache reset (" in out
