"""A deliberately broken vLLM worker extension for tests: it reports a successful weight load but loads nothing
(the "frozen policy" failure users hit when a weight sync silently fails)."""

from slipstream.inference.worker_ext import WeightLoaderExtension


class FrozenWeightLoader(WeightLoaderExtension):
    def slipstream_load_weights(self, path: str) -> dict:
        return {"path": path, "num_tensors": 0, "seconds": 0.0}
