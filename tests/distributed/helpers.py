"""Run a function on N CPU ranks (gloo, torch.multiprocessing spawn) as torchrun would, and build test batches."""

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from slipstream.transport.rollouts import MicroBatch, Routing, TrainingBatch, write_batch
from slipstream.utils.net import free_port


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    fn(*args)
    # The work is done and checked (rank 0 saved its results). Leave without the interpreter's shutdown: FSDP keeps
    # the gloo group alive past destroy_process_group, and its worker thread letting go of the last collective's
    # tensors takes the GIL; during shutdown that aborts the rank ("terminate called without an active exception";
    # tests/distributed/gloo_exit_race.py forces it). Errors in fn() still propagate above and fail the test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn(*args)` in `world_size` fresh processes with torchrun's environment variables; raise if one fails.
    `fn` must be importable (defined at module level)."""
    mp.spawn(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)


Job = tuple[int, Callable[..., Any], tuple]
"""(world size, fn, args) of one multi-rank run: `run_ranks(world_size, fn, *args)`."""


def _run_jobs(jobs: list[tuple[str, Callable[..., Any], tuple]], done_dir: Path) -> None:
    """In every rank: run each job in turn in one process group (setup_trainer joins it rather than creating its
    own); rank 0 marks `done_dir/<name>` once every rank has finished the job."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for name, fn, args in jobs:
        fn(*args)
        dist.barrier()
        if dist.get_rank() == 0:
            (done_dir / name).touch()
    dist.destroy_process_group()


class BatchedRanks:
    """The multi-rank runs of a module's parity cases with one spawn per world size instead of one per case: starting
    2-4 processes that import torch and Slipstream takes longer than training a tiny model for a few steps. (The
    single-process references already run case after case in the pytest process; each run seeds and builds all it
    uses.) `make_job(name, folder)` writes a case's inputs under `folder` and returns its Job; the jobs of every case
    this session selected run on the first `run(name)`. A case whose batch failed before it finished runs alone in a
    fresh folder, as it did before batching, so a failure is reported by its own test with its own traceback."""

    def __init__(self, root: Path, names: list[str], make_job: Callable[[str, Path], Job]) -> None:
        self.root, self.names, self.make_job = root, names, make_job
        self.folders: dict[str, Path] = {}
        self.started = False

    def run(self, name: str) -> Path:
        """Run (or have run) the case's job; returns the folder holding its inputs and outputs."""
        done = self.root / "done"
        if not self.started:
            self.started = True
            done.mkdir(parents=True)
            by_size: dict[int, list[tuple[str, Callable[..., Any], tuple]]] = {}
            for n in self.names:
                self.folders[n] = self.root / "batched" / n
                self.folders[n].mkdir(parents=True)
                world_size, fn, args = self.make_job(n, self.folders[n])
                by_size.setdefault(world_size, []).append((n, fn, args))
            for world_size, jobs in by_size.items():
                try:
                    run_ranks(world_size, _run_jobs, jobs, done)
                except Exception as e:  # mp.ProcessRaisedException/ProcessExitedException: unfinished jobs rerun alone
                    print(f"batched {world_size}-rank jobs stopped ({type(e).__name__}); unfinished ones run alone")
        if not (done / name).exists():
            self.folders[name] = self.root / "alone" / name
            self.folders[name].mkdir(parents=True)
            world_size, fn, args = self.make_job(name, self.folders[name])
            run_ranks(world_size, fn, *args)
            (done / name).touch()
        return self.folders[name]


def selected_params(request: Any, param: str) -> list[Any]:
    """Values of parameter `param` of the tests of the requesting module that this session runs (after -k/-m)."""
    items = [item for item in request.session.items if item.module is request.module and hasattr(item, "callspec")]
    return list(dict.fromkeys(item.callspec.params[param] for item in items if param in item.callspec.params))


REPLAY_SHAPE = (2, 2, 8)
"""(MoE layers, top-k, experts) of the tiny qwen3_moe: the routing `micro_batch(..., replay=True)` carries."""


