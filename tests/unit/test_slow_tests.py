"""tests/slow_tests.py: the `slow` list is read from pytest's --durations report (phases summed per test), and
every test it names lives in an existing file of the unit tier."""

from tests.slow_tests import SLOW_TESTS, read_slow_tests, slow_node_ids

REPORT = """
============================= slowest durations ==============================
6.06s setup    tests/unit/test_a.py::test_x[qwen3 moe]
0.60s call     tests/unit/test_b.py::TestY::test_z
0.50s teardown tests/unit/test_b.py::TestY::test_z
0.99s call     tests/unit/test_c.py::test_w
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_phases_add_up_per_test():
    assert slow_node_ids(REPORT, 1.0) == [
        "tests/unit/test_a.py::test_x[qwen3 moe]",
        "tests/unit/test_b.py::TestY::test_z",
    ]
    assert slow_node_ids(REPORT, 0.9) == [
        "tests/unit/test_a.py::test_x[qwen3 moe]",
        "tests/unit/test_b.py::TestY::test_z",
        "tests/unit/test_c.py::test_w",
    ]


def test_listed_tests_are_in_files_of_the_unit_tier():
    repo = SLOW_TESTS.parents[2]
    listed = read_slow_tests()
    assert listed and all(node_id.startswith("tests/unit/") for node_id in listed)
    assert all((repo / node_id.split("::")[0]).is_file() for node_id in listed), sorted(listed)
