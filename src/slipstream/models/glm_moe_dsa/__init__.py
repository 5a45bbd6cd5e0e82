"""GLM-5 family (`glm_moe_dsa`): multi-head latent attention (MLA, as DeepSeek-V3) restricted by DeepSeek sparse
attention (DSA: a lightweight indexer picks each query's top-k keys), dense first layers, then MoE layers with sigmoid
group-limited routing and shared experts (GLM-4.5's MoE)."""
