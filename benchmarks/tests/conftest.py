"""The benches' tests run under the same setup as tests/: tests/conftest.py is executed here (its environment
defaults, `tests/` on sys.path for `helpers` and `tolerance`, any fixture it defines), not copied; the checkout's
root goes on sys.path too, for `benchmarks` (a folder beside the package, not installed)."""

import os
import runpy
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
globals().update(
    {k: v for k, v in runpy.run_path(os.path.join(_ROOT, "tests", "conftest.py")).items() if k[:2] != "__"}
)
