"""Hugging Face Hub ids as `model.name`: a real hub cache layout (offline), one resolution in the launcher shared by
every process, revision pinning, and errors that tell offline / unknown alias / missing folder / hub failures apart."""

import hashlib
import json
import os
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path

import httpx2
import huggingface_hub
import pytest
from huggingface_hub import constants, scan_cache_dir
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from pydantic import ValidationError

from slipstream.config import RLConfig
from slipstream.config.eval import EvalConfig
from slipstream.config.inference import InferenceConfig
from slipstream.config.loader import load_config
from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.config.shared import ModelConfig
from slipstream.config.trainer import TrainerConfig
from slipstream.launch.models import resolve_run_model
from slipstream.launch.plan import write_configs
from slipstream.models import hub, resolve

REPO_ID = "tiny-org/tiny-qwen3"
MAIN_COMMIT = hashlib.sha1(b"main commit").hexdigest()
V2_COMMIT = hashlib.sha1(b"v2 commit").hexdigest()


def _blob_name(path: Path, data: bytes) -> str:
    """What the Hub's etag (and so the blob file name) is: sha256 for LFS files (weights), git's blob sha1 otherwise."""
    if path.suffix == ".safetensors":
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, repo_id: str, commit: str, source_dir: Path, refs: tuple[str, ...]) -> Path:
    """Lay `source_dir` out as huggingface_hub does: content in blobs/, snapshots/<commit>/ of relative links to
    them, and refs/<ref> holding the commit. Returns the snapshot folder."""
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type=constants.REPO_TYPE_MODEL)
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source_dir.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = storage / "blobs" / _blob_name(file, data)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty hub cache under a temp HF_HOME, offline. huggingface_hub reads its env at import, so its constants
    are patched as well as the environment (children would read the environment)."""
    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    for var, value in (("HF_HOME", home), ("HF_HUB_CACHE", cache), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(var, str(value))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def snapshots(hub_cache: Path, tiny_model_factory: Callable[[str], Path]) -> dict[str, Path]:
    """REPO_ID with a tiny qwen3 at `main` and a tiny llama at branch `v2`."""
    return {
        "main": add_snapshot(hub_cache, REPO_ID, MAIN_COMMIT, tiny_model_factory("qwen3"), ("main",)),
        "v2": add_snapshot(hub_cache, REPO_ID, V2_COMMIT, tiny_model_factory("llama"), ("v2",)),
    }


@pytest.fixture
def download_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The arguments of every huggingface_hub.snapshot_download call (the real one still runs)."""
    calls: list[dict] = []
    real = huggingface_hub.snapshot_download

    def counting(repo_id: str, **kwargs: object) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        return real(repo_id, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", counting)
    return calls


def _model_type(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text())["model_type"]


def test_cache_layout_is_what_huggingface_hub_reads(snapshots, hub_cache):
    (repo,) = scan_cache_dir(hub_cache).repos
    assert (repo.repo_id, repo.repo_type) == (REPO_ID, "model")
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {MAIN_COMMIT: {"main"}, V2_COMMIT: {"v2"}}
    main = huggingface_hub.snapshot_download(REPO_ID, local_files_only=True)
    assert Path(main) == snapshots["main"] and (Path(main) / "config.json").is_symlink()
    assert Path(huggingface_hub.snapshot_download(REPO_ID, revision="v2", local_files_only=True)) == snapshots["v2"]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen/Qwen3-0.6B", True),
        ("tiny-org/tiny.model_v1", True),
        ("Qwen3-0.6B", False),
        ("a/b/c", False),
        ("./models/x", False),
        ("/abs/model", False),
        ("~/model", False),
        ("org--x/name", False),
    ],
)
def test_is_hub_id(name, expected):
    assert hub.is_hub_id(name) is expected


def test_classify_model_name(tmp_path, tiny_qwen3_dir):
    imported = tmp_path / "models" / "my-import"
    imported.mkdir(parents=True)
    (imported / "config.json").write_text("{}")
    assert resolve.classify_model_name(str(tiny_qwen3_dir), tmp_path) == "folder"
    assert resolve.classify_model_name("smollm2-135m-instruct", tmp_path) == "alias"
    assert resolve.classify_model_name("my-import", tmp_path) == "imported"
    assert resolve.classify_model_name("Qwen/Qwen3-0.6B", tmp_path) == "hub_id"


