"""Files read out of a user's directory are regular files inside it (`dsv3_plugin.safe_files`), everywhere: a FIFO in
place of a file is refused at once (before, `open` blocked forever), a link out of the directory is refused (before,
convert/export copied a linked `tokenizer.json` from anywhere into DST), and a Hugging Face hub cache snapshot, whose
files are links into its own `../../blobs`, keeps working.

Each entry point is run in-process under an alarm: a read that blocks fails the test instead of hanging it."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import stat

import pytest
from helpers import write_train_config

from dsv3_plugin import safe_files as sf
from dsv3_plugin.checkpoint.convert import convert, load_megatron_rank
from dsv3_plugin.checkpoint.hf import load_pretrained
from dsv3_plugin.checkpoint.integrity import load_json
from dsv3_plugin.checkpoint.reader import CheckpointReader
from dsv3_plugin.checkpoint.tiny_release import write_tiny_release
from dsv3_plugin.cli import main as cli_main
from dsv3_plugin.data.tokenizer import load_tokenizer
from dsv3_plugin.errors import CheckpointError, DataError

INDEX = "model.safetensors.index.json"


class Boom(ValueError):
    """The error type the tests hand to safe_files."""


@contextlib.contextmanager
def no_hang(seconds: int = 120):
    """Fail (TimeoutError) instead of blocking forever: the alarm interrupts an `open()` blocked on a FIFO."""

    def boom(*_):
        raise TimeoutError(f"blocked for {seconds} s (a FIFO opened for reading without a writer)")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _fifo_in_place_of(path):
    os.remove(path)
    os.mkfifo(path)


def _link_to_outside_copy(path, outside_dir):
    """Replace `path` by a symlink to a copy of it outside its directory (same bytes: only the link is wrong)."""
    os.makedirs(outside_dir, exist_ok=True)
    copy = os.path.join(outside_dir, os.path.basename(path))
    shutil.move(path, copy)
    os.symlink(copy, path)


# ---- the module itself ----------------------------------------------------------------------------------------
def test_regular_files_and_links_inside_are_read(tmp_path):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "a.json").write_bytes(b'{"x": 1}')
    os.symlink("a.json", d / "b.json")  # a link to a sibling
    os.symlink("../a.json", d / "sub" / "c.json")  # from a subdirectory back into the directory
    for name in ("a.json", "b.json", "sub/c.json"):
        p = os.path.join(d, name)
        assert sf.read_regular(p, Boom, d) == b'{"x": 1}'
        assert sf.check_regular(p, Boom, d) == os.path.realpath(d / "a.json")
    assert sf.read_regular(d / "a.json", Boom, d, limit=3) == b'{"x"'  # limit + 1 bytes at most
    out = tmp_path / "copy.json"
    assert sf.copy_regular(d / "b.json", out, Boom, d) == 8
    assert not out.is_symlink() and out.read_bytes() == b'{"x": 1}'


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory", "char_device"])
def test_non_regular_entries_are_refused_before_any_open(tmp_path, kind):
    d = tmp_path / "d"
    d.mkdir()
    p = str(d / "config.json")
    sock = None
    if kind == "fifo":
        os.mkfifo(p)
        want = "is a FIFO (named pipe)"
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(p)
        want = "is a socket"
    elif kind == "directory":
        os.mkdir(p)
        want = "is a directory"
    else:
        try:
            os.mknod(p, stat.S_IFCHR | 0o644, os.makedev(1, 3))  # /dev/null's numbers
        except PermissionError:
            pytest.skip("creating a device node needs CAP_MKNOD")
        want = "is a character device"
    try:
        with no_hang(30):
            for call in (
                lambda: sf.check_regular(p, Boom, d, "JSON file"),
                lambda: sf.read_regular(p, Boom, d, what="JSON file"),
                lambda: sf.copy_regular(p, tmp_path / "out", Boom, d),
                lambda: sf.opened_path(p, Boom, d).__enter__(),
            ):
                with pytest.raises(Boom, match=f"^{re.escape(p)}: {re.escape(want)}, expected a"):
                    call()
            with pytest.raises(CheckpointError, match=f"^{re.escape(p)}: {re.escape(want)}, expected a cfg"):
                load_json(p, what="cfg")
    finally:
        if sock is not None:
            sock.close()
    assert not (tmp_path / "out").exists()


def test_links_out_of_the_directory_are_refused(tmp_path):
    d, outside = tmp_path / "d", tmp_path / "elsewhere"
    d.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"key")
    os.symlink(outside / "secret", d / "tokenizer.json")  # absolute link out
    os.symlink("../elsewhere/secret", d / "rel.json")  # relative link out
    os.symlink(outside, d / "linked_dir")  # a directory link out: files below it are outside too
    os.symlink(d / "missing", d / "dangling.json")  # dangling, inside
    for p in (
        d / "tokenizer.json",
        d / "rel.json",
        d / "linked_dir" / "secret",
        os.path.join(d, "..", "elsewhere", "secret"),
    ):
        with pytest.raises(Boom, match=r": resolves to .*elsewhere/secret, outside .*a link out of the directory"):
            sf.read_regular(p, Boom, d)
        with pytest.raises(Boom, match="outside"):
            sf.copy_regular(p, tmp_path / "copy", Boom, d)
    with pytest.raises(Boom, match=r"dangling\.json: missing"):
        sf.check_regular(d / "dangling.json", Boom, d)
    # a file the user names explicitly (root None) may live anywhere
    assert sf.read_regular(d / "tokenizer.json", Boom, None) == b"key"
    assert not (tmp_path / "copy").exists()


def _hub_snapshot(hub, repo, files: dict[str, bytes], rev="0123abcd") -> str:
    """huggingface_hub's cache layout: <repo>/blobs/<sha> and <repo>/snapshots/<rev>/<name> -> ../../blobs/<sha>."""
    import hashlib

    snap = os.path.join(hub, repo, "snapshots", rev)
    os.makedirs(os.path.join(hub, repo, "blobs"), exist_ok=True)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        with open(os.path.join(hub, repo, "blobs", sha), "wb") as f:
            f.write(data)
        link = os.path.join(snap, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(os.path.join(hub, repo, "blobs", sha), os.path.dirname(link)), link)
    return snap


