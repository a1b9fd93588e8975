"""`kvferry build-kernels`: every CPU kernel compiled ahead of time for explicit ISA levels,
so a serving host needs no compiler and an image can carry builds for other CPUs.

    kvferry build-kernels                              # all levels, into the kernels cache
    kvferry build-kernels --out /opt/kvferry/kernels   # to ship: serve with KVFERRY_KERNELS_DIR=...
    kvferry build-kernels --isa avx2                   # one level
    kvferry build-kernels --kernel paged_decode        # one kernel

At run time each kernel loads the best level the CPU supports
(kvferry/model/layers/cpu_kernels.py).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from kvferry.errors import KVFerryError

logger = logging.getLogger(__name__)


def add_args(parser: argparse.ArgumentParser) -> None:
    from kvferry.model.layers.cpu_kernels import ISA_LEVELS, KERNEL_SOURCES, KERNELS_DIR_ENV

    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"directory for the libraries (default: the kernels cache); serve with {KERNELS_DIR_ENV}=DIR",
    )
    parser.add_argument(
        "--isa",
        nargs="+",
        choices=[isa.name for isa in ISA_LEVELS],
        default=[isa.name for isa in ISA_LEVELS],
        help="instruction-set levels to build (default: all)",
    )
    parser.add_argument(
        "--kernel",
        nargs="+",
        choices=[source.stem for source in KERNEL_SOURCES],
        default=[source.stem for source in KERNEL_SOURCES],
        help="kernels to build (default: all)",
    )


def run(args: argparse.Namespace) -> list[Path]:
    from kvferry.model.layers import cpu_kernels

    out_dir = args.out or cpu_kernels.cache_dir()
    chosen = [isa for isa in cpu_kernels.ISA_LEVELS if isa.name in args.isa]
    built = []
    for isa in chosen:
        for source in (s for s in cpu_kernels.KERNEL_SOURCES if s.stem in args.kernel):
            logger.info("building %s for %s (%s)", source.name, isa.name, " ".join(isa.compile_flags))
            try:
                built.append(cpu_kernels.build_prebuilt(source, isa, out_dir))
            except cpu_kernels.BUILD_ERRORS as exc:
                raise KVFerryError(f"building {source.name} for {isa.name} failed: {exc}") from exc
    for path in built:
        print(path)
    return built
