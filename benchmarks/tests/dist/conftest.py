"""The multi-process benches' tests obey tests/dist's rule (every test leaves no process behind):
tests/dist/conftest.py is executed here, with its helper module `process_leftovers` on sys.path, so that its
autouse fixture applies to them too (not a copy)."""

import os
import runpy
import sys

_DIST = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "tests", "dist"
)
if _DIST not in sys.path:
    sys.path.insert(0, _DIST)
globals().update({k: v for k, v in runpy.run_path(os.path.join(_DIST, "conftest.py")).items() if k[:2] != "__"})
