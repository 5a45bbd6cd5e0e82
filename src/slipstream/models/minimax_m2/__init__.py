"""MiniMax-M2 family (`minimax_m2`: MiniMax-M2, M2.1): GQA attention with partial RoPE and q/k RMSNorm over the whole
projection (all heads at once); every layer an MoE of routed SwiGLU experts with sigmoid scores and a selection-only
`e_score_correction_bias`, no shared expert."""
