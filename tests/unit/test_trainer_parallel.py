"""parallel/ on one process: mesh sizing and its errors, block discovery, activation checkpointing (same values and
gradients, same state-dict keys), gradient clipping; and single-rank checkpoints (commit marker, resume rules)."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from slipstream.config.trainer import ParallelConfig
from slipstream.models.registry import load_pretrained
from slipstream.parallel.dist import RankInfo
from slipstream.parallel.fsdp import apply_activation_checkpointing, find_blocks
from slipstream.parallel.grad import clip_grad_norm
from slipstream.parallel.mesh import resolve_parallel_dims
from slipstream.trainer.ckpt import (
    COMMITTED,
    PROGRESS,
    CheckpointMeta,
    checkpoint_dir,
    committed_steps,
    load_checkpoint,
    resolve_resume_step,
    save_checkpoint,
)
from slipstream.trainer.policy import Policy

ONE_RANK = RankInfo(rank=0, world_size=1, local_rank=0)


def test_mesh_dims_default_to_the_ranks_left():
    dims = resolve_parallel_dims(ParallelConfig(), world_size=8)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.ep) == (1, 8, 1, 1)
    dims = resolve_parallel_dims(ParallelConfig(dp_replicate=2), world_size=8)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 4)
    assert resolve_parallel_dims(ParallelConfig(dp_shard=1), world_size=1).dp_shard == 1


@pytest.mark.parametrize(
    ("config", "world_size", "match"),
    [
        (
            ParallelConfig(dp_shard=3),
            4,
            r"dp_replicate \(1\) x dp_shard \(3\) x cp \(1\) = 3 ranks, but WORLD_SIZE is 4",
        ),
        (ParallelConfig(dp_replicate=3), 4, r"= 3 ranks, but WORLD_SIZE is 4"),
        (ParallelConfig(ep=3), 4, r"ep \(3\) must divide dp_shard x cp"),
    ],
)
def test_mesh_dims_errors_say_what_to_change(config, world_size, match):
    with pytest.raises(ValueError, match=match):
        resolve_parallel_dims(config, world_size)


def test_ep_is_carved_from_dp_shard_and_cp_ranks_share_batches():
    dims = resolve_parallel_dims(ParallelConfig(ep=2), world_size=4)
    assert (dims.dp_shard, dims.dp_shard_in_ep, dims.dp_shard_mod_ep, dims.num_data_ranks) == (4, 2, 2, 4)
    dims = resolve_parallel_dims(ParallelConfig(ep=4, cp=2), world_size=8)
    assert (dims.dp_shard, dims.dp_shard_in_ep, dims.dp_shard_mod_ep, dims.num_data_ranks) == (4, 2, 2, 4)
    assert [dims.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    dims = resolve_parallel_dims(ParallelConfig(cp=2), world_size=2)
    assert (dims.dp_shard, dims.dp_shard_in_ep, dims.dp_shard_mod_ep, dims.num_data_ranks) == (1, 1, 1, 1)


def test_ep_must_span_whole_cp_groups():
    with pytest.raises(ValueError, match=r"ep \(2\) must be a multiple of trainer.parallel.cp \(4\)"):
        ParallelConfig(ep=2, cp=4)


def test_find_blocks_in_ours_transformers_and_wrapped(tiny_qwen3_dir):
    ours = load_pretrained(tiny_qwen3_dir, impl="custom")
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    assert find_blocks(ours) is ours.layers
    assert find_blocks(hf) is hf.model.layers
    assert find_blocks(Policy(ours)) is ours.layers
    with pytest.raises(ValueError, match="no nn.ModuleList named 'layers'"):
        find_blocks(torch.nn.Linear(2, 2))


class _CountAttention(TorchDispatchMode):
    """Counts the attention kernel's forward runs (the CPU path's op) that actually execute."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.runs += func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("impl", ["custom", "hf"])
def test_activation_checkpointing_keeps_values_grads_and_keys(tiny_qwen3_dir, impl):
    """Full checkpointing and keep_attention (the default) give no-checkpointing's values and gradients; full
    reruns each block's attention kernel in backward, keep_attention does not."""
    input_ids_T, position_ids_T = torch.randint(3, 500, (12,)), torch.tensor([*range(5), *range(7)])
    temperatures_T = torch.full((12,), 0.8)
    results, runs = [], []
    for mode in ("none", "full", "keep_attention"):
        policy = Policy(load_pretrained(tiny_qwen3_dir, impl=impl))
        if mode != "none":
            apply_activation_checkpointing(policy, keep_attention=mode == "keep_attention")
        with _CountAttention() as counter:
            logprobs_T, _ = policy(input_ids_T, position_ids_T, temperatures_T)
            logprobs_T.sum().backward()
        runs.append(counter.runs)
        grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in policy.named_parameters()}
        results.append((list(policy.state_dict()), logprobs_T.detach(), grads))
    num_blocks = len(find_blocks(policy))
    assert runs == [num_blocks, 2 * num_blocks, num_blocks]
    keys, lp, grads = results[0]
    for keys_ac, lp_ac, grads_ac in results[1:]:
        assert keys == keys_ac and all("checkpoint" not in k for k in keys_ac)
        torch.testing.assert_close(lp_ac, lp, rtol=0, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grads_ac[name], grad, rtol=0, atol=1e-7, msg=name)


def test_clip_grad_norm_matches_torch():
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, reference, strict=True):
        p.grad = torch.randn_like(p) * 4
        r.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    torch.testing.assert_close(clip_grad_norm(params, 1.0), expected)
    assert expected > 1.0
    for p, r in zip(params, reference, strict=True):
        torch.testing.assert_close(p.grad, r.grad)
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params])) == pytest.approx(1.0, rel=1e-5)


