"""Streaming checkpoint conversion: released FP8/BF16 format -> dequantized released format, -> Megatron
per-(pp, ep)-rank layout, and back.

Streaming (each tensor read lazily and written straight into a safetensors file whose header was computed up
front: peak memory about one tensor), atomic (a hidden `.<DST>.partial-<pid>` renamed at the end, an exclusive
lock on DST, free space checked first), untrusted input read as regular files inside SRC only, and every header,
FP8 scale grid and tensor name validated before anything is written.

dtype rule (`dtype`, default bf16): FP8 weights are dequantized to `dtype`; other floating tensors are upcast to
`dtype` when narrower, never downcast (the fp32 router bias stays fp32), so BF16 sources round-trip bit-exactly.

Design notes: docs/design_notes.md#checkpoint-convert
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import shutil
import stat
import sys
from collections.abc import Iterator

import torch

from dsv3_plugin.checkpoint.hf import model_config
from dsv3_plugin.checkpoint.integrity import check_finite, load_json
from dsv3_plugin.checkpoint.megatron_layout import MegatronLayout
from dsv3_plugin.checkpoint.names import released_names, released_shapes
from dsv3_plugin.checkpoint.reader import INDEX_NAME, CheckpointReader, open_safetensors, read_safetensors_header
from dsv3_plugin.checkpoint.writer import StreamingSafetensorsWriter
from dsv3_plugin.errors import CheckpointError, ConfigError
from dsv3_plugin.safe_files import check_regular, copy_regular, opened_path

__all__ = ["convert", "load_megatron_rank", "read_layout", "atomic_output_dir", "LAYOUT_NAME", "DTYPES"]

LAYOUT_NAME = "layout.json"
LAYOUT_FORMAT = "dsv3-megatron"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE_JSON = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


# --------------------------------------------------------------------------------------------------
# Errors that mean "the output could not be written", whatever file they name (a failing write names none).
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def _fmt_bytes(n: int) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n} bytes ({n / k:.1f} {unit})"
    return f"{n} bytes"


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize  # what an unprivileged writer may use (root's reserve excluded)


def _make_parent(dst: str, parent: str) -> None:
    """Create DST's parent directories; a path component that is a file is a ConfigError naming it."""
    p = parent
    while not os.path.lexists(p):
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        raise ConfigError(f"{dst}: cannot be created, {p} is a file, not a directory (choose another output path)")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{dst}: cannot create {e.filename or parent} ({e.strerror or e})") from None


