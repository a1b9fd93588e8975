"""A lean GGUF reader: metadata, tensor index and memory-mapped tensor data.

gguf.GGUFReader builds Python objects for every element of the tokenizer arrays (~3 s
for a 49k vocabulary); this reader skips string arrays lazily and parses a file's
header in milliseconds. Dequantization is gguf.quants'.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvferry.errors import ModelLoadError
from kvferry.model.loader.gguf_dequant import dequantize

logger = logging.getLogger(__name__)

MAGIC = b"GGUF"
# GGUF value type -> struct format of one scalar (8: string, 9: array are handled apart)
SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class StringArray:
    """A string array left unparsed: where it starts and how many strings it holds."""

    offset: int
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first), as transformers lays weights out
    qtype: int  # gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: memoryview, pos: int = 0):
        self.buf, self.pos = buf, pos

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.unpack("<Q")
        text = bytes(self.buf[self.pos : self.pos + size]).decode("utf-8", errors="replace")
        self.pos += size
        return text

    def skip_string(self) -> None:
        self.pos += 8 + struct.unpack_from("<Q", self.buf, self.pos)[0]

    def value(self, vtype: int) -> Any:
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            return self.array()
        return self.unpack(SCALARS[vtype])

    def array(self) -> Any:
        etype, count = self.unpack("<I"), self.unpack("<Q")
        if etype in NUMPY:
            dtype = np.dtype(NUMPY[etype])
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += dtype.itemsize * count
            return arr
        if etype == STRING:
            start = self.pos
            for _ in range(count):
                self.skip_string()
            return StringArray(start, count)
        return [self.value(etype) for _ in range(count)]


class GGUFFile:
    """Metadata (`fields`), tensor index (`tensors`) and data of one GGUF file."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        try:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot read GGUF file {self.path!r}: {err}") from err
        self._buf = self._data.data  # a memoryview of the mapping
        try:
            self.fields, self.tensors = self._parse()
        except (struct.error, KeyError, ValueError, UnicodeDecodeError) as err:
            raise ModelLoadError(f"GGUF file {self.path!r} is malformed: {err}") from err

    def _parse(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        cur = _Cursor(self._buf)
        if bytes(self._buf[:4]) != MAGIC:
            raise ModelLoadError(f"{self.path!r} is not a GGUF file")
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"GGUF version {version} of {self.path!r} is not supported (2, 3)")
        num_tensors, num_fields = cur.unpack("<Q"), cur.unpack("<Q")
        fields = {}
        for _ in range(num_fields):
            key = cur.string()
            fields[key] = cur.value(cur.unpack("<I"))
        raw = [self._tensor_header(cur) for _ in range(num_tensors)]
        align = int(fields.get("general.alignment", 32))
        data_start = -(-cur.pos // align) * align
        tensors = [TensorInfo(n, s, q, data_start + off, size) for n, s, q, off, size in raw]
        return fields, tensors

    @staticmethod
    def _tensor_header(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int, int]:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        qtype, offset = cur.unpack("<I"), cur.unpack("<Q")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        nbytes = int(np.prod(dims)) // block * type_size
        return name, tuple(reversed(dims)), qtype, offset, nbytes

    def strings(self, key: str) -> list[str]:
        """Decode a string array field (e.g. tokenizer.ggml.tokens)."""
        lazy = self.fields[key]
        cur = _Cursor(self._buf, lazy.offset)
        return [cur.string() for _ in range(lazy.count)]

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as stored (uint8, flat; a view of the mapped file)."""
        return self._data[info.offset : info.offset + info.nbytes]

    def dequantize(self, info: TensorInfo) -> torch.Tensor:
        """The tensor as a new float32 torch tensor of shape `info.shape`."""
        return dequantize(self._data[info.offset : info.offset + info.nbytes], info.qtype, info.shape)
