"""Lazy reader of released-format checkpoints, with DeepSeek's block-wise FP8 dequantization.

A released directory holds `config.json` and one `model.safetensors` or shards listed by
`model.safetensors.index.json`. FP8 (E4M3) weights, detected by dtype and never by module name, carry a sibling
`<name>_scale_inv`, one fp32 scale per 128x128 block; the released dequantization (`inference/fp8_cast_bf16.py`):

    w[i, j] = float(w_fp8[i, j]) * scale_inv[i // 128, j // 128]            (computed in fp32)

Design notes (scale grid, integrity checks, the fast exact E4M3 decode on CPU): docs/design_notes.md#checkpoint-reader
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from dsv3_plugin.checkpoint.integrity import (
    ALLOW_HINT,
    check_finite,
    check_released_config,
    check_scale,
    fp8_special_codes,
    load_json,
    parse_json,
)
from dsv3_plugin.errors import CheckpointError
from dsv3_plugin.safe_files import open_regular, opened_path

__all__ = [
    "CheckpointReader",
    "TensorInfo",
    "SAFETENSORS_DTYPES",
    "read_safetensors_header",
    "open_safetensors",
    "dequantize_fp8_blockwise",
    "dequantize_fp8_reference",
    "scale_grid_shape",
    "iter_dequantized_tensors",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_FP8 = {"F8_E4M3", "F8_E5M2"}
_FLOAT = {"F64", "F32", "F16", "BF16"}


class TensorInfo:
    """Header facts of one stored tensor (no data read)."""

    __slots__ = ("name", "file", "dtype", "shape", "nbytes")

    def __init__(self, name: str, file: str, dtype: str, shape: tuple, nbytes: int):
        self.name, self.file, self.dtype, self.shape, self.nbytes = name, file, dtype, shape, nbytes

    @property
    def torch_dtype(self) -> torch.dtype:
        return SAFETENSORS_DTYPES[self.dtype]

    def __repr__(self) -> str:
        return f"TensorInfo({self.name!r}, {os.path.basename(self.file)!r}, {self.dtype}, {list(self.shape)})"


def read_safetensors_header(path: str, root: str | None = None) -> tuple[dict[str, TensorInfo], dict]:
    """Parse and check one safetensors header: {name: TensorInfo}, metadata. Detects truncated files, absurd
    header lengths, malformed entries (dtype, shape, offsets), duplicate names and overlapping or gappy data, all
    before any tensor is allocated. The file must be a regular file inside `root` (default: its own directory;
    `safe_files`: no FIFO, device or link out of it)."""
    root = os.path.dirname(os.path.abspath(path)) if root is None else root
    try:
        with open_regular(path, CheckpointError, root, "safetensors file") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 2**20:
                raise CheckpointError(
                    f"{path}: truncated or corrupt safetensors file (header of {n} bytes, file has {size})"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    hdr = parse_json(raw, f"{path} (safetensors header)")
    try:  # Python's JSON takes a lone UTF-16 surrogate escape ("\\ud800"), safetensors' own parser does not
        json.dumps(hdr, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise CheckpointError(
            f"{path} (safetensors header): not valid JSON (a lone surrogate escape {e.object[e.start : e.end]!r})"
        ) from None
    if not isinstance(hdr, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON {type(hdr).__name__}, not an object)")
    meta = hdr.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{path}: corrupt safetensors header (__metadata__ must map strings to strings)")
    out: dict[str, TensorInfo] = {}
    data_len = size - 8 - n
    spans = []
    for name, h in hdr.items():
        if not isinstance(h, dict):
            raise CheckpointError(f"{name} in {path}: corrupt header entry {h!r}")
        dt = h.get("dtype")
        if dt not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{name} in {path}: unsupported dtype {dt!r}")
        shape, offs = h.get("shape"), h.get("data_offsets")
        if not (isinstance(shape, list) and all(_is_int(s) and 0 <= s < 2**48 for s in shape) and len(shape) <= 8):
            raise CheckpointError(f"{name} in {path}: corrupt header, shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(x) and x >= 0 for x in offs)):
            raise CheckpointError(f"{name} in {path}: corrupt header, data_offsets {offs!r}")
        shape = tuple(shape)
        b, e = offs
        nbytes = math.prod(shape) * SAFETENSORS_DTYPES[dt].itemsize
        if e - b != nbytes:
            raise CheckpointError(
                f"{name} in {path}: header says {e - b} bytes for {dt} {list(shape)} (expected {nbytes})"
            )
        if e > data_len:
            raise CheckpointError(
                f"{name} in {path}: data ends at byte {e} but the file holds {data_len} "
                "data bytes (truncated safetensors file)"
            )
        spans.append((b, e, name))
        out[name] = TensorInfo(name, path, dt, shape, nbytes)
    end = 0
    for b, e, name in sorted(spans):
        if b != end:  # the format packs tensors back to back: a gap or an overlap is corruption
            raise CheckpointError(
                f"{name} in {path}: data starts at byte {b}, expected {end} "
                f"({'overlaps the previous tensor' if b < end else 'gap before it'}; "
                "corrupt safetensors file)"
            )
        end = e
    if end != data_len:
        raise CheckpointError(
            f"{path}: {data_len - end} trailing bytes after the last tensor (corrupt safetensors file)"
        )
    return out, meta


def open_safetensors(fd_path: str, path: str):
    """safetensors' `safe_open` of a checked file (`fd_path`, from `safe_files.opened_path`), whatever its parser
    rejects a CheckpointError naming `path` (one line, not a SafetensorError traceback)."""
    from safetensors import safe_open

    try:
        return safe_open(fd_path, framework="pt", device="cpu")
    except Exception as e:  # SafetensorError is not exported under a stable name
        raise CheckpointError(f"{path}: cannot open safetensors file ({e})") from None


def _header_bytes(path: str, root: str) -> int:
    """Size of a safetensors file's length prefix plus header (what reading the header read)."""
    with open_regular(path, CheckpointError, root, "safetensors file") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def scale_grid_shape(shape: tuple, block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(out/b0), ceil(in/b1)]: the released scale grid (ragged edge blocks count as whole blocks)."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


