"""What DeepSpeed's monitor wrote, read back for the tests: TensorBoard through tensorboard's own EventAccumulator,
the CSV monitor's files, and a W&B offline run's `.wandb` file (its record log: a 7-byte header ":W&B", 0xBEE1,
version; 32 KiB blocks of records [crc32 of type byte + data (4), length (2), type (1: full, 2 first, 3 middle,
4 last)], each record a `wandb_internal_pb2.Record`; wandb 0.31 ships no Python reader of its own). Each reader
returns {name: {x: value}}."""

import csv
import glob
import json
import os
import struct
import zlib


def tensorboard_scalars(log_dir: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        pts = acc.Scalars(tag)
        out[tag] = {e.step: e.value for e in pts}
        assert len(out[tag]) == len(pts), f"{tag}: two points at one step"
    return out


def csv_scalars(log_dir: str) -> dict:
    out = {}
    for path in glob.glob(os.path.join(log_dir, "*.csv")):
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        assert rows[0][0] == "step" and all(len(r) == 2 for r in rows[1:]), path
        out[os.path.basename(path)[: -len(".csv")]] = {int(s): float(v) for s, v in rows[1:]}
    return out


def _wandb_records(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:4] == b":W&B" and struct.unpack("<H", raw[4:6])[0] == 0xBEE1, f"{path}: not a W&B record log"
    block, pos, out, part = 32768, 7, [], b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        crc, n, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data = raw[pos + 7 : pos + 7 + n]
        if kind == 0 and n == 0:
            break
        assert zlib.crc32(bytes([kind]) + data) == crc, f"{path}: bad checksum at byte {pos}"
        part += data
        if kind in (1, 4):
            out.append(part)
            part = b""
        pos += 7 + n
    return out


def wandb_history(wandb_dir: str) -> dict:
    """{key: {step: value}} of the one offline run under `wandb_dir` (WANDB_DIR)."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, runs
    out = {}
    for data in _wandb_records(runs[0]):
        rec = pb.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") != "history":
            continue
        for item in rec.history.item:
            key = item.key or "/".join(item.nested_key)
            out.setdefault(key, {})[rec.history.step.num] = json.loads(item.value_json)
    return out
