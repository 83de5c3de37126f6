"""The dense families: GPT-2 and the Llama-like ones (llama, mistral, qwen2, qwen3, olmo2); their
reader is also the base every other family's reader builds on."""
