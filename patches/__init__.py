"""Version-guarded, small, reversible runtime patches of third-party code (one module per patch).

Each module exposes `apply()` (idempotent; returns True when it changed something) and `revert()`.
"""
