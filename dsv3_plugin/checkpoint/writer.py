"""Streaming safetensors writer: the header is computed from (name, dtype, shape) up front, then tensor bytes
are appended as they are produced, so a shard is never held in memory as a whole (peak memory = the
tensor being written). Tensors may arrive in row blocks (a dim-0 slice of a row-major tensor is a
contiguous byte range), which lets converters concatenate or split along dim 0 without a copy.
A failed write (a full disk, a quota, a read-only file system) raises an OSError naming the file (`named_os_error`).
Writes go to a background thread one tensor deep, so producing the next tensor (dequantization) overlaps
with writing the previous one; `write` returns once the previous write has finished, so a caller that
alternates two output buffers may reuse a buffer two writes later.

File format (safetensors spec): u64 little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}` padded with spaces
to a multiple of 8, then the tensors' raw little-endian bytes at those offsets.
"""

from __future__ import annotations

import json
import math
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from dsv3_plugin.errors import CheckpointError

__all__ = ["StreamingSafetensorsWriter", "DTYPE_NAMES", "named_os_error"]

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def named_os_error(e: OSError, path: str) -> OSError:
    """`e` with `path` as its file name when it has none: a failing `write` or `close` (ENOSPC, EDQUOT, EFBIG, EIO)
    raises an OSError that names no file, and the caller's message must say which output it was.

    Args:
        e: the error raised by a write to `path`.
        path: the file being written.

    Returns:
        `e` itself when it names a file, else a new OSError (the same subclass, from the errno) naming `path`.
    """
    if e.filename is not None or e.errno is None:
        return e
    return OSError(e.errno, e.strerror or os.strerror(e.errno), path)


class StreamingSafetensorsWriter:
    """Write `specs` = [(name, dtype, shape), ...] in that order to `path`."""

    def __init__(self, path: str, specs: list[tuple[str, torch.dtype, tuple]], metadata: dict | None = None):
        self.path = path
        self.specs = list(specs)
        hdr: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {"format": "pt"}).items()}}
        off = 0
        self.nbytes: list[int] = []
        for name, dtype, shape in self.specs:
            if name in hdr:
                raise CheckpointError(f"{name}: written twice to {path}")
            n = math.prod(shape) * dtype.itemsize
            hdr[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
            self.nbytes.append(n)
            off += n
        self.total_bytes = off
        raw = json.dumps(hdr, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._f = open(path, "wb")
        try:
            self._write(struct.pack("<Q", len(raw)) + raw)
        except BaseException:
            self._f.close()
            raise
        self._io = ThreadPoolExecutor(1, thread_name_prefix="safetensors-write")
        self._pending: Future | None = None
        self._k = 0  # index of the tensor being written
        self._done = 0  # bytes of it written so far

    def write(self, name: str, t: torch.Tensor) -> None:
        """Append `t`: the whole tensor `name`, or its next dim-0 row block."""
        if self._k >= len(self.specs):
            raise CheckpointError(f"{name}: not declared for {self.path}")
        exp_name, dtype, shape = self.specs[self._k]
        if name != exp_name:
            raise CheckpointError(f"{name}: written out of order to {self.path} (expected {exp_name})")
        if t.dtype != dtype:
            raise CheckpointError(f"{name}: dtype {t.dtype} does not match declared {dtype} in {self.path}")
        if tuple(t.shape[1:]) != tuple(shape[1:]) and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{name}: block shape {list(t.shape)} does not fit declared {list(shape)}")
        b = t.detach().contiguous().reshape(-1).view(torch.uint8)
        self._wait()
        if b.numel():
            self._pending = self._io.submit(self._write, memoryview(b.numpy()))
        self._done += b.numel()
        if self._done > self.nbytes[self._k]:
            raise CheckpointError(f"{name}: more data than its declared shape {list(shape)} in {self.path}")
        if self._done == self.nbytes[self._k]:
            self._k += 1
            self._done = 0

    def _write(self, data) -> None:
        try:
            self._f.write(data)
        except OSError as e:
            raise named_os_error(e, self.path) from None

    def _wait(self) -> None:
        if self._pending is not None:
            p, self._pending = self._pending, None
            p.result()

    def _shutdown(self) -> None:
        try:
            self._wait()
        finally:
            self._io.shutdown(wait=True)
            try:
                self._f.close()  # flushes the buffer: a full disk can show here first
            except OSError as e:
                raise named_os_error(e, self.path) from None

    def close(self) -> None:
        self._shutdown()
        if self._k != len(self.specs):
            raise CheckpointError(f"{self.specs[self._k][0]}: never written to {self.path}")

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._shutdown()
