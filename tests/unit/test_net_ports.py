"""Ports chosen for servers that start later lie below the kernel's ephemeral range (where bind(0) and outgoing
connections take theirs), and the whole block is free when chosen."""

import random
import socket

import pytest

from slipstream.utils import net


def test_ports_lie_below_the_ephemeral_range_and_the_block_is_free():
    start = net.ephemeral_start()
    for count in (1, 2, 3):
        base = net.free_port(count=count)
        assert net.LOWEST_PORT <= base and base + count - 1 < start
        socks = [socket.socket() for _ in range(count)]
        try:
            for offset, sock in enumerate(socks):
                sock.bind(("127.0.0.1", base + offset))
        finally:
            for sock in socks:
                sock.close()


def _taken_port_before_a_free_one() -> tuple[socket.socket, int]:
    """A port held by a listening socket here, the port after it free: chosen below the ephemeral range (an
    ephemeral port's neighbour may be any connection's; one run of the suite found it taken)."""
    for _ in range(50):
        port = net.free_port(count=2)
        taken = socket.socket()
        try:
            taken.bind(("127.0.0.1", port))
            taken.listen()
        except OSError:  # taken meanwhile
            taken.close()
            continue
        if net.ports_free("127.0.0.1", port + 1, 1):
            return taken, port
        taken.close()
    pytest.fail("no port with a free neighbour below the ephemeral range in 50 tries")


def test_a_taken_port_is_never_returned(monkeypatch):
    taken, port = _taken_port_before_a_free_one()
    try:
        # the range holds exactly the taken port and the one after it: only the second can come back
        monkeypatch.setattr(net, "LOWEST_PORT", port)
        monkeypatch.setattr(net, "ephemeral_start", lambda: port + 2)
        for seed in range(20):
            assert net.free_port(rng=random.Random(seed)) == port + 1
        with pytest.raises(RuntimeError, match="no block of 2 free TCP port"):
            net.free_port(count=2, rng=random.Random(0))
    finally:
        taken.close()


def test_the_ephemeral_range_is_read_from_the_kernel_file(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t60999\n")
    assert net.ephemeral_start(path) == 40000
    assert net.ephemeral_start(tmp_path / "missing") == net.DEFAULT_EPHEMERAL_START


def test_no_room_below_the_range_names_the_fix(monkeypatch):
    monkeypatch.setattr(net, "ephemeral_start", lambda: net.LOWEST_PORT + 1)  # room for one port, not two
    with pytest.raises(RuntimeError, match="set the port explicitly"):
        net.free_port(count=2)
