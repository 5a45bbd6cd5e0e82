"""Self-attention over PACKED rows (samples share a row; position_ids restart at 0 at each sample; no token sees
another sample; prefix trees share a prompt among samples, common/prefix_tree.py), with one path per device and
layout, picked once per forward by `build_attention_layout`:

| backend       | when                                             | kernel                                         |
|---------------|--------------------------------------------------|------------------------------------------------|
| "causal"      | CUDA, every row holds one sample                 | SDPA is_causal=True (cuDNN, else flash)        |
| "varlen"      | CUDA, packed rows, 16-bit compute (bf16 / fp16)  | flash attention varlen over cu_seqlens         |
| "flex"        | packed rows or prefix trees when the model's     | flex_attention with a block mask of the rows'  |
|               | `packed_attention` is "flex" (any device)        | samples / trees (compiled on CUDA)             |
| "reference"   | anything else (CPU; float32 packed rows on CUDA; | block-diagonal causal mask + SDPA, O(T^2) mask |
|               | rows holding prefix trees)                       |                                                |
| "context_parallel" | a ContextShard is given (any device)        | all-gathered K/V + the reference mask at offset |

Packed rows on CUDA also take the reference where torch has no `torch.nn.attention.varlen` (before 2.10).
Under context parallelism (parallel/cp.py) the rows hold one shard of longer rows: keys and values are all-gathered
through `ContextShard.gather_kv` and the shard's queries attend with the reference's mask, offset to the shard; GPUs
take this masked SDPA path too (no fused kernel takes a query offset into a packed mask).
`packed_attention` (the reference) defines the result; tests/gpu checks every GPU path against it. On an H100 with
torch 2.11 (benchmarks/RESULTS.md) the causal path runs cuDNN's kernel, 1.8x faster than flash there.

Legend: B = rows, T = tokens per row, N = B * T tokens, S = samples (over all rows), D = hidden size,
H = query heads, G = key/value heads, K = head dim, t = tokens of a context-parallel shard of a row.
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from slipstream.models.common.document_blocks import document_block_mask
from slipstream.models.common.norm import RMSNorm
from slipstream.models.common.prefix_tree import has_branches, tree_ids, tree_mask
from slipstream.models.common.rope import apply_rope

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

if varlen_attn is None:
    _VARLEN_KWARGS: dict = {}
else:
    _params = inspect.signature(varlen_attn).parameters
    # torch 2.10 takes is_causal; later releases take window_size and (some) ask for enable_gqa explicitly.
    _VARLEN_KWARGS = {"window_size": (-1, 0)} if "window_size" in _params else {"is_causal": True}
    if "enable_gqa" in _params:
        _VARLEN_KWARGS["enable_gqa"] = True

# cuDNN's fused attention is the fastest causal kernel on Hopper (benchmarks/RESULTS.md); flash and memory-efficient
# follow.
_CAUSAL_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ContextShard:
    """Context parallelism, set up from outside: the rows given to the model are tokens [offset, offset + t) of
    longer rows whose positions are `kv_position_ids_BT` (T tokens, every cp rank's shard in order)."""

    kv_position_ids_BT: Tensor
    offset: int
    gather_kv: Callable[[Tensor], Tensor]
    """[B, t, ...] of this rank -> [B, T, ...] of every cp rank along dim 1, differentiable (backward reduce-scatters)."""


@dataclass(frozen=True)
class AttentionLayout:
    """How the samples of a packed batch lie in its rows, and which attention path runs them."""

    backend: str
    """"causal", "varlen" or "reference" (see the module docstring)."""
    position_ids_BT: Tensor
    cu_seqlens_S1: Tensor | None = None
    """varlen only: int32 offsets of each sample in the flattened N tokens, then N."""
    max_seqlen: int = 0
    """varlen only: the longest sample."""
    context: ContextShard | None = None
    """context_parallel only: where the rows' tokens sit in the whole rows."""
    mask_B1TT: Tensor | None = None
    """context_parallel only: [B, 1, t, T], True where a query of the shard may attend to a key of the row."""
    block_mask: object | None = None
    """flex only: the rows' BlockMask (prefix_tree.py's rule: samples and trees never see each other)."""


PACKED_KERNELS = ("varlen", "flex")
"""What runs rows that hold several samples (or prefix trees): "varlen" (flash attention varlen on CUDA, the
reference mask elsewhere and for trees) or "flex" (flex_attention with a block mask, samples and trees alike)."""


def build_attention_layout(
    position_ids_BT: Tensor,
    compute_dtype: torch.dtype,
    context: ContextShard | None = None,
    packed: str = "varlen",
) -> AttentionLayout:
    """Pick the attention path for this batch (one host sync on CUDA; none on CPU).

    `compute_dtype` is the dtype attention runs in (the autocast dtype, or the activations' dtype without autocast).
    `packed` (PACKED_KERNELS) chooses the kernel of rows holding several samples or prefix trees.
    """
    if packed not in PACKED_KERNELS:
        raise ValueError(f"packed attention {packed!r}; choose one of {', '.join(PACKED_KERNELS)}")
    if context is not None:
        mask_B1tT = build_shard_causal_mask(context, position_ids_BT.shape[-1])
        return AttentionLayout("context_parallel", position_ids_BT, context=context, mask_B1TT=mask_B1tT)
    if packed == "flex" and not _one_sample_per_row(position_ids_BT):
        if position_ids_BT.device.type == "cuda":
            compiled_flex_attention()  # made here, outside the compiled blocks that call it
        return AttentionLayout("flex", position_ids_BT, block_mask=build_block_mask(position_ids_BT))
    if position_ids_BT.device.type != "cuda":
        return AttentionLayout("reference", position_ids_BT)
    starts_BT = position_ids_BT == 0
    starts_BT[:, 0] = True  # a row's first token starts a group even when its positions do not start at 0
    starts_S = torch.nonzero(starts_BT.flatten()).squeeze(-1)
    if bool(has_branches(position_ids_BT)):  # prefix trees: only the reference's mask expresses their branches
        return AttentionLayout("reference", position_ids_BT)
    num_rows = position_ids_BT.shape[0]
    if starts_S.numel() == num_rows:
        return AttentionLayout("causal", position_ids_BT)
    if varlen_attn is None or compute_dtype not in _SIXTEEN_BIT:
        return AttentionLayout("reference", position_ids_BT)
    cu_seqlens_S1 = F.pad(starts_S, (0, 1), value=position_ids_BT.numel()).to(torch.int32)
    max_seqlen = int((cu_seqlens_S1[1:] - cu_seqlens_S1[:-1]).max())
    return AttentionLayout("varlen", position_ids_BT, cu_seqlens_S1, max_seqlen)


def _one_sample_per_row(position_ids_BT: Tensor) -> bool:
    """Does every row hold one sample (positions restart nowhere but at column 0, no branch)? One host sync."""
    restarts_BT = position_ids_BT[:, 1:] != position_ids_BT[:, :-1] + 1
    return not bool(restarts_BT.any())


def build_block_mask(position_ids_BT: Tensor):
    """flex_attention's BlockMask of `tree_mask`'s rule (same tree, causal, own segment or the root prefix it
    continues), from per-token indices: no [T, T] tensor on CUDA, where its construction is compiled. Rows of
    independent samples (no prefix tree) take document_blocks.py's direct construction (one host sync here)."""
    from torch.nn.attention.flex_attention import create_block_mask

    ids = tree_ids(position_ids_BT)
    tree_BT, segment_BT, fork_BT, is_root_BT = ids.tree_start_BT, ids.segment_start_BT, ids.fork_BT, ids.is_root_BT
    if not bool(has_branches(position_ids_BT)):

        def sample_mask_mod(b, h, q, kv):
            return (tree_BT[b, q] == tree_BT[b, kv]) & (kv <= q)

        return document_block_mask(tree_BT, sample_mask_mod)

    def mask_mod(b, h, q, kv):
        same_tree = tree_BT[b, q] == tree_BT[b, kv]
        in_prefix = is_root_BT[b, kv] & (position_ids_BT[b, kv] < fork_BT[b, q])
        return same_tree & (kv <= q) & ((segment_BT[b, q] == segment_BT[b, kv]) | in_prefix)

    B, T = position_ids_BT.shape
    on_gpu = position_ids_BT.device.type == "cuda"
    return create_block_mask(mask_mod, B, None, T, T, device=position_ids_BT.device, _compile=on_gpu)


_COMPILED_FLEX: list = []
"""torch.compile(flex_attention), made once, outside compiled blocks (when a flex layout is chosen): made inside the
first trace, the list's emptiness was a guard of that graph, which failed at the next call and recompiled every
block once more (seen with TORCH_LOGS=recompiles on an H100)."""


def compiled_flex_attention():
    """The compiled flex_attention kernel (its fused CUDA kernel), created on first use."""
    if not _COMPILED_FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX.append(torch.compile(flex_attention))
    return _COMPILED_FLEX[0]


def flex_attention_call(q_BHTK: Tensor, k_BGTK: Tensor, v_BGTK: Tensor, block_mask) -> Tensor:
    """o_BHTK through flex_attention in the autocast dtype (the op is not autocast-aware); compiled on CUDA (its
    fused kernel), eager elsewhere (the reference loop, fine for the CPU's small rows)."""
    from torch.nn.attention.flex_attention import flex_attention

    device_type = q_BHTK.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else q_BHTK.dtype
    q_BHTK, k_BGTK, v_BGTK = q_BHTK.to(dtype), k_BGTK.to(dtype), v_BGTK.to(dtype)
    fn = compiled_flex_attention() if device_type == "cuda" else flex_attention
    with torch.autocast(device_type, enabled=False):
        return fn(q_BHTK, k_BGTK, v_BGTK, block_mask=block_mask, enable_gqa=True)


def build_packed_causal_mask(position_ids_BT: Tensor) -> Tensor:
    """mask_B1TT (bool, True = may attend): causal and block-diagonal over the samples of each row, and over the
    prefix trees of each row (common/prefix_tree.py: a branch also sees the root prefix it continues).

    O(T^2) memory per row: a reference for CPU and tests, not for long GPU sequences.
    """
    return tree_mask(position_ids_BT)


def build_shard_causal_mask(context: ContextShard, num_queries: int) -> Tensor:
    """mask_B1tT: `build_packed_causal_mask` of the whole rows, restricted to the shard's query rows."""
    return tree_mask(context.kv_position_ids_BT, context.offset, num_queries)


def context_parallel_attention(q_BtHK: Tensor, k_BtGK: Tensor, v_BtGK: Tensor, layout: AttentionLayout) -> Tensor:
    """o_BtHK of the shard's queries over the keys and values of the whole rows (one all-gather for K and V)."""
    kv_BT2GK = layout.context.gather_kv(torch.stack((k_BtGK, v_BtGK), dim=2))
    k_BGTK, v_BGTK = kv_BT2GK[:, :, 0].transpose(1, 2), kv_BT2GK[:, :, 1].transpose(1, 2)
    o_BHtK = F.scaled_dot_product_attention(
        q_BtHK.transpose(1, 2), k_BGTK, v_BGTK, attn_mask=layout.mask_B1TT, enable_gqa=True
    )
    return o_BHtK.transpose(1, 2)


def packed_attention(q_BHTK: Tensor, k_BGTK: Tensor, v_BGTK: Tensor, position_ids_BT: Tensor) -> Tensor:
    """o_BHTK: softmax(q k^T / sqrt(K)) v within each sample, causally; G divides H (grouped-query attention).
    The reference every other path must match."""
    mask_B1TT = build_packed_causal_mask(position_ids_BT)
    return F.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, attn_mask=mask_B1TT, enable_gqa=True)


