"""Free TCP ports for servers that a process starts later (a store, a metrics endpoint, an engine).

A port from `bind(port 0)` comes from the kernel's ephemeral range, the same range the kernel hands out to
every outgoing connection and every other `bind(0)` on the machine. Between choosing such a port and the
server binding it, seconds pass (vLLM starts, torchrun spawns its workers), and another process can take it:
CI saw `OSError: [Errno 98] Address already in use` that way. Ports chosen here lie below the ephemeral range,
where the kernel never assigns one by itself, so only another explicit choice can collide.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST_PORT = 10000
"""No port below this is chosen (below it lie the well-known and commonly configured services' ports)."""

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_START = 32768
"""Linux's default start of the ephemeral range, used where the range cannot be read (macOS has 49152)."""


def ephemeral_start(path: Path = EPHEMERAL_RANGE_FILE) -> int:
    """The first port of the kernel's ephemeral range (Linux's `ip_local_port_range`), or Linux's default."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def ports_free(host: str, base: int, count: int) -> bool:
    """Whether `base .. base + count - 1` can all be bound on `host` right now."""
    socks = []
    try:
        for port in range(base, base + count):
            sock = socket.socket()
            socks.append(sock)
            sock.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = "127.0.0.1", count: int = 1, rng: random.Random | None = None) -> int:
    """A port p, below the ephemeral range, with p .. p + count - 1 free on `host` right now (a random choice,
    so that two processes choosing at once rarely pick the same one)."""
    if count < 1:
        raise ValueError(f"free_port: count must be >= 1, got {count}")
    rng = rng or random.SystemRandom()
    start = ephemeral_start()
    high = start - count
    if high < LOWEST_PORT:
        raise RuntimeError(
            f"the ephemeral port range starts at {start} ({EPHEMERAL_RANGE_FILE}): no room below it "
            f"for {count} port(s) above {LOWEST_PORT}; set the port explicitly in the config"
        )
    for _ in range(200):
        base = rng.randrange(LOWEST_PORT, high + 1)
        if ports_free(host, base, count):
            return base
    raise RuntimeError(
        f"no block of {count} free TCP port(s) found on {host} between {LOWEST_PORT} and {high + count - 1} "
        "after 200 tries; set the port explicitly in the config"
    )
