"""GPUs and model shapes the planner knows: peak figures, memory, link bandwidths, and transformer shapes with
their parameter counts (total, active per token, experts)."""

from typing import Literal

from pydantic import Field

from slipstream.config.base import BaseConfig


class GpuSpec(BaseConfig):
    """One GPU kind. Link figures: intra-node from benchmarks/RESULTS.md ("Weight transfer": raw NCCL broadcast
    ~360 GB/s between two H200s over NVLink); inter-node is an assumption (one 400 Gb/s NIC per GPU)."""

    name: str
    """h100 or h200."""
    peak_bf16_flops: float = Field(gt=0)
    """Dense bf16 peak (the published figure, 989e12, for both SXM parts)."""
    memory_gib: float = Field(gt=0)
    """Memory torch can use."""
    hbm_bytes_per_s: float = Field(gt=0)
    """HBM bandwidth (datasheet: 3.35 TB/s H100 SXM, 4.8 TB/s H200)."""
    intra_node_bytes_per_s: float = Field(360e9, gt=0)
    """NVLink, one direction, as a raw NCCL broadcast reaches it."""
    inter_node_bytes_per_s: float = Field(50e9, gt=0)
    """Network per GPU (assumed: one 400 Gb/s NIC per GPU)."""


GPUS = {
    "h100": GpuSpec(name="h100", peak_bf16_flops=989e12, memory_gib=79.6, hbm_bytes_per_s=3.35e12),
    "h200": GpuSpec(name="h200", peak_bf16_flops=989e12, memory_gib=139.8, hbm_bytes_per_s=4.8e12),
}


class ModelShape(BaseConfig):
    """A decoder-only transformer, dense or MoE (every layer from `num_dense_layers` on is MoE)."""

    name: str
    """Name `--model-shape` takes."""
    num_layers: int = Field(ge=1)
    """Transformer blocks."""
    hidden: int = Field(ge=1)
    """Model width."""
    num_heads: int = Field(ge=1)
    """Query heads."""
    num_kv_heads: int = Field(ge=1)
    """Key/value heads (GQA)."""
    head_dim: int = Field(ge=1)
    """Width of one head."""
    intermediate: int = Field(ge=1)
    """Dense MLP width (dense layers)."""
    vocab: int = Field(ge=1)
    """Vocabulary size (embedding and LM head rows)."""
    tied_embeddings: bool = False
    """Whether the LM head shares the embedding's weights."""
    num_experts: int = Field(0, ge=0)
    """Routed experts per MoE layer (0: dense model)."""
    top_k: int = Field(0, ge=0)
    """Experts each token is routed to."""
    moe_intermediate: int = Field(0, ge=0)
    """Width of one expert's MLP."""
    num_shared_experts: int = Field(0, ge=0)
    """Experts every token goes through, per MoE layer."""
    num_dense_layers: int = Field(0, ge=0)
    """Leading layers with a dense MLP in a MoE model."""
    kv_bytes_per_token: int | None = Field(None, ge=1)
    """KV-cache bytes per token over all layers if not plain GQA (e.g. MLA's latent cache); None: from heads."""
    attention: Literal["dense", "sparse"] = "dense"
    """sparse: attention cost capped at `sparse_top_k` keys per query (DeepSeek-style sparse attention)."""
    sparse_top_k: int = Field(2048, ge=1)
    """Keys each query attends to with sparse attention."""

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.num_experts else 0

    @property
    def attn_params_per_layer(self) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv)

    @property
    def expert_params_per_layer(self) -> int:
        return 3 * self.hidden * self.moe_intermediate * self.num_experts

    @property
    def dense_params(self) -> int:
        """Parameters every rank holds whole under EP (all but the routed experts), embeddings and head included."""
        dense_mlp = 3 * self.hidden * self.intermediate * (self.num_layers - self.num_moe_layers)
        shared = 3 * self.hidden * self.moe_intermediate * self.num_shared_experts * self.num_moe_layers
        router = self.hidden * self.num_experts * self.num_moe_layers
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.attn_params_per_layer + dense_mlp + shared + router + embed

    @property
    def expert_params(self) -> int:
        return self.expert_params_per_layer * self.num_moe_layers

    @property
    def total_params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def active_dense_matmul_params(self) -> int:
        """Per token, outside the routed experts and the LM head: attention, dense and shared MLPs, router."""
        return self.dense_params - self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def active_expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate * self.top_k * self.num_moe_layers

    @property
    def active_params(self) -> int:
        return self.active_dense_matmul_params + self.active_expert_params + self.vocab * self.hidden

    def kv_bytes(self) -> int:
        """KV-cache bytes per token (bf16) over all layers."""
        if self.kv_bytes_per_token is not None:
            return self.kv_bytes_per_token
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    def attention_context(self, context: float) -> float:
        return min(context, self.sparse_top_k) if self.attention == "sparse" else context

    def cut(self, num_layers: int) -> "ModelShape":
        """The same shape with fewer layers (the benchmarks' Qwen3-30B-A3B cuts)."""
        return self.model_copy(update={"num_layers": num_layers, "name": f"{self.name}-{num_layers}l"})


QWEN3_0_6B = ModelShape(
    name="qwen3-0.6b",
    num_layers=28,
    hidden=1024,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    intermediate=3072,
    vocab=151936,
    tied_embeddings=True,
)
QWEN3_30B_A3B = ModelShape(
    name="qwen3-30b-a3b",
    num_layers=48,
    hidden=2048,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    intermediate=6144,
    vocab=151936,
    num_experts=128,
    top_k=8,
    moe_intermediate=768,
)
GLM5_ASSUMED = ModelShape(
    name="glm-5",
    num_layers=78,
    hidden=6144,
    num_heads=96,
    num_kv_heads=8,
    head_dim=128,
    intermediate=12288,
    vocab=154880,
    num_experts=256,
    top_k=8,
    moe_intermediate=2048,
    num_shared_experts=1,
    num_dense_layers=3,
    kv_bytes_per_token=78 * 576 * 2,
    attention="sparse",
    sparse_top_k=2048,
)
"""GLM-5 as the planner's worked example (docs/planner.md) assumes it. Built to match published figures (744B total / 40B active
parameters, DeepSeek-style sparse attention); everything else is an assumption chosen to reproduce those totals:
78 layers (3 dense), hidden 6144, 256 routed experts of width 2048 (top 8) + 1 shared, attention projections
counted as GQA 96/8 heads of 128, and an MLA-style latent KV cache of 576 values per token and layer."""

SHAPES = {s.name: s for s in (QWEN3_0_6B, QWEN3_30B_A3B, GLM5_ASSUMED)}