def test_local_folder_wins_over_hub_id_of_same_spelling(monkeypatch, tmp_path, tiny_qwen3_dir):
    shutil.copytree(tiny_qwen3_dir, tmp_path / "tiny-org" / "tiny-qwen3")
    monkeypatch.chdir(tmp_path)
    assert resolve.classify_model_name(REPO_ID, tmp_path) == "folder"
    assert resolve.resolve_model(REPO_ID, cache_dir=tmp_path) == (tmp_path / REPO_ID).resolve()


def test_unknown_alias_missing_folder_and_bare_folder_are_told_apart(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"neither a model folder nor a known alias.*or give a Hugging Face Hub id"):
        resolve.resolve_model("no-such-alias", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"not a model folder \(.*/missing/dir does not exist\) nor a Hugging Face"):
        resolve.resolve_model("./missing/dir", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"'a/b/c' is not a model folder"):
        resolve.resolve_model("a/b/c", cache_dir=tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"'org/name' is a directory without config.json"):
        resolve.resolve_model("org/name", cache_dir=tmp_path)


def _rl_config(output_dir: Path, **model: str) -> RLConfig:
    return RLConfig.model_validate(
        {
            "max_steps": 1,
            "output_dir": str(output_dir),
            "model": model,
            "orchestrator": {"batch_size": 8, "group_size": 4},
            "trainer": {"optim": {"lr": 2e-6}},
        }
    )


def _served_argv(monkeypatch: pytest.MonkeyPatch, config: InferenceConfig) -> list[str]:
    """The vLLM command line run_inference would exec for `config`."""
    from slipstream.inference import server
    from slipstream.inference.admin_token import TOKEN_ENV

    class Execed(Exception):
        pass

    def fake_execve(path: str, argv: list[str], env: dict[str, str]) -> None:
        raise Execed(argv)

    monkeypatch.setenv(TOKEN_ENV, "test-token")
    monkeypatch.setattr(server.os, "execve", fake_execve)
    with pytest.raises(Execed) as info:
        server.run_inference(config)
    return info.value.args[0]


def test_hub_id_is_resolved_once_for_every_process(monkeypatch, tmp_path, snapshots, download_calls):
    from slipstream.eval.run import resolve_eval_model
    from slipstream.parallel.dist import RankInfo
    from slipstream.trainer.setup import resolve_model_once

    config = resolve_run_model(_rl_config(tmp_path / "run", name=REPO_ID))
    assert len(download_calls) == 1
    assert config.model == ModelConfig(name=REPO_ID, path=snapshots["main"])
    paths = write_configs(config)
    assert RLConfig.model_validate(tomllib.loads(paths["rl"].read_text())) == config
    sections = {
        name: load_config(cls, ["-c", str(paths[name])])
        for name, cls in (
            ("inference", InferenceConfig),
            ("orchestrator", OrchestratorConfig),
            ("trainer", TrainerConfig),
        )
    }
    assert {name: (c.model.name, c.model.path) for name, c in sections.items()} == {
        name: (REPO_ID, snapshots["main"]) for name in sections
    }
    argv = _served_argv(monkeypatch, sections["inference"])
    assert argv[argv.index("--model") + 1] == str(snapshots["main"])
    assert argv[argv.index("--served-model-name") + 1] == sections["orchestrator"].model.name == REPO_ID
    assert (
        resolve_model_once(sections["trainer"].model, RankInfo(rank=0, world_size=1, local_rank=0)) == snapshots["main"]
    )
    evaluation = EvalConfig.model_validate({"model": sections["inference"].model.model_dump(), "inference": {}})
    assert resolve_eval_model(evaluation) == snapshots["main"]
    assert resolve_run_model(config) is config  # already resolved (e.g. a resumed run's rl.toml): nothing to do
    assert len(download_calls) == 1


def test_unresolved_processes_resolve_for_themselves(snapshots, download_calls):
    from slipstream.parallel.dist import RankInfo
    from slipstream.trainer.setup import resolve_model_once

    model = ModelConfig(name=REPO_ID)
    assert resolve_model_once(model, RankInfo(rank=0, world_size=1, local_rank=0)) == snapshots["main"]
    assert len(download_calls) == 1


