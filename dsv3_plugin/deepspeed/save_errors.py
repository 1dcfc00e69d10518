"""A DeepSpeed save that fails on a full disk without breaking its collectives.

`engine.save_checkpoint` runs collectives between its file writes (a barrier before, the tag check, a barrier
after). If one rank's `torch.save` raised in the middle (ENOSPC, EDQUOT, EROFS, EFBIG, or torch's zip writer's
"unexpected pos"), that rank would leave for the run directory's agreement while the others wait in DeepSpeed's
barrier: mismatched collectives. `deferred_write_errors(engine)` lets the save run to its end on every rank: the
first failed write of this rank is kept (later writes of the same save are skipped: the save is lost anyway) and
raised after DeepSpeed returned, where `training.run_dir.RunDir.save` agrees on it with the other ranks and
removes the partial checkpoint. Anything that is not a failed write (`checkpoint_tags.write_failure`) is raised at
once.
"""

from __future__ import annotations

import contextlib

from dsv3_plugin.training.checkpoint_tags import write_failure

__all__ = ["deferred_write_errors"]


@contextlib.contextmanager
def deferred_write_errors(engine):
    """Within the block, `engine.checkpoint_engine.save` keeps this rank's first failed write instead of raising;
    at the end of the block (if the block itself raised nothing) that error is raised.

    Args:
        engine: a DeepSpeed engine (its `checkpoint_engine` does every file write of `save_checkpoint`).

    Raises:
        OSError / RuntimeError: the first failed write, after the save's collectives have run on this rank.
    """
    ce = engine.checkpoint_engine
    had_own = "save" in vars(ce)  # an instance attribute (another wrapper) is put back as it was
    orig = ce.save
    failed: list[BaseException] = []

    def save(state_dict, path):
        if failed:
            return None
        try:
            return orig(state_dict, path)
        except (OSError, RuntimeError) as e:
            if write_failure(e) is None:
                raise
            failed.append(e)
            return None

    ce.save = save
    try:
        yield
    finally:
        if had_own:
            ce.save = orig
        else:
            del ce.save
    if failed:
        raise failed[0]
