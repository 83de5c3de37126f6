"""The mixture-of-experts families (mixtral, qwen2_moe, qwen3_moe, olmoe) and the MoE block every
MoE family shares (DeepSeek-V3's and gpt-oss's too): its sub-config and its description."""
