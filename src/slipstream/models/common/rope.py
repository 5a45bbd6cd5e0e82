"""Rotary position embeddings (default, linear, llama3 and yarn scaling; optionally partial: only the first dims of each
head rotate), matching transformers' numerics.

Legend: B = rows, T = tokens per row, H = heads, K = head dim, R = rotated dims of a head (K unless partial).
"""

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, kw_only=True)
class RopeArgs:
    """RoPE parameters, as in the HF config's `rope_parameters` (5.x) or `rope_theta` + `rope_scaling` (4.x)."""

    theta: float
    """Base wavelength (`rope_theta`)."""
    rope_type: str = "default"
    """One of SUPPORTED_ROPE_TYPES."""
    factor: float = 1.0
    """Scaling factor for `linear`, `llama3` and `yarn`."""
    low_freq_factor: float = 1.0
    """llama3 only."""
    high_freq_factor: float = 4.0
    """llama3 only."""
    original_max_position_embeddings: int = 8192
    """llama3 and yarn: context length of pre-training."""
    beta_fast: float = 32.0
    """yarn only: rotations above which a frequency is kept (extrapolated)."""
    beta_slow: float = 1.0
    """yarn only: rotations below which a frequency is divided by `factor` (interpolated)."""
    truncate: bool = True
    """yarn only: round the ramp's bounds to whole dims (GPT-OSS: False)."""
    attention_factor: float = 1.0
    """yarn only: cos and sin are multiplied by it (transformers' `attention_scaling`)."""
    partial_rotary_factor: float = 1.0
    """Fraction of each head's dims that rotate (GLM-4.5: 0.5): the first R = int(K * factor) dims rotate, with
    frequencies of an R-dim RoPE; the others pass through. Only families that opt in read it from the config."""

    def rotary_dim(self, head_dim: int) -> int:
        """R: the rotated dims of a head of `head_dim` dims (transformers' `int(head_dim * partial_rotary_factor)`)."""
        return int(head_dim * self.partial_rotary_factor)


