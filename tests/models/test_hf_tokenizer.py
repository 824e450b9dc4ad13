"""The real SmolLM2's tokenizer directory, as the catalogue writes it, read by ``transformers``
(what guidellm and aiperf do with ``--tokenizer DIR``): same ids, same chat prompt as ours."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from prefixkv.models.catalog import ensure_model, tokenizer_dir
from prefixkv.models.gguf_tokenizer import tokenizer_from_gguf
from prefixkv.models.hf_tokenizer import write_hf_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # the real SmolLM2 (fetched once, like test_smollm2.py)

TEXTS = (
    "You are a helpful assistant.",
    "12345 apples cost $3.50, don't they?",
    "  leading spaces\n\nand\ttabs   ",
    "héllo wörld 日本語 🙂",
    "<|im_start|>user\nHi<|im_end|>",
    "def f(x):\n    return x ** 2  # comment",
)
MESSAGES = [
    [{"role": "user", "content": "Say hello."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
]


def test_transformers_reads_the_catalogues_directory_like_our_tokenizer(smol: Path) -> None:
    ensure_model("smollm2-135m-instruct", stream=io.StringIO())  # writes it if an older fetch did not
    tok_dir = tokenizer_dir("smollm2-135m-instruct")
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    ours = tokenizer_from_gguf(smol)
    for text in TEXTS:
        assert hf.encode(text) == ours.encode(text), text
        assert hf.decode(hf.encode(text)) == text
    for messages in MESSAGES:
        assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
            ours.apply_chat_template(messages))
    assert (hf.eos_token, hf.model_max_length) == ("<|im_end|>", 8192)
    assert hf.eos_token_id == ours.eos_token_id


def test_an_export_replaces_a_stale_directory(smol: Path, tmp_path: Path) -> None:
    out = tmp_path / "tok"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / "stale.txt").write_text("x")
    write_hf_tokenizer(smol, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((out / "special_tokens_map.json").read_text())["eos_token"] == "<|im_end|>"
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]  # no temporary directory left
