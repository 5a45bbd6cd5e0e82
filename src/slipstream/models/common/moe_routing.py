"""DeepSeek-V3-style routing (GLM-4.5 / INTELLECT-3, the base of GLM-5's MoE): sigmoid expert scores, a selection-only
score correction bias, group-limited top-k and a routed scaling factor; and the MoE layer that adds a dense shared
expert to the routed ones. Both subclass common/moe.py's TopKRouter and MoE, so expert parallelism (which wraps the
GroupedExperts), the trainer's router-replay counters and the MoE statistics work unchanged.

Legend: N = tokens, D = hidden size, E = experts, A = active experts per token (top-k), Q = expert groups,
P = experts per group (E / Q).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.models.common.mlp import SwiGLU
from slipstream.models.common.moe import MoE, TopKRouter, replay_counts


class GroupLimitedSigmoidRouter(TopKRouter):
    """transformers' `Glm4MoeTopkRouter` (= DeepSeek-V3's): with s = sigmoid(float32 logits),

    - selection: on `s + e_score_correction_bias`, experts are split into Q groups; a group scores the sum of its two
      best experts, only the `topk_groups` best groups stay, and the top-A experts of those are chosen;
    - gate weights: `s` (WITHOUT the bias) at the chosen experts, renormalised to sum to 1 if `norm_topk_prob`
      (+1e-20 as transformers), then times `routed_scaling_factor`.

    `e_score_correction_bias` is a float32 buffer (in the state dict and the checkpoint, never trained: DeepSeek-V3
    updates it outside backprop to balance the load); the selection carries no gradient, as a top-k does not.

    Router replay (`replay_NA`, see TopKRouter): the replayed experts REPLACE the whole selection (bias, groups and
    top-k; inference made that choice with the same rule), and the gate weights are this router's sigmoid scores at
    the replayed experts, normalised and scaled as above; the bias never enters them. So gradients reach the router
    through the scores of the replayed experts, and a replay of the router's own choice changes nothing.

    The first output, `probs_NE`, is what MoE's load-balance statistics average: sigmoid scores normalised to sum to
    1 over the experts (DeepSeek-V3's sequence-wise balance loss uses these affinities), so the Switch-style aux loss
    of common/moe.py still equals A when the load is balanced. transformers' glm4_moe computes no aux loss.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        *,
        num_groups: int = 1,
        topk_groups: int = 1,
        routed_scaling_factor: float = 1.0,
    ):
        super().__init__(dim, num_experts, top_k, norm_topk_prob)
        if num_experts % num_groups != 0:
            raise ValueError(f"n_group ({num_groups}) must divide the number of routed experts ({num_experts})")
        if num_groups > 1 and num_experts // num_groups < 2:
            raise ValueError(f"group-limited routing needs >= 2 experts per group (E={num_experts}, Q={num_groups})")
        if not 1 <= topk_groups <= num_groups or top_k > topk_groups * (num_experts // num_groups):
            raise ValueError(
                f"topk_group ({topk_groups}) groups of {num_experts // num_groups} experts cannot hold "
                f"num_experts_per_tok ({top_k}) experts (n_group {num_groups})"
            )
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.routed_scaling_factor = routed_scaling_factor
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def select(self, scores_NE: Tensor) -> Tensor:
        """expert_ids_NA: group-limited top-A of `scores_NE + e_score_correction_bias` (no gradient)."""
        with torch.no_grad():
            choice_NE = scores_NE + self.e_score_correction_bias.float()
            if self.num_groups > 1:
                N, E = choice_NE.shape
                choice_NQP = choice_NE.view(N, self.num_groups, E // self.num_groups)
                group_scores_NQ = choice_NQP.topk(2, dim=-1).values.sum(dim=-1)
                groups_NQ = group_scores_NQ.topk(self.topk_groups, dim=-1, sorted=False).indices
                keep_NQ = torch.zeros_like(group_scores_NQ, dtype=torch.bool).scatter_(1, groups_NQ, True)
                choice_NE = choice_NQP.masked_fill(~keep_NQ[..., None], float("-inf")).view(N, E)
            return choice_NE.topk(self.top_k, dim=-1, sorted=False).indices

    def logits(self, x_ND: Tensor) -> Tensor:
        """logits_NE in float32, as TopKRouter's (a subclass may reshape them: Laguna's softcap)."""
        with torch.autocast(x_ND.device.type, enabled=False):
            return F.linear(x_ND.float(), self.weight.float())

    def forward(self, x_ND: Tensor, replay_NA: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(probs_NE float32 (normalised sigmoid scores, for statistics), expert_ids_NA, weights_NA float32)."""
        scores_NE = self.logits(x_ND).sigmoid()
        expert_ids_NA = self.select(scores_NE)
        if replay_NA is not None:
            expert_ids_NA = replay_selection(self, expert_ids_NA, replay_NA)
        weights_NA = scores_NE.gather(-1, expert_ids_NA)
        if self.norm_topk_prob:
            weights_NA = weights_NA / (weights_NA.sum(dim=-1, keepdim=True) + 1e-20)
        weights_NA = weights_NA * self.routed_scaling_factor
        return scores_NE / scores_NE.sum(dim=-1, keepdim=True), expert_ids_NA, weights_NA


def replay_selection(router: TopKRouter, own_NA: Tensor, replay_NA: Tensor) -> Tensor:
    """expert_ids_NA: inference's experts (`replay_NA`) for the tokens it routed (no -1), the router's own choice
    `own_NA` for the others; records (tokens, of those replayed, of those the ones whose own set was inference's)
    on `router.replay_counts`, as TopKRouter does (moe.replay_counts)."""
    replay_NA = replay_NA.to(own_NA.dtype)
    routed_N, router.replay_counts = replay_counts(own_NA, replay_NA)
    return torch.where(routed_N[:, None], replay_NA, own_NA)


class SharedExpertMoE(MoE):
    """Routed experts through a GroupLimitedSigmoidRouter, plus a dense shared SwiGLU (`shared_experts`, width
    `shared_hidden_dim`: transformers' `moe_intermediate_size * n_shared_experts`) that every token goes through:
    y = routed(x) + shared(x). Returns (y_BTD, aux_loss) as MoE does (the aux loss over the routed experts only)."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        *,
        shared_hidden_dim: int,
        num_groups: int = 1,
        topk_groups: int = 1,
        routed_scaling_factor: float = 1.0,
    ):
        super().__init__(dim, hidden_dim, num_experts, top_k, norm_topk_prob)
        self.router = GroupLimitedSigmoidRouter(
            dim,
            num_experts,
            top_k,
            norm_topk_prob,
            num_groups=num_groups,
            topk_groups=topk_groups,
            routed_scaling_factor=routed_scaling_factor,
        )
        self.shared_experts = SwiGLU(dim, shared_hidden_dim)

    def forward(self, x_BTD: Tensor, replay_BTA: Tensor | None = None) -> tuple[Tensor, Tensor]:
        y_BTD, aux_loss = super().forward(x_BTD, replay_BTA)
        return y_BTD + self.shared_experts(x_BTD), aux_loss

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        nn.init.zeros_(self.router.e_score_correction_bias)
        self.shared_experts.init_weights(std)
