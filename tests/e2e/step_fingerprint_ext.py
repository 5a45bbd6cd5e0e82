"""Engine-step fingerprints for tests: vLLM mixes this class into each worker (`--worker-extension-cls`), and once a test
calls `install_fingerprints` (POST /collective_rpc), every engine step records the fingerprint of the model's parameters
(the float64 sum of every parameter, cheap on a tiny model) when it begins (execute_model) and when it ends (its
sample_tokens, or execute_model when that returned the output itself). A step whose two fingerprints differ saw its
weights change in its middle: a weight update that mixed versions inside one engine step."""

import torch


def _fingerprint(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(sum(p.detach().to(torch.float64).sum() for p in model.parameters()))


class StepFingerprints:
    """The worker extension named on the command line."""

    def install_fingerprints(self) -> float:
        """Start recording (once); returns the model's fingerprint now."""
        model = self.model_runner.get_model()
        if getattr(self, "_fingerprint_steps", None) is None:
            self._fingerprint_steps: list[list[float]] = []
            self._fingerprint_begin: float | None = None
            execute, sample = self.execute_model, self.sample_tokens

            def execute_model(*args, **kwargs):
                begin = _fingerprint(model)
                output = execute(*args, **kwargs)
                if output is None:  # sampling follows in sample_tokens, the same step
                    self._fingerprint_begin = begin
                else:
                    self._fingerprint_steps.append([begin, _fingerprint(model)])
                return output

            def sample_tokens(*args, **kwargs):
                output = sample(*args, **kwargs)
                self._fingerprint_steps.append([self._fingerprint_begin, _fingerprint(model)])
                return output

            self.execute_model, self.sample_tokens = execute_model, sample_tokens
        return _fingerprint(model)

    def take_fingerprints(self) -> list[list[float]]:
        """The [begin, end] fingerprints of every engine step since the last call."""
        steps, self._fingerprint_steps = self._fingerprint_steps, []
        return steps
