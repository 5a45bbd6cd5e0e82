"""Writes tests/unit/slow_tests.txt, the unit tests marked `slow` at collection (tests/unit/conftest.py) that
`make test-quick` leaves out (`make test` runs them all): those whose setup, call and teardown together took
THRESHOLD seconds or more in any of the measured runs of the unit tier given (several runs catch the tests near the
threshold that a run on a quieter host takes under it).

    python -m pytest tests/unit -q --durations=0 > durations-1.txt     # and durations-2.txt, ...
    python -m tests.slow_tests durations-*.txt [--threshold 1.0]
"""

import argparse
import re
from collections import defaultdict
from pathlib import Path

SLOW_TESTS = Path(__file__).resolve().parent / "unit" / "slow_tests.txt"
HEADER = """\
# Unit tests marked `slow` (tests/unit/conftest.py): `make test-quick` leaves them out, `make test` runs them.
# Each took {threshold:g} s or more (setup + call + teardown) in one of {num_runs} runs of tests/unit on the 2-core machine;
# regenerate with tests/slow_tests.py when the suite's speed changes.
"""
# one line of pytest's --durations report: "6.06s setup    tests/unit/test_x.py::test_y[param]"
DURATION_LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S.*?)\s*$")


def slow_node_ids(durations_report: str, threshold_s: float) -> list[str]:
    """Node ids whose phases in a pytest --durations=0 report add up to `threshold_s` or more, sorted."""
    seconds: dict[str, float] = defaultdict(float)
    for line in durations_report.splitlines():
        if match := DURATION_LINE.match(line):
            seconds[match[3]] += float(match[1])
    return sorted(node_id for node_id, total in seconds.items() if total >= threshold_s)


def read_slow_tests(path: Path = SLOW_TESTS) -> set[str]:
    return {line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.slow_tests", description=__doc__.split("\n\n")[0])
    parser.add_argument("durations", type=Path, nargs="+", help="outputs of `pytest tests/unit --durations=0`")
    parser.add_argument("--threshold", type=float, default=1.0, help="seconds from which a test is slow")
    args = parser.parse_args()
    node_ids = set()
    for report in args.durations:
        if not (slow := slow_node_ids(report.read_text(), args.threshold)):
            parser.error(f"no test took {args.threshold:g} s or more in {report}: is it a --durations=0 report?")
        node_ids.update(slow)
    header = HEADER.format(threshold=args.threshold, num_runs=len(args.durations))
    SLOW_TESTS.write_text(header + "".join(f"{node_id}\n" for node_id in sorted(node_ids)))
    print(f"{len(node_ids)} slow unit tests written to {SLOW_TESTS}")


if __name__ == "__main__":
    main()
