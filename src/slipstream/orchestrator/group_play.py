"""Playing one rollout group of the pipeline (pipeline.py), each token stamped with its policy version.

Single-turn environments: one request for `group_size` completions per group. Multi-turn (tool-using)
environments: `group_size` concurrent rollouts through `run_rollout`, one request per model turn (rollout/turns.py);
a rollout that fails inside its environment is counted and left out, and a group with fewer than two survivors is
dropped and counted.
"""

import asyncio
import itertools
from collections.abc import Awaitable, Callable

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.envs.base import AnyEnvironment, is_multi_turn
from slipstream.envs.rollout import ModelFn
from slipstream.orchestrator.client import InferenceClient
from slipstream.orchestrator.ledger import Group
from slipstream.orchestrator.multiturn import RolloutFailures, play_group, reward_or_missing
from slipstream.orchestrator.sampler import request_seed
from slipstream.orchestrator.weights import WeightRelay
from slipstream.rollout.client import InferenceError
from slipstream.rollout.record import Rollout, sampling_params
from slipstream.rollout.streaming import StreamedChat
from slipstream.rollout.turns import TurnProgress, TurnRequester, sample_completions


class GroupPlayer:
    """Generates the rollouts of one group at a time: `fresh_progress` before each (re)start, then `play`."""

    def __init__(
        self,
        client: InferenceClient,
        env: AnyEnvironment,
        relay: WeightRelay,
        config: OrchestratorConfig,
        ready: Callable[[], Awaitable[int]],
    ) -> None:
        """`ready`: waits until a new model turn may go out and returns the served version to stamp it with."""
        self.client, self.env, self.relay, self.config = client, env, relay, config
        self.group_size = config.group_size
        self.multi_turn = is_multi_turn(env)
        self.failures = RolloutFailures(config.group_size, config.batch_size // config.group_size)
        self.turns = TurnRequester(
            client,
            sampling_params(config.sampling),
            config.request_timeout_s,
            ready=ready,
            version_now=lambda: relay.served_version,
        )

    def fresh_progress(self, group: Group) -> None:
        if self.multi_turn:
            group.stream = TurnProgress()
        elif not self.config.router_replay:  # router replay: whole replies (see slipstream.rollout.replies)
            where = f"{self.client.base_url}/v1/chat/completions (stream, task {group.task.id})"
            group.stream = StreamedChat(self.group_size, lambda: self.relay.served_version, where)

    async def play(self, group: Group) -> list[Rollout] | None:
        """The group's rollouts; None when too few survived (counted in `failures`)."""
        play = self._play_multi_turn if self.multi_turn else self._play_single_turn
        return await play(group)

    async def _play_single_turn(self, group: Group) -> list[Rollout] | None:
        """One request for the group's completions, each scored by the environment; None when too few got a
        reward."""
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                rollouts = await self._generate(group)
        except TimeoutError:
            timeout = self.config.request_timeout_s
            raise InferenceError(
                f"task {group.task.id}: no complete reply within request_timeout_s = {timeout}s"
            ) from None
        rewards = await asyncio.gather(*(reward_or_missing(self.env, group.task, r.completion_text) for r in rollouts))
        for rollout in rollouts:
            rollout.group_index = group.index
        return self.failures.scored(group.task, rollouts, rewards)

    async def _play_multi_turn(self, group: Group) -> list[Rollout] | None:
        """The group's rollouts through the environment; None when fewer than two survived."""
        progress = group.stream
        assert isinstance(progress, TurnProgress)  # set by fresh_progress
        samples = itertools.count()  # play_group builds the rollouts' model functions in sample order
        base = self._request_seed(group)

        def model_fn() -> ModelFn:
            sample = next(samples)
            turn_seed = None if base is None else (lambda turn: base + sample + turn * self.group_size)
            return self.turns.model_fn(group.task, progress, turn_seed)

        outcomes = await play_group(self.env, group.task, self.group_size, model_fn, self.config.rollout_timeout_s)
        return self.failures.survivors(group.task, outcomes, group.index, group.request_version)

    async def _generate(self, group: Group) -> list[Rollout]:
        """Send the group's request and parse its completions, each token with its policy version."""
        sampling = sampling_params(self.config.sampling)
        if (seed := self._request_seed(group)) is not None:
            sampling["seed"] = seed  # vLLM seeds sample i with seed + i
        chat = group.stream
        assert chat is None or isinstance(chat, StreamedChat)  # set by fresh_progress
        return await sample_completions(
            self.client,
            group.task,
            sampling,
            self.group_size,
            group.request_version,
            chat,
            require_routed_experts=self.config.router_replay,
        )

    def _request_seed(self, group: Group) -> int | None:
        """Base seed of the group's requests (None: unseeded), from the run's seed and the task's stream position."""
        return request_seed(self.config.seed, group.task_index) if self.config.seed_requests else None
