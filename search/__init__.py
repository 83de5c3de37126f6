"""The search over knobs (optuna). The only package that imports optuna."""
