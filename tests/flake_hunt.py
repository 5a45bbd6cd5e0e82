"""Flake hunter: runs the given tests N times, each run beside a CPU hog (a process keeping one core busy, as a
loaded CI host would), and reports per test how many runs failed, with the first line of each failure.

    python -m tests.flake_hunt [-n RUNS] [--hogs K] [TEST ...] [-- PYTEST_ARGS]     # TEST: tests/e2e by default
    make flake-hunt N=3 [TESTS=tests/e2e/test_rl_tiny.py]

A hog lives at most as long as a run may (--run-timeout) and exits by itself once the hunter is gone; the hunter
kills it after each run, on Ctrl-C and on SIGTERM. Each run's pytest output and per-test records stay in --out (a
new temporary folder unless given). Exit status: 0 when every run passed, 1 when one failed, 130 when interrupted.
"""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TESTS = ("tests/e2e",)
HOG_TAG = "flake-hunt-hog"  # in the hog's command line, so `ps` shows what it is
# Checks its deadline and its parent between short bursts: a hog whose hunter was SIGKILLed exits within a moment.
HOG_CODE = """
import os, sys, time
deadline, parent = time.monotonic() + float(sys.argv[1]), int(sys.argv[2])
while time.monotonic() < deadline and os.getppid() == parent:
    for _ in range(100_000):
        pass
"""
STOP_GRACE_S = 60  # after SIGINT, pytest runs the tests' teardown (which stops their vLLM servers) before SIGKILL
# Each run loads this module as a pytest plugin (the hooks below), which appends one JSON line per test phase and per
# failed collection to the file this variable names: exact node ids (JUnit XML names a test by the file defining
# it, so the tests a class inherits from a helper module would all look alike).
RECORDS_VAR = "SLIPSTREAM_FLAKE_HUNT_RECORDS"
PLUGIN = "tests.flake_hunt"


@dataclass
class Tally:
    """One test across the runs: how many runs it ran in (not skipped), and each failure's run and first line."""

    runs: int = 0
    skips: int = 0
    failures: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class HuntResult:
    tests: dict[str, Tally] = field(default_factory=dict)
    broken_runs: list[tuple[int, str]] = field(default_factory=list)
    """Runs whose pytest did not finish normally (timed out, crashed, usage error): (run, why)."""
    hog_pids: list[int] = field(default_factory=list)
    interrupted: bool = False

    @property
    def failed(self) -> bool:
        return bool(self.broken_runs) or any(record.failures for record in self.tests.values())


def start_hog(lifetime_s: float) -> subprocess.Popen:
    """A process keeping one core busy for at most `lifetime_s`, in its own session (a terminal's Ctrl-C reaches
    the hunter only, which kills it)."""
    args = [sys.executable, "-c", HOG_CODE, str(lifetime_s), str(os.getpid()), HOG_TAG]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)


