"""GLM-5's attention: multi-head latent attention (MLA) whose queries each attend only to the keys that DeepSeek
sparse attention's (DSA) indexer ranks in their top-k, over packed rows (samples never see each other: the indexer
ranks only keys of the query's own sample, causally) and under context parallelism.

Context parallelism: MLA's keys and values come from one small per-token latent (`kv_lora_rank` + rope dims), and the
indexer's keys are one `index_head_dim` vector per token; both are all-gathered over the cp group in ONE call (far
less than gathering H expanded heads), then every rank expands K/V for the whole row, ranks its shard's queries
against every key of their samples (the shard's mask from common/attention.py) and attends. The result is exact:
each query sees exactly what it sees without cp.

Ties: where keys share the k-th best index score (relu zeroes a key for every indexer head, so with few heads or
negative head weights many keys score exactly 0, often the best score of a query), the earliest keys are kept: vLLM's
one explicit rule (its context-parallel top-k merge ranks by score, then by the lower token index), and the only rule
that keeps the same choice however the sample is packed or sharded. transformers' `topk` picks among equal scores as
its kernel happens to (on CPU: a quickselect), so it differs exactly there; tests/unit/test_glm_moe_dsa_sparse.py
shows both and checks ours against transformers with the rule above.

Indexer RoPE: interleaved pairs when the config sets `indexer_rope_interleave` (GLM-5's checkpoints), else the two
halves (NeoX, DeepSeek-V3.2's indexer): what vLLM serves. transformers 5.19 interleaves whatever the config says.

Training: the indexer runs without gradient, as in transformers (`@torch.no_grad`) and in DeepSeek-V3.2, where the
language-model loss never reaches it (its input is detached; its own KL loss against the attention distribution
trains it during continued pre-training, not modelled here: RL and SFT keep it as the checkpoint has it). Its
weights are loaded, kept and published unchanged, so inference's top-k stays the checkpoint's; the optimizer skips
them (no gradient). Its scores are float32 whatever the autocast.

Memory: the mask is [B, 1, t, T] booleans and the indexer scores [B, t', index heads, T] float32 per query chunk
t' (chunked to bound them); attention is masked SDPA. Fine for tests and moderate rows, O(T^2) like the reference.

Legend: B = rows, T = tokens per row (all cp shards), t = this shard's tokens (T without cp), D = hidden size,
H = heads, Q = q_lora_rank, C = kv_lora_rank, N = qk_nope_head_dim, R = qk_rope_head_dim, V = v_head_dim,
I = index_head_dim, J = index heads, A = index_topk.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.models.common.attention import AttentionLayout, build_packed_causal_mask
from slipstream.models.common.norm import RMSNorm
from slipstream.models.common.rope import apply_rope, apply_rope_interleaved
from slipstream.models.glm_moe_dsa.args import GlmMoeDsaArgs

LATENT_NORM_EPS = 1e-6
"""transformers builds `q_a_layernorm`, `kv_a_layernorm` and the indexer's `k_norm` with this eps, not the config's."""
INDEX_SCORES_BUDGET = 2**28
"""Float32 index scores held at once (1 GiB): queries are ranked in chunks of at most this many scores (a Python loop
that torch.compile unrolls: T = 16384 with 32 indexer heads takes 32 chunks)."""


class DsaIndexer(nn.Module):
    """DSA's lightning indexer (transformers' GlmMoeDsaIndexer): J heads of queries from the query bottleneck
    (`wq_b`), one key per token (`wk`, LayerNorm `k_norm`), both with RoPE on their first R dims (interleaved or
    half-split, see the module docstring); a key's score for a query is sum_j w_j * relu(q_j . k / sqrt(I)),
    w = `weights_proj`(x) / sqrt(J)."""

    def __init__(self, args: GlmMoeDsaArgs):
        super().__init__()
        self.num_heads, self.head_dim, self.top_k = args.index_n_heads, args.index_head_dim, args.index_topk
        self.rope_dim = args.qk_rope_head_dim
        self.rotate = apply_rope_interleaved if args.indexer_rope_interleave else apply_rope
        self.wq_b = nn.Linear(args.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=LATENT_NORM_EPS)
        self.weights_proj = nn.Linear(args.hidden_size, self.num_heads, bias=False)

    def _rope(self, x_BTJI: Tensor, cos_BTR: Tensor, sin_BTR: Tensor) -> Tensor:
        x_rot, x_pass = x_BTJI.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((self.rotate(x_rot, cos_BTR, sin_BTR), x_pass), dim=-1)

    def keys(self, x_BtD: Tensor, cos_BtR: Tensor, sin_BtR: Tensor) -> Tensor:
        """k_BtI: the indexer's key of each token (no gradient)."""
        with torch.no_grad():
            k_Bt1I = self.k_norm(self.wk(x_BtD)).unsqueeze(2)
            return self._rope(k_Bt1I, cos_BtR, sin_BtR).squeeze(2)

    def select(
        self, x_BtD: Tensor, q_resid_BtQ: Tensor, k_BTI: Tensor, cos_BtR: Tensor, sin_BtR: Tensor, mask_BtT: Tensor
    ) -> Tensor:
        """keep_BtT: True at each query's top-A keys among those `mask_BtT` allows (all of them when they are at most
        A); computed without gradient, in float32."""
        B, t, T = mask_BtT.shape
        if self.top_k >= T:  # every allowed key is in the top-k
            return mask_BtT
        with torch.no_grad(), torch.autocast(x_BtD.device.type, enabled=False):
            q_BtJI = F.linear(q_resid_BtQ.float(), self.wq_b.weight.float()).view(B, t, self.num_heads, self.head_dim)
            q_BtJI = self._rope(q_BtJI, cos_BtR.float(), sin_BtR.float())
            w_BtJ = F.linear(x_BtD.float(), self.weights_proj.weight.float()) * self.num_heads**-0.5
            k_BIT = k_BTI.float().transpose(1, 2)
            chunk = max(1, INDEX_SCORES_BUDGET // (B * self.num_heads * T))
            keep = []
            for start in range(0, t, chunk):
                rows = slice(start, start + chunk)
                scores_BcJT = torch.matmul(q_BtJI[:, rows], k_BIT.unsqueeze(1)) * self.head_dim**-0.5
                index_BcT = torch.matmul(w_BtJ[:, rows].unsqueeze(-2), scores_BcJT.relu()).squeeze(-2)
                index_BcT = index_BcT.masked_fill(~mask_BtT[:, rows], float("-inf"))
                # A stable sort, not topk: among keys of EQUAL score (relu zeroes whole keys) the earlier key wins, as
                # in vLLM's merge, a rule that does not depend on where the sample sits in the row (topk's does).
                top_BcA = index_BcT.sort(dim=-1, descending=True, stable=True).indices[..., : self.top_k]
                keep.append(torch.zeros_like(mask_BtT[:, rows]).scatter_(-1, top_BcA, True))
            return torch.cat(keep, dim=1) & mask_BtT

    def init_weights(self, std: float) -> None:
        for linear in (self.wq_b, self.wk, self.weights_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        self.k_norm.reset_parameters()


class MlaSparseAttention(nn.Module):
    """transformers' GlmMoeDsaAttention (every layer a "full" indexer layer), with HF's parameter names."""

    def __init__(self, args: GlmMoeDsaArgs):
        super().__init__()
        D, H, bias = args.hidden_size, args.num_heads, args.attention_bias
        self.num_heads, self.kv_lora_rank = H, args.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.scale = args.qk_head_dim**-0.5
        self.q_a_proj = nn.Linear(D, args.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(args.q_lora_rank, LATENT_NORM_EPS)
        self.q_b_proj = nn.Linear(args.q_lora_rank, H * args.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, args.kv_lora_rank + args.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, H * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * args.v_head_dim, D, bias=bias)
        self.indexer = DsaIndexer(args)

    def forward(self, x_BtD: Tensor, cos_BtR: Tensor, sin_BtR: Tensor, layout: AttentionLayout) -> Tensor:
        B, t, _ = x_BtD.shape
        H, N, R = self.num_heads, self.nope_dim, self.rope_dim
        q_resid_BtQ = self.q_a_layernorm(self.q_a_proj(x_BtD))
        q_nope_BtHN, q_rot_BtHR = self.q_b_proj(q_resid_BtQ).view(B, t, H, N + R).split([N, R], dim=-1)
        q_BtHK = torch.cat((q_nope_BtHN, apply_rope_interleaved(q_rot_BtHR, cos_BtR, sin_BtR)), dim=-1)
        c_BtC, k_rot_BtR = self.kv_a_proj_with_mqa(x_BtD).split([self.kv_lora_rank, R], dim=-1)
        k_rot_BtR = apply_rope_interleaved(k_rot_BtR.unsqueeze(2), cos_BtR, sin_BtR).squeeze(2)
        index_k_BtI = self.indexer.keys(x_BtD, cos_BtR, sin_BtR)
        # One per-token row holds all a key needs: the normed latent, the rope key and the indexer's key.
        c_BtC = self.kv_a_layernorm(c_BtC)
        row_Bt_ = torch.cat((c_BtC, k_rot_BtR.to(c_BtC.dtype), index_k_BtI.to(c_BtC.dtype)), dim=-1)
        if layout.context is not None:
            row_BT_, mask_BtT = layout.context.gather_kv(row_Bt_), layout.mask_B1TT[:, 0]
        else:
            row_BT_, mask_BtT = row_Bt_, build_packed_causal_mask(layout.position_ids_BT)[:, 0]
        c_BTC, k_rot_BTR, index_k_BTI = row_BT_.split([self.kv_lora_rank, R, index_k_BtI.shape[-1]], dim=-1)
        T = c_BTC.shape[1]
        k_nope_BTHN, v_BTHV = self.kv_b_proj(c_BTC).view(B, T, H, N + self.v_dim).split([N, self.v_dim], dim=-1)
        k_BTHK = torch.cat((k_nope_BTHN, k_rot_BTR.unsqueeze(2).expand(B, T, H, R)), dim=-1)
        keep_BtT = self.indexer.select(x_BtD, q_resid_BtQ, index_k_BTI, cos_BtR, sin_BtR, mask_BtT)
        o_BHtV = F.scaled_dot_product_attention(
            q_BtHK.transpose(1, 2),
            k_BTHK.transpose(1, 2),
            v_BTHV.transpose(1, 2),
            attn_mask=keep_BtT.unsqueeze(1),
            scale=self.scale,
        )
        return self.o_proj(o_BHtV.transpose(1, 2).reshape(B, t, H * self.v_dim))

    def init_weights(self, std: float) -> None:
        for linear in (self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.q_a_layernorm.init_weights()
        self.kv_a_layernorm.init_weights()
        self.indexer.init_weights(std)
