"""What every MoE family adds to the decoder skeleton: logits with the per-layer load-balance losses, the last
forward's statistics, and the choice of expert kernel."""

from torch import Tensor

from slipstream.models.common.moe import MoE, MoEStats, collect_moe_stats
from slipstream.models.common.transformer import DecoderLM


class MoEDecoderLM(DecoderLM):
    """A DecoderLM with MoE blocks (common/moe.py); families subclass it with their own blocks."""

    def forward_with_aux_loss(self, input_ids_BT: Tensor, position_ids_BT: Tensor) -> tuple[Tensor, Tensor]:
        """(logits_BTV, aux_loss_L) for a packed batch (the model never adds the aux loss to anything)."""
        h_BTD, aux_loss_L = self.forward_hidden_with_aux_loss(input_ids_BT, position_ids_BT)
        return self.logits(h_BTD), aux_loss_L

    def moe_stats(self) -> MoEStats:
        """tokens_per_expert_LE, router_prob_mean_LE, aux_loss_L of the last forward (detached; common/moe.py)."""
        return collect_moe_stats(self)

    def set_grouped_mm(self, enabled: bool) -> None:
        """Choose torch._grouped_mm (True, the default) or the per-expert loop (False) for every MoE layer."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.experts.use_grouped_mm = enabled