def micro_batch(lengths: list[tuple[int, int]], seed: int, vocab_size: int = 500, replay: bool = False) -> MicroBatch:
    """Packed samples of (prompt, completion) lengths with advantages, temperatures and noisy inference log-probs;
    with `replay`, random router replay (distinct experts per token and layer; each sample's last token and one
    token in five without routing, as from vLLM)."""
    g = torch.Generator().manual_seed(seed)
    ids, pos, mask, adv, temps = [], [], [], [], []
    for i, (num_prompt, num_completion) in enumerate(lengths):
        n = num_prompt + num_completion
        ids += torch.randint(3, vocab_size, (n,), generator=g).tolist()
        pos += list(range(n))
        mask += [False] * num_prompt + [True] * num_completion
        adv += [0.0] * num_prompt + [(-1.0) ** (i + seed) * (0.5 + i)] * num_completion
        temps += [1.0] * num_prompt + [0.7 + 0.2 * i] * num_completion
    lq = [-(2.0 + 3.0 * torch.rand(1, generator=g).item()) if m else 0.0 for m in mask]
    routing = None
    if replay:
        layers, top_k, experts = REPLAY_SHAPE
        experts_TRA = torch.rand(len(ids), layers, experts, generator=g).argsort(-1)[..., :top_k].to(torch.uint8)
        unrouted_T = (torch.rand(len(ids), generator=g) < 0.2) | torch.tensor([p == 0 for p in pos[1:]] + [True])
        experts_TRA[unrouted_T] = 255
        routing = Routing(experts_TRA.numpy().tobytes(), "uint8", layers, top_k)
    return MicroBatch(ids, pos, mask, adv, lq, temps, routing)


def step_micro_batches(step: int, world_size: int, replay: bool = False) -> list[list[MicroBatch]]:
    """Micro-batches of each rank for `step`; rank 0 gets one more than the others (exercises padding passes)."""
    per_rank = []
    for rank in range(world_size):
        count = 2 if rank == 0 else 1
        per_rank.append(
            [
                micro_batch([(3, 5 + j), (2, 4 + rank)], seed=100 * step + 10 * rank + j, replay=replay)
                for j in range(count)
            ]
        )
    return per_rank


def write_step_batches(
    output_dir: Path, num_steps: int, world_size: int, as_single_rank: bool = False, replay: bool = False
) -> None:
    """Write rollouts/step_N/rank_R for steps 1..num_steps, split over `world_size` ranks, or (as_single_rank) all
    micro-batches of those ranks in one rank-0 file with the same loss normaliser."""
    for step in range(1, num_steps + 1):
        per_rank = step_micro_batches(step, world_size, replay)
        num_loss = sum(sum(mb.loss_mask) for mbs in per_rank for mb in mbs)
        if as_single_rank:
            per_rank = [[mb for mbs in per_rank for mb in mbs]]
        for rank, mbs in enumerate(per_rank):
            write_batch(output_dir, TrainingBatch(step, rank, num_loss, mbs, metrics={"reward/mean": 0.5}))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def _plain_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def train_and_record(config: Any, result_path: Path, num_steps: int) -> None:
    """Set up the trainer (any number of ranks), train `num_steps` steps on the rank's batch files, and (rank 0)
    save {"grads": full gradients before the first optimizer step, "metrics": per step, "state": full state dict}."""
    from slipstream.trainer.setup import setup_trainer, teardown_trainer
    from slipstream.trainer.step import train_step
    from slipstream.transport.rollouts import batch_path, read_batch

    trainer = setup_trainer(config)
    grads: dict[str, torch.Tensor] = {}

    def record_first_grads(optimizer, args, kwargs):
        if not grads:  # full_tensor() is a collective: every rank records
            named = trainer.policy.named_parameters()  # glm_moe_dsa's indexers never get a gradient (nor in hf)
            grads.update({_plain_name(n): _full(p.grad) for n, p in named if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(record_first_grads)
    metrics = []
    for step in range(1, num_steps + 1):
        batch = read_batch(batch_path(config.output_dir, step, trainer.data_rank))
        metrics.append(
            train_step(
                trainer.policy,
                trainer.optimizer,
                batch,
                config.loss,
                config.optim.max_grad_norm,
                trainer.device,
                trainer.autocast_dtype,
            )
        )
    if trainer.world_size > 1:
        state = gather_full_state_dict(trainer.policy)
    else:
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    if trainer.info.is_main:
        torch.save({"grads": grads, "metrics": metrics, "state": state}, result_path)
    teardown_trainer(trainer)


def run_trainers(configs: list[Any]) -> None:
    """Call run_trainer with each config in turn, in one process group (created here, as torchrun's env says)."""
    import torch.distributed as dist

    from slipstream.trainer.rl import run_trainer

    dist.init_process_group("gloo")
    try:
        for config in configs:
            run_trainer(config)
    finally:
        dist.destroy_process_group()


def gather_full_state_dict(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective (every rank calls it): the wrapped model's full state dict, unsharded, on the CPU at rank 0
    (an empty dict on the other ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from slipstream.trainer.policy import strip_wrapped_prefix

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return strip_wrapped_prefix(get_model_state_dict(policy, options=options))


class CollectBuckets:
    """A bucket sink keeping a copy of every bucket's bytes, by bucket index."""

    def __init__(self) -> None:
        self.buckets: dict[int, torch.Tensor] = {}

    def send(self, index, bucket, flat) -> None:
        self.buckets[index] = flat.clone()

    def close(self) -> None:
        pass