# --------------------------------------------------------------------------------------------------
# FP8 block dequantization
def dequantize_fp8_reference(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """DeepSeek's formula written plainly (the baseline and the tests' oracle): expand the scale grid to the
    weight's shape and multiply in fp32, then cast."""
    out_f, in_f = w_fp8.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:out_f].repeat_interleave(block[1], 1)[:, :in_f]
    return (w_fp8.to(torch.float32) * s).to(dtype)


_CHUNK_ELEMS = 1 << 20  # the fastest of 2^18, 2^20, 2^21 on a 2-core CPU: large enough per call, small for the cache
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_TLS = threading.local()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            n = max(1, min(os.cpu_count() or 1, torch.get_num_threads()))
            # One intra-op thread per worker: the workers themselves are the parallelism.
            _POOL = ThreadPoolExecutor(
                n, thread_name_prefix="fp8-dequant", initializer=torch.set_num_threads, initargs=(1,)
            )
        return _POOL


def _buffers(numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b = getattr(_TLS, "bufs", None)
    if b is None or b[0].numel() < numel:
        b = (
            torch.empty(numel, dtype=torch.int16),
            torch.empty(numel, dtype=torch.float32),
            torch.empty(numel, dtype=torch.uint8),
        )
        _TLS.bufs = b
    return b


def _dequant_rows(
    w_fp8: torch.Tensor, scale_cols: torch.Tensor, out: torch.Tensor, r0: int, r1: int, is_e4m3: bool
) -> bool:
    """out[r0:r1] = w_fp8[r0:r1] * scale_cols (one row-block: scale_cols [in] already expanded per column).
    Returns True if the rows hold NaN/Inf codes (decoded as NaN/Inf, as `float(w_fp8)` does)."""
    rows, cols = r1 - r0, w_fp8.shape[1]
    src = w_fp8[r0:r1]
    if out.dtype == torch.float32:
        f32 = out[r0:r1]
    else:
        f32 = _buffers(rows * cols)[1][: rows * cols].view(rows, cols)
    if is_e4m3:
        # NaN codes are 0x7F / 0xFF: (byte | 0x80) reaches 255 only for them. One OR and one max over the
        # cache-hot bytes (far cheaper than an fp32 min/max pass over the decoded block).
        u8 = _buffers(rows * cols)[2][: rows * cols].view(rows, cols)
        special = int(torch.bitwise_or(src.view(torch.uint8), 0x80, out=u8).max()) == 255
        # E4M3 (s eeee mmm) -> FP16 (s eeeee mmmmmmmmmm) with value / 2^8: sign-extend, << 7, clear bit 14.
        i16 = _buffers(rows * cols)[0][: rows * cols].view(rows, cols)
        i16.copy_(src.view(torch.int8))
        i16.mul_(128)
        i16.bitwise_and_(-16512)  # 0xBF80
        f32.copy_(i16.view(torch.float16))
        if special:  # the NaN code re-encodes to +-1.875, above every finite code (448 / 2^8 = 1.75)
            f32.masked_fill_(f32.abs() > 1.75, float("nan"))
    else:
        f32.copy_(src)  # torch's cast: E5M2's Inf and NaN codes decode as Inf and NaN
        lo, hi = torch.aminmax(f32)
        special = not (math.isfinite(float(lo)) and math.isfinite(float(hi)))
    f32.mul_(scale_cols)
    if f32.data_ptr() != out[r0:r1].data_ptr():
        out[r0:r1].copy_(f32)
    return special


def dequantize_fp8_blockwise(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    name: str = "<tensor>",
    check_finite: bool = False,
    file: str | None = None,
) -> torch.Tensor:
    """Fast, exact equivalent of `dequantize_fp8_reference` (bitwise equal, NaN/Inf codes included).

    `w_fp8` [O, I] float8_e4m3fn/e5m2, `scale_inv` [ceil(O/b0), ceil(I/b1)] fp32 -> [O, I] `dtype`.
    With `check_finite`, a non-finite or overflowing scale, or NaN/Inf codes in the data, raise
    `CheckpointError` naming `name` (and `file`) instead of producing non-finite weights.
    """
    where = f"{name} in {file}" if file else name
    if w_fp8.dim() != 2:
        raise CheckpointError(f"{where}: FP8 weight must be 2-D for block scaling (got {list(w_fp8.shape)})")
    grid = scale_grid_shape(tuple(w_fp8.shape), block)
    if tuple(scale_inv.shape) != grid:
        raise CheckpointError(
            f"{name}{SCALE_SUFFIX}: scale grid {list(scale_inv.shape)} does not match weight "
            f"{list(w_fp8.shape)} with {block[0]}x{block[1]} blocks (expected {list(grid)})"
        )
    if check_finite:  # finite data codes x a scale below this bound give finite products: no output pass
        check_scale(scale_inv, w_fp8.dtype, dtype, f"{name}{SCALE_SUFFIX}" + (f" in {file}" if file else ""))
    O, I = w_fp8.shape
    w_fp8 = w_fp8.contiguous()
    if out is None:
        out = torch.empty(O, I, dtype=dtype)
    is_e4m3 = w_fp8.dtype == torch.float8_e4m3fn
    # Per-column scales of each row block, [nbr, I] fp32; x 2^8 undoes the FP16 re-encoding's bias shift.
    s = scale_inv.to(torch.float32)
    if is_e4m3:
        s = s * 256.0
    cols_NI = s.repeat_interleave(block[1], 1)[:, :I].contiguous()
    # Jobs of at most _CHUNK_ELEMS elements inside one row block: their int16/fp32 buffers stay in cache.
    step = max(1, min(block[0], _CHUNK_ELEMS // max(1, I)))
    jobs = [
        (r0 // block[0], r0, min(r0 + step, (r0 // block[0] + 1) * block[0], O))
        for b0 in range(0, O, block[0])
        for r0 in range(b0, min(b0 + block[0], O), step)
    ]
    if O * I < (1 << 20) or len(jobs) == 1:
        special = [_dequant_rows(w_fp8, cols_NI[k], out, r0, r1, is_e4m3) for k, r0, r1 in jobs]
    else:
        futs = [_pool().submit(_dequant_rows, w_fp8, cols_NI[k], out, r0, r1, is_e4m3) for k, r0, r1 in jobs]
        special = [f.result() for f in futs]
    if check_finite and any(special):
        n = fp8_special_codes(w_fp8)
        kind = "NaN codes (S.1111.111)" if is_e4m3 else "Inf/NaN codes (S.11111.xx)"
        raise CheckpointError(
            f"{where}: {n} FP8 {kind} among {w_fp8.numel()} values (non-finite weights); {ALLOW_HINT}"
        )
    return out


# --------------------------------------------------------------------------------------------------
class CheckpointReader:
    """Lazy, validated view of a released-format checkpoint directory.

    `names()` are the logical tensors (FP8 weights included, their `_scale_inv` siblings folded into them).
    `get(name, dtype)` returns one tensor, dequantized when stored as FP8.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        require_config: bool = True,
        max_open_files: int = 1,
        max_mapped_bytes: int = 256 * 2**20,
        allow_non_finite: bool = False,
    ):
        self.path = os.fspath(path)
        # safe_open memory-maps a shard; the pages read stay resident (and count in RSS) until the handle is
        # closed. So at most `max_open_files` shards are open (LRU), and a handle is dropped once
        # `max_mapped_bytes` were read through it: resident mapped pages stay below that bound plus the
        # tensors still referenced, whatever the shard size.
        self.max_open_files = max(1, max_open_files)
        self.max_mapped_bytes = max_mapped_bytes
        # NaN/Inf in weights or scales -> CheckpointError unless explicitly allowed (integrity.py).
        self.allow_non_finite = allow_non_finite
        self._mapped: dict[str, int] = {}
        self._handles: dict[str, object] = {}
        # bytes read from the files: headers, then the data of every tensor fetched (weights and scales)
        self.bytes_read = 0
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: not a checkpoint directory")
        cfg_path = os.path.join(self.path, "config.json")
        self.config_path = cfg_path
        self.config: dict = {}
        if os.path.lexists(cfg_path):
            self.config = load_json(cfg_path, what="released config.json", root=self.path)
        elif require_config:
            raise CheckpointError(f"{cfg_path}: missing config.json")
        qc = self.config.get("quantization_config") or {}
        bs = qc.get("weight_block_size") if isinstance(qc, dict) else None
        bs = [128, 128] if bs is None else bs
        if not (isinstance(bs, list) and len(bs) == 2 and all(_is_int(b) and b > 0 for b in bs)):
            raise CheckpointError(
                f"{cfg_path}: quantization_config.weight_block_size must be two positive ints (got {bs!r})"
            )
        self.block: tuple[int, int] = (bs[0], bs[1])
        self.stored: dict[str, TensorInfo] = {}
        self.metadata: dict[str, dict] = {}
        self._open_files(cfg_path)
        self._pair_scales()
        if require_config:
            check_released_config(self.config, cfg_path, len(self.names()))

    # -- discovery and validation ----------------------------------------------------------------
    def _open_files(self, cfg_path: str) -> None:
        idx_path = os.path.join(self.path, INDEX_NAME)
        single = os.path.join(self.path, SINGLE_NAME)
        if os.path.lexists(idx_path):
            index = load_json(idx_path, what="safetensors index", root=self.path)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(
                    f'{idx_path}: not a valid index (need a "weight_map" object mapping tensor '
                    f"names to shard files, got {type(weight_map).__name__})"
                )
            if not weight_map:
                raise CheckpointError(f'{idx_path}: "weight_map" is empty (no tensors)')
            files: dict[str, list[str]] = {}
            for name, fn in weight_map.items():
                if not isinstance(fn, str):
                    raise CheckpointError(f"{name}: {idx_path} maps it to {fn!r}, not a shard file name")
                if os.path.basename(fn) != fn or fn in ("", ".", ".."):
                    raise CheckpointError(
                        f"{idx_path}: shard name {fn!r} (of tensor {name}) is not a plain "
                        "file name inside the checkpoint directory"
                    )
                files.setdefault(fn, []).append(name)
            for fn, names in files.items():
                fp = os.path.join(self.path, fn)
                if not os.path.lexists(fp):
                    raise CheckpointError(f"{names[0]}: index {idx_path} points to missing file {fp}")
                infos, meta = read_safetensors_header(fp, self.path)
                self.bytes_read += _header_bytes(fp, self.path)
                self.metadata[fp] = meta
                for n in names:
                    if n not in infos:
                        raise CheckpointError(f"{n}: listed in {idx_path} for {fp} but that file does not hold it")
                for n, info in infos.items():
                    if weight_map.get(n) != fn:
                        raise CheckpointError(f"{n} in {fp}: unexpected tensor, not listed for this file in {idx_path}")
                    self.stored[n] = info
        elif os.path.lexists(single):
            infos, meta = read_safetensors_header(single, self.path)
            self.bytes_read += _header_bytes(single, self.path)
            self.metadata[single] = meta
            self.stored.update(infos)
        else:
            raise CheckpointError(f"{self.path}: no {INDEX_NAME} and no {SINGLE_NAME}")
        if not self.stored:
            raise CheckpointError(f"{self.path}: the checkpoint holds no tensors")

    def _pair_scales(self) -> None:
        self.scale_of: dict[str, str] = {}
        for name, info in self.stored.items():
            if name.endswith(SCALE_SUFFIX):
                base = name[: -len(SCALE_SUFFIX)]
                if base not in self.stored:
                    raise CheckpointError(f"{name} in {info.file}: unexpected scale tensor, no weight {base}")
                if self.stored[base].dtype not in _FP8:
                    raise CheckpointError(
                        f"{name} in {info.file}: scale for {base}, which is stored as "
                        f"{self.stored[base].dtype}, not FP8"
                    )
                continue
            if info.dtype in _FP8:
                sname = name + SCALE_SUFFIX
                if sname not in self.stored:
                    raise CheckpointError(f"{name} in {info.file}: FP8 weight without {sname}")
                sinfo = self.stored[sname]
                if sinfo.dtype not in _FLOAT:
                    raise CheckpointError(f"{sname} in {sinfo.file}: scale dtype {sinfo.dtype}, expected F32")
                if len(info.shape) != 2:
                    raise CheckpointError(f"{name} in {info.file}: FP8 weight must be 2-D (got {list(info.shape)})")
                grid = scale_grid_shape(info.shape, self.block)
                if tuple(sinfo.shape) != grid:
                    raise CheckpointError(
                        f"{sname} in {sinfo.file}: scale grid {list(sinfo.shape)} does not match weight "
                        f"{list(info.shape)} with {self.block[0]}x{self.block[1]} blocks (expected {list(grid)})"
                    )
                self.scale_of[name] = sname
            elif info.dtype not in _FLOAT:
                raise CheckpointError(
                    f"{name} in {info.file}: unexpected dtype {info.dtype} (weights are "
                    "F32/BF16/F16 or FP8 with a _scale_inv)"
                )

    # -- queries ---------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """Logical tensor names (scale tensors folded into their FP8 weights), in stored order."""
        return [n for n in self.stored if not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in self.scale_of)]

    def __contains__(self, name: str) -> bool:
        return name in self.stored and not (name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in self.scale_of)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.stored[name]
        except KeyError:
            raise CheckpointError(f"{name}: missing from checkpoint {self.path}") from None

    def is_fp8(self, name: str) -> bool:
        return name in self.scale_of

    def shape(self, name: str) -> tuple:
        return self.info(name).shape

    def input_bytes(self, name: str) -> int:
        """Bytes read for `name` (weight plus its scale)."""
        n = self.info(name).nbytes
        if name in self.scale_of:
            n += self.stored[self.scale_of[name]].nbytes
        return n

    def files(self) -> list[str]:
        return sorted({i.file for i in self.stored.values()})

    def names_by_file(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for n in self.names():
            out.setdefault(self.stored[n].file, []).append(n)
        return out

    def is_quantized(self) -> bool:
        return bool(self.scale_of)

    # -- data ------------------------------------------------------------------------------------
    def _handle(self, file: str):
        h = self._handles.pop(file, None)
        if h is None:
            while len(self._handles) >= self.max_open_files:
                self._mapped.pop(evicted := next(iter(self._handles)), None)
                self._handles.pop(evicted)
            # the descriptor checked to be the regular file inside the directory is what gets mapped
            with opened_path(file, CheckpointError, self.path, "safetensors file") as fd_path:
                h = open_safetensors(fd_path, file)
        self._handles[file] = h  # (re)inserted last: most recently used
        return h

    def raw(self, name: str) -> torch.Tensor:
        """The stored tensor as is (FP8 stays FP8)."""
        info = self.info(name)
        try:
            t = self._handle(info.file).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{name} in {info.file}: cannot read ({e})") from None
        self._mapped[info.file] = self._mapped.get(info.file, 0) + info.nbytes
        self.bytes_read += info.nbytes
        if self._mapped[info.file] >= self.max_mapped_bytes:
            self._handles.pop(info.file, None)  # unmapped once `t` (which holds the mapping) is freed
            self._mapped[info.file] = 0
        return t

    def out_dtype(self, name: str, dtype: torch.dtype | None) -> torch.dtype:
        """The dtype `get(name, dtype)` returns: FP8 -> `dtype` (default bf16); others -> `dtype` if given."""
        if dtype is not None:
            return dtype
        return torch.bfloat16 if name in self.scale_of else self.info(name).torch_dtype

    def get(self, name: str, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """One logical tensor; FP8 weights are dequantized block-wise (fp32 math) to `dtype` (default bf16).
        Non-finite values (NaN/Inf weights, scales or FP8 codes) raise unless `allow_non_finite`."""
        if name not in self:
            raise CheckpointError(f"{name}: missing from checkpoint {self.path}")
        t = self.raw(name)
        info = self.stored[name]
        if name in self.scale_of:
            s = self.raw(self.scale_of[name])
            return dequantize_fp8_blockwise(
                t,
                s,
                self.block,
                self.out_dtype(name, dtype),
                out=out,
                name=name,
                check_finite=not self.allow_non_finite,
                file=info.file,
            )
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)  # upcasts are exact; a downcast may overflow, so the check looks at the result
        check_finite(t, f"{name} in {info.file}", self.allow_non_finite)
        if out is not None:
            out.copy_(t)
            return out
        return t

    def get_fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One FP8 weight as stored, not dequantized: (E4M3 [O, I], fp32 `weight_scale_inv`
        [ceil(O/b0), ceil(I/b1)]). The scales are checked as `get` checks them (and NaN codes refused) unless
        `allow_non_finite`; a weight stored otherwise (BF16, E5M2) is a CheckpointError naming it."""
        if name not in self:
            raise CheckpointError(f"{name}: missing from checkpoint {self.path}")
        info = self.stored[name]
        if name not in self.scale_of or info.dtype != "F8_E4M3":
            raise CheckpointError(
                f"{name} in {info.file}: stored as {info.dtype}, not FP8 E4M3 with a weight_scale_inv"
            )
        sname = self.scale_of[name]
        q, s = self.raw(name), self.raw(sname).to(torch.float32)
        if not self.allow_non_finite:
            check_scale(s, q.dtype, torch.float32, f"{sname} in {self.stored[sname].file}")
            if n := fp8_special_codes(q):
                raise CheckpointError(
                    f"{name} in {info.file}: {n} NaN codes among {q.numel()} FP8 values; {ALLOW_HINT}"
                )
        return q, s

    def iter_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream (name, tensor) file by file."""
        for _, names in self.names_by_file().items():
            for n in names:
                yield n, self.get(n, dtype)

    def iter_logical(self, fp8_dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(name, file, tensor) file by file: FP8 weights dequantized to `fp8_dtype`, others as stored."""
        for file, names in self.names_by_file().items():
            for n in names:
                yield n, file, (self.get(n, fp8_dtype) if self.is_fp8(n) else self.get(n))

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_dequantized_tensors(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, allow_non_finite: bool = False
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(name, file, tensor) for every logical tensor of a released-format directory, file by file; FP8
    weights dequantized block-wise to `dtype` (fp32 by default: the exact product of the formula), other
    tensors as stored. Non-finite values raise unless `allow_non_finite`."""
    with CheckpointReader(path, allow_non_finite=allow_non_finite) as r:
        yield from r.iter_logical(dtype)
