"""``prefixkv bench ops``: shape of the rows, table and JSON, argument errors, peer handling.

Timings are not asserted (performance targets live in the benchmark, not in unit tests); the
runs are tiny. Peer rows run only where ``sglang`` / ``vllm`` import.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from prefixkv.bench import ops, ops_peers

KINDS = ("seed-reference", "radix-bs16+array", "radix-bs1+u32")
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def rows() -> list[ops.OpsRow]:
    return ops.run_ops(KINDS, prompts=20, iters=20)


def test_rows_in_order_with_positive_figures(rows: list[ops.OpsRow]) -> None:
    assert [r.index for r in rows] == list(KINDS)
    for r in rows:
        assert r.match_us > 0 and r.insert_us > 0 and r.evict_us > 0
        assert r.bytes_per_prefix is not None and r.bytes_per_prefix > 0
        assert r.note == ""


def test_every_row_frees_ten_leaves_worth_of_tokens(rows: list[ops.OpsRow]) -> None:
    """Equal work: each evict call frees 10 x 1,024 tokens, whatever the block size (the seed's
    reference frees whole leaves: at most one leaf more, as SGLang's tree does)."""
    for r in rows[1:]:
        assert r.evict_tokens == ops.EVICT_TOKENS
    assert ops.EVICT_TOKENS <= rows[0].evict_tokens < ops.EVICT_TOKENS + 2000
    assert rows[1].evict_units is not None and 9 <= rows[1].evict_units <= 10
    assert rows[1].evict_units == rows[2].evict_units  # the same leaves at block sizes 16 and 1
    assert rows[0].evict_units is None  # the seed reference does not count leaves


def test_evictions_run_on_fresh_loads_of_the_same_leaves() -> None:
    """Evict calls take the oldest leaves of untouched loads (the insert phase's matches would
    split prompts and change which leaves are oldest): the 2,000-token system prompt and eight
    1,024-token prompts, then ten prompts (the first call leaves 48 tokens of a ninth), on every
    load, whatever the block size; ``evict_loads`` multiplies the calls."""
    got = ops.run_ops(("radix-bs16", "radix-bs1"), prompts=40, iters=20, evict_loads=2)
    assert [r.evict_units for r in got] == [9.5, 9.5]
    assert all(r.evict_tokens == ops.EVICT_TOKENS for r in got)
    with pytest.raises(ValueError, match="evict_loads"):
        ops.run_ops(("radix-bs16",), prompts=5, iters=5, evict_loads=0)


def test_table_has_baseline_first_and_every_row(rows: list[ops.OpsRow]) -> None:
    table = ops.format_table(rows)
    lines = table.splitlines()
    assert "speedup vs seed-reference" in lines[0]
    assert lines[2].startswith("seed-reference") and "1.00x" in lines[2]
    assert lines[3].startswith("radix-bs16+array")
    assert "peer" not in table  # no peer rows, no peer table


def test_peer_table_compares_like_with_like(rows: list[ops.OpsRow]) -> None:
    fake = ops.OpsRow("sglang-radix-bs16", 10.0, 20.0, 50.0, 10240, 10.0, None, "note")
    table = ops.format_table([*rows, fake])
    line = [ln for ln in table.splitlines() if ln.startswith("sglang-radix-bs16 ")][-1]
    ours = rows[1]
    assert "radix-bs16+array" in line and f"{ours.evict_us / 50.0:.2f}x" in line
    assert "n/a" in table and ops_peers.NOTES["sglang"] in table


def test_cli_writes_json_without_peers(tmp_path, capsys) -> None:
    out = tmp_path / "ops.json"
    assert ops.main(["--kinds", "radix-bs16", "--prompts", "5", "--iters", "5",
                     "--json", str(out), "--no-peers"]) == 0
    printed = capsys.readouterr().out
    assert "radix-bs16" in printed and "peers:" not in printed
    data = json.loads(out.read_text())
    assert [d["index"] for d in data] == ["radix-bs16"]
    assert set(data[0]) == {"index", "match_us", "insert_us", "evict_us", "evict_tokens",
                            "evict_units", "bytes_per_prefix", "note"}


@pytest.mark.skipif(HAVE_SGLANG or HAVE_VLLM, reason="peers are installed here")
def test_auto_peers_says_not_installed(capsys) -> None:
    assert ops.main(["--kinds", "radix-bs16", "--prompts", "5", "--iters", "5"]) == 0
    assert "peers: not installed" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--peers"):
        ops.main(["--kinds", "radix-bs16", "--prompts", "5", "--iters", "5", "--peers"])


@pytest.mark.parametrize("kind", ["btree-bs16", "radix-16", "radix-bs0", "radix-bs16+list",
                                  "radix-bs16+",
                                  "hash:md5-bs16", "vllm-bs8", "vllm-bs16+array",
                                  "sglang-radix-bsx", "sglang-radix-bs1+hash",
                                  "sglang-unified:cpp-bs1"])
def test_bad_kind_is_rejected_before_running(kind: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(kind))):
        ops.run_ops(("seed-reference", kind), prompts=5, iters=5)


