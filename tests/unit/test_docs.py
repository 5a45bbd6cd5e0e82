"""The documentation: the site builds with `mkdocs build --strict` (broken links, anchors and nav fail), the
configuration reference is what the configs generate now, and nothing user-facing cites files outside the
repository or paths that do not exist."""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

from slipstream import config_reference
from slipstream.cli import CONFIG_COMMANDS
from slipstream.config.loader import help_rows

ROOT = Path(__file__).resolve().parents[2]
USER_FACING = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_config_reference_is_up_to_date():
    committed = (ROOT / config_reference.DEFAULT_OUT).read_text()
    assert committed == config_reference.render(), (
        f"{config_reference.DEFAULT_OUT} is out of date with the configs; regenerate it with "
        f"`{config_reference.REGENERATE}` (from the repository root) and commit it"
    )


def test_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
    out = subprocess.run([*cmd, "--site-dir", str(tmp_path / "site")], capture_output=True, text=True, env=env)
    assert out.returncode == 0, (
        f"mkdocs build --strict failed (mkdocs and mkdocs-material come with `pip install -e '.[dev]'`):\n"
        f"{out.stdout}{out.stderr}"
    )
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


# files that live outside this repository (the project's working notes), which readers of the docs do not have
OUTSIDE = re.compile(r"\.\./shared|/work/shared|REFERENCE\.md|DESIGN\.md")


def test_no_citation_of_files_outside_the_repository():
    hits = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in [*USER_FACING, *sorted((ROOT / "src").rglob("*.py"))]
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "README.md, docs/ and src/ must not cite files outside the repository; state the fact:\n" + (
        "\n".join(hits)
    )


# repository paths written in README.md and docs/ (globs and placeholders such as `test_*` or `<name>` left out), and
# the docs pages src/ names
REPO_PATH = re.compile(r"(?<![\w/.-])((?:docs|examples|tests|benchmarks)/[\w./-]*\w)(?![\w*<])")
DOCS_PATH = re.compile(r"(?<![\w/.-])(docs/[\w./-]*\w)(?![\w*<])")


def test_cited_repository_paths_exist():
    cited = [(path, REPO_PATH) for path in USER_FACING] + [(path, DOCS_PATH) for path in (ROOT / "src").rglob("*.py")]
    missing = set()
    for path, pattern in cited:
        text = re.sub(r"\\(.)", r"\1", path.read_text())  # Markdown escapes (`multi\_tenant`) read as the text
        for match in pattern.finditer(text):
            if not (ROOT / match.group(1)).exists():
                missing.add(f"{path.relative_to(ROOT)}: {match.group(1)}")
    assert not missing, "paths cited but not in the repository:\n" + "\n".join(sorted(missing))


def test_make_targets_named_in_the_docs_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.M))
    named = {t for path in USER_FACING for t in re.findall(r"`make (?:\w+=\S+ )*([a-z][\w-]*)", path.read_text())}
    assert named and named <= targets, (
        f"make targets named in README.md or docs/ but not in the Makefile: {named - targets}"
    )


def test_reference_lists_every_option_of_every_command():
    for command, (module_name, class_name, _, _) in CONFIG_COMMANDS.items():
        module = importlib.import_module(module_name)
        options = {row[0] for row in help_rows(getattr(module, class_name), getattr(module, "HELP_SKIP", ()))}
        page = config_reference.render_command(command)
        keys = {f"--{key}" for key in re.findall(r"^\| `([^`]+)` \|", page, flags=re.M)}
        assert keys == options, command


def test_reference_escapes_markdown_outside_code_spans():
    escaped = config_reference.escape("a|b `c|d_e` <run> *x* [y] max_steps")
    assert escaped == r"a\|b `c|d_e` &lt;run&gt; \*x\* \[y] max\_steps"