def test_revision_pins_a_branch_or_commit(tmp_path, snapshots, download_calls):
    assert _model_type(resolve.resolve_model(REPO_ID)) == "qwen3"
    assert resolve.resolve_model(REPO_ID, revision="v2") == snapshots["v2"]
    assert resolve.resolve_model(REPO_ID, revision=V2_COMMIT) == snapshots["v2"]
    assert _model_type(snapshots["v2"]) == "llama"
    config = resolve_run_model(_rl_config(tmp_path / "run", name=REPO_ID, revision="v2"))
    assert (config.trainer.model.path, config.trainer.model.revision) == (snapshots["v2"], "v2")
    assert [call.get("revision") for call in download_calls] == [None, "v2", V2_COMMIT, "v2"]


def test_not_in_cache_while_offline_says_what_to_run(snapshots):
    with pytest.raises(ValueError) as info:
        resolve.resolve_model("other-org/absent")
    message = str(info.value)
    assert "tried Hugging Face Hub model 'other-org/absent'" in message
    assert "not in the Hugging Face cache" in message and "HF_HUB_OFFLINE is set" in message
    assert "`hf download other-org/absent`" in message and "unset HF_HUB_OFFLINE" in message
    with pytest.raises(ValueError, match=r"at revision 'v3'.*`hf download tiny-org/tiny-qwen3 --revision v3`"):
        resolve.resolve_model(REPO_ID, revision="v3")


def test_local_files_only_without_offline_env(monkeypatch, snapshots):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert resolve.resolve_model(REPO_ID, local_files_only=True) == snapshots["main"]
    with pytest.raises(ValueError, match=r"downloads are off \(local_files_only is set\)"):
        resolve.resolve_model("other-org/absent", local_files_only=True)


def test_hub_repo_without_config_json(hub_cache, tmp_path):
    source = tmp_path / "gguf_only"
    source.mkdir()
    (source / "model.Q4_0.gguf").write_bytes(b"GGUF")
    add_snapshot(hub_cache, "gguf-org/only-gguf", MAIN_COMMIT, source, ("main",))
    with pytest.raises(ValueError, match=r"'gguf-org/only-gguf' has no config.json .* not a transformers model repo"):
        resolve.resolve_model("gguf-org/only-gguf")


def _http_error(cls: type[HfHubHTTPError], status: int) -> HfHubHTTPError:
    request = httpx2.Request("GET", f"https://huggingface.co/api/models/{REPO_ID}")
    return cls(f"HTTP {status}", response=httpx2.Response(status, request=request))


@pytest.mark.parametrize(
    ("error", "offline", "expected"),
    [
        (_http_error(RepositoryNotFoundError, 404), False, r"no such repo, or a private one.*set HF_TOKEN"),
        (_http_error(GatedRepoError, 403), False, r"gated.*accept its terms at https://huggingface.co/tiny-org"),
        (_http_error(RevisionNotFoundError, 404), False, r"has no revision 'v9'; set model.revision"),
        (_http_error(HfHubHTTPError, 401), False, r"refused access \(HTTP 401\); set HF_TOKEN"),
        (_http_error(HfHubHTTPError, 503), False, r"answered HTTP 503.*retry later"),
        (LocalEntryNotFoundError("cannot find"), False, r"could not reach the Hub at https://huggingface.co"),
        (LocalEntryNotFoundError("cannot find"), True, r"downloads are off \(HF_HUB_OFFLINE is set\)"),
    ],
)
def test_hub_failures_become_clear_errors(monkeypatch, hub_cache, error, offline, expected):
    def failing(repo_id: str, **kwargs: object) -> str:
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    with pytest.raises(ValueError, match=expected) as info:
        hub.resolve_hub_id(REPO_ID, revision="v9")
    assert info.value.__cause__ is error


def test_revision_only_for_hub_ids(tiny_qwen3_dir):
    with pytest.raises(ValidationError, match=r"model.revision only applies to Hugging Face Hub ids"):
        ModelConfig(name="smollm2-135m-instruct", revision="v2")
    with pytest.raises(ValueError, match=r"is a local model folder; unset model.revision"):
        resolve.resolve_model(str(tiny_qwen3_dir), revision="v2")


def test_recorded_path_must_be_a_model_folder(tmp_path):
    with pytest.raises(ValueError, match=r"model.path .* is not a model folder on this machine.*unset model.path"):
        resolve.resolve_model_config(ModelConfig(name=REPO_ID, path=tmp_path))
