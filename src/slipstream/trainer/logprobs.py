"""Per-token log-probs and entropies of a packed micro-batch under one of our models (packed rows, no padding) or a
Hugging Face causal LM (packed samples run as right-padded rows), through a chunked LM head. Micro-batches with
images (vision-language models, transformers only) run as right-padded rows with the images' pixels, and the model
computes their M-RoPE positions itself.

Legend: T = packed tokens, B = samples (padded rows), L = longest sample, N = predicted tokens (T - B),
D = hidden size, V = vocabulary.
"""

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from slipstream.models.common.attention import ContextShard
from slipstream.models.common.moe import REPLAY_PAD
from slipstream.models.common.prefix_tree import parent_index
from slipstream.models.common.transformer import DecoderLM
from slipstream.parallel.cp import ContextParallel
from slipstream.trainer.data import (
    PackedMicroBatch,
    PaddedLayout,
    build_padded_layout,
    expand_trees,
    pack,
    padded_position_ids,
    unpack,
)
from slipstream.trainer.lm_head import CPU_SAVED_PROBS_BYTES, lm_head_logprobs
from slipstream.trainer.row_layout import use_padded_rows

if TYPE_CHECKING:
    from slipstream.trainer.vlm_batch import ImageInputs

DEFAULT_CHUNK_SIZE = 8192
"""Tokens per LM-head chunk: only [chunk, V] logits (in the compute dtype) exist at a time."""

# Config attributes with which transformers post-processes logits after the LM head (softcapping, scaling).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def mixed_precision(device: torch.device, compute_dtype: torch.dtype) -> AbstractContextManager:
    """Run a float32 model's forward with matmuls in `compute_dtype` (torch.autocast; CPU supports bfloat16 too).
    Parameters and their gradients stay float32; a no-op when `compute_dtype` is float32."""
    if compute_dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype)


def is_custom_model(model: nn.Module) -> bool:
    """One of our models (slipstream/models), which runs packed rows itself, rather than a transformers model."""
    return isinstance(model, DecoderLM)


