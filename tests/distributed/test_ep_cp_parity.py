"""Expert parallelism and context parallelism on CPU ranks (gloo) equal one process: loss and gradients after one
step (<= 1e-5), weights after five steps (<= 1e-4). ep=2 and fsdp=2 x ep=2 train the MoE model with the tokens'
all-to-all; cp=2 splits every packed row over two ranks that read one batch file (all-gathered K/V); ep=2 x cp=2
(with activation checkpointing) does both on the same two ranks. Families: qwen3_moe, qwen3, glm4_moe, glm_moe_dsa,
qwen3_5_moe_text (EP only) and afmoe."""

import pytest
import torch

from slipstream.config.shared import ModelConfig
from slipstream.config.trainer import LossConfig, OptimConfig, ParallelConfig, TrainerConfig
from slipstream.trainer.policy import load_model
from tests.distributed.helpers import BatchedRanks, selected_params, train_and_record, write_step_batches

NUM_STEPS = 5
LR = 1e-3
MAX_WEIGHT_MISMATCH = LR
MEAN_WEIGHT_MISMATCH = 1e-3 * LR
"""After NUM_STEPS AdamW steps. The gradients agree to ~1e-8 (checked above at 1e-5), but AdamW divides each
element's momentum by its own RMS, so an element whose gradient is near zero moves by up to ~lr on rounding alone, in
either direction: the weights of parallel and single runs may differ by a fraction of lr there (laguna-ep2's largest:
under 1e-4 on the CPUs of earlier runs, 1.37e-4 on 2026-11-28, 3.71e-4 on 2026-11-29), at a few elements. A sharding
bug in the optimizer state moves weights by ~lr everywhere: the mean difference tells the two apart."""
CASES = {
    # name: (family, world size, data-parallel ranks (batch files), parallel config, loss kind)
    "qwen3_moe-ep2": ("qwen3_moe", 2, 2, ParallelConfig(ep=2), "dppo_tv"),
    "qwen3_moe-fsdp2-ep2": ("qwen3_moe", 4, 4, ParallelConfig(ep=2), "dppo_tv"),
    "qwen3_moe-hsdp2-ep2": ("qwen3_moe", 4, 4, ParallelConfig(dp_replicate=2, ep=2), "dppo_tv"),
    # The experts' FSDP unit (expert_fsdp of 2) gathers at the block's boundary (parallel/fsdp.py: hook_at_block):
    # the recomputation in backward must find the experts gathered, their gradients reduced after the block's.
    "qwen3_moe-fsdp2-ep2-ac": ("qwen3_moe", 4, 4, ParallelConfig(ep=2, activation_checkpointing=True), "dppo_tv"),
    # One ep group spanning the cp group (the all-to-all moves tokens between the two halves of each row), with
    # activation checkpointing: recomputation in backward repeats the all-to-alls and the K/V all-gather.
    "qwen3_moe-ep2-cp2-ac": ("qwen3_moe", 2, 1, ParallelConfig(ep=2, cp=2, activation_checkpointing=True), "dppo_tv"),
    "qwen3-cp2": ("qwen3", 2, 1, ParallelConfig(cp=2), "dppo_tv"),
    # geo_mask needs whole samples' log-ratios, which the cp ranks only have together.
    "qwen3_moe-cp2-geo": ("qwen3_moe", 2, 1, ParallelConfig(cp=2), "geo_mask"),
    # Router replay: the replayed experts follow the tokens through the all-to-all and the cp shards.
    "qwen3_moe-ep2-cp2-ac-replay": (
        "qwen3_moe", 2, 1, ParallelConfig(ep=2, cp=2, activation_checkpointing=True), "dppo_tv"
    ),
    "qwen3_moe-fsdp2-ep2-replay": ("qwen3_moe", 4, 4, ParallelConfig(ep=2), "dppo_tv"),
    # GLM-4.5 MoE (sigmoid group-limited routing with a selection bias, a shared expert, a dense first layer, partial
    # RoPE): EP, CP (its attention is plain GQA: the all-gathered K/V path applies unchanged), both with replay.
    "glm4_moe-ep2": ("glm4_moe", 2, 2, ParallelConfig(ep=2), "dppo_tv"),
    "glm4_moe-cp2": ("glm4_moe", 2, 1, ParallelConfig(cp=2), "dppo_tv"),
    "glm4_moe-ep2-cp2-ac-replay": (
        "glm4_moe", 2, 1, ParallelConfig(ep=2, cp=2, activation_checkpointing=True), "dppo_tv"
    ),
    # GLM-5 (MLA + DSA: each query attends to the indexer's top 4 keys, so sparse in these rows): EP, CP (the MLA
    # latent and the indexer keys all-gathered, every query ranking its whole sample), both with replay.
    "glm_moe_dsa-ep2": ("glm_moe_dsa", 2, 2, ParallelConfig(ep=2), "dppo_tv"),
    "glm_moe_dsa-cp2": ("glm_moe_dsa", 2, 1, ParallelConfig(cp=2), "dppo_tv"),
    "glm_moe_dsa-ep2-cp2-ac-replay": (
        "glm_moe_dsa", 2, 1, ParallelConfig(ep=2, cp=2, activation_checkpointing=True), "dppo_tv"
    ),
    # Qwen3.5-MoE (Gated DeltaNet + gated attention, a gated shared expert): EP only, with replay and checkpointing
    # (its linear-attention layers refuse context parallelism: models/qwen3_5_moe/model.py).
    "qwen3_5_moe_text-ep2-ac-replay": (
        "qwen3_5_moe_text", 2, 2, ParallelConfig(ep=2, activation_checkpointing=True), "dppo_tv"
    ),
    # AFMoE / Trinity (sliding windows of 8 tokens with RoPE + a NoPE full layer, gated attention, a shared expert, a
    # dense first layer): EP, and EP x CP with replay (the sliding layers mask the all-gathered keys by window too).
    "afmoe-ep2": ("afmoe", 2, 2, ParallelConfig(ep=2), "dppo_tv"),
    "afmoe-ep2-cp2-ac-replay": ("afmoe", 2, 1, ParallelConfig(ep=2, cp=2, activation_checkpointing=True), "dppo_tv"),
    # Nemotron-H (Mamba2 + NoPE attention + squared-ReLU MLP / MoE with a shared expert): EP only, with replay and
    # checkpointing (its Mamba2 layers refuse context parallelism: models/nemotron_h/model.py).
    "nemotron_h-ep2-ac-replay": ("nemotron_h", 2, 2, ParallelConfig(ep=2, activation_checkpointing=True), "dppo_tv"),
    # GPT-OSS (sinks, sliding windows of 8 tokens, biased experts): CP only (the family refuses EP), with checkpointing.
    "gpt_oss-cp2-ac": ("gpt_oss", 2, 1, ParallelConfig(cp=2, activation_checkpointing=True), "dppo_tv"),
    # Laguna (sliding windows of 8 tokens with their own RoPE, partial RoPE on the full layer, per-layer head counts,
    # softplus output gates, softcapped sigmoid routing, a shared expert, a dense first layer): EP, CP, and EP x CP
    # with replay and checkpointing (the sliding layers mask the all-gathered keys by window).
    # MiniMax-M2 (full-width q/k norm over all heads, partial RoPE, sigmoid routing with a selection bias, every layer
    # MoE): EP x CP with replay and checkpointing (the q/k norm spans heads, not tokens: cp shards keep it local).
    "minimax_m2-ep2": ("minimax_m2", 2, 2, ParallelConfig(ep=2), "dppo_tv"),
    "minimax_m2-ep2-cp2-ac-replay": (
        "minimax_m2", 2, 1, ParallelConfig(ep=2, cp=2, activation_checkpointing=True), "dppo_tv"
    ),
    "laguna-ep2": ("laguna", 2, 2, ParallelConfig(ep=2), "dppo_tv"),
    "laguna-cp2": ("laguna", 2, 1, ParallelConfig(cp=2), "dppo_tv"),
    "laguna-ep2-cp2-ac-replay": ("laguna", 2, 1, ParallelConfig(ep=2, cp=2, activation_checkpointing=True), "dppo_tv"),
}  # fmt: skip


