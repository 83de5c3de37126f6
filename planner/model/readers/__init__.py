"""HuggingFace config.json readers, one per group of model types (transformers' own configuration and modeling files are their source)."""
