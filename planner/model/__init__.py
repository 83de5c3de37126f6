"""What is trained: the model and training configs, the kinds, presets, and one package per model family (``families/``: its config.json reader, its config pieces, its blocks' description)."""
