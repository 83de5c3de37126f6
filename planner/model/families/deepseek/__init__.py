"""DeepSeek-V3 (model_type deepseek_v3): multi-head latent attention and a sigmoid, group-limited
router over the shared MoE block."""
