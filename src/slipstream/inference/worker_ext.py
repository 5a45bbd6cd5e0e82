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

        self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)  # type: ignore[attr-defined]
        return {"path": str(folder), "num_tensors": len(names), "seconds": round(time.perf_counter() - start, 3)}
