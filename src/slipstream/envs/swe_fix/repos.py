"""Tiny Python repositories with one bug and a failing unittest module, generated deterministically.

Each template returns the repository's files, the issue text, the test module to run and the known fix (an exact,
unique text replacement in one source file); test values vary with the random generator.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass

PACKAGES = ("toolbox", "utils", "helpers", "corelib", "common", "kit")


@dataclass(frozen=True)
class Fix:
    path: str
    old: str
    new: str


@dataclass(frozen=True)
class RepoSpec:
    """A generated repository: files by relative path, the issue, the failing tests and the fix."""

    name: str
    files: dict[str, str]
    issue: str
    test_module: str
    """Dotted module the reward runs (`python3 -m unittest <test_module>`)."""
    num_tests: int
    fix: Fix

    @property
    def test_files(self) -> dict[str, str]:
        return {path: text for path, text in self.files.items() if path.startswith("tests/")}


@dataclass(frozen=True)
class _Bug:
    module: str
    source: str
    """Buggy source; the marker `{old}` (replaced literally, not str.format) is where the buggy snippet goes."""
    old: str
    new: str
    issue: str
    tests: list[str]
    """Test method bodies (one line each) using names imported from the module."""
    imports: str


_TEMPLATES: list[Callable[[random.Random], _Bug]] = []


def _template(fn: Callable[[random.Random], _Bug]) -> Callable[[random.Random], _Bug]:
    _TEMPLATES.append(fn)
    return fn


@_template
def _clamp(rng: random.Random) -> _Bug:
    lo, hi = rng.randint(-20, 0), rng.randint(10, 50)
    source = (
        'def clamp(value, low, high):\n    """Limit value to the range [low, high]."""\n    if value < low:\n'
        "        return low\n{old}    return value\n"
    )
    return _Bug(
        "numeric",
        source,
        "    if value > high:\n        return low\n",
        "    if value > high:\n        return high\n",
        "clamp() returns the wrong value when the input is above the upper bound.",
        [
            f"self.assertEqual(clamp({hi - 1}, {lo}, {hi}), {hi - 1})",
            f"self.assertEqual(clamp({lo - 5}, {lo}, {hi}), {lo})",
            f"self.assertEqual(clamp({hi + 7}, {lo}, {hi}), {hi})",
        ],
        "clamp",
    )


@_template
def _mean(rng: random.Random) -> _Bug:
    values = [rng.randint(1, 9) * 2 for _ in range(4)]
    mean = sum(values) / len(values)
    return _Bug(
        "stats",
        'def mean(values):\n    """Arithmetic mean of a non-empty list."""\n{old}',
        "    return sum(values) / (len(values) - 1)\n",
        "    return sum(values) / len(values)\n",
        "mean() gives results that are too large.",
        [f"self.assertEqual(mean({values}), {mean!r})", "self.assertEqual(mean([5]), 5)"],
        "mean",
    )


@_template
def _palindrome(rng: random.Random) -> _Bug:
    phrase = rng.choice(["Never odd or even", "Step on no pets", "Was it a car or a cat I saw", "No lemon no melon"])
    return _Bug(
        "text",
        'def is_palindrome(text):\n    """True if text reads the same backwards, ignoring case and non-letters."""\n'
        "{old}    return cleaned == cleaned[::-1]\n",
        '    cleaned = "".join(c for c in text if c.isalnum())\n',
        '    cleaned = "".join(c.lower() for c in text if c.isalnum())\n',
        "is_palindrome() should ignore letter case but does not.",
        [
            f"self.assertTrue(is_palindrome({phrase!r}))",
            "self.assertTrue(is_palindrome('abba'))",
            "self.assertFalse(is_palindrome('abc'))",
        ],
        "is_palindrome",
    )


@_template
def _leap(rng: random.Random) -> _Bug:
    year = rng.choice([1600, 2000, 2400])
    return _Bug(
        "calendar_utils",
        'def is_leap_year(year):\n    """Gregorian leap year rule."""\n{old}',
        "    return year % 4 == 0 and year % 100 != 0\n",
        "    return (year % 4 == 0 and year % 100 != 0) or year % 400 == 0\n",
        f"is_leap_year({year}) returns False, but {year} is a leap year.",
        [
            f"self.assertTrue(is_leap_year({year}))",
            "self.assertFalse(is_leap_year(1900))",
            f"self.assertTrue(is_leap_year({rng.choice([2024, 1996, 2012])}))",
        ],
        "is_leap_year",
    )


@_template
def _chunks(rng: random.Random) -> _Bug:
    n, size = rng.randint(7, 11), rng.randint(2, 3)
    while n % size == 0:
        n += 1
    items = list(range(n))
    expected = [items[i : i + size] for i in range(0, n, size)]
    return _Bug(
        "sequences",
        'def chunks(items, size):\n    """Split items into lists of `size` (the last one may be shorter)."""\n{old}',
        "    return [items[i : i + size] for i in range(0, len(items) - size + 1, size)]\n",
        "    return [items[i : i + size] for i in range(0, len(items), size)]\n",
        "chunks() drops the last, shorter chunk.",
        [f"self.assertEqual(chunks({items}, {size}), {expected})", "self.assertEqual(chunks([1, 2], 2), [[1, 2]])"],
        "chunks",
    )


@_template
def _words(rng: random.Random) -> _Bug:
    words = rng.sample(["alpha", "beta", "gamma", "delta", "kappa", "omega", "sigma"], 4)
    text = "  ".join(words) + "   "
    return _Bug(
        "text",
        'def count_words(text):\n    """Number of whitespace-separated words."""\n{old}',
        '    return len(text.split(" "))\n',
        "    return len(text.split())\n",
        "count_words() miscounts text with repeated spaces.",
        [f"self.assertEqual(count_words({text!r}), 4)", "self.assertEqual(count_words('one'), 1)"],
        "count_words",
    )


@_template
def _roman(rng: random.Random) -> _Bug:
    cases = {"IV": 4, "IX": 9, "XIV": 14, "XL": 40, "XC": 90, "CD": 400, "MCMXCIV": 1994, "MMXXIV": 2024}
    picked = rng.sample(sorted(cases), 3)
    source = (
        'VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}\n\n\n'
        'def roman_to_int(numeral):\n    """Value of a Roman numeral."""\n    total = 0\n'
        "    for i, char in enumerate(numeral):\n"
        "{old}        else:\n            total += VALUES[char]\n    return total\n"
    )
    condition = "        if i + 1 < len(numeral) and VALUES[char] < VALUES[numeral[i + 1]]:\n"
    return _Bug(
        "roman",
        source,
        condition + "            total += VALUES[char]\n",
        condition + "            total -= VALUES[char]\n",
        "roman_to_int() is wrong for subtractive numerals such as IV.",
        [f"self.assertEqual(roman_to_int({k!r}), {cases[k]})" for k in picked]
        + ["self.assertEqual(roman_to_int('III'), 3)"],
        "roman_to_int",
    )


@_template
def _fizzbuzz(rng: random.Random) -> _Bug:
    n = rng.choice([15, 30, 45, 60])
    source = (
        'def fizzbuzz(n):\n    """FizzBuzz for multiples of 15, Fizz of 3, Buzz of 5, else the number itself."""\n'
        '{old}    if n % 5 == 0:\n        return "Buzz"\n    return str(n)\n'
    )
    return _Bug(
        "game",
        source,
        '    if n % 3 == 0:\n        return "Fizz"\n    if n % 15 == 0:\n        return "FizzBuzz"\n',
        '    if n % 15 == 0:\n        return "FizzBuzz"\n    if n % 3 == 0:\n        return "Fizz"\n',
        f"fizzbuzz({n}) should be 'FizzBuzz'.",
        [f"self.assertEqual(fizzbuzz({n}), 'FizzBuzz')", "self.assertEqual(fizzbuzz(9), 'Fizz')"]
        + ["self.assertEqual(fizzbuzz(10), 'Buzz')", "self.assertEqual(fizzbuzz(7), '7')"],
        "fizzbuzz",
    )


def _render(bug: _Bug, package: str, index: int) -> RepoSpec:
    module_path = f"{package}/{bug.module}.py"
    tests = "".join(f"    def test_{i}(self):\n        {line}\n\n" for i, line in enumerate(bug.tests))
    test_source = (
        f"import unittest\n\nfrom {package}.{bug.module} import {bug.imports}\n\n\n"
        f"class Test{bug.imports.title().replace('_', '')}(unittest.TestCase):\n{tests.rstrip()}\n\n\n"
        'if __name__ == "__main__":\n    unittest.main()\n'
    )
    test_name = f"test_{bug.module}"
    files = {
        "README.md": f"# {package}\n\nSmall helpers. Run the tests with `python3 -m unittest tests.{test_name}`.\n",
        f"{package}/__init__.py": "",
        module_path: bug.source.replace("{old}", bug.old),
        "tests/__init__.py": "",
        f"tests/{test_name}.py": test_source,
    }
    return RepoSpec(
        name=f"{package}-{bug.module}-{index}",
        files=files,
        issue=bug.issue,
        test_module=f"tests.{test_name}",
        num_tests=len(bug.tests),
        fix=Fix(module_path, bug.old, bug.new),
    )


def generate_repo(rng: random.Random, index: int) -> RepoSpec:
    """One repository; templates cycle with `index` so every template appears in a split."""
    bug = _TEMPLATES[index % len(_TEMPLATES)](rng)
    return _render(bug, rng.choice(PACKAGES), index)


def num_templates() -> int:
    return len(_TEMPLATES)


def apply_fix(files: dict[str, str], fix: Fix) -> dict[str, str]:
    """`files` with the fix applied (the old text must occur exactly once)."""
    text = files[fix.path]
    if text.count(fix.old) != 1:
        raise ValueError(f"fix of {fix.path} does not match exactly once")
    return files | {fix.path: text.replace(fix.old, fix.new)}
