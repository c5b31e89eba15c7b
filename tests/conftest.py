"""Fixtures: the tiny tokenizer and models of constrained_spec.testing, built once a session."""

import pytest
import torch

from constrained_spec import testing

torch.set_num_threads(1)  # tiny models: threads only add overhead, and CI has 2 cores


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return testing.tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_target(tiny_tokenizer):
    return testing.tiny_model(tiny_tokenizer, seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_tokenizer):
    return testing.tiny_model(tiny_tokenizer, seed=1, layers=1)


@pytest.fixture(scope="session", params=["fused", "python"])
def tiny_int4_target(request, tiny_tokenizer):
    """The tiny target's weights quantized as the default model ships (Q4_1 linears, Q8_0 LM
    head), in the compact forward; every test taking it runs on both ways of running its layers
    (the fused ones skip, saying why, where they cannot be compiled)."""
    from constrained_spec import kernels, llama

    if request.param == "fused" and (missing := kernels.fused_missing()):
        pytest.skip(f"the fused layers cannot be compiled here: {missing}")
    model = llama.from_transformers(testing.tiny_model(tiny_tokenizer, seed=0), "int4")
    model.use_layers(request.param)
    return model


@pytest.fixture(params=["llguidance", "regex"])
def engine(request):
    """Both constraint engines: every test taking this fixture runs on each."""
    return request.param
