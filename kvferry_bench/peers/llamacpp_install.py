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

A ready marker then says the venv needs nothing more.
"""

from __future__ import annotations

import logging
from pathlib import Path

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


class LlamaCppInstallError(PeerInstallError):
    """The llama.cpp venv could not be built or does not run."""


def is_ready(venv: Path) -> bool:
    """True when `venv` was installed and checked by `ensure_llamacpp`."""
    return (venv / READY).is_file() and venv_bin(venv, "python").is_file()


def ensure_llamacpp(venv: Path = DEFAULT_VENV) -> Path:
    """The llama.cpp venv, built and checked on first use; its python."""
    venv = venv.absolute()
    if is_ready(venv):
        return venv_bin(venv, "python")
    venv.mkdir(parents=True, exist_ok=True)
    log = venv / "kvferry-install.log"
    logger.info("installing %s into %s (a build from source the first time: minutes; log: %s)",
                REQUIREMENT, venv, log)  # fmt: skip
    if not venv_bin(venv, "pip").is_file():
        run_logged([base_python(), "-m", "venv", venv], log, LlamaCppInstallError)
    run_logged([venv_bin(venv, "pip"), "install", "-q", REQUIREMENT], log, LlamaCppInstallError)
    run_logged([venv_bin(venv, "python"), "-c", CHECK], log, LlamaCppInstallError)
    (venv / READY).write_text(REQUIREMENT + "\n")
    return venv_bin(venv, "python")
