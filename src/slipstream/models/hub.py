"""Hugging Face Hub ids (`org/name`) as model names: downloaded by huggingface_hub into its own cache (HF_HUB_CACHE)
and read from there; hub failures become errors that say what was tried and what to do.
"""

from pathlib import Path

from slipstream.models.cache import is_model_dir, say

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


def resolve_hub_id(repo_id: str, revision: str | None = None, local_files_only: bool = False) -> Path:
    """The local snapshot folder of Hugging Face Hub model `repo_id` at `revision` (None: main), downloaded into the
    Hugging Face cache unless it is there already. Honours HF_HUB_OFFLINE, HF_HUB_CACHE/HF_HOME and HF_TOKEN; hub
    errors become ValueErrors saying what was tried and what to do."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    target = _hub_target(repo_id, revision)
    say(f"resolving Hugging Face Hub model {target} (cache {constants.HF_HUB_CACHE})")
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
    if not is_model_dir(folder):
        raise ValueError(
            f"Hugging Face Hub model {target} has no config.json (snapshot {folder}): it is not a transformers model "
            f"repo (a GGUF-only repo? import its .gguf with `slipstream model import <file.gguf>`)"
        )
    say(f"{target} -> {folder}")
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
