"""The policy module the trainer shards and calls: wraps a model (ours or transformers') so that one forward
maps a packed micro-batch to per-token log-probs and entropies, with the LM head inside that forward.

FSDP2 all-gathers a module's parameters in its forward hooks; the LM head is applied to the final hidden states
outside the model's own `forward`, so the wrapper is the FSDP root that owns the embeddings, final norm and head.
"""

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from slipstream.models.common.prefix_tree import parent_index
from slipstream.parallel.cp import ContextParallel
from slipstream.trainer.logprobs import DEFAULT_CHUNK_SIZE, packed_logprobs, runs_prefix_trees

if TYPE_CHECKING:
    from slipstream.trainer.data import PaddedLayout
    from slipstream.trainer.vlm_batch import ImageInputs

WRAPPED_PREFIX = "model."
"""State-dict keys of the policy are the wrapped model's keys with this prefix."""


class Policy(nn.Module):
    """`forward(input_ids_T, position_ids_T, temperatures_T, loss_mask_T=None, replay_TRA=None, images=None,
    layout=None) -> (logprobs_T, entropy_T)` (see packed_logprobs): with `loss_mask_T` the LM head runs only for
    loss tokens (0 elsewhere); `replay_TRA` replays inference's routing in the MoE layers (router replay); `images`
    are the micro-batch's images (vision-language models); `layout` is the rows' layout when the caller has it
    (PackedMicroBatch.layout).

    With `context_parallel` (parallel/cp.py) the ranks of a cp group pass the same micro-batch, each runs its shard
    of the row, and each returns the whole row's values; `owned_tokens` says which tokens' loss a rank adds up.
    `head_dtype`: float32 keeps the LM head's logits in float32 (model.head_dtype); None: the compute dtype."""

    def __init__(
        self,
        model: nn.Module,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        context_parallel: ContextParallel | None = None,
        head_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.context_parallel = context_parallel
        self.head_dtype = head_dtype

    def forward(
        self,
        input_ids_T: Tensor,
        position_ids_T: Tensor,
        temperatures_T: Tensor,
        loss_mask_T: Tensor | None = None,
        replay_TRA: Tensor | None = None,
        images: "ImageInputs | None" = None,
        layout: "PaddedLayout | None" = None,
    ) -> tuple[Tensor, Tensor]:
        return packed_logprobs(
            self.model,
            input_ids_T,
            position_ids_T,
            temperatures_T,
            self.chunk_size,
            target_mask_T=loss_mask_T,
            context_parallel=self.context_parallel,
            replay_TRA=replay_TRA,
            images=images,
            layout=layout,
            head_dtype=self.head_dtype,
        )

    def owned_tokens(
        self, num_tokens: int, device: torch.device, position_ids_T: Tensor | None = None
    ) -> Tensor | None:
        """owned_T: the tokens of a micro-batch whose loss this rank adds up; None (all of them) without CP. Pass
        the micro-batch's `position_ids_T` when it may hold prefix trees (a branch's first token is predicted from
        the shared prefix)."""
        if self.context_parallel is None:
            return None
        parent_T = None if position_ids_T is None else parent_index(position_ids_T)
        return self.context_parallel.owned_tokens(num_tokens, device, parent_T)

    def runs_prefix_trees(self, device: torch.device) -> bool:
        """Does this policy compute a prefix tree's shared prefix once (logprobs.runs_prefix_trees), rather than write
        the tree out as its samples?"""
        return runs_prefix_trees(self.model, device, self.context_parallel is not None)


def load_model(model_dir: Path, impl: str, vlm: bool = False) -> tuple[nn.Module, str]:
    """(float32 model on the CPU, resolved impl "custom" or "hf") for an HF model folder and `trainer.model_impl`.
    `vlm` ([model.vlm]): the whole vision-language model (vision encoder + language model) through transformers'
    AutoModelForImageTextToText, under the checkpoint's own tensor names."""
    from transformers import AutoConfig

    from slipstream.models.registry import load_pretrained, resolve_impl

    if vlm:
        from transformers import AutoModelForImageTextToText

        if impl == "custom":
            raise ValueError("[model.vlm] runs through transformers: set trainer.model_impl = 'hf' or 'auto'")
        return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32), "hf"

    resolved = resolve_impl(AutoConfig.from_pretrained(model_dir).model_type, impl)
    return load_pretrained(model_dir, impl=resolved, dtype=torch.float32, device="cpu"), resolved


def strip_wrapped_prefix(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Policy state-dict keys -> the wrapped model's keys."""
    bad = [k for k in state_dict if not k.startswith(WRAPPED_PREFIX)]
    if bad:
        raise ValueError(f"policy state dict has keys outside the wrapped model, e.g. {bad[:3]}")
    return {k[len(WRAPPED_PREFIX) :]: v for k, v in state_dict.items()}
