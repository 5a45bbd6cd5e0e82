"""Where models live on disk: the slipstream cache (`<cache>/models/<name>`, where imported models go) and the checks
and finishing touches of a model folder written there.
"""

import json
import os
from pathlib import Path


def say(msg: str) -> None:
    """Print a progress line of model acquisition (imports, downloads)."""
    print(f"[slipstream.models] {msg}", flush=True)


def default_cache_dir() -> Path:
    """`$SLIPSTREAM_CACHE_DIR`, or `~/.cache/slipstream`."""
    env = os.environ.get("SLIPSTREAM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "slipstream"


def models_dir(cache_dir: Path | None) -> Path:
    """The folder imported models live in: `<cache>/models`."""
    return (Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / "models").resolve()


def is_model_dir(path: Path) -> bool:
    """True if `path` is a folder holding a model (a config.json)."""
    return path.is_dir() and (path / "config.json").is_file()


def check_replaceable(out_dir: Path) -> None:
    """Refuse to replace an existing non-empty folder that is not a model folder (the atomic commit deletes it)."""
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "config.json").is_file():
        raise ValueError(f"refusing to replace {out_dir}: it exists and is not a model folder (no config.json)")


def finalize_model_dir(folder: Path, model_max_length: int | None) -> None:
    """Make a freshly saved folder portable: readable permissions and a tokenizer class older transformers know."""
    folder = Path(folder)
    config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    # transformers 5 writes its internal `TokenizersBackend`; `PreTrainedTokenizerFast` loads it in 4.x and 5.x.
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if model_max_length is not None:
        tok_config["model_max_length"] = model_max_length
    for key in ("is_local", "local_files_only"):
        tok_config.pop(key, None)
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    # mkdtemp makes 0700 dirs and some writers make 0600 files; a shared cache must be readable by others.
    folder.chmod(0o755)
    for p in folder.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