@contextlib.contextmanager
def _output_lock(dst: str, parent: str, base: str) -> Iterator[None]:
    """An exclusive `flock` on `.<DST>.lock` next to DST for as long as DST is being written: a second writer of the
    same DST refuses at once, naming the holder's pid, instead of both writing one directory. The kernel releases
    the lock when its holder dies (kill -9 included), so a stale lock file never blocks anyone."""
    path = os.path.join(parent, f".{base}.lock")
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as e:
            raise CheckpointError(f"{dst}: cannot write in {parent} ({e.strerror or e}: {path})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(
                f"{dst}: another process (pid {holder}) is writing it now (it holds {path}); wait for it to finish "
                "or choose another output directory"
            ) from None
        # The previous holder removes the file before releasing it: a lock on a removed file locks nothing.
        try:
            st, fst = os.stat(path), os.fstat(fd)
            same = (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # the holder, for the message of a second writer
        except OSError as e:  # a full disk cannot take even these bytes
            raise CheckpointError(f"{dst}: cannot write in {parent} ({e.strerror or e}: {path})") from None
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still holding it (see above)
        os.close(fd)


@contextlib.contextmanager
def atomic_output_dir(dst: str, expected_bytes: int | None = None) -> Iterator[str]:
    """Yield a fresh hidden sibling of `dst`; rename it to `dst` on success, delete it on any failure.

    Args:
        dst: the output directory (must not exist).
        expected_bytes: about how much the output will hold: refused before anything is written when the file
            system has less free, and named in the message when a write fails for lack of space.

    Yields:
        The temporary directory to write into.

    Raises:
        ConfigError: a component of DST's parent is a file.
        CheckpointError: DST exists; another process is writing DST (`.<DST>.lock` is held; its pid is named);
            not enough free space; a write failed for lack of space or a read-only file system (the partial
            output is removed, DST is not created; the message names DST, the bytes needed and the bytes free).
    """
    dst = os.path.abspath(dst)
    if os.path.lexists(dst):
        raise CheckpointError(f"{dst}: output already exists (refusing to overwrite)")
    parent, base = os.path.dirname(dst), os.path.basename(dst)
    _make_parent(dst, parent)
    with _output_lock(dst, parent, base):
        if os.path.lexists(dst):  # the previous holder of the lock finished it
            raise CheckpointError(f"{dst}: output already exists (refusing to overwrite)")
        prefix = f".{base}.partial-"
        for stale in os.listdir(parent):  # leftovers of killed runs: under the lock, nobody else writes DST
            if stale.startswith(prefix) and stale[len(prefix) :].isdigit():
                shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
        free = _free_bytes(parent)
        if expected_bytes is not None and expected_bytes > free:
            raise CheckpointError(
                f"{dst}: the output needs about {_fmt_bytes(expected_bytes)} but only {_fmt_bytes(free)} are free "
                f"in {parent}; nothing was written"
            )
        tmp = os.path.join(parent, f"{prefix}{os.getpid()}")
        try:
            os.makedirs(tmp)
        except OSError as e:
            raise CheckpointError(f"{dst}: cannot write in {parent} ({e.strerror or e}: {tmp})") from None
        try:
            yield tmp
            os.rename(tmp, dst)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            fn = os.fspath(e.filename) if e.filename is not None else None
            ours = fn is not None and (os.path.abspath(fn) + os.sep).startswith(tmp + os.sep)
            if e.errno not in _DISK_ERRNOS and not ours:
                raise  # not about the output (e.g. a source file): the OSError names its own file
            need = f"the output needs about {_fmt_bytes(expected_bytes)}, " if expected_bytes is not None else ""
            raise CheckpointError(
                f"{dst}: {e.strerror or e} while writing {fn or 'the output'}; {need}{_fmt_bytes(free)} were free in "
                f"{parent} at the start; the partial output was removed and {dst} was not created"
            ) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _is_train_run(src: str) -> bool:
    """Whether `src` is what `dsv3 train` writes (a run directory, its ckpt/, or one DeepSpeed tag directory) rather
    than a released checkpoint: no config.json, and DeepSpeed's `latest` pointer or model-states files."""
    if os.path.isfile(os.path.join(src, "config.json")):
        return False
    ck = os.path.join(src, "ckpt") if os.path.isdir(os.path.join(src, "ckpt")) else src
    return os.path.isfile(os.path.join(ck, "latest")) or os.path.isfile(os.path.join(src, "mp_rank_00_model_states.pt"))


def _target_dtype(stored: torch.dtype, is_fp8: bool, dtype: torch.dtype) -> torch.dtype:
    if is_fp8:
        return dtype
    if stored.is_floating_point and stored.itemsize < dtype.itemsize:
        return dtype
    return stored


class _OutBuffers:
    """Two reusable output buffers for dequantized tensors (no page faults on fresh allocations). Safe with
    `StreamingSafetensorsWriter`, whose `write` returns only after the previous write finished."""

    def __init__(self):
        self._bufs = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self._k = 0

    def take(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        n = torch.Size(shape).numel() * dtype.itemsize
        self._k ^= 1
        if self._bufs[self._k].numel() < n:
            self._bufs[self._k] = torch.empty(n, dtype=torch.uint8)
        return self._bufs[self._k][:n].view(dtype).view(shape)


def _get(reader: CheckpointReader, name: str, dtype: torch.dtype, bufs: _OutBuffers) -> torch.Tensor:
    if reader.is_fp8(name):
        return reader.get(name, dtype, out=bufs.take(reader.shape(name), dtype))
    return reader.get(name, dtype)


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        file=sys.stderr,
        disable=not enabled,
        dynamic_ncols=True,
    )


def _side_files(src: str, skip: set[str]) -> list[str]:
    """The files that travel with the weights (tokenizer files and the like; never executed, only copied): every
    entry but the weights, `skip`, hidden names and directories. Each must be a regular file inside `src`
    (`safe_files`): a link out of the directory or a FIFO is refused, not copied and not silently dropped."""
    out = []
    for fn in sorted(os.listdir(src)):
        p = os.path.join(src, fn)
        if fn in skip or fn.endswith(".safetensors") or fn.startswith("."):
            continue
        try:
            if stat.S_ISDIR(os.stat(p).st_mode):
                continue  # a subdirectory (the release's inference/ code, figures/): not part of the checkpoint
        except OSError:
            pass  # a dangling link or an unreadable entry: check_regular below names it
        check_regular(p, CheckpointError, src)
        out.append(fn)
    return out


def _copy_side_files(src: str, dst: str, names: list[str]) -> None:
    """Copy `names` (`_side_files`) from `src` to `dst`: the bytes of the checked regular file, never a link."""
    for fn in names:
        copy_regular(os.path.join(src, fn), os.path.join(dst, fn), CheckpointError, src)


def _out_config(cfg: dict, dtype: torch.dtype) -> dict:
    out = {k: v for k, v in cfg.items() if k != "quantization_config"}
    out["torch_dtype"] = _DTYPE_JSON[dtype]
    return out


def _check_names(reader: CheckpointReader) -> None:
    req, opt = released_names(reader.config)
    have = set(reader.names())
    missing = sorted(req - have)
    if missing:
        raise CheckpointError(f"{missing[0]}: missing from {reader.path} ({len(missing)} tensors missing)")
    extra = sorted(have - req - opt)
    if extra:
        raise CheckpointError(
            f"{extra[0]} in {reader.info(extra[0]).file}: unexpected tensor ({len(extra)} unexpected)"
        )
    shapes = released_shapes(reader.config)
    for n in reader.names():
        if tuple(reader.shape(n)) != shapes[n]:
            raise CheckpointError(
                f"{n} in {reader.info(n).file}: shape {list(reader.shape(n))}, config.json implies {list(shapes[n])}"
            )


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


# --------------------------------------------------------------------------------------------------
def _to_hf_from_released(reader: CheckpointReader, out: str, dtype: torch.dtype, progress: bool) -> dict:
    """Dequantized released format: same shard names and tensor names, scales dropped, new index."""
    by_file = reader.names_by_file()
    weight_map, total, bufs = {}, 0, _OutBuffers()
    bar = _progress(sum(reader.input_bytes(n) for n in reader.names()), progress, "convert hf")
    with bar:
        for src_file, names in by_file.items():
            fn = os.path.basename(src_file)
            specs = [
                (
                    n,
                    reader.out_dtype(n, _target_dtype(reader.info(n).torch_dtype, reader.is_fp8(n), dtype)),
                    reader.shape(n),
                )
                for n in names
            ]
            with StreamingSafetensorsWriter(os.path.join(out, fn), specs, {"format": "pt"}) as w:
                for n, dt, _ in specs:
                    w.write(n, _get(reader, n, dt, bufs))
                    bar.update(reader.input_bytes(n))
                    weight_map[n] = fn
                total += w.total_bytes
    if os.path.exists(os.path.join(reader.path, INDEX_NAME)):
        _write_json(os.path.join(out, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})
    return {"tensors": len(weight_map), "files": len(by_file), "output_bytes": total}


def _to_megatron(reader: CheckpointReader, out: str, pp: int, ep: int, dtype: torch.dtype, progress: bool) -> dict:
    layout = MegatronLayout(reader.config, pp, ep)
    # files[(stage, ep)][mcore] = [(part, hf), ...]
    files: dict[tuple[int, int], dict[str, list[tuple[int, str]]]] = {(s, r): {} for s in range(pp) for r in range(ep)}
    for hf in reader.names():
        p = layout.place(hf)
        files[(p.stage, p.ep_rank)].setdefault(p.name, []).append((p.part, hf))
    for parts_by_name in files.values():
        for mc, parts in parts_by_name.items():
            parts.sort()
            if [k for k, _ in parts] != list(range(len(parts))) or len(parts) not in (1, 2):
                raise CheckpointError(f"{mc}: needs gate and up projections, found only {[h for _, h in parts]}")
    meta_files, bufs = {}, _OutBuffers()
    bar = _progress(sum(reader.input_bytes(n) for n in reader.names()), progress, "convert megatron")
    total = 0
    with bar:
        for (s, r), parts_by_name in files.items():
            fn = layout.file_name(s, r)
            specs, plan = [], []
            # In source-shard order, so each input shard is opened once per output file, not once per tensor.
            order = sorted(parts_by_name.items(), key=lambda kv: reader.info(kv[1][0][1]).file)
            for mc, parts in order:
                hfs = [h for _, h in parts]
                dts = {_target_dtype(reader.info(h).torch_dtype, reader.is_fp8(h), dtype) for h in hfs}
                shapes = [reader.shape(h) for h in hfs]
                if len(dts) != 1 or len({sh[1:] for sh in shapes}) != 1:
                    raise CheckpointError(
                        f"{hfs[0]} in {reader.info(hfs[0]).file}: cannot be fused with {hfs[1]} "
                        f"into {mc} (shapes {shapes}, dtypes {sorted(map(str, dts))})"
                    )
                dt = dts.pop()
                shape = (sum(sh[0] for sh in shapes),) + tuple(shapes[0][1:])
                specs.append((mc, dt, shape))
                plan.append((mc, dt, hfs))
            with StreamingSafetensorsWriter(os.path.join(out, fn), specs, {"format": "pt"}) as w:
                for mc, dt, hfs in plan:
                    for h in hfs:  # dim-0 concatenation = consecutive byte ranges
                        w.write(mc, _get(reader, h, dt, bufs))
                        bar.update(reader.input_bytes(h))
                total += w.total_bytes
            meta_files[fn] = {
                "stage": s,
                "ep_rank": r,
                "tensors": {mc: [[h, reader.shape(h)[0]] for h in hfs] for mc, _, hfs in plan},
            }
    _write_json(
        os.path.join(out, LAYOUT_NAME),
        {"format": LAYOUT_FORMAT, "version": 1, "dtype": _DTYPE_JSON[dtype], **layout.describe(), "files": meta_files},
    )
    return {"tensors": len(reader.names()), "files": len(files), "output_bytes": total}


def read_layout(src: str) -> dict:
    """`layout.json` of a `--to megatron` directory, checked (format, per-file entries); CheckpointError if not."""
    p = os.path.join(src, LAYOUT_NAME)
    lay = load_json(p, what=f"{LAYOUT_FORMAT} layout file")
    if lay.get("format") != LAYOUT_FORMAT or not isinstance(lay.get("files"), dict):
        raise CheckpointError(f"{p}: not a {LAYOUT_FORMAT} layout file")
    for fn, fmeta in lay["files"].items():
        tensors = fmeta.get("tensors") if isinstance(fmeta, dict) else None
        if not isinstance(tensors, dict) or not all(
            isinstance(parts, list)
            and parts
            and all(
                isinstance(x, list)
                and len(x) == 2
                and isinstance(x[0], str)
                and isinstance(x[1], int)
                and not isinstance(x[1], bool)
                and x[1] >= 0
                for x in parts
            )
            for parts in tensors.values()
        ):
            raise CheckpointError(
                f'{p}: entry for {fn!r} must be {{"tensors": {{name: [[released name, rows], ...]}}}}'
            )
        if not all(
            isinstance(fmeta.get(k), int) and not isinstance(fmeta.get(k), bool) and fmeta[k] >= 0
            for k in ("stage", "ep_rank")
        ):
            raise CheckpointError(f'{p}: entry for {fn!r} needs non-negative integer "stage" and "ep_rank"')
    return lay


def _check_megatron_files(src: str, lay: dict) -> dict[str, dict]:
    headers = {}
    for fn, fmeta in lay["files"].items():
        fp = os.path.join(src, fn)
        if os.path.basename(fn) != fn or fn in ("", ".", ".."):
            raise CheckpointError(f"{src}/{LAYOUT_NAME}: file name {fn!r} is not a plain file name")
        if not os.path.lexists(fp):
            first = next(iter(fmeta["tensors"]), "<no tensors>")
            raise CheckpointError(f"{first}: {LAYOUT_NAME} points to missing file {fp}")
        infos, _ = read_safetensors_header(fp, src)
        for mc, parts in fmeta["tensors"].items():
            if mc not in infos:
                raise CheckpointError(f"{mc}: listed in {LAYOUT_NAME} but missing from {fp}")
            if sum(rows for _, rows in parts) != (infos[mc].shape[0] if infos[mc].shape else 1):
                raise CheckpointError(f"{mc} in {fp}: {infos[mc].shape} does not hold the rows of {parts}")
            if infos[mc].dtype not in ("F32", "BF16", "F16", "F64"):
                raise CheckpointError(
                    f"{mc} in {fp}: dtype {infos[mc].dtype} (the Megatron layout holds floating-point weights)"
                )
        extra = sorted(set(infos) - set(fmeta["tensors"]))
        if extra:
            raise CheckpointError(f"{extra[0]} in {fp}: unexpected tensor, not listed in {LAYOUT_NAME}")
        headers[fn] = infos
    return headers


def _to_hf_from_megatron(src: str, out: str, dtype: torch.dtype | None, progress: bool, allow_non_finite: bool) -> dict:
    lay = read_layout(src)
    headers = _check_megatron_files(src, lay)
    nonempty = [fn for fn in lay["files"] if lay["files"][fn]["tensors"]]
    weight_map, total = {}, 0
    bar = _progress(sum(i.nbytes for h in headers.values() for i in h.values()), progress, "convert hf")
    with bar:
        for k, fn in enumerate(nonempty):
            infos = headers[fn]
            out_fn = f"model-{k + 1:05d}-of-{len(nonempty):05d}.safetensors"
            specs, plan = [], []
            for mc, parts in lay["files"][fn]["tensors"].items():
                info = infos[mc]
                dt = _target_dtype(info.torch_dtype, False, dtype) if dtype is not None else info.torch_dtype
                r0 = 0
                for hf, rows in parts:
                    shape = (rows,) + tuple(info.shape[1:]) if len(parts) > 1 else tuple(info.shape)
                    if hf in weight_map:
                        raise CheckpointError(f"{hf}: stored twice ({weight_map[hf]} and {fn})")
                    weight_map[hf] = out_fn
                    specs.append((hf, dt, shape))
                    plan.append((hf, mc, r0, r0 + rows, len(parts) > 1, dt))
                    r0 += rows
            with (
                opened_path(os.path.join(src, fn), CheckpointError, src, "safetensors file") as fd_path,
                open_safetensors(fd_path, os.path.join(src, fn)) as f,
                StreamingSafetensorsWriter(os.path.join(out, out_fn), specs, {"format": "pt"}) as w,
            ):
                for hf, mc, r0, r1, split, dt in plan:
                    t = f.get_slice(mc)[r0:r1] if split else f.get_tensor(mc)
                    check_finite(t, f"{mc} (rows of {hf}) in {os.path.join(src, fn)}", allow_non_finite)
                    w.write(hf, t.to(dt))
                    bar.update(t.numel() * infos[mc].torch_dtype.itemsize)
                total += w.total_bytes
    _write_json(os.path.join(out, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})
    return {"tensors": len(weight_map), "files": len(nonempty), "output_bytes": total}


# --------------------------------------------------------------------------------------------------
def convert(
    src: str,
    dst: str,
    to: str,
    pp: int = 1,
    ep: int = 1,
    dtype: str | None = None,
    progress: bool = True,
    allow_non_finite: bool = False,
) -> dict:
    """Convert checkpoint directory `src` into new directory `dst` (see module docstring); returns a summary.

    to = "hf-bf16" | "hf": released format (from a released source: FP8 dequantized to `dtype`, which must
    be bf16 for "hf-bf16"; from a Megatron-layout source: the exact inverse). to = "megatron": the
    per-(pp, ep)-rank layout of docs/checkpoints.md.

    NaN/Inf in weights or scales (FP8 NaN codes included) raise `CheckpointError` naming tensor and file,
    unless `allow_non_finite` (copies them through, e.g. to inspect a damaged file).
    """
    if to not in ("hf-bf16", "hf", "megatron"):
        raise ValueError(f"--to {to!r}: choose hf-bf16, hf or megatron")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose bf16 or fp32")
    if to == "hf-bf16" and dtype not in (None, "bf16"):
        raise ValueError("--dtype: --to hf-bf16 writes bf16 (use --to hf --dtype fp32 for fp32)")
    tdt = DTYPES[dtype or "bf16"]
    src = os.path.abspath(src)
    is_megatron = os.path.exists(os.path.join(src, LAYOUT_NAME))
    if to != "megatron" and (pp != 1 or ep != 1):
        raise ValueError("--pp/--ep: only meaningful with --to megatron")
    if is_megatron:
        if to == "megatron":
            raise CheckpointError(f"{src}: already in the Megatron layout (convert --to hf first to re-split)")
        headers = _check_megatron_files(src, read_layout(src))
        cfg = load_json(os.path.join(src, "config.json"), what="released config.json")
        model_config(cfg, os.path.join(src, "config.json"))  # the file must describe a model we can build
        side = _side_files(src, {LAYOUT_NAME, "config.json", INDEX_NAME})
        infos = [i for h in headers.values() for i in h.values()]
        out_dt = [_target_dtype(i.torch_dtype, False, tdt) if dtype else i.torch_dtype for i in infos]
        data = sum(math.prod(i.shape) * dt.itemsize for i, dt in zip(infos, out_dt))
        need = _expected_bytes(data, len(infos), len(headers), src, side)
        with atomic_output_dir(dst, need) as tmp:
            summary = _to_hf_from_megatron(src, tmp, DTYPES[dtype] if dtype else None, progress, allow_non_finite)
            if dtype:
                cfg["torch_dtype"] = _DTYPE_JSON[tdt]
            _write_json(os.path.join(tmp, "config.json"), cfg)
            _copy_side_files(src, tmp, side)
        return {"to": to, "src": src, "dst": os.path.abspath(dst), **summary}

    if _is_train_run(src):
        raise CheckpointError(f"{src} is a dsv3 train run directory: use dsv3 export {src} DST --to hf-bf16|hf")
    reader = CheckpointReader(src, allow_non_finite=allow_non_finite)
    model_config(reader.config, reader.config_path)  # one reading of config.json for convert, load and train
    _check_names(reader)
    side = _side_files(src, {"config.json", INDEX_NAME, LAYOUT_NAME})
    names = reader.names()
    data = sum(
        math.prod(reader.shape(n))
        * reader.out_dtype(n, _target_dtype(reader.info(n).torch_dtype, reader.is_fp8(n), tdt)).itemsize
        for n in names
    )
    need = _expected_bytes(data, len(names), len(reader.files()), src, side)
    with reader, atomic_output_dir(dst, need) as tmp:
        if to == "megatron":
            summary = _to_megatron(reader, tmp, pp, ep, tdt, progress)
        else:
            summary = _to_hf_from_released(reader, tmp, tdt, progress)
        _write_json(os.path.join(tmp, "config.json"), _out_config(reader.config, tdt))
        _copy_side_files(src, tmp, side)
    return {"to": to, "src": src, "dst": os.path.abspath(dst), **summary}


def _expected_bytes(data: int, n_tensors: int, n_files: int, src: str, side: list[str]) -> int:
    """About what an output holds: the tensor data, a header entry and an index line per tensor, config/layout JSON
    per file, and the side files copied (the estimate the free-space check and its messages use)."""
    return data + 256 * n_tensors + 4096 * (n_files + 2) + sum(os.path.getsize(os.path.join(src, f)) for f in side)


def load_megatron_rank(
    path: str, stage: int, ep_rank: int, shared: bool = True, allow_non_finite: bool = False
) -> dict[str, torch.Tensor]:
    """State dict of pipeline stage `stage`, expert rank `ep_rank`: its experts plus (if `shared`) the
    stage's non-expert tensors, which live in the stage's ep-rank-0 file (docs/checkpoints.md). Headers are
    checked against layout.json first; NaN/Inf values raise unless `allow_non_finite`."""
    lay = read_layout(path)
    _check_megatron_files(path, lay)
    by_rank = {(m["stage"], m["ep_rank"]): fn for fn, m in lay["files"].items()}
    if (stage, ep_rank) not in by_rank:
        raise CheckpointError(f"{path}: no file for stage {stage}, ep rank {ep_rank} in {LAYOUT_NAME}")

    def load(fn: str) -> dict[str, torch.Tensor]:
        with (
            opened_path(os.path.join(path, fn), CheckpointError, path, "safetensors file") as fd_path,
            open_safetensors(fd_path, os.path.join(path, fn)) as f,
        ):
            sd = {n: f.get_tensor(n) for n in f.keys()}  # (safetensors' load_file)
        for n, t in sd.items():
            check_finite(t, f"{n} in {os.path.join(path, fn)}", allow_non_finite)
        return sd

    own = load(by_rank[(stage, ep_rank)])
    if ep_rank != 0:
        if any(".local_experts." not in n for n in own):
            bad = next(n for n in own if ".local_experts." not in n)
            raise CheckpointError(f"{bad}: non-expert tensor in ep rank {ep_rank}'s file {by_rank[(stage, ep_rank)]}")
        if shared:
            if (stage, 0) not in by_rank:
                raise CheckpointError(f"{path}: no file for stage {stage}, ep rank 0 in {LAYOUT_NAME}")
            zero = load(by_rank[(stage, 0)])
            own.update({n: t for n, t in zero.items() if ".local_experts." not in n})
    elif not shared:
        own = {n: t for n, t in own.items() if ".local_experts." in n}
    return own