def _policy_and_optimizer(model_dir):
    policy = Policy(load_pretrained(model_dir, impl="custom"))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    return policy, optimizer


def _one_step(policy, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    ids_T, pos_T = torch.randint(3, 500, (10,), generator=g), torch.arange(10)
    logprobs_T, _ = policy(ids_T, pos_T, torch.ones(10))
    logprobs_T.sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_checkpoint_round_trip_commit_and_resume_rules(tiny_qwen3_dir, tmp_path):
    meta = CheckpointMeta(step=3, model_type="qwen3", impl="custom")
    assert resolve_resume_step(tmp_path, "latest") is None and resolve_resume_step(tmp_path, None) is None
    policy, optimizer = _policy_and_optimizer(tiny_qwen3_dir)
    _one_step(policy, optimizer, seed=0)
    stale = checkpoint_dir(tmp_path, 3).parent / ".trainer.tmp"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("left by a crash")
    torch.manual_seed(123)
    path = save_checkpoint(policy, optimizer, tmp_path, meta, ONE_RANK)
    rng_after_save = torch.get_rng_state()
    assert path == checkpoint_dir(tmp_path, 3) and (path / COMMITTED).is_file() and not stale.exists()
    assert json.loads((path / PROGRESS).read_text())["world_size"] == 1
    (tmp_path / "checkpoints" / "step_5" / "trainer").mkdir(parents=True)  # uncommitted: ignored
    assert committed_steps(tmp_path) == [3] and resolve_resume_step(tmp_path, "latest") == 3
    with pytest.raises(FileNotFoundError, match=r"resume_step = 5 .*\(committed steps: \[3\]\)"):
        resolve_resume_step(tmp_path, 5)

    fresh, fresh_optimizer = _policy_and_optimizer(tiny_qwen3_dir)
    torch.manual_seed(999)
    load_checkpoint(fresh, fresh_optimizer, tmp_path, meta, ONE_RANK)
    assert torch.equal(torch.get_rng_state(), rng_after_save)
    for (name, p), q in zip(policy.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
    _one_step(policy, optimizer, seed=1)
    _one_step(fresh, fresh_optimizer, seed=1)
    for (name, p), q in zip(policy.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(p, q), name

    with pytest.raises(ValueError, match="impl='hf'.*resume with the model and trainer.model_impl"):
        load_checkpoint(fresh, fresh_optimizer, tmp_path, CheckpointMeta(3, "qwen3", "hf"), ONE_RANK)


def _params_with_grads(scale: float, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(5, 3), (7,), (2, 2, 4)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


@pytest.mark.parametrize("scale", [0.01, 10.0, float("nan")])
def test_fused_adamw_clips_in_its_kernel_as_the_separate_clip_does(scale):
    """clip_and_step hands torch's fused AdamW the clipping divisor and the non-finite flag instead of clipping
    first: the same update (to float rounding) for norms under and over the limit, and a NaN norm skips the step
    with weights and moments untouched."""
    from slipstream.trainer.step import _fused_adamw_clips, clip_and_step

    fused_params, plain_params = _params_with_grads(scale), _params_with_grads(scale)
    before = [p.detach().clone() for p in fused_params]
    results = []
    for params, fused in ((fused_params, True), (plain_params, False)):
        model = torch.nn.ParameterList(params)
        optimizer = torch.optim.AdamW(params, lr=0.1, weight_decay=0.01, fused=fused or None)
        assert _fused_adamw_clips(optimizer, params) is fused
        for step in range(2):  # the second step sees moments
            if step > 0:
                for p, q in zip(params, _params_with_grads(scale, seed=1), strict=True):
                    p.grad = q.grad
            results.append(clip_and_step(model, optimizer, max_grad_norm=1.0))
            assert all(p.grad is None for p in params)
        assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
    (norm_f, skipped_f), _, (norm_p, skipped_p), _ = results
    assert skipped_f == skipped_p == (scale != scale)
    if scale != scale:
        for p, b in zip(fused_params, before, strict=True):
            assert torch.equal(p.detach(), b)
        return
    torch.testing.assert_close(norm_f, norm_p)
    for f, p, b in zip(fused_params, plain_params, before, strict=True):
        torch.testing.assert_close(f.detach(), p.detach(), atol=1e-6, rtol=1e-6)
        assert not torch.equal(f.detach(), b)  # the step did update


class _CountDeltaRule(TorchDispatchMode):
    """Counts runs of qwen3_5_moe's delta-rule op that actually execute (forward and recomputation)."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.runs += func is torch.ops.slipstream.chunk_gated_delta_rule.default
        return func(*args, **(kwargs or {}))


def test_keep_attention_saves_the_delta_rule_of_linear_attention(tiny_model_factory):
    """Linear attention's delta rule is the attention kernel of qwen3_5_moe: keep_attention checkpointing saves its
    output (one run per linear layer, not two), with the gradients of full checkpointing."""
    input_ids_T, position_ids_T = torch.randint(3, 500, (12,)), torch.tensor([*range(5), *range(7)])
    temperatures_T = torch.full((12,), 0.8)
    runs, grads = [], []
    for keep in (False, True):
        policy = Policy(load_pretrained(tiny_model_factory("qwen3_5_moe_text"), impl="custom"))
        apply_activation_checkpointing(policy, keep_attention=keep)
        with _CountDeltaRule() as counter:
            logprobs_T, _ = policy(input_ids_T, position_ids_T, temperatures_T)
            logprobs_T.sum().backward()
        runs.append(counter.runs)
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in policy.named_parameters()})
    num_linear = sum(t == "linear_attention" for t in policy.model.args.layer_types)
    assert num_linear >= 1 and runs == [2 * num_linear, num_linear]
    for name, grad in grads[0].items():
        if grad is not None:
            torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-7, msg=name)
