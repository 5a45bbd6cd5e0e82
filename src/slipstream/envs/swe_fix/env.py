"""swe_fix: repair a bug in a tiny Python repository with bash and file tools executed in a sandbox.

Each rollout gets a fresh copy of its task's repository in its own sandbox. Reward: 1.0 when the task's test module
passes, else 0.0. Before the final test run the original test files are restored (inside the sandbox), and the run
must report exactly the task's number of tests, so editing or deleting tests does not pay.
"""

import asyncio
import random
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from slipstream.envs.base import RewardResult, State, Task
from slipstream.envs.multiturn import check_task_counts, split_tasks
from slipstream.envs.swe_fix.repos import RepoSpec, generate_repo
from slipstream.envs.swe_fix.tools import CODING_TOOLS, format_result, run_file_helper
from slipstream.envs.tools import ToolEnv, ToolError, tool_metrics
from slipstream.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, detect_isolation

SYSTEM_PROMPT = (
    "You are a software engineer working in a Python repository (the current directory). Use the tools to inspect "
    "the code, run the tests and fix the bug. Do not modify the tests. The sandbox has no network access. When the "
    "tests pass, reply with a short summary and no tool call."
)
_RAN_RE = re.compile(r"^Ran (\d+) tests? in ", re.MULTILINE)
# Bytecode caches are keyed on source mtime (seconds) and size: an edit of equal size within the same second would
# run the stale .pyc. Never write caches, and never read the repository's own __pycache__ (it may be planted).
PYTHON_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/tmp/slipstream-pycache"}
TEST_PYTHON = ["python3", "-s", "-E", "-B", "-X", "pycache_prefix=/tmp/slipstream-pycache"]


def _user_prompt(spec: RepoSpec) -> str:
    listing = "\n".join(sorted(spec.files))
    return (
        f"Issue: {spec.issue}\n\nFiles:\n{listing}\n\nThe tests in {spec.test_module} fail. Fix the source code so that "
        f"`python3 -m unittest {spec.test_module}` passes."
    )


class SweFixEnv(ToolEnv):
    """Tasks are generated repositories (one per task, deterministic from `seed`), cycling through the bug templates."""

    name = "swe_fix"

    def __init__(
        self,
        num_tasks: int = 200,
        num_eval_tasks: int = 16,
        max_turns: int = 20,
        seed: int = 0,
        rollout_timeout_s: float = 1800.0,
        command_timeout_s: float = 30.0,
        memory_mb: int = 1024,
        work_root: str | None = None,
        allow_unsandboxed: bool = False,
    ) -> None:
        """`work_root`: where per-rollout repositories are created (default: the system temp dir); `allow_unsandboxed`:
        run the model's commands without isolation where this machine cannot isolate them (dangerous)."""
        super().__init__(CODING_TOOLS, max_turns=max_turns, rollout_timeout_s=rollout_timeout_s)
        isolation = detect_isolation()
        if not isolation.available and not allow_unsandboxed:
            raise SandboxUnavailable(
                f"swe_fix runs model-written commands and this machine cannot sandbox them: {isolation.reason}. "
                "Install bubblewrap, or set orchestrator.env.args.allow_unsandboxed = true to run them unisolated."
            )
        self.allow_unsandboxed = allow_unsandboxed
        self.limits = SandboxLimits(
            wall_seconds=command_timeout_s, cpu_seconds=max(1, int(command_timeout_s)), memory_mb=memory_mb
        )
        self.work_root = Path(work_root) if work_root is not None else Path(tempfile.gettempdir())
        if not self.work_root.is_dir():
            raise ValueError(f"swe_fix work_root {self.work_root} is not an existing directory")
        sizes = check_task_counts(self.name, num_tasks, num_eval_tasks)
        self._tasks = {split: _make_tasks(split, n, seed) for split, n in sizes.items()}

    def tasks(self, split: str) -> Sequence[Task]:
        return split_tasks(self.name, self._tasks, split)

    async def setup_state(self, task: Task) -> State:
        workdir = Path(tempfile.mkdtemp(prefix=f"swe_fix-{task.id}-", dir=self.work_root))
        try:
            for relative, text in task.info["files"].items():
                path = workdir / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            sandbox = Sandbox(workdir, self.limits, allow_unsandboxed=self.allow_unsandboxed, env=PYTHON_ENV)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return {"workdir": workdir, "sandbox": sandbox}

    async def cleanup(self, state: State) -> None:
        await asyncio.to_thread(shutil.rmtree, state["workdir"])

    async def reward(self, task: Task, state: State) -> RewardResult:
        sandbox: Sandbox = state["sandbox"]
        metrics = tool_metrics(state)
        try:
            for relative, text in task.info["test_files"].items():
                await run_file_helper(sandbox, {"op": "write", "path": relative, "content": text})
        except ToolError as e:  # the model made the tests unrestorable (e.g. replaced tests/ by a symlink)
            state["test_output"] = f"could not restore the tests: {e}"
            return RewardResult(value=0.0, metrics=metrics | {"tests_passed": 0.0, "tests_ran": 0.0})
        result = await sandbox.arun([*TEST_PYTHON, "-m", "unittest", "-v", task.info["test_module"]])
        state["test_output"] = format_result(result)
        ran = _RAN_RE.findall(result.stderr)
        num_ran = int(ran[-1]) if ran else 0
        last_line = result.stderr.rstrip().rsplit("\n", 1)[-1]
        passed = result.ok and num_ran == task.info["num_tests"] and last_line.startswith("OK")
        metrics |= {"tests_passed": float(passed), "tests_ran": float(num_ran)}
        return RewardResult(value=float(passed), metrics=metrics)


def _make_tasks(split: str, num_tasks: int, seed: int) -> list[Task]:
    rng = random.Random(f"swe_fix:{split}:{seed}")
    tasks = []
    for i in range(num_tasks):
        spec = generate_repo(rng, i)
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": _user_prompt(spec)}]
        info = {
            "repo": spec.name,
            "files": spec.files,
            "test_files": spec.test_files,
            "test_module": spec.test_module,
            "num_tests": spec.num_tests,
        }
        fix = {"path": spec.fix.path, "old_text": spec.fix.old, "new_text": spec.fix.new}
        tasks.append(Task(id=f"{split}-{i}", prompt=prompt, answer=fix, info=info))
    return tasks
