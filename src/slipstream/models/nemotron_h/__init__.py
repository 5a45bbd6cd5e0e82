"""Nemotron-H family (`nemotron_h`: NVIDIA Nemotron-H / Nemotron-3): a hybrid stack of single-mixer blocks, each a
Mamba2 layer, a NoPE GQA attention layer, a squared-ReLU MLP or a sigmoid-routed MoE of squared-ReLU experts with a
shared expert; packed rows restart the Mamba layers' conv and SSM state at every sample."""
