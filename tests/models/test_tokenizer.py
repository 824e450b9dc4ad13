"""Tokenizer wrapper, chat template rendering, incremental detokenizer (demo tokenizer)."""

from __future__ import annotations

import json

import pytest

from prefixkv.models import IncrementalDetokenizer, Tokenizer, ensure_demo_model
from prefixkv.models.demo import build_byte_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("cache")))


@pytest.mark.parametrize("text", ["", "hello world", "héllo, 世界! 🚀\n\ttabs  spaces", "\x00\xff"])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < 256 for i in ids)


def test_special_tokens(tok):
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 258
    assert tok.bos_token is None and tok.bos_token_id is None
    assert tok.vocab_size == 259
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids == [257, ord("h"), ord("i"), 258]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "assistant\n"
    )
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])


def test_template_features_and_errors(tmp_path):
    build_byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}"
        "{{ raise_exception('bad role') }}{% endif %}{{ m | tojson }}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|endoftext|>", "special": True},
                "chat_template": [{"name": "default", "template": template}],
            }
        )
    )
    t = Tokenizer.from_dir(tmp_path)
    assert t.bos_token_id == 256
    out = t.apply_chat_template([{"role": "user", "content": "é"}])
    assert out == '<|endoftext|>{"role": "user", "content": "é"}'
    with pytest.raises(ValueError, match="bad role"):
        t.apply_chat_template([{"role": "bad", "content": ""}])
    # a caller's value the template cannot use is a ValueError, not the TypeError it raises
    # (a server's 500: chat_template_kwargs {"tools": 5} with a template looping over tools)
    t._template = t._template.environment.from_string("{% for x in tools %}{{ x }}{% endfor %}{{ bos_token }}")
    with pytest.raises(ValueError, match="chat template failed: TypeError"):
        t.apply_chat_template([{"role": "user", "content": ""}], tools=5)
    assert t.apply_chat_template([], tools=["a"], bos_token="<s>") == "a<s>"  # the caller's bos wins
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path / "missing")


def test_incremental_detokenizer_holds_back_split_characters(tok):
    text = "a世🚀b é"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    # "世" is 3 bytes: nothing is emitted until its last byte arrives.
    assert deltas[1:4] == ["", "", "世"]


def test_incremental_detokenizer_skips_specials_and_flushes(tok):
    detok = IncrementalDetokenizer(tok)
    assert detok.push([ord("o"), ord("k"), 258]) == "ok"
    assert detok.push(list("é".encode())[:1]) == ""
    assert detok.flush() == ""  # the stream ends mid-character: vLLM's text ends before it
    assert detok.text == "ok"


def test_a_broken_character_followed_by_text_stays(tok):
    detok = IncrementalDetokenizer(tok)
    lead = list("é".encode())[:1]  # a lead byte whose character never completes
    assert detok.push(lead) == "" and detok.push([ord("A")]) == "\ufffdA"
    assert detok.push(lead) == "" and detok.flush() == "" and detok.text == "\ufffdA"


def test_peek_gives_each_candidate_its_text_in_context_and_changes_nothing(tok):
    detok = IncrementalDetokenizer(tok)
    e1, e2, e3 = "世".encode()  # three byte tokens
    assert detok.push([ord("a")]) == "a"
    assert detok.peek([e1, ord("b"), 258]) == ["", "b", "<|im_end|>"]  # a special shows as itself
    assert detok.push([e1]) == "" and detok.push([e2]) == ""
    # the token completing the character carries all of it (what was held back included)
    assert detok.peek([e3, ord("c")]) == ["世", "\ufffdc"]
    assert detok.push([e3]) == "世" and detok.text == "a世"
