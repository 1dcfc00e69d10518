"""`free_port`: the rendezvous port of a self-spawned run (and of the launchers the tests start) is chosen below
the kernel's ephemeral range, so that no connection made meanwhile (other jobs' gloo pairs, other test workers)
can be handed it before rank 0 binds it. CI saw the opposite once: EADDRINUSE at rank 0's TCPStore.
"""

import socket

from dsv3_plugin.parallel.distributed import _ephemeral_range, free_port


def test_port_is_free_and_outside_the_ephemeral_range():
    lo, hi = _ephemeral_range()
    assert 1024 <= lo <= hi <= 65535
    ports = {free_port() for _ in range(20)}
    for port in ports:
        assert port < lo, (port, lo)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # free when returned (nothing holds it)
    assert len(ports) > 1  # random, not one fixed port that two concurrent runs would both take


def test_a_port_in_use_is_not_returned():
    held = []
    try:
        for _ in range(50):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            port = free_port()
            s.bind(("127.0.0.1", port))  # raises if free_port returned a port someone holds
            s.listen()
            held.append(s)
        assert len({s.getsockname()[1] for s in held}) == len(held)
    finally:
        for s in held:
            s.close()