def causal_attention(q_BHTK: Tensor, k_BGTK: Tensor, v_BGTK: Tensor) -> Tensor:
    """o_BHTK for rows that each hold one sample: plain causal SDPA (fused kernels, no mask tensor)."""
    with sdpa_kernel(_CAUSAL_BACKENDS, set_priority=True):
        return F.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, is_causal=True, enable_gqa=True)


def varlen_attention(q_NHK: Tensor, k_NGK: Tensor, v_NGK: Tensor, cu_seqlens_S1: Tensor, max_seqlen: int) -> Tensor:
    """o_NHK over the flattened tokens: causal within each sample [cu_seqlens[s], cu_seqlens[s+1]), flash attention
    varlen (GQA native); runs in the autocast dtype (the op is not autocast-aware)."""
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q_NHK.dtype
    q_NHK, k_NGK, v_NGK = q_NHK.to(dtype), k_NGK.to(dtype), v_NGK.to(dtype)
    return varlen_attn(q_NHK, k_NGK, v_NGK, cu_seqlens_S1, cu_seqlens_S1, max_seqlen, max_seqlen, **_VARLEN_KWARGS)


def attention(q_BTHK: Tensor, k_BTGK: Tensor, v_BTGK: Tensor, layout: AttentionLayout) -> Tensor:
    """o_BTHK through the path `layout.backend` names."""
    if layout.backend == "varlen":
        B, T = q_BTHK.shape[:2]
        o_NHK = varlen_attention(
            q_BTHK.flatten(0, 1), k_BTGK.flatten(0, 1), v_BTGK.flatten(0, 1), layout.cu_seqlens_S1, layout.max_seqlen
        )
        return o_NHK.view(B, T, *o_NHK.shape[1:])
    if layout.backend == "context_parallel":
        return context_parallel_attention(q_BTHK, k_BTGK, v_BTGK, layout)
    q_BHTK, k_BGTK, v_BGTK = q_BTHK.transpose(1, 2), k_BTGK.transpose(1, 2), v_BTGK.transpose(1, 2)
    if layout.backend == "flex":
        return flex_attention_call(q_BHTK, k_BGTK, v_BGTK, layout.block_mask).transpose(1, 2)
    if layout.backend == "causal":
        return causal_attention(q_BHTK, k_BGTK, v_BGTK).transpose(1, 2)
    if layout.backend == "reference":
        return packed_attention(q_BHTK, k_BGTK, v_BGTK, layout.position_ids_BT).transpose(1, 2)
    raise ValueError(f"unknown attention backend {layout.backend!r}")


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE and optional per-head q/k RMSNorm (Qwen3); HF's parameter names."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool,
        qk_norm: bool,
        norm_eps: float,
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=bias)
        # Qwen3 normalises each head's query and key before RoPE (one weight of size K shared by all heads).
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, layout: AttentionLayout) -> Tensor:
        B, T, _ = x_BTD.shape
        q_BTHK = self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim)
        k_BTGK = self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        v_BTGK = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        q_BTHK, k_BTGK = apply_rope(q_BTHK, cos_BTK, sin_BTK), apply_rope(k_BTGK, cos_BTK, sin_BTK)
        o_BTHK = attention(q_BTHK, k_BTGK, v_BTGK, layout)
        return self.o_proj(o_BTHK.reshape(B, T, self.num_heads * self.head_dim))

    def init_weights(self, std: float) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_weights()


