"""Shared fixtures, the GPU marker, and one torch thread."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """Real CPU steps run on one intra-op thread: on a 2-core runner two OpenMP threads wait on
    each other whenever anything else runs (a tiny model's validation took 40 s instead of 15 s
    under load). Fake-tensor simulations do no arithmetic and are unaffected; torchrun's ranks
    get one thread each from torchrun itself."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