def test_hub_snapshot_reads_its_own_blobs_only(tmp_path):
    hub = str(tmp_path / "hub")
    snap = _hub_snapshot(hub, "models--org--name", {"config.json": b"{}", "sub/tokenizer.json": b"[]"})
    other = _hub_snapshot(hub, "models--org--other", {"x.json": b"1"})
    assert sf.read_regular(os.path.join(snap, "config.json"), Boom, snap) == b"{}"
    assert sf.read_regular(os.path.join(snap, "sub", "tokenizer.json"), Boom, os.path.join(snap, "sub")) == b"[]"
    assert sf.hf_blob_store(os.path.realpath(snap)) == os.path.join(os.path.realpath(hub), "models--org--name", "blobs")
    # a link into ANOTHER repository's blobs is a link out
    os.symlink(os.path.realpath(os.path.join(other, "x.json")), os.path.join(snap, "theirs.json"))
    with pytest.raises(Boom, match="outside"):
        sf.read_regular(os.path.join(snap, "theirs.json"), Boom, snap)
    # not a snapshot (no snapshots/<rev> above it): a link into blobs is a link out
    plain = os.path.join(hub, "models--org--name", "copy")
    os.makedirs(plain)
    os.symlink(os.path.realpath(os.path.join(snap, "config.json")), os.path.join(plain, "config.json"))
    with pytest.raises(Boom, match="outside"):
        sf.read_regular(os.path.join(plain, "config.json"), Boom, plain)
    assert sf.hf_blob_store(os.path.realpath(plain)) is None
    assert sf.hf_blob_store(os.path.realpath(tmp_path)) is None


def test_entry_swapped_for_a_fifo_between_check_and_open(tmp_path, monkeypatch):
    """The race the O_NONBLOCK open and the fstat re-check close: the file passes the stat check, then becomes a FIFO
    just before `os.open` (an opener without O_NONBLOCK would block there for ever)."""
    d = tmp_path / "d"
    d.mkdir()
    p = d / "config.json"
    p.write_bytes(b"{}")
    real_open = os.open

    def swap_then_open(path, flags, *a):
        if os.fspath(path) == os.path.realpath(p) and not stat.S_ISFIFO(os.lstat(p).st_mode):
            _fifo_in_place_of(p)
        return real_open(path, flags, *a)

    monkeypatch.setattr(sf.os, "open", swap_then_open)
    with no_hang(30), pytest.raises(Boom, match=r"config\.json: replaced while being opened \(now a FIFO"):
        sf.read_regular(p, Boom, d)


