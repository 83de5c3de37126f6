"""What is trained: the model and training configs, the kinds and family defaults, presets and the config.json readers."""
