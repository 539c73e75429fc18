import pytest

from tests.model_cache import ModelCache

pytest.importorskip("llama_cpp", reason="the server tokenizes with llama.cpp's vocabulary")
pytest.importorskip("aiohttp", reason="the server runs on aiohttp")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """models(arch, qtype, preset="tiny", seed=1, **overrides) -> path of a synthetic GGUF."""
    return ModelCache(tmp_path_factory)
