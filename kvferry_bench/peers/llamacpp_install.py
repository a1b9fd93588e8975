"""llama.cpp (llama-cpp-python) in a venv of its own (never a kvferry dependency, never kvferry's venv).

Installed on first use, from the package registry only:

1. ``python3.11 -m venv VENV``;
2. ``pip install llama-cpp-python[server]==0.3.36``: PyPI has its source only, so pip builds
   llama.cpp on this machine (CMake, the native CPU flags: AVX2 here, AVX-512 where the CPU
   has it; about 20 minutes on 2 cores the first time, then pip's wheel cache makes another
   venv a matter of seconds). The ``server`` extra brings its OpenAI-compatible server
   (``python -m llama_cpp.server``);
3. a check: ``llama_cpp`` imports, its shared library loads and reports the CPU features it
   was built for, and the server module imports.

A ready marker then says the venv needs nothing more. Held to an instruction-set level
(``kvferry bench peers --max-isa``), the build gets that level's GGML options instead of
the CPU's own (``GGML_NATIVE=OFF``), in a venv of its own (``.venv-llamacpp-<level>``),
without pip's wheel cache (which would hand back the native build), and the check refuses
a library that reports a feature above the level.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvferry.cpu_features import IsaCap
from kvferry_bench.peers.install import PeerInstallError, base_python, run_logged, venv_bin

logger = logging.getLogger(__name__)

DEFAULT_VENV = Path(".venv-llamacpp")
DIST = "llama-cpp-python"
VERSION = "0.3.36"
REQUIREMENT = f"{DIST}[server]=={VERSION}"
READY = ".kvferry-llamacpp-ready"
CHECK = (
    "import llama_cpp, llama_cpp.server.app\n"
    f"assert llama_cpp.__version__ == {VERSION!r}, llama_cpp.__version__\n"
    "llama_cpp.llama_backend_init()\n"
    "print(llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())\n"
)


# The GGML build options of each level (x86); every option named and not on is off.
GGML_OPTIONS = ("AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI")
GGML_OPTIONS += ("AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16")
GGML_AVX2_ON = frozenset({"AVX", "AVX2", "FMA", "F16C", "BMI2"})
GGML_ON = {
    IsaCap.AVX2: GGML_AVX2_ON,
    IsaCap.AVX512: GGML_AVX2_ON | {"AVX512"},
    IsaCap.AVX512_BF16: GGML_AVX2_ON | {"AVX512", "AVX512_BF16"},
}
# What the library's system info must not report at each level.
ABOVE = {
    IsaCap.AVX2: ("AVX512", "AMX", "AVX_VNNI"),
    IsaCap.AVX512: ("AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX"),
    IsaCap.AVX512_BF16: ("AVX512_VBMI", "AVX512_VNNI", "AMX"),
}


def cmake_args(cap: IsaCap) -> str:
    """CMAKE_ARGS building llama.cpp for `cap` alone, whatever this CPU has."""
    on = GGML_ON[cap]
    options = [f"-DGGML_{name}={'ON' if name in on else 'OFF'}" for name in GGML_OPTIONS]
    return " ".join(["-DGGML_NATIVE=OFF", *options])


def default_venv(cap: IsaCap | None) -> Path:
    return DEFAULT_VENV if cap is None else Path(f"{DEFAULT_VENV}-{cap.value}")


def check_code(cap: IsaCap | None) -> str:
    """The venv's check: CHECK, and under a cap no feature above it in the system info."""
    if cap is None:
        return CHECK
    above = ABOVE[cap]
    return CHECK + (
        "info = llama_cpp.llama_print_system_info().decode()\n"
        f"assert not [f for f in {above!r} if f in info], info\n"
    )


class LlamaCppInstallError(PeerInstallError):
    """The llama.cpp venv could not be built or does not run."""


def is_ready(venv: Path) -> bool:
    """True when `venv` was installed and checked by `ensure_llamacpp`."""
    return (venv / READY).is_file() and venv_bin(venv, "python").is_file()


def ensure_llamacpp(venv: Path = DEFAULT_VENV, cap: IsaCap | None = None) -> Path:
    """The llama.cpp venv, built (for `cap`, if given) and checked on first use; its python."""
    venv = venv.absolute()
    if is_ready(venv):
        return venv_bin(venv, "python")
    venv.mkdir(parents=True, exist_ok=True)
    log = venv / "kvferry-install.log"
    logger.info("installing %s into %s (a build from source the first time: minutes; log: %s)",
                REQUIREMENT, venv, log)  # fmt: skip
    if not venv_bin(venv, "pip").is_file():
        run_logged([base_python(), "-m", "venv", venv], log, LlamaCppInstallError)
    install: list[str | Path] = [venv_bin(venv, "pip"), "install", "-q", REQUIREMENT]
    if cap is not None:
        install = ["env", f"CMAKE_ARGS={cmake_args(cap)}", *install, "--no-cache-dir"]
    run_logged(install, log, LlamaCppInstallError)
    run_logged([venv_bin(venv, "python"), "-c", check_code(cap)], log, LlamaCppInstallError)
    (venv / READY).write_text(REQUIREMENT + (f" for {cap.value}" if cap else "") + "\n")
    return venv_bin(venv, "python")
