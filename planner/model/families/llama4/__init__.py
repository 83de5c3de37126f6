"""Llama 4's text model (model_type llama4_text, and the text part of the multimodal llama4):
mixture-of-experts blocks (a sigmoid top-k router whose scores scale the experts' input, a shared
expert) interleaved with dense ones, no-RoPE layers with attention temperature tuning, a
weightless L2 norm of q and k on the RoPE layers, chunked local attention."""
