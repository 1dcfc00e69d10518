import os
import sys

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def _rank_server():
    from helpers import RankServer

    server = RankServer()
    yield server
    server.down()


@pytest.fixture
def shared_rank_server(request, _rank_server):
    """One forkserver for the test's `spawn` calls, shared with the other tests of this pytest process (requested by
    tests/dist and tests/megatron for every test); none for a test marked `own_forkserver`."""
    if request.node.get_closest_marker("own_forkserver"):
        _rank_server.down()
    else:
        _rank_server.up()
