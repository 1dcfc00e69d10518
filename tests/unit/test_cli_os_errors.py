"""What the system refuses is one line and exit 2, never a traceback (issue 27): an output directory below a file, two
writers of one DST, a disk that is full before or during a `dsv3 convert` / `dsv3 export`, a read-only file system;
and `dsv3`'s last resort, an OSError naming a path that a sub-command did not turn into a message itself.

A full disk midway is made two ways: `RLIMIT_FSIZE` in a subprocess (SIGXFSZ ignored, so a write past the limit
fails with EFBIG instead of killing the process), and a small tmpfs mounted in a user + mount namespace
(`unshare -Urm`, skipped with the reason where the kernel does not allow it), where the writes fail with ENOSPC."""

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from dsv3_plugin.checkpoint.convert import convert
from dsv3_plugin.checkpoint.tiny_release import write_tiny_release
from dsv3_plugin.cli import main as cli_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return write_tiny_release(tmp_path_factory.mktemp("rel") / "rel")  # ~1 MiB FP8; ~2 MiB as BF16


@pytest.fixture(scope="module")
def meg(release, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("meg") / "meg")
    convert(release, out, "megatron", pp=1, ep=1, progress=False)
    return out


def _argv(kind, src, dst):
    return {
        "convert": ["convert", src, dst, "--to", "hf-bf16", "--no-progress"],
        "export": ["export", src, dst, "--to", "hf-bf16", "--no-progress"],
    }[kind]


def _src(kind, release, meg):
    return release if kind == "convert" else meg


def _cli(capsys, argv):
    capsys.readouterr()
    rc = cli_main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    return rc, err


def _leftovers(parent, base):
    return sorted(n for n in os.listdir(parent) if n.startswith(f".{base}.") or n == base)