def _config(model_dir, output_dir, parallel, loss_kind):
    return TrainerConfig(
        model=ModelConfig(name=str(model_dir)),
        model_impl="custom",
        output_dir=output_dir,
        max_steps=NUM_STEPS,
        optim=OptimConfig(lr=LR, max_grad_norm=0.5),
        loss=LossConfig(kind=loss_kind, geo_low=0.03, geo_high=1.5),
        parallel=parallel,
        device="cpu",
        num_threads=1,
    )


@pytest.fixture(scope="module")
def multi_rank_runs(request, tiny_model_factory, tmp_path_factory):
    """The multi-rank runs of the selected cases, in one spawn per world size (see BatchedRanks)."""

    def make_job(case, folder):
        family, world_size, num_data_ranks, parallel, loss_kind = CASES[case]
        write_step_batches(folder / "multi", NUM_STEPS, world_size=num_data_ranks, replay=case.endswith("-replay"))
        config = _config(tiny_model_factory(family), folder / "multi", parallel, loss_kind)
        return world_size, train_and_record, (config, folder / "multi.pt", NUM_STEPS)

    return BatchedRanks(tmp_path_factory.mktemp("ep_cp_parity"), selected_params(request, "case"), make_job)


@pytest.mark.parametrize("case", list(CASES))
def test_ep_and_cp_match_one_process(tiny_model_factory, tmp_path, case, multi_rank_runs):
    family, world_size, num_data_ranks, parallel, loss_kind = CASES[case]
    model_dir = tiny_model_factory(family)
    single = tmp_path / "single"
    replay = case.endswith("-replay")
    write_step_batches(single, NUM_STEPS, world_size=num_data_ranks, as_single_rank=True, replay=replay)

    multi_pt = multi_rank_runs.run(case) / "multi.pt"
    reference_parallel = ParallelConfig(activation_checkpointing=parallel.activation_checkpointing)
    train_and_record(_config(model_dir, single, reference_parallel, loss_kind), tmp_path / "single.pt", NUM_STEPS)
    got, want = torch.load(multi_pt), torch.load(tmp_path / "single.pt")

    assert got["grads"].keys() == want["grads"].keys()
    grad_diff = max((got["grads"][k] - g).abs().max().item() for k, g in want["grads"].items())
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=1e-5, msg=name)
    first_got, first_want = got["metrics"][0], want["metrics"][0]
    keys = ["loss", "mismatch_kl", "entropy", "masked_fraction", "grad_norm", "num_tokens"]
    if replay:
        keys += ["router/replayed_fraction", "router/agreement"]
        assert 0.5 < first_want["router/replayed_fraction"] < 1 and first_want["router/agreement"] < 0.5
    for key in keys:
        assert first_got[key] == pytest.approx(first_want[key], rel=0, abs=1e-5), key
    assert first_want["grad_norm"] > 0.5  # the clip acted
    if loss_kind == "geo_mask":
        assert 0 < first_want["masked_fraction"] < 1  # some samples masked as a whole, some not
    assert got["state"].keys() == want["state"].keys()
    initial, _ = load_model(model_dir, "custom")
    initial_state = initial.state_dict()
    largest_update = max((want["state"][k] - initial_state[k]).abs().max().item() for k in want["state"])
    largest_mismatch = max((got["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    mean_mismatch = sum((got["state"][k] - want["state"][k]).abs().sum().item() for k in want["state"]) / sum(
        t.numel() for t in want["state"].values()
    )
    print(
        f"{case}: masked {first_want['masked_fraction']:.2f}, max grad diff {grad_diff:.2e}, max weight diff after {NUM_STEPS} steps {largest_mismatch:.2e}"
    )
    assert largest_update > LR >= MAX_WEIGHT_MISMATCH >= largest_mismatch
    assert mean_mismatch <= MEAN_WEIGHT_MISMATCH, f"weights differ by {mean_mismatch:.2e} on average"
