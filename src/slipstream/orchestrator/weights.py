"""Weight relay: keeps the served policy fresh enough for each step, loads published weights, verifies every load.

Verification scores the trainer's probe tokens on inference and compares log-probs, so a failed or partial
weight update (a frozen or corrupted policy) is caught instead of training silently.
"""

import asyncio
import json
import time
from pathlib import Path

import numpy as np

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.orchestrator.client import InferenceClient
from slipstream.orchestrator.rollouts import cache_salt
from slipstream.transport.weights import PROBE, latest_ready_step, read_probe, wait_for_weights, weights_dir
from slipstream.utils.fs import append_line

WEIGHT_CHECKS_FILE = "weight_checks.jsonl"


class WeightSyncError(RuntimeError):
    """Inference log-probs disagree with the trainer's after a weight update."""


class WeightRelay:
    """Tracks the policy version inference serves (0 = initial weights) and updates it between batches."""

    def __init__(self, client: InferenceClient, config: OrchestratorConfig, served_version: int = 0) -> None:
        self.client = client
        self.config = config
        self.output_dir = Path(config.output_dir).resolve()
        self.served_version = served_version

    async def maybe_update_weights(self, step: int) -> dict[str, float]:
        """Before generating batch `step`: load the newest ready weights, waiting if the served ones are too old.

        Returns metrics for the batch: timing of the wait and of the update, and the weight check when one ran.
        """
        min_version = step - 1 - self.config.max_async_level
        newest = latest_ready_step(self.output_dir)
        metrics = {"timing/wait_weights_s": 0.0, "timing/weight_update_s": 0.0}
        if self.served_version < min_version and (newest is None or newest < min_version):
            start = time.perf_counter()
            newest = await asyncio.to_thread(
                wait_for_weights, self.output_dir, min_version, self.config.weights_timeout_s
            )
            metrics["timing/wait_weights_s"] = time.perf_counter() - start
        if newest is None or newest <= self.served_version:
            return metrics
        if newest >= step:
            raise RuntimeError(
                f"{weights_dir(self.output_dir, newest)} exists before batch {step} was generated: "
                f"{self.output_dir} holds weights of another run; use a fresh output_dir"
            )
        start = time.perf_counter()
        metrics.update(await self.load(newest))
        metrics["timing/weight_update_s"] = time.perf_counter() - start
        return metrics

    async def load_final(self, final_step: int) -> None:
        """After the last batch: wait for the trainer's final weights and serve (and verify) them, so the run
        ends with inference serving the trained policy."""
        if self.served_version < final_step:
            await asyncio.to_thread(wait_for_weights, self.output_dir, final_step, self.config.weights_timeout_s)
            await self.load(final_step)

    async def load(self, version: int) -> dict[str, float]:
        """Load `weights/step_<version>` on inference, then verify it if `weight_check.enabled`."""
        await self.client.load_weights(str(weights_dir(self.output_dir, version)))
        self.served_version = version
        if not self.config.weight_check.enabled:
            return {}
        check = await verify_weights(self.client, self.output_dir, version, self.config.weight_check_tolerance)
        if not check["passed"]:
            message = (
                f"weight update to step {version} did not take effect on inference (policy frozen or corrupted): "
                f"probe log-probs differ by max {check['max_abs_diff']:.3g} (mean {check['mean_abs_diff']:.3g}) "
                f"over {check['num_tokens']} tokens, allowed {self.config.weight_check_tolerance:.3g} "
                f"(orchestrator.weight_check.max_abs_diff); details in {self.output_dir / WEIGHT_CHECKS_FILE}"
            )
            if self.config.weight_check.stop_on_failure:
                raise WeightSyncError(message)
            print(f"[orchestrator] WARNING: {message}", flush=True)
        return {"weight_sync/max_abs_diff": check["max_abs_diff"]}


async def verify_weights(client: InferenceClient, output_dir: Path, step: int, max_abs_diff: float) -> dict:
    """Score the trainer's probe of `step` on inference, append the comparison to weight_checks.jsonl, return it."""
    probe_path = weights_dir(output_dir, step) / PROBE
    if not probe_path.exists():
        raise FileNotFoundError(
            f"{probe_path} is missing, so the weight update cannot be verified; "
            "the trainer must publish a probe, or set orchestrator.weight_check.enabled = false"
        )
    probe = read_probe(output_dir, step)
    token_ids, expected = list(probe["token_ids"]), [float(x) for x in probe["logprobs"]]
    if len(expected) != len(token_ids) - 1 or not expected:
        raise ValueError(f"{probe_path}: needs len(logprobs) == len(token_ids) - 1 > 0")
    got = await client.score_tokens(token_ids, cache_salt(step))
    diff = np.abs(np.asarray(got) - np.asarray(expected))
    check = {
        "step": step,
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "num_tokens": len(expected),
        "passed": bool(diff.max() <= max_abs_diff),
        "inference_logprobs": got,
    }
    append_line(Path(output_dir) / WEIGHT_CHECKS_FILE, json.dumps(check))
    return check
