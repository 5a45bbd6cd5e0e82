"""Stdlib logging for one Slipstream process: each record is one line with an ISO-8601 UTC timestamp, the level and
the process role, written to stdout, which the launcher sends to `<run>/logs/<role>.log`. The level comes from
`SLIPSTREAM_LOG_LEVEL` (default INFO)."""

import logging
import os
import sys
import time

LEVEL_ENV = "SLIPSTREAM_LOG_LEVEL"
# per-request INFO lines of HTTP clients would drown the one line per step; matplotlib says once per fresh install
# that it built its font cache
_QUIET_LOGGERS = ("httpx", "httpcore", "urllib3", "matplotlib")


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever sys.stdout is at emit time, so a redirected stdout (pytest's capture) gets the records."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # the base class assigns it; sys.stdout is read at emit time instead
        pass


def build_formatter(role: str) -> logging.Formatter:
    """`2026-01-31T12:00:00.123Z INFO [trainer] message`."""
    formatter = logging.Formatter(f"%(asctime)s.%(msecs)03dZ %(levelname)s [{role}] %(message)s", "%Y-%m-%dT%H:%M:%S")
    formatter.converter = time.gmtime
    return formatter


def resolve_level(level: str | None = None) -> int:
    """`level` if given, else $SLIPSTREAM_LOG_LEVEL, else INFO; a name that is not a logging level is an error."""
    name = (level or os.environ.get(LEVEL_ENV) or "INFO").upper()
    value = logging.getLevelName(name)
    if not isinstance(value, int):
        raise ValueError(f"{LEVEL_ENV}={name!r} is not a logging level; use DEBUG, INFO, WARNING or ERROR")
    return value


def setup_logging(role: str, level: str | None = None) -> None:
    """Route the process's log records to stdout as `timestamp LEVEL [role] message` lines. Idempotent: a second
    call (a test running several processes' loops in one interpreter) only updates the role and level."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if isinstance(h, _StdoutHandler)), None)
    if handler is None:
        handler = _StdoutHandler()
        root.addHandler(handler)
    handler.setFormatter(build_formatter(role))
    root.setLevel(resolve_level(level))
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
