"""Phi-3 (model_type phi3): Llama's layout with fused q/k/v and gate/up projections and partial
rotary positions."""
