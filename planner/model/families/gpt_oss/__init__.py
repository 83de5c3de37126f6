"""gpt-oss (model_type gpt_oss): attention sinks, sliding-window layers and biased clamped-SwiGLU
experts over the shared MoE block."""