def rope_args_from_hf(cfg, *, allow_partial_rotary: bool = False, allow_yarn: bool = False) -> RopeArgs:
    """Read RoPE settings from a transformers config (5.x `rope_parameters`, or 4.x `rope_theta`/`rope_scaling`).
    `partial_rotary_factor` (in `rope_parameters`, or top-level in 4.x configs) is rejected unless the family
    supports it (`allow_partial_rotary`); so is yarn unless the family opts in (`allow_yarn`, GPT-OSS): some families add
    yarn terms elsewhere (DeepSeek's mscale on the softmax scale) that their attention would have to model."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if not params:
        params = {"rope_theta": cfg.rope_theta, **(getattr(cfg, "rope_scaling", None) or {})}
    partial_rotary_factor = float(
        params.get("partial_rotary_factor") or getattr(cfg, "partial_rotary_factor", None) or 1.0
    )
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type '{rope_type}' is not supported by the custom models ({SUPPORTED_ROPE_TYPES}); use impl='hf'"
        )
    if rope_type == "yarn" and not allow_yarn:
        raise ValueError("rope_type 'yarn' is not supported by this family's custom model; use impl='hf'")
    if partial_rotary_factor != 1.0 and not allow_partial_rotary:
        raise ValueError("partial_rotary_factor != 1 is not supported by the custom models; use impl='hf'")
    kwargs = {"theta": float(params["rope_theta"]), "rope_type": rope_type}
    if partial_rotary_factor != 1.0:
        kwargs["partial_rotary_factor"] = partial_rotary_factor
    if rope_type in ("linear", "llama3"):
        kwargs["factor"] = float(params["factor"])
    if rope_type == "yarn":
        kwargs.update(_yarn_kwargs(cfg, params))
    if rope_type == "llama3":
        kwargs["low_freq_factor"] = float(params["low_freq_factor"])
        kwargs["high_freq_factor"] = float(params["high_freq_factor"])
        original = params.get("original_max_position_embeddings") or cfg.max_position_embeddings
        kwargs["original_max_position_embeddings"] = int(original)
    return RopeArgs(**kwargs)


@lru_cache(maxsize=16)
def rope_inv_freq(rope: RopeArgs, head_dim: int) -> Tensor:
    """Inverse frequencies [R/2], float32, computed on CPU exactly as transformers does (then moved by the caller).

    Computed on the fly (no module buffer) so models built on the meta device need no re-initialisation.
    """
    dim = rope.rotary_dim(head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_scale(inv_freq, rope, dim)
    return inv_freq


def _yarn_kwargs(cfg, params: dict) -> dict:
    """RopeArgs fields of a yarn config, with transformers' defaults (factor from the context lengths when unset;
    attention factor from `mscale`/`mscale_all_dim` or 0.1 ln(factor) + 1)."""
    original = int(params.get("original_max_position_embeddings") or cfg.max_position_embeddings)
    factor = params.get("factor") or cfg.max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return dict(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention_factor),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_scale(inv_freq: Tensor, rope: RopeArgs, dim: int) -> Tensor:
    """YaRN: frequencies that turn more than `beta_fast` times over the original context are kept, those turning
    fewer than `beta_slow` times are divided by `factor`, with a linear ramp over the dims in between."""

    def correction_dim(num_rotations: float) -> float:
        wavelengths = rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return (inv_freq / rope.factor) * (1 - keep) + inv_freq * keep


def _llama3_scale(inv_freq: Tensor, rope: RopeArgs) -> Tensor:
    """Llama 3.1 frequency scaling: keep high frequencies, divide low ones by `factor`, interpolate in between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(rope: RopeArgs, head_dim: int, position_ids_BT: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(cos_BTR, sin_BTR) for the given positions, computed in float32 and cast to `dtype` (R = K unless partial)."""
    inv_freq = rope_inv_freq(rope, head_dim).to(position_ids_BT.device)
    freqs_BTk = position_ids_BT[..., None].float() * inv_freq
    angles_BTK = torch.cat((freqs_BTk, freqs_BTk), dim=-1)
    cos_BTK, sin_BTK = angles_BTK.cos(), angles_BTK.sin()
    if rope.attention_factor != 1.0:
        cos_BTK, sin_BTK = cos_BTK * rope.attention_factor, sin_BTK * rope.attention_factor
    return cos_BTK.to(dtype), sin_BTK.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BTHK: Tensor, cos_BTR: Tensor, sin_BTR: Tensor) -> Tensor:
    """Rotate query or key heads (HF's half-split convention, not interleaved pairs); heads stay in dim 2, the layout
    the projections produce and varlen attention consumes. Partial RoPE (R < K): the first R dims of each head
    rotate (half-split within them) and the last K - R pass through, as transformers does."""
    rotary_dim = cos_BTR.shape[-1]
    if rotary_dim < x_BTHK.shape[-1]:
        x_BTHR, x_pass = x_BTHK[..., :rotary_dim], x_BTHK[..., rotary_dim:]
        return torch.cat((apply_rope(x_BTHR, cos_BTR, sin_BTR), x_pass), dim=-1)
    cos_BT1K, sin_BT1K = cos_BTR.unsqueeze(2), sin_BTR.unsqueeze(2)
    return x_BTHK * cos_BT1K + _rotate_half(x_BTHK) * sin_BT1K


def apply_rope_interleaved(x_BTHR: Tensor, cos_BTR: Tensor, sin_BTR: Tensor) -> Tensor:
    """Rotate heads whose rotated dims are INTERLEAVED pairs (x0, x1), (x2, x3), ... (DeepSeek's MLA, GLM-5), as
    transformers' `apply_rotary_pos_emb_interleave`: pair i turns by frequency i, and the result comes out
    de-interleaved (all first members, then all second members). Queries and keys are permuted alike, so their dot
    products are those of the interleaved rotation."""
    half = cos_BTR.shape[-1] // 2
    cos_BT1k, sin_BT1k = cos_BTR[..., :half].unsqueeze(2), sin_BTR[..., :half].unsqueeze(2)
    x1, x2 = x_BTHR[..., 0::2], x_BTHR[..., 1::2]
    return torch.cat((x1 * cos_BT1k - x2 * sin_BT1k, x2 * cos_BT1k + x1 * sin_BT1k), dim=-1)
