"""GLM-4.5 MoE family (`glm4_moe`: GLM-4.5, GLM-4.5-Air, INTELLECT-3): GQA attention with partial RoPE, q/k/v biases
and optional q/k norm; dense first layers, then MoE layers with sigmoid group-limited routing and a shared expert."""