def _python(code: str, env_extra: dict | None = None, prefix: list[str] | None = None, timeout=600):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(env_extra or {})
    return subprocess.run(
        (prefix or []) + [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---- the output path ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["convert", "export"])
def test_dst_below_a_file_is_one_line(kind, release, meg, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    dst = str(tmp_path / "afile" / "sub" / "out")
    rc, err = _cli(capsys, _argv(kind, _src(kind, release, meg), dst))
    assert rc == 2, err
    afile = tmp_path / "afile"
    assert (
        err.strip()
        == f"error: {dst}: cannot be created, {afile} is a file, not a directory (choose another output path)"
    )


@pytest.mark.parametrize("kind", ["convert", "export"])
def test_a_second_writer_of_dst_refuses_at_once_naming_the_holder(kind, release, meg, tmp_path, capsys):
    """One process holds DST (inside `atomic_output_dir`, as a running convert does); a convert or export to the same
    DST refuses at once with its pid instead of writing the same directory. Killed with -9, the holder leaves only its
    hidden partial directory: the kernel dropped the lock, and the next run takes it and cleans up."""
    dst = str(tmp_path / "out")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from dsv3_plugin.checkpoint.convert import atomic_output_dir\n"
            f"with atomic_output_dir({dst!r}) as tmp:\n"
            "    open(tmp + '/half.safetensors', 'wb').write(b'x' * 100)\n"
            "    print(tmp, flush=True)\n"
            "    time.sleep(600)\n",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        partial = holder.stdout.readline().strip()
        assert partial.endswith(f".out.partial-{holder.pid}"), partial
        rc, err = _cli(capsys, _argv(kind, _src(kind, release, meg), dst))
        assert rc == 2, err
        lock = os.path.join(tmp_path, ".out.lock")
        assert err.strip() == (
            f"error: {dst}: another process (pid {holder.pid}) is writing it now (it holds {lock}); wait for it to "
            "finish or choose another output directory"
        )
        assert os.path.isfile(os.path.join(partial, "half.safetensors"))  # the holder's work was not touched
        assert not os.path.exists(dst)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    rc, err = _cli(capsys, _argv(kind, _src(kind, release, meg), dst))
    assert rc == 0, err
    assert os.path.isfile(os.path.join(dst, "config.json"))
    assert _leftovers(str(tmp_path), "out") == ["out"]  # the dead writer's partial dir and the lock file are gone


# ---- a full disk ---------------------------------------------------------------------------------------------
_LINE = re.compile(
    r"^error: (?P<dst>\S+): (?P<why>[^;]+) while writing (?P<file>\S+); the output needs about (?P<need>\d+) bytes "
    r"\([\d.]+ MiB\), (?P<free>\d+) bytes[^;]* were free in (?P<parent>\S+) at the start; the partial output was "
    r"removed and (?P=dst) was not created$"
)


@pytest.mark.parametrize("kind", ["convert", "export"])
def test_write_failing_midway_removes_the_partial_output_and_names_the_bytes(kind, release, meg, tmp_path):
    """RLIMIT_FSIZE of 256 KiB: the first shard (~2 MiB in BF16) cannot be written (EFBIG), after the free-space check
    passed. Exit 2, one line naming DST, the file, the bytes needed and free; no DST, no partial directory, no lock."""
    dst = str(tmp_path / "out")
    argv = _argv(kind, _src(kind, release, meg), dst)
    r = _python(
        f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
        from dsv3_plugin.cli import main
        sys.exit(main({argv!r}))
        """
    )
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    m = _LINE.match(lines[0])
    assert m, lines[0]
    assert m["dst"] == dst and m["why"] == os.strerror(errno.EFBIG) and m["parent"] == str(tmp_path)
    assert m["file"].startswith(os.path.join(str(tmp_path), ".out.partial-"))
    assert int(m["need"]) > 256 * 1024 and int(m["free"]) > 0
    assert _leftovers(str(tmp_path), "out") == []


def _userns_ok() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    r = subprocess.run(["unshare", "-Urm", "true"], capture_output=True, text=True)
    return None if r.returncode == 0 else f"unshare -Urm is not allowed here ({r.stderr.strip()[:200]})"


needs_userns = pytest.mark.skipif(_userns_ok() is not None, reason=str(_userns_ok()))


def _in_tmpfs(mnt: str, options: str, code: str, timeout=600):
    """Run `code` in a fresh user + mount namespace with a tmpfs (`options`) on `mnt`; print what `mnt` holds after."""
    script = (
        f"mount -t tmpfs -o {options} tmpfs {mnt} || exit 99\n"
        f'{sys.executable} -c "$PYCODE"; rc=$?\n'
        f"echo LEFT: $(ls -A {mnt})\n"
        "exit $rc\n"
    )
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    env["PYCODE"] = textwrap.dedent(code)
    return subprocess.run(
        ["unshare", "-Urm", "sh", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def _tmpfs_out(tmp_path) -> tuple[str, str]:
    """(a mount point for _in_tmpfs, the output directory inside it)."""
    mnt = str(tmp_path / "mnt")
    os.makedirs(mnt)
    return mnt, os.path.join(mnt, "out")


def _cli_code(argv) -> str:
    """Python source that exits with `dsv3 ARGV`'s status."""
    return f"import sys\nfrom dsv3_plugin.cli import main\nsys.exit(main({argv!r}))\n"


def _one_error_line(r) -> str:
    """The single stderr line of a run that must have exited 2."""
    assert r.returncode == 2, (r.stdout, r.stderr[-3000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


@needs_userns
@pytest.mark.parametrize("kind", ["convert", "export"])
def test_not_enough_free_space_is_refused_before_writing(kind, release, meg, tmp_path):
    mnt, dst = _tmpfs_out(tmp_path)
    argv = _argv(kind, _src(kind, release, meg), dst)
    r = _in_tmpfs(mnt, "size=512k", _cli_code(argv))
    line = _one_error_line(r)
    assert re.fullmatch(
        rf"error: {re.escape(dst)}: the output needs about \d+ bytes \([\d.]+ MiB\) but only \d+ bytes \(\d+\.\d KiB\) "
        rf"are free in {re.escape(mnt)}; nothing was written",
        line,
    ), line
    assert r.stdout.strip().splitlines()[-1] == "LEFT:"  # not even a lock file


@needs_userns
def test_disk_full_midway_on_a_real_file_system(release, tmp_path):
    """ENOSPC from a tmpfs that is smaller than the output, with the free-space check blind (another process filling
    the disk after it passed): the same one line, the partial output removed."""
    mnt, dst = _tmpfs_out(tmp_path)
    argv = _argv("convert", release, dst)
    code = f"""
    import sys
    import dsv3_plugin.checkpoint.convert as c
    c._free_bytes = lambda path: 1 << 50  # the disk fills after the check
    from dsv3_plugin.cli import main
    sys.exit(main({argv!r}))
    """
    r = _in_tmpfs(mnt, "size=512k", code)
    line = _one_error_line(r)
    m = _LINE.match(line)
    assert m and m["why"] == os.strerror(errno.ENOSPC) and m["dst"] == dst, line
    assert r.stdout.strip().splitlines()[-1] == "LEFT:"


@needs_userns
@pytest.mark.parametrize("kind", ["convert", "export"])
def test_read_only_file_system(kind, release, meg, tmp_path):
    mnt, dst = _tmpfs_out(tmp_path)
    argv = _argv(kind, _src(kind, release, meg), dst)
    r = _in_tmpfs(mnt, "ro", _cli_code(argv))
    assert _one_error_line(r) == (
        f"error: {dst}: cannot write in {mnt} ({os.strerror(errno.EROFS)}: {os.path.join(mnt, '.out.lock')})"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a chmod 555 directory anyway")
def test_read_only_directory(release, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        rc, err = _cli(capsys, _argv("convert", release, str(ro / "out")))
    finally:
        os.chmod(ro, 0o755)
    assert rc == 2 and f"cannot write in {ro} ({os.strerror(errno.EACCES)}" in err, err
    assert os.listdir(ro) == []


# ---- dsv3's last resort --------------------------------------------------------------------------------------
def test_an_os_error_about_a_path_is_one_line_exit_2(monkeypatch, capsys):
    import dsv3_plugin.cli.convert as cli_convert

    def fails(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/out/model-00001.safetensors")

    monkeypatch.setattr(cli_convert, "run", fails)
    rc, err = _cli(capsys, ["convert", "a", "b", "--to", "hf"])
    assert rc == 2 and err == f"error: convert: {os.strerror(errno.ENOSPC)}: /data/out/model-00001.safetensors\n"

    def rename_fails(args):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), "/a/x", None, "/b/x")  # (the 4th is winerror)

    monkeypatch.setattr(cli_convert, "run", rename_fails)
    rc, err = _cli(capsys, ["convert", "a", "b", "--to", "hf"])
    assert rc == 2 and err == f"error: convert: {os.strerror(errno.EXDEV)}: /a/x -> /b/x\n"


def test_an_os_error_naming_no_path_keeps_its_traceback(monkeypatch):
    import dsv3_plugin.cli.convert as cli_convert

    def fails(args):
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    monkeypatch.setattr(cli_convert, "run", fails)
    with pytest.raises(ConnectionResetError):
        cli_main(["convert", "a", "b", "--to", "hf"])
