"""The weight path's import layers (slipstream/weights/__init__.py): the receiving side, which vLLM's workers import,
never loads the sending side, the trainer, parallel/ or models/ (so no FSDP code of Slipstream's), and wire/ imports
neither side. Checked statically, over every import statement reachable from each module (a lazy import inside a
function included), and by importing each receive-side module in a fresh interpreter."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
WEIGHTS = SRC / "slipstream" / "weights"
FSDP = "torch.distributed.fsdp"
NEVER = ("slipstream.weights.send", "slipstream.trainer", "slipstream.parallel", "slipstream.models", FSDP)
"""What the receiving side and wire/ never import."""
FORBIDDEN = {"receive": NEVER, "wire": (*NEVER, "slipstream.weights.receive")}


def module_names(side: str) -> list[str]:
    folder = WEIGHTS / side
    names = [f"slipstream.weights.{side}.{p.stem}" for p in sorted(folder.glob("*.py")) if p.stem != "__init__"]
    return [f"slipstream.weights.{side}", *names]


def source(module: str) -> Path | None:
    """The file of one of our modules (None: not ours, or not a module but a name imported from one)."""
    path = SRC.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def imports(module: str, path: Path) -> list[str]:
    """Every module an import statement of `path` names, wherever the statement is (relative ones resolved; for
    `from a import b`, both `a` and `a.b`: b may be a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            found += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return found


def reachable(root: str) -> dict[str, list[str]]:
    """Every module an import statement reachable from `root` names (through our modules and their parent packages,
    whether the import runs at import time or later), with the chain of our modules that leads to it."""
    chains: dict[str, list[str]] = {root: [root]}
    todo = [root]
    while todo:
        module = todo.pop()
        path = source(module)
        if path is None:
            continue
        parts = module.split(".")
        for name in [".".join(parts[:i]) for i in range(1, len(parts))] + imports(module, path):
            if name not in chains:
                chains[name] = [*chains[module], name]
                if name.startswith("slipstream"):
                    todo.append(name)
    return chains


def banned(names, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == f or n.startswith(f"{f}.") for f in forbidden))


@pytest.mark.parametrize("side", sorted(FORBIDDEN))
def test_no_import_statement_reaches_the_sending_side(side):
    for module in module_names(side):
        chains = reachable(module)
        bad = banned(chains, FORBIDDEN[side])
        nearest = min(bad, key=lambda name: len(chains[name]), default=None)
        assert nearest is None, f"{module} imports {nearest}: " + " -> ".join(chains[nearest])


# Imports argv[1] after the modules argv[2:] (vLLM's, which load torch's FSDP themselves) and prints what was loaded.
PROBE = """
import importlib, json, sys
for name in sys.argv[2:]:
    importlib.import_module(name)
before = set(sys.modules)
importlib.import_module(sys.argv[1])
print(json.dumps({"all": sorted(sys.modules), "new": sorted(set(sys.modules) - before)}))
"""


@pytest.mark.parametrize("module", module_names("receive"))
def test_importing_the_receiving_side_loads_no_trainer_code(module):
    """In a fresh interpreter: none of our forbidden modules is loaded, and no FSDP module beyond vLLM's own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, module, *vllm_imports(module)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = tuple(f for f in NEVER if f.startswith("slipstream"))
    assert not banned(loaded["all"], ours), f"importing {module} loads {banned(loaded['all'], ours)}"
    assert not banned(loaded["new"], (FSDP,)), f"importing {module} loads {banned(loaded['new'], (FSDP,))[:5]}"


def vllm_imports(module: str) -> list[str]:
    """The vLLM modules `module` imports at its top level."""
    names: list[str] = []
    for node in ast.parse(source(module).read_text()).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return [name for name in names if name.split(".")[0] == "vllm"]
