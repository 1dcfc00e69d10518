import os
import sys

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

# The longest test files (`--durations`, 2026-12-07), collected first: `make test` runs with `--dist loadfile`, where
# xdist hands whole files to its workers in collection order, so a long file collected last would run alone at the
# end of its phase with a core idle. Only the order changes (pytest's order otherwise, each file's own order kept).
LONG_FIRST = (
    "tests/dist/test_soak.py",
    "tests/dist/test_multinode.py",
    "tests/dist/test_pipeline_ep_train.py",
    "tests/dist/test_train_launchers.py",
    "tests/dist/test_train_data.py",
    "tests/dist/test_train_rundir.py",
    "tests/megatron/test_pretrain_dualpipev.py",
    "tests/megatron/test_lora_megatron.py",
    "tests/megatron/test_pretrain_overlap.py",
    "tests/megatron/test_finetune_megatron.py",
    "tests/megatron/test_pretrain_two_nodes.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable sort


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
