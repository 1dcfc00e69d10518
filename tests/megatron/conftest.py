import pytest


@pytest.fixture(autouse=True)
def _ranks_from_the_shared_forkserver(shared_rank_server):
    """The `spawn` calls of tests/megatron share one forkserver per pytest process (tests/conftest.py)."""