def sliding_window_attention(q_BtHK: Tensor, k_BtGK: Tensor, v_BtGK: Tensor, layout: AttentionLayout, window: int):
    """o_BtHK: the packed causal attention of common/attention.py's reference mask (under context parallelism: the
    shard's queries over the all-gathered keys, with the shard's mask) where a query also sees only the keys less than
    `window` positions behind it (transformers' `kv_idx > q_idx - sliding_window`). Positions, not columns, measure
    the distance, so packed samples and prefix-tree branches keep their own windows."""
    position_ids_Bt = layout.position_ids_BT
    if layout.backend == "context_parallel":
        kv_BT2GK = layout.context.gather_kv(torch.stack((k_BtGK, v_BtGK), dim=2))
        k_BTGK, v_BTGK = kv_BT2GK[:, :, 0], kv_BT2GK[:, :, 1]
        kv_position_ids_BT, mask_B1tT = layout.context.kv_position_ids_BT, layout.mask_B1TT
    else:
        k_BTGK, v_BTGK = k_BtGK, v_BtGK
        kv_position_ids_BT, mask_B1tT = position_ids_Bt, build_packed_causal_mask(position_ids_Bt)
    distance_BtT = position_ids_Bt[:, :, None] - kv_position_ids_BT[:, None, :]
    mask_B1tT = mask_B1tT & (distance_BtT < window)[:, None]
    o_BHtK = F.scaled_dot_product_attention(
        q_BtHK.transpose(1, 2), k_BTGK.transpose(1, 2), v_BTGK.transpose(1, 2), attn_mask=mask_B1tT, enable_gqa=True
    )
    return o_BHtK.transpose(1, 2)
