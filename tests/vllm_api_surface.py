"""What Slipstream's vLLM engine needs from a vLLM release, read from its source without importing it (so a release
for another platform or Python can be checked from its wheel): the engine base class's abstract methods and
constructor, the engine factory's registration, and the layer-wise reload Slipstream drives.

    python -m tests.vllm_api_surface DIR...     # DIR: a folder holding an unpacked wheel's `vllm/` package

tests/unit/test_vllm_support.py runs the same check on the installed vLLM.
"""

import ast
import sys
from pathlib import Path

ENGINE_METHODS = {
    "init_transfer_engine",
    "start_weight_update",
    "update_weights",
    "receive_weights",
    "finish_weight_update",
    "shutdown",
    "trainer_send_weights",
}
"""Every method Slipstream's engine implements: a release may declare abstract only these."""

RELOAD_NAMES = {"initialize_layerwise_reload", "finalize_layerwise_reload"}


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _decorators(fn: ast.FunctionDef) -> set[str]:
    return {d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "") for d in fn.decorator_list}


def problems(root: Path) -> list[str]:
    """What in the release under `root` (the folder holding `vllm/`) Slipstream's engine does not fit; [] if all."""
    vllm, found = root / "vllm", []
    base = ast.parse((vllm / "distributed/weight_transfer/base.py").read_text())
    engine = _class(base, "WeightTransferEngine")
    if engine is None:
        return ["no WeightTransferEngine class in distributed/weight_transfer/base.py"]
    methods = {n.name: n for n in engine.body if isinstance(n, ast.FunctionDef)}
    abstract = {name for name, fn in methods.items() if "abstractmethod" in _decorators(fn)}
    if abstract - ENGINE_METHODS:
        found.append(f"abstract methods Slipstream's engine lacks: {sorted(abstract - ENGINE_METHODS)}")
    init = methods.get("__init__")
    args = [a.arg for a in init.args.args] if init else []
    if args != ["self", "config", "vllm_config", "device", "model"]:
        found.append(f"WeightTransferEngine.__init__ takes {args}")
    if "parse_update_info" not in methods:
        found.append("WeightTransferEngine.parse_update_info is gone")
    factory = _class(
        ast.parse((vllm / "distributed/weight_transfer/factory.py").read_text()), "WeightTransferEngineFactory"
    )
    source = ast.unparse(factory) if factory else ""
    if "def register_engine" not in source or "_registry" not in source:
        found.append("WeightTransferEngineFactory.register_engine / _registry changed")
    reload = vllm / "model_executor/model_loader/reload"
    exported = (reload / "__init__.py").read_text()
    found += [f"reload.{name} is not exported" for name in sorted(RELOAD_NAMES) if name not in exported]
    layerwise = (reload / "layerwise.py").read_text()
    if "LAYERWISE_INFO" not in layerwise or "loaded_weights.append((" not in layerwise:
        found.append("layerwise.LAYERWISE_INFO / loaded_weights (name, bound arguments) changed")
    return found


def main(dirs: list[str]) -> int:
    failed = 0
    for d in dirs:
        issues = problems(Path(d))
        failed += bool(issues)
        print(f"{d}: {'ok' if not issues else '; '.join(issues)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
