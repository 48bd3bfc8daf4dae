import pytest
import torch

import dualkv_compile as dk


@pytest.fixture(autouse=True)
def fresh_counters():
    """Each test counts its own rewrites and compiles from a clean Dynamo cache."""
    dk.counters.clear()
    torch._dynamo.reset()
