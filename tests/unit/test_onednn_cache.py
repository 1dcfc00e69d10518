"""The plugin gives oneDNN's kernel cache room for the per-expert GEMM shapes (`model.moe.layer`'s NOTE: with the
default 1024 entries a few MoE layers' BF16 expert GEMMs miss the LRU cache on every call), and keeps a user's own
setting."""

import os
import subprocess
import sys

from dsv3_plugin.model.moe.layer import ONEDNN_CACHE_CAPACITY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE = "import os, dsv3_plugin; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"


def _read(env: dict) -> str:
    env = {**env, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True).stdout


def test_the_plugin_sets_the_capacity_before_any_gemm():
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    assert _read(env).strip() == str(ONEDNN_CACHE_CAPACITY)
    # 3 MoE layers x 64 experts x the 7 GEMM shapes of an expert's SwiGLU forward and backward (at most: some
    # share a shape) would not fit in oneDNN's default 1024
    assert ONEDNN_CACHE_CAPACITY >= 3 * 64 * 7 > 1024


def test_a_users_setting_is_kept():
    assert _read({**os.environ, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "77"}).strip() == "77"
