"""vLLM worker extension: load a published `weights/step_N` folder in place (called through /collective_rpc).

vLLM mixes this class into its worker (`--worker-extension-cls`), so `self` is the vLLM worker.
"""

import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


class WeightLoaderExtension:
    """Methods callable on every vLLM worker via POST /collective_rpc {"method": ..., "args": [...]}."""

    def slipstream_load_weights(self, path: str) -> dict:
        """Reload all model weights in place from the safetensors files of `path`."""
        folder = Path(path)
        if not (folder / "READY").exists():
            raise FileNotFoundError(f"{folder} is not a complete published weights folder (no READY marker)")
        start = time.perf_counter()
        names: list[str] = []

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in iter_safetensors(folder):
                names.append(name)
                yield name, tensor

        model = self.get_model()  # type: ignore[attr-defined]
        tied = shared_parameter_groups(model)
        self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        refreshed = refresh_tied_modules(model, tied, set(names))
        return {
            "path": str(folder),
            "num_tensors": len(names),
            "refreshed": refreshed,
            "seconds": round(time.perf_counter() - start, 3),
        }


def shared_parameter_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of parameters that share storage (tied embeddings), grouped."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(param.data_ptr(), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def refresh_tied_modules(model: torch.nn.Module, groups: list[list[str]], loaded: set[str]) -> list[str]:
    """A tied parameter (lm_head = embed_tokens) arrives once in the checkpoint, so vLLM's layer-wise reload
    never re-processes the module that uses the other name; on the CPU build that module keeps a packed copy
    of the OLD weight for its GEMM. Re-run its post-load processing. Returns the refreshed module names."""
    params = dict(model.named_parameters(remove_duplicate=False))
    refreshed = []
    for group in groups:
        if len({params[n].data_ptr() for n in group}) != 1:
            raise RuntimeError(f"tied parameters {group} no longer share storage after the weight reload")
        for name in group:
            if name in loaded:
                continue
            module = model.get_submodule(name.rpartition(".")[0])
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                refreshed.append(name.rpartition(".")[0])
    return refreshed
