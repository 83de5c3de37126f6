"""Run a plan in real PyTorch and compare measured with predicted. The only package importing torch."""