def test_opened_path_names_the_checked_file_whatever_happens_to_the_name(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    p = d / "model.safetensors"
    p.write_bytes(b"checked")
    with sf.opened_path(p, Boom, d) as fd_path:
        os.remove(p)
        os.mkfifo(p)  # what a library opening `p` by name would now block on
        with no_hang(30), open(fd_path, "rb") as f:
            assert f.read() == b"checked"


# ---- every reader of a checkpoint or tokenizer directory ------------------------------------------------------
@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The tiny release, sharded (index + several shards), with its tokenizer."""
    d = write_tiny_release(tmp_path_factory.mktemp("rel") / "rel", shard_bytes=300_000)
    assert os.path.exists(os.path.join(d, INDEX))
    return d


@pytest.fixture
def src(release, tmp_path):
    d = str(tmp_path / "src")
    shutil.copytree(release, d)
    return d


@pytest.fixture(scope="module")
def train_config(tmp_path_factory):
    return write_train_config(tmp_path_factory.mktemp("cfg") / "c.json")


def _shards(d):
    with open(os.path.join(d, INDEX)) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def _cli(capsys, argv):
    capsys.readouterr()
    with no_hang():
        rc = cli_main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    return rc, err


@pytest.mark.parametrize("entry", ["config.json", "index", "shard", "single_file"])
def test_fifo_in_a_checkpoint_is_refused_not_waited_on(src, tmp_path, capsys, train_config, entry):
    if entry == "single_file":  # one model.safetensors instead of an index
        for fn in _shards(src) + [INDEX]:
            os.remove(os.path.join(src, fn))
        name = "model.safetensors"
        open(os.path.join(src, name), "wb").close()
    else:
        name = {"config.json": "config.json", "index": INDEX, "shard": _shards(src)[1]}[entry]
    _fifo_in_place_of(os.path.join(src, name))
    want = os.path.join(src, name) + r": is a FIFO \(named pipe\), expected a"
    with no_hang(), pytest.raises(CheckpointError, match=want):
        CheckpointReader(src)
    with no_hang(), pytest.raises(CheckpointError, match=want):
        load_pretrained(src)
    dst = str(tmp_path / "out")
    runs = {
        "convert": ["convert", src, dst, "--to", "hf-bf16", "--no-progress"],
        "generate": ["generate", "--model", src, "--prompt-ids", "1,2", "--max-new-tokens", "2"],
        "train --init-from": ["train", "--config", train_config, "--init-from", src, "--nproc", "1", "--out", dst],
    }
    for what, argv in runs.items():
        rc, err = _cli(capsys, argv)
        assert rc == 2 and re.search(want, err), (what, rc, err[-2000:])
    assert not os.path.exists(dst)


def test_index_entry_linking_out_of_the_directory_is_refused(src, tmp_path, capsys):
    shard = _shards(src)[0]
    _link_to_outside_copy(os.path.join(src, shard), str(tmp_path / "elsewhere"))
    want = f"{os.path.join(src, shard)}: resolves to {tmp_path / 'elsewhere' / shard}, outside {src}"
    with pytest.raises(CheckpointError, match=re.escape(want)):
        CheckpointReader(src)
    rc, err = _cli(capsys, ["convert", src, str(tmp_path / "out"), "--to", "hf-bf16", "--no-progress"])
    assert rc == 2 and want in err, err
    assert not (tmp_path / "out").exists()


def test_tokenizer_linked_from_elsewhere_is_neither_loaded_nor_copied(src, tmp_path, capsys):
    _link_to_outside_copy(os.path.join(src, "tokenizer.json"), str(tmp_path / "elsewhere"))
    tok = os.path.join(src, "tokenizer.json")
    with pytest.raises(DataError, match=f"^{tok}: resolves to .*elsewhere/tokenizer.json, outside {src}"):
        load_tokenizer(src)
    # convert copies side files: it refuses instead of copying the linked file's bytes into DST
    rc, err = _cli(capsys, ["convert", src, str(tmp_path / "out"), "--to", "hf-bf16", "--no-progress"])
    assert rc == 2 and f"{tok}: resolves to" in err, err
    assert not (tmp_path / "out").exists()
    rc, err = _cli(capsys, ["generate", "--model", src, "--prompt", "def", "--max-new-tokens", "2"])
    assert rc == 2 and f"{tok}: resolves to" in err, err


def test_export_refuses_a_tokenizer_directory_with_a_link_out_or_a_fifo(release, tmp_path, capsys):
    meg = str(tmp_path / "meg")
    convert(release, meg, "megatron", pp=1, ep=1, progress=False)
    tok = str(tmp_path / "tok")
    os.makedirs(tok)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(release, fn), os.path.join(tok, fn))
    _link_to_outside_copy(os.path.join(tok, "tokenizer.json"), str(tmp_path / "elsewhere"))
    rc, err = _cli(capsys, ["export", meg, str(tmp_path / "x"), "--to", "hf-bf16", "--tokenizer", tok, "--no-progress"])
    assert rc == 2 and f"{tok}/tokenizer.json: resolves to" in err, err
    os.remove(os.path.join(tok, "tokenizer.json"))
    shutil.copyfile(os.path.join(release, "tokenizer.json"), os.path.join(tok, "tokenizer.json"))
    os.mkfifo(os.path.join(tok, "special_tokens_map.json"))  # a file transformers would open
    rc, err = _cli(capsys, ["export", meg, str(tmp_path / "x"), "--to", "hf-bf16", "--tokenizer", tok, "--no-progress"])
    assert rc == 2 and f"{tok}/special_tokens_map.json: is a FIFO (named pipe)" in err, err
    assert not (tmp_path / "x").exists()


def test_megatron_layout_file_that_is_a_fifo(release, tmp_path, capsys):
    meg = str(tmp_path / "meg")
    convert(release, meg, "megatron", pp=2, ep=1, progress=False)
    fn = "mp_rank_pp001_ep000.safetensors"
    _fifo_in_place_of(os.path.join(meg, fn))
    want = f"{os.path.join(meg, fn)}: is a FIFO (named pipe)"
    with no_hang(), pytest.raises(CheckpointError, match=re.escape(want)):
        load_megatron_rank(meg, 1, 0)
    for argv in (
        ["convert", meg, str(tmp_path / "out"), "--to", "hf", "--no-progress"],
        ["export", meg, str(tmp_path / "out"), "--to", "hf-bf16", "--no-progress"],
    ):
        rc, err = _cli(capsys, argv)
        assert rc == 2 and want in err, (argv[0], err)
    assert not (tmp_path / "out").exists()


def test_a_side_file_that_is_a_fifo_is_refused_not_dropped(src, tmp_path, capsys):
    os.mkfifo(os.path.join(src, "NOTES.md"))
    rc, err = _cli(capsys, ["convert", src, str(tmp_path / "out"), "--to", "hf-bf16", "--no-progress"])
    assert rc == 2 and f"{os.path.join(src, 'NOTES.md')}: is a FIFO (named pipe)" in err, err
    assert not (tmp_path / "out").exists()


def test_hub_cache_snapshot_converts_loads_and_tokenizes(release, tmp_path):
    """A `snapshot_download` directory (every file a link into ../../blobs) keeps working, and what convert writes
    are the files' bytes, not links into the cache; one link into another repository's blobs is refused."""
    files = {}
    for fn in os.listdir(release):
        with open(os.path.join(release, fn), "rb") as f:
            files[fn] = f.read()
    hub = str(tmp_path / "hub")
    snap = _hub_snapshot(hub, "models--deepseek-ai--tiny", files)
    assert all(os.path.islink(os.path.join(snap, fn)) for fn in files)
    load_pretrained(snap)
    assert len(load_tokenizer(snap)) == 1024
    out = str(tmp_path / "out")
    convert(snap, out, "hf-bf16", progress=False)
    for fn in ("tokenizer.json", "tokenizer_config.json"):
        p = os.path.join(out, fn)
        assert not os.path.islink(p) and open(p, "rb").read() == files[fn]
    other = _hub_snapshot(hub, "models--someone--else", {"tokenizer.json": b"{}"})
    os.remove(os.path.join(snap, "tokenizer.json"))
    os.symlink(os.path.realpath(os.path.join(other, "tokenizer.json")), os.path.join(snap, "tokenizer.json"))
    with pytest.raises(DataError, match="outside"):
        load_tokenizer(snap)
    with pytest.raises(CheckpointError, match="outside"):
        convert(snap, str(tmp_path / "out2"), "hf-bf16", progress=False)
    assert not os.path.exists(tmp_path / "out2")


def test_export_of_a_run_refuses_a_model_states_fifo(tmp_path, capsys):
    """A run's tag directory: `torch.load` of a FIFO would block; it is refused like any other entry."""
    from test_export import _fake_run

    root = str(tmp_path / "run")
    _fake_run(root)
    tag = os.path.join(root, "ckpt", "step3")
    os.mkfifo(os.path.join(tag, "layer_0_expert_0_mp_rank_00_model_states.pt"))
    rc, err = _cli(capsys, ["export", root, str(tmp_path / "x"), "--to", "hf-bf16", "--no-progress"])
    assert rc == 2 and "layer_0_expert_0_mp_rank_00_model_states.pt: is a FIFO (named pipe)" in err, err
    assert not (tmp_path / "x").exists()
