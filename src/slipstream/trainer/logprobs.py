"""Per-token log-probs and entropies of a packed micro-batch under a Hugging Face causal LM.

Legend: T = packed tokens, B = samples (padded rows), L = longest sample, N = predicted tokens (T - B),
D = hidden size, V = vocabulary.
"""

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from slipstream.trainer.data import PackedMicroBatch, build_padded_layout, pack, unpack

DEFAULT_CHUNK_SIZE = 8192
"""Tokens per LM-head chunk: only [chunk, V] logits exist at a time (recomputed in backward)."""

# Config attributes with which transformers post-processes logits after the LM head (softcapping, scaling).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def mixed_precision(device: torch.device, compute_dtype: torch.dtype) -> AbstractContextManager:
    """Run a float32 model's forward with matmuls in `compute_dtype` (torch.autocast; CPU supports bfloat16 too).
    Parameters and their gradients stay float32; a no-op when `compute_dtype` is float32."""
    if compute_dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype)


def compute_logprobs(
    model: nn.Module, mb: PackedMicroBatch, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[Tensor, Tensor]:
    """Return (logprobs_T, entropy_T): log p(input_ids[t] | its sample's prefix) at temperatures_T[t], and the
    entropy of that distribution. Both are 0 at each sample's first token. Gradients flow through logprobs_T.

    Packed samples never attend to each other: they run as right-padded rows with an attention mask.
    """
    check_plain_lm_head(model)
    layout = build_padded_layout(mb.position_ids_T)
    input_ids_BL = unpack(mb.input_ids_T, layout, pad_value=0)
    position_ids_BL = unpack(mb.position_ids_T, layout, pad_value=0)
    attention_mask_BL = unpack(torch.ones_like(mb.input_ids_T), layout, pad_value=0)
    out = model.base_model(
        input_ids=input_ids_BL, attention_mask=attention_mask_BL, position_ids=position_ids_BL, use_cache=False
    )
    hidden_TD = pack(out.last_hidden_state, layout)

    # Token t (not a sample start) is predicted from the hidden state of token t - 1 of the same sample.
    target_N = torch.nonzero(~layout.is_start_T).squeeze(-1)
    logprobs_N, entropy_N = chunked_lm_head_logprobs(
        model.get_output_embeddings(),
        hidden_TD[target_N - 1],
        mb.input_ids_T[target_N],
        mb.temperatures_T[target_N],
        chunk_size,
    )
    zeros_T = torch.zeros(mb.num_tokens, dtype=torch.float32, device=hidden_TD.device)
    return zeros_T.index_copy(0, target_N, logprobs_N), zeros_T.index_copy(0, target_N, entropy_N)


def chunked_lm_head_logprobs(
    lm_head: nn.Module, hidden_ND: Tensor, token_ids_N: Tensor, temperatures_N: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Log-probs of token_ids_N and entropies (float32) under softmax(lm_head(hidden_ND) / temperature),
    chunk by chunk; with grad enabled each chunk's logits are recomputed in backward instead of stored."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0 (got {chunk_size})")
    recompute = torch.is_grad_enabled() and hidden_ND.requires_grad
    logprobs, entropies = [], []
    for start in range(0, hidden_ND.shape[0], chunk_size):
        chunk = slice(start, start + chunk_size)
        args = (lm_head, hidden_ND[chunk], token_ids_N[chunk], temperatures_N[chunk])
        lp_C, ent_C = checkpoint(_head_chunk, *args, use_reentrant=False) if recompute else _head_chunk(*args)
        logprobs.append(lp_C)
        entropies.append(ent_C)
    if not logprobs:
        empty_N = hidden_ND.new_zeros(0, dtype=torch.float32)
        return empty_N, empty_N
    return torch.cat(logprobs), torch.cat(entropies)


def _head_chunk(
    lm_head: nn.Module, hidden_CD: Tensor, token_ids_C: Tensor, temperatures_C: Tensor
) -> tuple[Tensor, Tensor]:
    # The head's matmul runs in the compute dtype (as inference computes its logits); the log-softmax is float32.
    logits_CV = lm_head(hidden_CD)
    with torch.autocast(hidden_CD.device.type, enabled=False):
        logp_CV = F.log_softmax(logits_CV.float() / temperatures_C.unsqueeze(-1), dim=-1)
        logprobs_C = logp_CV.gather(-1, token_ids_C.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            entropy_C = -(logp_CV.exp() * logp_CV).sum(-1)
    return logprobs_C, entropy_C


def check_plain_lm_head(model: nn.Module) -> None:
    """Raise if the model transforms its logits after the LM head: compute_logprobs applies the head alone."""
    config = model.config
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            raise NotImplementedError(
                f"{config.model_type} applies {name}={value} to its logits after the LM head; "
                "trainer/logprobs.py applies the LM head alone: add that transform to _head_chunk first"
            )
    if model.base_model is model:
        raise NotImplementedError(f"{type(model).__name__} has no separate base model and LM head")
