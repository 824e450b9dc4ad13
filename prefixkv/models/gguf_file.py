"""A minimal, fast GGUF reader: metadata as Python values, tensors as memory-mapped bytes.

``gguf.GGUFReader`` builds one numpy object per vocabulary string and takes seconds on a
49k-token vocabulary; this reader parses the header with ``struct`` in well under a second and
leaves dequantization to ``gguf.quants`` (see :mod:`prefixkv.models.gguf_loader`). Format:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (versions 2 and 3, little endian).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(slots=True, frozen=True)
class GGUFTensor:
    """One tensor: name, shape (row-major, torch order), ggml type id and its raw bytes."""

    name: str
    shape: tuple[int, ...]
    tensor_type: int
    data: np.ndarray  # uint8, memory-mapped


class GGUFFile:
    """The parsed file: ``metadata`` (name -> value) and ``tensors`` (in file order).

    ``ValueError`` for anything that is not a little-endian GGUF v2/v3 file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            self.metadata, infos, data_start = self._parse_header()
        except (struct.error, UnicodeDecodeError, EOFError) as exc:
            raise ValueError(f"not a readable GGUF file: {self.path}: {exc}") from exc
        self.tensors = self._map_tensors(infos, data_start)

    def _parse_header(self) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
        with self.path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"not a GGUF file (bad magic): {self.path}")
            (version,) = struct.unpack("<I", _read(f, 4))
            if version not in (2, 3):
                raise ValueError(f"unsupported GGUF version {version} in {self.path}")
            n_tensors, n_kv = struct.unpack("<QQ", _read(f, 16))
            meta: dict[str, Any] = {}
            for _ in range(n_kv):
                key = _string(f)
                (vtype,) = struct.unpack("<I", _read(f, 4))
                meta[key] = _value(f, vtype)
            infos = []
            for _ in range(n_tensors):
                name = _string(f)
                (n_dims,) = struct.unpack("<I", _read(f, 4))
                dims = struct.unpack(f"<{n_dims}Q", _read(f, 8 * n_dims))
                ttype, offset = struct.unpack("<IQ", _read(f, 12))
                infos.append((name, tuple(int(d) for d in reversed(dims)), int(ttype), int(offset)))
            align = int(meta.get("general.alignment", 32))
            data_start = -(-f.tell() // align) * align
        return meta, infos, data_start

    def _map_tensors(
        self, infos: list[tuple[str, tuple[int, ...], int, int]], data_start: int
    ) -> list[GGUFTensor]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        raw = np.memmap(self.path, dtype=np.uint8, mode="r")
        tensors = []
        for name, shape, ttype, offset in infos:
            try:
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError) as exc:
                raise ValueError(f"GGUF tensor {name!r} has unknown type {ttype}") from exc
            count = int(np.prod(shape))
            nbytes = count // block * size
            start = data_start + offset
            if start + nbytes > raw.shape[0]:
                raise ValueError(f"GGUF tensor {name!r} runs past the end of {self.path}")
            rows = count // shape[-1]
            data = raw[start : start + nbytes].reshape(rows, nbytes // rows)
            tensors.append(GGUFTensor(name, shape, ttype, data))
        return tensors


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EOFError("truncated file")
    return data


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", _read(f, 8))
    return _read(f, n).decode("utf-8")


def _value(f: BinaryIO, vtype: int) -> Any:
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        etype, count = struct.unpack("<IQ", _read(f, 12))
        if etype == _STRING:
            return [_string(f) for _ in range(count)]
        if etype in _NUMPY:
            dtype = np.dtype(_NUMPY[etype])
            values = np.frombuffer(_read(f, dtype.itemsize * count), dtype=dtype)
            return [bool(v) for v in values] if etype == 7 else values.tolist()
        return [_value(f, etype) for _ in range(count)]
    if vtype not in _SCALARS:
        raise ValueError(f"unknown GGUF value type {vtype}")
    fmt, size = _SCALARS[vtype]
    return struct.unpack(fmt, _read(f, size))[0]
