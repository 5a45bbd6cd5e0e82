"""Process logging (slipstream.monitor.logs): every line of a process's log file carries an ISO-8601 UTC timestamp,
the level and the role; the level comes from SLIPSTREAM_LOG_LEVEL."""

import logging
import re
import subprocess
import sys

import pytest

from slipstream.monitor.logs import LEVEL_ENV, resolve_level, setup_logging

LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) \[([\w-]+)\] (.*)$")


@pytest.fixture
def restore_root():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_records_are_one_line_with_timestamp_level_and_role(capsys, restore_root, monkeypatch):
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    setup_logging("orchestrator")
    setup_logging("orchestrator")  # idempotent: one handler, one line per record
    logging.getLogger("slipstream.orchestrator.loop").info("step 1/2 | reward 0.500")
    logging.getLogger("slipstream.orchestrator.loop").debug("not shown at INFO")
    logging.getLogger("httpx").info("HTTP Request: POST /v1/chat/completions")  # per-request noise stays out
    logging.getLogger("matplotlib.font_manager").info("generated new fontManager")  # once per fresh install
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    match = LINE.match(lines[0])
    assert match and match.groups() == ("INFO", "orchestrator", "step 1/2 | reward 0.500"), lines[0]


def test_level_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(LEVEL_ENV, "debug")
    assert resolve_level() == logging.DEBUG
    assert resolve_level("warning") == logging.WARNING  # an explicit level wins
    monkeypatch.setenv(LEVEL_ENV, "chatty")
    with pytest.raises(ValueError, match=f"{LEVEL_ENV}='CHATTY' is not a logging level"):
        resolve_level()


def test_trainer_log_file_lines_carry_timestamp_and_level(tmp_path):
    """As under the launcher: the process's stdout and stderr go to `logs/trainer.log`."""
    script = (
        "from slipstream.monitor.logs import setup_logging\n"
        "from slipstream.trainer.rl import NonFiniteGuard\n"
        "setup_logging('trainer')\n"
        "NonFiniteGuard(3).update(7, True)\n"
    )
    log_path = tmp_path / "logs" / "trainer.log"
    log_path.parent.mkdir()
    with open(log_path, "wb") as log:
        subprocess.run([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, check=True, timeout=120)
    lines = log_path.read_text().splitlines()
    matches = [m.groups() for m in map(LINE.match, lines) if m]
    assert ("WARNING", "trainer", "step 7: NaN/inf gradient norm, optimizer step skipped (1 in a row)") in matches, (
        lines
    )
