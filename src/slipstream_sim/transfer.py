"""The simulator's side of vLLM's weight-transfer API (/init_weight_transfer_engine, /start_weight_update,
/update_weights, /finish_weight_update, /get_world_size), with vLLM's semantics: a version arrives either from a
published folder or by broadcast from the trainer, and is served from /finish_weight_update on. Broadcast weights are
received by the very code Slipstream's vLLM engine runs (weights/receive/receiver.py), on `SimConfig.transfer_device`
(torch is imported only then), so GPU tests and benchmarks exercise the real transfer without vLLM."""

import asyncio
import json
from pathlib import Path
from typing import Any

from slipstream_sim.config import SimConfig
from slipstream_sim.engine import SimEngine, SimRequestError


class SimWeightTransfer:
    """One simulated worker (receiver rank 1 of the trainer's group)."""

    def __init__(self, engine: SimEngine, config: SimConfig) -> None:
        self.engine, self.config = engine, config
        self.receiver = None
        self.active = False
        self.received: list[dict] = []
        """Statistics of every version received (step, tensors, bytes, seconds, source)."""
        self.num_sessions = 0
        self.weight_version = "default"
        """vLLM's /weight_info: "default" until the first finished update, then that update's weight_version."""

    async def init(self, init_info: dict[str, Any]) -> None:
        from slipstream.weights.receive.receiver import WeightReceiver
        from slipstream.weights.wire.collective import GroupInit

        try:
            init = GroupInit(**init_info)
        except (TypeError, ValueError) as e:
            raise SimRequestError(f"invalid init_info: {e}") from e
        if self.receiver is None:
            import torch

            self.receiver = WeightReceiver(torch.device(self.config.transfer_device))
        await asyncio.to_thread(self.receiver.join, init)
        self.num_sessions += 1

    def start(self) -> None:
        if self.active:
            raise SimRequestError("start_weight_update called while a weight update is already active")
        if self.config.require_pause_for_load and not self.engine.paused:
            raise SimRequestError("weight update while generation is running; call POST /pause first")
        if "weights" in self.engine.asleep:
            self.engine.check_awake("weight update")
        self.active = True

    async def update(self, update_info: dict[str, Any]) -> None:
        if not self.active:
            raise SimRequestError("start_weight_update must be called before update_weights")
        step = update_info.get("step") if isinstance(update_info, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise SimRequestError(
                f"update_info must be an object with an integer 'step' >= 0 (got {update_info!r:.200})"
            )
        if update_info.get("stage"):
            raise SimRequestError(
                "the simulated inference server does not stage versions in the background (weights.no_stall needs "
                "vLLM with Slipstream's engine): set weights.no_stall = false"
            )
        if "path" in update_info:
            if not isinstance(update_info["path"], str) or not update_info["path"]:
                raise SimRequestError(f"update_info 'path' must be a folder path, got {update_info['path']!r:.200}")
            folder = Path(update_info["path"])
            if self.config.require_ready_marker and not (folder / "READY").exists():
                raise SimRequestError(f"{folder} is not a complete published weights folder (no READY marker)")
            self.received.append({"step": int(update_info["step"]), "source": str(folder)})
            return
        if "model" in update_info:  # the model's own checkpoint (version 0), as Slipstream's engine takes it
            if step != 0 or not isinstance(update_info["model"], str) or not update_info["model"]:
                raise SimRequestError(f"update_info 'model' needs step 0 and a folder path (got {update_info!r:.200})")
            self.received.append({"step": 0, "source": update_info["model"]})
            return
        if self.receiver is None or self.receiver.group is None:
            raise SimRequestError("weights arrive by broadcast but no group was joined: /init_weight_transfer_engine")
        try:
            stats = await asyncio.to_thread(self.receiver.receive, update_info, _discard)
        except ValueError as e:  # a malformed update_info or manifest (checked before anything is received)
            raise SimRequestError(str(e)) from e
        self.received.append(stats.to_dict())
        print(f"[sim] received {json.dumps(stats.to_dict())}", flush=True)

    def finish(self, weight_version: str | None) -> None:
        if not self.active:
            raise SimRequestError("finish_weight_update called without a matching start_weight_update")
        self.active = False
        if weight_version is None or not str(weight_version).isdigit():
            raise SimRequestError(f"the simulator needs weight_version = the policy version (got {weight_version!r})")
        source = self.received[-1].get("source", "") if self.received else ""
        self.engine.serve_version(int(weight_version), str(source))
        self.weight_version = str(weight_version)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.shutdown()


def _discard(pairs: list) -> None:
    """The simulator has no model to load into: received tensors are counted (by the receiver) and dropped."""
