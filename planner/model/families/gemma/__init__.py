"""Gemma 2 and Gemma 3 (model_type gemma2, gemma3_text, and gemma3's text model): norms before and
after each branch, the GeGLU MLP, the scaled embedding, sliding/global layers."""
