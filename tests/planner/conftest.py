"""Plans shared by the report and plot tests (planned once per session)."""

from __future__ import annotations

import pytest

from planner.program.results import PlanResult
from roofplan import api


@pytest.fixture(scope="session")
def single() -> PlanResult:
    """tiny-llama on one GPU, knobs searched."""
    model, training = api.load_model("tiny-llama")
    return api.plan(model, training)


@pytest.fixture(scope="session")
def multi() -> PlanResult:
    """tiny-llama on 8 GPUs, knobs and ZeRO stage searched."""
    model, training = api.load_model("tiny-llama", seq_len=128, global_batch_size=64)
    return api.plan(model, training, gpus=8)
