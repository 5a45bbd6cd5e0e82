"""`slipstream env init NAME`: write an environment package that installs with pip and trains with `slipstream rl`
unchanged (its pyproject registers NAME under the `slipstream.environments` entry points).

    slipstream env init my-env [--dir PARENT]   # writes PARENT/my-env/
    pip install -e PARENT/my-env                # then: orchestrator.env.name = "my-env"
"""

import argparse
import keyword
import re
import sys
from pathlib import Path

_PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "0.1.0"
description = "A Slipstream RL environment: {name}"
requires-python = ">=3.10"
# Slipstream is not declared: the environment is loaded by the orchestrator that runs it, in Slipstream's Python.
dependencies = []

[project.entry-points."slipstream.environments"]
{name} = "{package}.env:load_environment"

[tool.setuptools.packages.find]
where = ["src"]
"""

_INIT = '''\
"""{name}: a Slipstream RL environment (see env.py)."""
'''

_ENV = '''\
"""{name}: a single-turn environment. The model is asked to repeat a word in capitals; the reward is 1.0 for the
exact word, 0.5 when it appears in the reply, else 0.0. Replace the tasks and the reward with yours.

Slipstream's orchestrator calls `load_environment(**orchestrator.env.args)` and then uses the environment's
`name`, `tasks(split)` and `reward(task, completion_text)`. A multi-turn environment (tools, feedback between turns)
implements `setup_state`, `env_response`, `reward(task, state)` and `cleanup` instead: see Slipstream's
docs/environments.md and slipstream/envs/base.py.
"""

import random
from typing import Any

from slipstream.envs.base import Task

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "piano", "ocean", "candle", "forest", "silver", "garden"]


class {cls}:
    name = "{name}"

    def __init__(self, num_tasks: int = 256, seed: int = 0) -> None:
        self.num_tasks, self.seed = num_tasks, seed

    def tasks(self, split: str) -> list[Task]:
        """A deterministic list of tasks per split ("train" or "eval")."""
        rng = random.Random(f"{{self.seed}}:{{split}}")
        count = self.num_tasks if split == "train" else max(self.num_tasks // 8, 1)
        out = []
        for i in range(count):
            word = rng.choice(WORDS)
            prompt = [{{"role": "user", "content": f"Repeat this word in capital letters, nothing else: {{word}}"}}]
            out.append(Task(id=f"{{split}}-{{i}}", prompt=prompt, answer=word.upper()))
        return out

    def reward(self, task: Task, completion_text: str) -> float:
        reply = completion_text.strip()
        if reply == task.answer:
            return 1.0
        return 0.5 if task.answer in reply else 0.0


def load_environment(**args: Any) -> {cls}:
    """What `orchestrator.env.name = "{name}"` (or "{package}.env:load_environment") calls with env.args."""
    return {cls}(**args)
'''

_TEST = """\
from {package}.env import load_environment


def test_tasks_are_deterministic_and_rewards_score_replies():
    env = load_environment(num_tasks=16, seed=1)
    tasks = env.tasks("train")
    assert len(tasks) == 16 and [t.id for t in tasks] == [t.id for t in load_environment(num_tasks=16, seed=1).tasks("train")]
    task = tasks[0]
    assert env.reward(task, task.answer) == 1.0
    assert env.reward(task, f"Sure: {{task.answer}}") == 0.5
    assert env.reward(task, "no") == 0.0
"""

_README = """\
# {name}

A [Slipstream](https://pypi.org/project/slipstream/) RL environment, written by `slipstream env init`.

    pip install -e .                 # registers "{name}" under the slipstream.environments entry points
    pytest tests                     # the environment's own tests
    slipstream rl -c my.toml --orchestrator.env.name {name} --orchestrator.env.args '{{ num_tasks = 128 }}'

Without installing: `--orchestrator.env.name {package}.env:load_environment` with `src/` on PYTHONPATH.
Edit `src/{package}/env.py`: `tasks(split)` and `reward(task, completion_text)`.
"""

_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")


def package_name(name: str) -> str:
    """The Python package of environment `name` (`my-env` -> `my_env`)."""
    return name.replace("-", "_").lower()


def init_env_package(name: str, parent: Path) -> Path:
    """Write the package of environment `name` into `parent/name` and return that folder; refuses to overwrite."""
    package = package_name(name)
    if not _NAME_RE.match(name) or keyword.iskeyword(package):
        raise ValueError(f"environment name {name!r}: use letters, digits, '-' and '_', starting with a letter")
    root = Path(parent) / name
    if root.exists():
        raise FileExistsError(f"{root} already exists; pick another name or --dir")
    cls = "".join(part.capitalize() for part in package.split("_")) + "Env"
    files = {
        "pyproject.toml": _PYPROJECT,
        "README.md": _README,
        f"src/{package}/__init__.py": _INIT,
        f"src/{package}/env.py": _ENV,
        "tests/test_env.py": _TEST,
    }
    for relative, template in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(template.format(name=name, package=package, cls=cls))
    return root


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="slipstream env", description="environment packages")
    commands = parser.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init", help="write an installable environment package skeleton")
    init.add_argument("name", help="environment name (also the pip package name and the entry-point name)")
    init.add_argument("--dir", type=Path, default=Path("."), help="parent folder (default: the current one)")
    args = parser.parse_args(argv)
    try:
        root = init_env_package(args.name, args.dir)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {root}: pip install -e {root}, then set orchestrator.env.name = {args.name!r}")
    return 0