def test_bad_counts_are_rejected() -> None:
    with pytest.raises(ValueError, match="--prompts"):
        ops.main(["--prompts", "0"])
    with pytest.raises(ValueError, match="--rounds"):
        ops.main(["--rounds", "0"])
    with pytest.raises(ValueError, match="kinds"):
        ops.run_ops((), prompts=5, iters=5)


def test_importing_the_benchmark_does_not_import_torch_or_peers() -> None:
    code = ("import sys, prefixkv.bench.ops; "
            "print(sorted(m for m in ('torch', 'sglang', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_torchvision_stand_in_answers_only_torchvision() -> None:
    finder = ops_peers._TorchvisionStandIn()
    assert finder.find_spec("torchvision.transforms", None) is not None
    assert finder.find_spec("torchvisionx", None) is None
    module = finder.create_module(finder.find_spec("torchvision", None))
    assert module.__version__ == "0.28.0"
    with pytest.raises(RuntimeError, match="stand-in"):
        module.transforms.InterpolationMode.BICUBIC()


@pytest.mark.slow  # importing SGLang alone takes seconds
@pytest.mark.skipif(not (HAVE_SGLANG and HAVE_VLLM), reason="sglang and vllm not installed")
def test_peers_run_on_the_same_workload() -> None:
    kinds = ("radix-bs16+array", "sglang-radix-bs16", "sglang-unified:rust-bs1", "vllm-bs16")
    got = ops.run_ops(kinds, prompts=20, iters=20)
    assert [r.index for r in got] == list(kinds)
    for r in got[1:]:
        assert r.match_us > 0 and r.insert_us > 0 and r.evict_us > 0
        assert r.evict_tokens >= ops.EVICT_TOKENS and r.note
    assert got[2].bytes_per_prefix is None  # the Rust core's memory is not visible
    assert "our time / peer's" in ops.format_table(got)


@pytest.mark.slow  # importing SGLang alone takes seconds
@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang not installed")
@pytest.mark.parametrize("kind", ["sglang-radix-bs1+alloc", "sglang-unified:rust-bs16+alloc"])
def test_alloc_kinds_free_evicted_leaves_through_sglangs_allocator(kind: str) -> None:
    """An ``+alloc`` peer's evicted leaves reach SGLang's own allocator: its free list holds
    exactly the freed slots (pages at page size 16) when the eviction returns, and is empty
    again once the engine has "taken" them."""
    peer = ops_peers.make_peer(kind, 4096)
    bs = peer.block_size
    for i in range(3):  # three 64-token prompts, no shared prefix
        tokens = [1000 * (i + 1) + t for t in range(64)]
        peer.insert(peer.insert_input(tokens, list(range(i * 64 // bs, (i + 1) * 64 // bs))))
    real, seen = peer.allocator.real, []
    taken = peer.allocator.taken
    peer.allocator.taken = lambda: (seen.append(len(real.free_pages) * (bs if bs > 1 else 1)),
                                    taken())
    assert peer.evict_tokens(128) == (128, 2)
    assert seen == [128] and len(real.free_pages) == 0


def test_a_small_vocabulary_keeps_two_byte_keys() -> None:
    """Token ids below 2**16 are stored in 2 bytes, a 150k vocabulary's in 2.25 (18-bit packed,
    with the C helper built) or 4: the bytes per cached 512-token prefix (bs16) differ by 128
    or 1,024; packed, a prefix costs at most 2 KB in all (issue 15)."""
    from prefixkv.cache.radix_node import PACKED

    small, large = (ops.run_ops(("radix-bs16",), prompts=5, iters=5, vocab=v)[0]
                    for v in (32000, 150_000))
    assert small.bytes_per_prefix is not None and large.bytes_per_prefix is not None
    extra = large.bytes_per_prefix - small.bytes_per_prefix
    if PACKED:
        assert 64 < extra < 256 and large.bytes_per_prefix <= 2048
    else:
        assert extra > 900  # 512 tokens x 2 bytes, less slack
    with pytest.raises(ValueError, match="vocab"):
        ops.run_ops(("radix-bs16",), prompts=5, iters=5, vocab=1)