def compute_logprobs(
    model: nn.Module,
    mb: PackedMicroBatch,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    head_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Return (logprobs_T, entropy_T): log p(input_ids[t] | its sample's prefix) at temperatures_T[t], and the
    entropy of that distribution. Both are 0 at each sample's first token. Gradients flow through logprobs_T."""
    return packed_logprobs(
        model,
        mb.input_ids_T,
        mb.position_ids_T,
        mb.temperatures_T,
        chunk_size,
        layout=mb.layout,
        head_dtype=head_dtype,
    )


def packed_logprobs(
    model: nn.Module,
    input_ids_T: Tensor,
    position_ids_T: Tensor,
    temperatures_T: Tensor,
    chunk_size: int,
    target_mask_T: Tensor | None = None,
    context_parallel: ContextParallel | None = None,
    replay_TRA: Tensor | None = None,
    images: "ImageInputs | None" = None,
    layout: PaddedLayout | None = None,
    head_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """`compute_logprobs` on the micro-batch's tensors. Packed samples never attend to each other: our models
    separate them by position_ids (one row, no padding) or run one padded row per sample where that is cheaper
    (row_layout.py); transformers models get right-padded rows and a mask. Prefix trees (samples sharing a prompt
    computed once, models/common/prefix_tree.py) give every sample the log-probs it has alone.

    With `target_mask_T` (the loss mask) the LM head runs only for those tokens: log-prob and entropy are 0
    elsewhere (prompt tokens' log-probs are never used by the loss, and the head is a quarter of the step's FLOPs).
    With `context_parallel` (our models only) this rank runs its shard of the row and the LM head for the targets it
    owns; the results are summed over the cp group, so every cp rank returns the whole row's values.
    `replay_TRA` (router replay, our MoE models only) follows the tokens into whichever layout runs.
    `images` (vision-language models run by transformers): the micro-batch's images (vlm_batch.py).
    `layout`: `build_padded_layout(position_ids_T)` when the caller has it already (to_packed builds it on the CPU).
    `head_dtype`: the LM head's logits dtype when wider than the compute dtype (model.head_dtype; lm_head.py).
    """
    if layout is None:
        layout = build_padded_layout(position_ids_T)
    if replay_TRA is not None:
        check_replay(model, replay_TRA, input_ids_T.numel())
    # Token t (not a sample start) is predicted from the hidden state of token t - 1 of the same sample, or, for a
    # branch's first token, of the last token of the shared prefix it continues (layout.parent_T).
    is_target_T = ~layout.is_start_T if target_mask_T is None else target_mask_T & ~layout.is_start_T
    if context_parallel is not None:
        return _context_parallel_logprobs(
            model,
            context_parallel,
            input_ids_T,
            position_ids_T,
            temperatures_T,
            chunk_size,
            is_target_T,
            replay_TRA,
            head_dtype,
        )
    if is_custom_model(model):
        hidden_TD = custom_hidden(model, input_ids_T, position_ids_T, layout, replay_TRA)
        head_weight_VD, head_bias_V = model.lm_head_weight, None
    else:
        check_plain_lm_head(model)
        if images is not None:
            hidden_TD = vlm_hidden(model, input_ids_T, layout, images)
        else:
            hidden_TD = hf_hidden(model, input_ids_T, position_ids_T, layout)
        lm_head = model.get_output_embeddings()
        head_weight_VD, head_bias_V = lm_head.weight, lm_head.bias
    target_N = torch.nonzero(is_target_T).squeeze(-1)
    hidden_ND = hidden_TD[layout.parent_T[target_N]]
    return _scatter_head_logprobs(
        head_weight_VD, head_bias_V, hidden_ND, input_ids_T, temperatures_T, target_N, chunk_size, head_dtype
    )


def hf_hidden(model: nn.Module, input_ids_T: Tensor, position_ids_T: Tensor, layout: PaddedLayout) -> Tensor:
    """hidden_TD of a transformers model: one right-padded row per sample under its attention mask. Prefix trees
    (which its attention cannot express) are written out as their samples first (`expand_trees`): exact, with the
    prefix computed once per sample."""
    if layout.num_branches:
        source_E, own_T = expand_trees(position_ids_T)
        return hf_hidden(
            model, input_ids_T[source_E], position_ids_T[source_E], build_padded_layout(position_ids_T[source_E])
        )[own_T]
    input_ids_BL = unpack(input_ids_T, layout, pad_value=0)
    position_ids_BL = unpack(position_ids_T, layout, pad_value=0)
    attention_mask_BL = unpack(torch.ones_like(input_ids_T), layout, pad_value=0)
    out = model.base_model(
        input_ids=input_ids_BL, attention_mask=attention_mask_BL, position_ids=position_ids_BL, use_cache=False
    )
    return pack(out.last_hidden_state, layout)


def vlm_hidden(model: nn.Module, input_ids_T: Tensor, layout: PaddedLayout, images: "ImageInputs") -> Tensor:
    """hidden_TD of a transformers vision-language model (Qwen3-VL family): one right-padded row per sample under its
    attention mask, every image of the micro-batch encoded in one vision pass (rows follow the packed order, so the
    images' token order is the model's), and no position_ids: the model derives M-RoPE's 3-D positions from the
    token types (an image's tokens advance by its side, not its token count; packed 1-D positions would be wrong)."""
    if layout.num_branches:
        raise ValueError("a micro-batch with images holds a prefix tree; the orchestrator never shares image samples")
    if images.pixel_values_PF.shape[0] and not getattr(model.config, "vision_config", None):
        raise ValueError(f"the micro-batch holds images but {type(model).__name__} is not a vision-language model")
    input_ids_BL = unpack(input_ids_T, layout, pad_value=0)
    attention_mask_BL = unpack(torch.ones_like(input_ids_T), layout, pad_value=0)
    out = model.base_model(
        input_ids=input_ids_BL,
        attention_mask=attention_mask_BL,
        pixel_values=images.pixel_values_PF,
        image_grid_thw=images.image_grid_thw_I3,
        mm_token_type_ids=(input_ids_BL == images.image_token_id).int() * attention_mask_BL,
        use_cache=False,
    )
    return pack(out.last_hidden_state, layout)


def _context_parallel_logprobs(
    model: nn.Module,
    cp: ContextParallel,
    input_ids_T: Tensor,
    position_ids_T: Tensor,
    temperatures_T: Tensor,
    chunk_size: int,
    is_target_T: Tensor,
    replay_TRA: Tensor | None = None,
    head_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """packed_logprobs of our model with the row sharded over the cp group (parallel/cp.py)."""
    if not is_custom_model(model):
        raise ValueError("context parallelism runs our models only (trainer.model_impl = 'custom')")
    shard = cp.shard_row(input_ids_T, position_ids_T)
    context = ContextShard(shard.row_position_ids_T[None], shard.offset, cp.gather_tokens)
    replay_tRA = None if replay_TRA is None else cp.shard_tokens(replay_TRA, pad_value=REPLAY_PAD)
    hidden_tD = model.forward_hidden(
        shard.input_ids_t[None], shard.position_ids_t[None], context, None if replay_tRA is None else replay_tRA[None]
    )[0]
    parent_T = parent_index(position_ids_T)
    owned_T = cp.owned_tokens(input_ids_T.numel(), input_ids_T.device, parent_T)
    target_N = torch.nonzero(is_target_T & owned_T).squeeze(-1)
    logprobs_T, entropy_T = _scatter_head_logprobs(
        model.lm_head_weight,
        None,
        hidden_tD[parent_T[target_N] - shard.offset],
        input_ids_T,
        temperatures_T,
        target_N,
        chunk_size,
        head_dtype,
    )
    return cp.sum_over_ranks(logprobs_T), cp.sum_over_ranks(entropy_T).detach()


def _scatter_head_logprobs(
    head_weight_VD: Tensor,
    head_bias_V: Tensor | None,
    hidden_ND: Tensor,
    input_ids_T: Tensor,
    temperatures_T: Tensor,
    target_N: Tensor,
    chunk_size: int,
    head_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """(logprobs_T, entropy_T): the LM head for targets `target_N` (predicted from `hidden_ND`), 0 elsewhere."""
    logprobs_N, entropy_N = chunked_lm_head_logprobs(
        head_weight_VD,
        hidden_ND,
        input_ids_T[target_N],
        temperatures_T[target_N],
        chunk_size,
        head_bias_V,
        head_dtype,
    )
    zeros_T = torch.zeros(input_ids_T.numel(), dtype=torch.float32, device=hidden_ND.device)
    return zeros_T.index_copy(0, target_N, logprobs_N), zeros_T.index_copy(0, target_N, entropy_N)


EXPAND_TREES_ON = ("cuda",)
"""Devices where our models run prefix trees as their samples (see custom_hidden)."""


def custom_hidden(
    model: DecoderLM,
    input_ids_T: Tensor,
    position_ids_T: Tensor,
    layout: PaddedLayout,
    replay_TRA: Tensor | None = None,
) -> Tensor:
    """hidden_TD of our model, run as the packed row or as one padded row per sample (row_layout.py). On CUDA,
    prefix trees are written out as their samples first (`expand_trees`: exact, the prefix computed once per
    sample): no fused kernel there takes a tree's mask, and the dense mask grows as the square of the row. With
    `model.packed_attention = "flex"` trees stay trees (flex_attention takes their block mask). Models whose layers
    cannot take a tree at all (recurrent linear attention: `supports_prefix_trees = False`) get samples everywhere."""
    device = input_ids_T.device
    if layout.num_branches and not runs_prefix_trees(model, device):
        source_E, own_T = expand_trees(position_ids_T)
        replay_ERA = None if replay_TRA is None else replay_TRA[source_E]
        expanded = build_padded_layout(position_ids_T[source_E])
        return custom_hidden(model, input_ids_T[source_E], position_ids_T[source_E], expanded, replay_ERA)[own_T]
    autocast = torch.is_autocast_enabled(device.type)
    compute_dtype = torch.get_autocast_dtype(device.type) if autocast else model.lm_head_weight.dtype
    if not use_padded_rows(model, layout, device, compute_dtype):
        replay = None if replay_TRA is None else replay_TRA[None]
        return model.forward_hidden(input_ids_T[None], position_ids_T[None], None, replay)[0]
    input_ids_BL = unpack(input_ids_T, layout, pad_value=0)
    replay_BLRA = None if replay_TRA is None else unpack(replay_TRA, layout, pad_value=REPLAY_PAD)
    # Pads continue their row's positions: each row is then one causal sample (or tree), whatever its pads are.
    position_ids_BL = padded_position_ids(position_ids_T, layout)
    return pack(model.forward_hidden(input_ids_BL, position_ids_BL, None, replay_BLRA), layout)


def runs_prefix_trees(model: nn.Module, device: torch.device, context_parallel: bool = False) -> bool:
    """Does `packed_logprobs` run a prefix tree as a tree (its shared prefix computed once) rather than write it out
    as its samples? Our models that take trees do, under context parallelism (its masked attention takes any rows)
    and off CUDA unless `packed_attention` is "flex" (custom_hidden); transformers models never do (hf_hidden)."""
    if not is_custom_model(model) or not getattr(model, "supports_prefix_trees", True):
        return False
    return context_parallel or device.type not in EXPAND_TREES_ON or model.packed_attention == "flex"


def check_replay(model: nn.Module, replay_TRA: Tensor, num_tokens: int) -> None:
    """Raise unless `replay_TRA` fits the micro-batch and our MoE model (R MoE blocks, expert ids in range)."""
    if not is_custom_model(model) or not model.num_moe_blocks:
        raise ValueError(
            "the batch carries router replay (orchestrator.router_replay) but the trainer runs no MoE model of ours: "
            "router replay needs an MoE model with trainer.model_impl = 'custom'"
        )
    num_experts = model.args.num_experts
    if replay_TRA.shape[:2] != (num_tokens, model.num_moe_blocks) or int(replay_TRA.max()) >= num_experts:
        raise ValueError(
            f"router replay of shape {tuple(replay_TRA.shape)} (largest expert id {int(replay_TRA.max())}) does not "
            f"fit {num_tokens} tokens, {model.num_moe_blocks} MoE layers and {num_experts} experts: does inference "
            "serve the same model?"
        )


def chunked_lm_head_logprobs(
    head_weight_VD: Tensor,
    hidden_ND: Tensor,
    token_ids_N: Tensor,
    temperatures_N: Tensor,
    chunk_size: int,
    head_bias_V: Tensor | None = None,
    head_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-probs of token_ids_N and entropies (float32) under softmax((hidden_ND @ W^T + b) / temperature),
    chunk by chunk through the fused head (trainer/lm_head.py): no [N, V] tensor is ever materialised, forward or
    backward (each chunk's logits are recomputed in backward). On the CPU, float32 logits of N tokens within
    CPU_SAVED_PROBS_BYTES keep their probabilities for backward instead (nothing recomputed)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0 (got {chunk_size})")
    keep_probs = hidden_ND.shape[0] * head_weight_VD.shape[0] * 4 <= CPU_SAVED_PROBS_BYTES
    logprobs, entropies = [], []
    # With no tokens, one empty chunk still runs: every rank's head parameters then get a (zero) gradient, which
    # FSDP's collectives need.
    for start in range(0, max(hidden_ND.shape[0], 1), chunk_size):
        chunk = slice(start, start + chunk_size)
        lp_C, ent_C = lm_head_logprobs(
            hidden_ND[chunk],
            head_weight_VD,
            head_bias_V,
            token_ids_N[chunk],
            temperatures_N[chunk],
            head_dtype,
            keep_probs,
        )
        logprobs.append(lp_C)
        entropies.append(ent_C)
    return torch.cat(logprobs), torch.cat(entropies)


def check_plain_lm_head(model: nn.Module) -> None:
    """Raise if the model transforms its logits after the LM head: compute_logprobs applies the head alone."""
    config = model.config
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            raise ValueError(
                f"{config.model_type} applies {name}={value} to its logits after the LM head; "
                "trainer/logprobs.py applies the LM head alone: add that transform to trainer/lm_head.py first"
            )
    if model.base_model is model:
        raise ValueError(f"{type(model).__name__} has no separate base model and LM head")
