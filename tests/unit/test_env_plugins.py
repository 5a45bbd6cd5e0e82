"""Environments from outside the package: import paths, names registered by installed packages (entry points), and
the package `slipstream env init` writes (it installs with pip, its own test passes, and it loads by both names)."""

import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slipstream.cli import main as cli_main
from slipstream.config.loader import load_config
from slipstream.config.rl import RLConfig
from slipstream.envs.registry import build_env, known_envs
from slipstream.envs.scaffold import init_env_package

ROOT = Path(__file__).resolve().parents[2]


def _module(tmp_path, name: str, body: str):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))


def _installed(site: Path, dist: str, entry_points: str) -> None:
    """What pip leaves in `site` for distribution `dist` registering `entry_points` (lines `NAME = module:attr`)."""
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[slipstream.environments]\n{entry_points}\n")


def test_import_paths_load_and_bad_ones_say_why(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _module(
        tmp_path,
        "plugin_envs",
        """
        from slipstream.envs.reverse_text import ReverseTextEnv

        def load_environment(**args):
            return ReverseTextEnv(**args)

        NOT_CALLABLE = 3

        def broken(**args):
            return object()
        """,
    )
    env = build_env("plugin_envs:load_environment", num_tasks=5)
    assert env.name == "reverse_text" and len(env.tasks("train")) == 5
    cases = {
        "no_such_module_xyz:load": "cannot import 'no_such_module_xyz'",
        "plugin_envs:missing": "has no attribute 'missing'",
        "plugin_envs:NOT_CALLABLE": "not a callable",
        "plugin_envs:broken": "without name, tasks, reward",
        "plugin_envs:": "an import path is 'package.module:attribute'",
        "nothing_like_this": "unknown environment 'nothing_like_this'",
    }
    for name, message in cases.items():
        with pytest.raises(ValueError, match=message):
            build_env(name)
    with pytest.raises(ValueError, match="do not fit environment"):
        build_env("plugin_envs:load_environment", no_such_arg=1)


def test_installed_packages_register_names_through_entry_points(tmp_path, monkeypatch):
    site = tmp_path / "site"
    _installed(site, "ep-env", "ep-words = ep_env:load\nep-broken = ep_env_missing:load")
    _module(site, "ep_env", "from slipstream.envs.alphabet_sort import AlphabetSortEnv\nload = AlphabetSortEnv\n")
    monkeypatch.syspath_prepend(str(site))
    assert {"ep-words", "ep-broken", "reverse_text"} <= set(known_envs())
    assert build_env("ep-words").name == "alphabet_sort"
    with pytest.raises(ValueError, match="loading entry point 'ep_env_missing:load' failed"):
        build_env("ep-broken")


def test_env_init_writes_a_package_that_installs_and_trains_by_name(tmp_path, capsys):
    assert cli_main(["env", "init", "word-echo", "--dir", str(tmp_path)]) == 0
    root = tmp_path / "word-echo"
    assert "pip install -e" in capsys.readouterr().out
    assert cli_main(["env", "init", "word-echo", "--dir", str(tmp_path)]) == 2  # never overwrites
    with pytest.raises(ValueError, match="use letters"):
        init_env_package("9lives", tmp_path)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
    subprocess.run([*pip, str(root)], check=True, capture_output=True)
    assert (site / "word_echo" / "env.py").is_file()
    check = (
        "from slipstream.envs.registry import build_env; "
        "a = build_env('word-echo', num_tasks=8); b = build_env('word_echo.env:load_environment', num_tasks=8); "
        "t = a.tasks('train')[0]; assert a.reward(t, t.answer) == 1.0 and b.tasks('train') == a.tasks('train'); "
        "print(a.name, len(a.tasks('eval')))"
    )
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["word-echo", "1"]
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", str(root / "tests")],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": f"{site}"},
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_the_documented_own_environment_commands_build_it(tmp_path, monkeypatch):
    """docs/environments.md's `slipstream rl -c examples/reverse_text/rl.toml ... --orchestrator.env.name word-echo`
    commands, as written, up to the environment the orchestrator builds (no vLLM): the example config's reverse-text
    arguments are replaced, and word-echo's loader takes what is left."""
    init_env_package("word-echo", tmp_path)
    _installed(tmp_path / "site", "word-echo", "word-echo = word_echo.env:load_environment")
    monkeypatch.syspath_prepend(str(tmp_path / "word-echo" / "src"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.chdir(ROOT)
    doc = (ROOT / "docs" / "environments.md").read_text().replace("\\\n", " ")
    commands = [line for line in doc.splitlines() if line.startswith("slipstream rl") and "word-echo" in line]
    assert len(commands) == 2, commands
    for command in commands:
        argv = shlex.split(command)
        assert argv[:2] == ["slipstream", "rl"]
        env = load_config(RLConfig, argv[2:]).orchestrator.env
        built = build_env(env.name, **env.args)
        assert built.name == "word-echo" and built.tasks("train") and built.tasks("eval"), command
    assert env.args == {"num_tasks": 64} and len(built.tasks("train")) == 64
