"""patches/pretrain_gpt.diff (Megatron-LM core_v0.16.x, where megatron-core's wheel has no `megatron.training`).

Megatron-LM's `pretrain_gpt.py` is in no wheel and cannot be downloaded at test time, and this repository does
not copy other projects' files, so:
- always: the diff is well formed (git header naming the pre-image blob, hunks whose counts match) and applies
  with `git apply --check` to the pre-image reconstructed from its own hunks; the names it adds import;
- with MEGATRON_LM_DIR=<a Megatron-LM git clone>: it applies to `core_v0.16.1:pretrain_gpt.py` itself, whose blob
  id is the one in the diff's `index` line (checked this way when the diff was written: it applies to
  core_v0.16.0/0.16.1, with offset 70 to core_v0.17.0, and not to core_v0.18.0 or later).
"""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIFF = os.path.join(ROOT, "patches", "pretrain_gpt.diff")
HUNK = re.compile(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@")


def _hunks(text):
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        m = HUNK.match(lines[i])
        if not m:
            i += 1
            continue
        old_start, old_n, new_start, new_n = map(int, m.groups())
        body = []
        i += 1
        while i < len(lines) and not HUNK.match(lines[i]):
            body.append(lines[i])
            i += 1
        out.append((old_start, old_n, new_start, new_n, body))
    return out


def test_diff_is_well_formed_and_applies_to_its_preimage(tmp_path):
    with open(DIFF) as f:
        text = f.read()
    head = text.splitlines()[:4]
    assert head[0] == "diff --git a/pretrain_gpt.py b/pretrain_gpt.py"
    assert re.fullmatch(r"index [0-9a-f]{12}\.\.[0-9a-f]{12} 100644", head[1])
    assert head[2:] == ["--- a/pretrain_gpt.py", "+++ b/pretrain_gpt.py"]
    hunks = _hunks(text)
    assert len(hunks) == 2
    pre = {}
    for old_start, old_n, new_start, new_n, body in hunks:
        assert sum(l[:1] in (" ", "-") for l in body) == old_n
        assert sum(l[:1] in (" ", "+") for l in body) == new_n
        pre_lines = [l[1:] for l in body if l[:1] in (" ", "-")]
        for k, line in enumerate(pre_lines):
            pre[old_start + k] = line
    n = max(pre) + 5
    # Lines the hunks do not show are filled with distinct placeholders (git matches context exactly).
    (tmp_path / "pretrain_gpt.py").write_text("\n".join(pre.get(i, f"# line {i}") for i in range(1, n + 1)) + "\n")
    subprocess.run(["git", "apply", "--check", DIFF], cwd=tmp_path, check=True)
    subprocess.run(["git", "apply", DIFF], cwd=tmp_path, check=True)
    patched = (tmp_path / "pretrain_gpt.py").read_text()
    assert "partial(model_provider, select_builder(gpt_builder))" in patched
    assert "extra_args_provider=partial(add_dsv3_args, other=" in patched


def test_names_the_diff_adds_resolve():
    import argparse

    from dsv3_plugin.megatron.gpt import add_dsv3_args, select_builder

    parser = add_dsv3_args(argparse.ArgumentParser())
    assert parser.parse_args(["--dsv3-config", "ds.json"]).dsv3_config == "ds.json"
    assert callable(select_builder(lambda *a, **k: None))


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"), reason="set MEGATRON_LM_DIR to a Megatron-LM git clone")
def test_diff_applies_to_megatron_lm_core_v0_16_1(tmp_path):
    src = os.environ["MEGATRON_LM_DIR"]
    blob = subprocess.run(
        ["git", "-C", src, "rev-parse", "core_v0.16.1:pretrain_gpt.py"], check=True, capture_output=True, text=True
    ).stdout.strip()
    index = open(DIFF).read().splitlines()[1].split()[1].split("..")[0]
    assert blob.startswith(index)
    content = subprocess.run(
        ["git", "-C", src, "show", "core_v0.16.1:pretrain_gpt.py"], check=True, capture_output=True
    ).stdout
    (tmp_path / "pretrain_gpt.py").write_bytes(content)
    subprocess.run(["git", "apply", "--check", DIFF], cwd=tmp_path, check=True)