def _stop_pytest(proc: subprocess.Popen) -> None:
    """SIGINT to pytest's process group (it tears the tests down and writes its report), then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _first_line(text: str | None) -> str:
    line = next((line.strip() for line in (text or "").splitlines() if line.strip()), "(no message)")
    return line if len(line) <= 300 else line[:297] + "..."


def _write_record(node_id: str, when: str, outcome: str, message: str | None) -> None:
    if path := os.environ.get(RECORDS_VAR):
        with open(path, "a") as records:
            records.write(json.dumps({"node_id": node_id, "when": when, "outcome": outcome, "message": message}) + "\n")


def _failure_line(report: pytest.CollectReport | pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)  # absent for collection errors and some plugins' reports
    line = _first_line(crash.message if crash is not None else str(report.longrepr))
    return line if report.when == "call" else f"{report.when}: {line}"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _write_record(report.nodeid, report.when, report.outcome, _failure_line(report) if report.failed else None)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write_record(report.nodeid, "collect", "failed", _failure_line(report))


def read_records(path: Path) -> dict[str, tuple[str, str | None]]:
    """node id -> (passed/failed/skipped, first line of its first failure), from one run's records."""
    tests: dict[str, tuple[str, str | None]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        outcome, _ = tests.get(record["node_id"], ("passed", None))
        if outcome != "failed" and record["outcome"] in ("failed", "skipped"):
            tests[record["node_id"]] = (record["outcome"], record["message"])
        else:
            tests.setdefault(record["node_id"], (outcome, None))
    return tests


def run_once(
    run: int,
    tests: Sequence[str],
    pytest_args: Sequence[str],
    out: Path,
    hogs: int,
    run_timeout: float,
    result: HuntResult,
) -> tuple[int | str, Path]:
    """One pytest run beside `hogs` CPU hogs (always killed on the way out); pytest's exit code or why it had none."""
    records, log_path = out / f"run_{run}.jsonl", out / f"run_{run}.log"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        PLUGIN,
        *tests,
        *pytest_args,
    ]
    hog_procs = []
    try:
        for _ in range(hogs):
            hog_procs.append(start_hog(run_timeout + STOP_GRACE_S))
            result.hog_pids.append(hog_procs[-1].pid)
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(
                command,
                cwd=REPO,
                env={**os.environ, RECORDS_VAR: str(records)},
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                status: int | str = proc.wait(timeout=run_timeout)
            except subprocess.TimeoutExpired:
                status = f"timed out after {run_timeout:.0f} s"
            finally:
                if proc.poll() is None:
                    _stop_pytest(proc)
    finally:
        for hog in hog_procs:
            hog.kill()
            hog.wait()
    return status, records


def record_run(run: int, status: int | str, records: Path, result: HuntResult) -> str:
    """Adds one run's outcomes to `result`; returns its summary line."""
    cases = read_records(records)
    for node_id, (outcome, message) in cases.items():
        record = result.tests.setdefault(node_id, Tally())
        if outcome == "skipped":
            record.skips += 1
            continue
        record.runs += 1
        if outcome == "failed":
            record.failures.append((run, message))
    # 0: all passed, 1: some failed (both reported per test); anything else leaves no trustworthy per-test count
    if status not in (0, 1):
        result.broken_runs.append((run, status if isinstance(status, str) else f"pytest exited with {status}"))
    outcomes = [outcome for outcome, _ in cases.values()]
    counts = {outcome: outcomes.count(outcome) for outcome in ("passed", "failed", "skipped")}
    return ", ".join(f"{n} {outcome}" for outcome, n in counts.items() if n) or "no tests reported"


def hunt(
    tests: Sequence[str],
    runs: int,
    pytest_args: Sequence[str] = (),
    hogs: int = 1,
    run_timeout: float = 3600,
    out: Path | None = None,
    log: Callable[[str], None] = lambda line: print(line, flush=True),
) -> HuntResult:
    """Runs pytest on `tests` `runs` times, each beside `hogs` CPU hogs; stops early (interrupted) on Ctrl-C."""
    out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="flake_hunt-"))
    out.mkdir(parents=True, exist_ok=True)
    result = HuntResult()
    log(f"flake hunt: {runs} run(s) of {' '.join([*tests, *pytest_args])} beside {hogs} CPU hog(s); logs in {out}")
    run = 0
    try:
        for run in range(1, runs + 1):
            started = time.monotonic()
            status, records = run_once(run, tests, pytest_args, out, hogs, run_timeout, result)
            summary = record_run(run, status, records, result)
            took = time.monotonic() - started
            log(f"run {run}/{runs}: {summary} in {took:.0f} s (exit {status}; {out}/run_{run}.log)")
    except KeyboardInterrupt:  # run_once has stopped pytest and the hogs; the interrupted run is not counted
        result.interrupted = True
        log(f"run {run}/{runs}: interrupted")
    return result


def format_report(result: HuntResult) -> str:
    """Per test that failed at least once: failed/ran, then each failure's run and first line, most failures first."""
    failing = sorted(((t, r) for t, r in result.tests.items() if r.failures), key=lambda item: -len(item[1].failures))
    lines = [f"{len(result.tests)} test(s) seen, {len(failing)} failed at least once"]
    for node_id, record in failing:
        lines.append(f"  {len(record.failures)}/{record.runs} failed  {node_id}")
        lines.extend(f"      run {run}: {message}" for run, message in record.failures)
    lines.extend(f"  run {run} broken: {why}" for run, why in result.broken_runs)
    skipped = [(t, r) for t, r in result.tests.items() if r.skips]
    lines.extend(f"  skipped in {r.skips} run(s): {t}" for t, r in skipped)
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM takes Ctrl-C's path: pytest and the hogs are stopped


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m tests.flake_hunt", description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="*", default=list(DEFAULT_TESTS), help="pytest paths or node ids")
    parser.add_argument("-n", "--runs", type=int, default=3, help="how many times to run them (default 3)")
    parser.add_argument("--hogs", type=int, default=1, help="CPU hogs beside each run, one core each (0: none)")
    parser.add_argument("--run-timeout", type=float, default=3600, help="seconds one pytest run may take")
    parser.add_argument("--out", type=Path, help="folder for each run's log and JUnit XML")
    args = parser.parse_args(argv[:split])
    if args.runs < 1 or args.hogs < 0 or args.run_timeout <= 0:
        parser.error("--runs must be at least 1, --hogs at least 0 and --run-timeout positive")
    signal.signal(signal.SIGTERM, _interrupt)
    # Ctrl-C stops a hunt even when it was started with SIGINT ignored, as a shell's background job (`... &` in a
    # script, `nohup`) is: Python then leaves SIGINT ignored, and so would the pytest runs it starts
    signal.signal(signal.SIGINT, signal.default_int_handler)
    result = hunt(args.tests, args.runs, argv[split + 1 :], args.hogs, args.run_timeout, args.out)
    print(format_report(result))
    return 130 if result.interrupted else int(result.failed)


if __name__ == "__main__":
    sys.exit(main())
