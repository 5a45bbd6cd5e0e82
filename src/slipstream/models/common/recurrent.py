"""What models with recurrent layers (linear attention, Mamba) cannot take: their state runs along each sample from
its first token, so a context-parallel shard (which starts mid-sample) and a prefix-tree row (whose branches would
each need the state at their fork point) would not be computed exactly. Such a family sets
`supports_context_parallel = supports_prefix_trees = False` and names its state in `recurrent_state` (common/transformer.py
DecoderLM), whose forward calls `refuse_split_state`."""

import torch
from torch import Tensor

from slipstream.models.common.attention import ContextShard
from slipstream.models.common.prefix_tree import has_branches


def refuse_split_state(
    family: str, layers: str, state: str, context: ContextShard | None, position_ids_BT: Tensor
) -> None:
    """Raise for a context shard or a prefix-tree row. `layers`: what carries the state ("its Mamba2 layers");
    `state`: its name in the tree message ("the Mamba2 state")."""
    if context is not None:
        raise ValueError(
            f"{family} does not support context parallelism: {layers} carry a recurrent state along each sample, "
            "which a context shard cannot see without state passing (not implemented), so the result would not be "
            "exact; set trainer.parallel.cp = 1"
        )
    # One host sync per forward (the blocks, compiled or not, never see it).
    if not torch.compiler.is_compiling() and bool(has_branches(position_ids_BT)):
        raise ValueError(
            f"{family} cannot train prefix-tree rows (a branch would need {state} at its fork point): "
            "set orchestrator.shared_prefix = false for this model"
        )
