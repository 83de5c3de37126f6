"""One module per model family of the reference model (``validate.reference_model`` assembles the
blocks from them): ``dense`` (attention, MLP, q/k norms; the transformers config of each family
implementation hf runs, ``HF_CONFIGS``), ``moe`` (the MoE MLP every MoE family shares), ``deepseek``
(multi-head latent attention), ``gpt_oss`` (its experts' clamped SwiGLU). The planner's families
are ``planner.model.families``.
"""
