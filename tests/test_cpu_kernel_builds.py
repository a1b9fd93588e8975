"""Prebuilt CPU kernels (`kvferry build-kernels`, kvferry/model/layers/cpu_kernels.py): each
kernel built for explicit ISA levels into a directory, loaded at run time without a
compiler, the best level the CPU runs chosen, and a level it lacks never loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.cpu_features import CPUFeatures, read_cpu_features
from kvferry.model.layers import cpu_kernels
from kvferry.model.layers.cpu_kernels import AVX2, AVX512, AVX512_BF16, ISA_LEVELS

DECODE = cpu_kernels.CSRC / "paged_decode.cpp"
AVX2_CPU = CPUFeatures(frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"}))
BF16_CPU = CPUFeatures(AVX512_BF16.cpu_flags | {"amx_bf16"})


def _place_every_level(directory: Path) -> None:
    directory.mkdir(exist_ok=True)
    for isa in ISA_LEVELS:
        (directory / cpu_kernels.prebuilt_name(DECODE, isa)).write_bytes(b"")


@pytest.mark.parametrize(
    ("cpu", "expected"),
    [(AVX2_CPU, AVX2), (CPUFeatures(AVX512.cpu_flags), AVX512), (BF16_CPU, AVX512_BF16)],
)
def test_the_best_level_the_cpu_runs_is_chosen(tmp_path: Path, cpu: CPUFeatures, expected) -> None:
    _place_every_level(tmp_path)
    found = cpu_kernels.find_prebuilt(DECODE, cpu, [tmp_path])
    assert found is not None and found.isa == expected
    assert found.path.name.startswith(f"paged_decode-{expected.name}-")


def test_a_level_the_cpu_lacks_is_never_chosen(tmp_path: Path) -> None:
    for isa in (AVX512_BF16, AVX512):
        (tmp_path / cpu_kernels.prebuilt_name(DECODE, isa)).write_bytes(b"")
    assert cpu_kernels.find_prebuilt(DECODE, AVX2_CPU, [tmp_path]) is None
    assert cpu_kernels.find_prebuilt(DECODE, CPUFeatures(frozenset()), [tmp_path]) is None


def test_a_shipped_directory_comes_before_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache = cpu_kernels.cache_dir()
    cache.mkdir(parents=True)
    _place_every_level(cache)
    _place_every_level(tmp_path / "image")
    monkeypatch.setenv(cpu_kernels.KERNELS_DIR_ENV, str(tmp_path / "image"))
    found = cpu_kernels.find_prebuilt(DECODE, AVX2_CPU)
    assert found is not None and found.path.parent == tmp_path / "image"
    monkeypatch.delenv(cpu_kernels.KERNELS_DIR_ENV)
    found = cpu_kernels.find_prebuilt(DECODE, AVX2_CPU)
    assert found is not None and found.path.parent == cache


def test_names_follow_the_sources_and_the_level() -> None:
    names = {
        cpu_kernels.prebuilt_name(source, isa) for source in cpu_kernels.KERNEL_SOURCES for isa in ISA_LEVELS
    }
    assert len(names) == len(cpu_kernels.KERNEL_SOURCES) * len(ISA_LEVELS) == 18


# Run without a compiler and without a cache: load the decode kernel from the shipped
# directory, hold it to SDPA once, and report what torch loaded.
LOAD_AND_RUN = """
import json, torch
from kvferry.kv.spec import Layout
from kvferry.model.layers import decode_kernel
from tests.test_decode_kernel import _assert_kernel_equals_sdpa, _case
assert decode_kernel.decode_kernel_available()
q, cache, attn = _case(Layout.NHD, torch.float32, 10, 32)
_assert_kernel_equals_sdpa(q, cache, attn, Layout.NHD, 10, 2e-6)
print(json.dumps(sorted(torch.ops.loaded_libraries)))
"""


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a compile; minutes on a busy 2-core machine
def test_build_kernels_ships_a_library_the_engine_loads_without_a_compiler(tmp_path: Path) -> None:
    host = read_cpu_features()
    best = next((isa for isa in ISA_LEVELS if isa.runs_on(host)), None)
    if best is None:
        pytest.skip("this CPU runs none of the prebuilt levels")
    out = tmp_path / "kernels"
    build = [sys.executable, "-m", "kvferry.entrypoints.cli", "build-kernels", "--isa", best.name]
    build += ["--kernel", DECODE.stem, "--out", str(out)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=2000)
    assert done.returncode == 0, done.stderr[-3000:]
    library = out / cpu_kernels.prebuilt_name(DECODE, best)
    assert done.stdout.split() == [str(library)]
    # Decoys for the levels this CPU lacks: were one loaded, its name would show.
    for isa in ISA_LEVELS:
        if not isa.runs_on(host):
            shutil.copy(library, out / cpu_kernels.prebuilt_name(DECODE, isa))
    env = {**os.environ, "CXX": "/nonexistent/g++", "XDG_CACHE_HOME": str(tmp_path / "empty-cache")}
    env[cpu_kernels.KERNELS_DIR_ENV] = str(out)
    run = subprocess.run(
        [sys.executable, "-c", LOAD_AND_RUN], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = json.loads(run.stdout.strip().splitlines()[-1])
    assert [Path(p) for p in loaded if Path(p).parent == out] == [library]


# A stand-in compiler: notes when each build starts and ends (a line per event in $BUILD_LOG),
# holds each build for a moment, and writes an empty "library" where -o says.
FAKE_COMPILER = """#!/bin/sh
[ "$1" = --version ] && { echo fake-cxx 1; exit 0; }
out=""; prev=""
for arg in "$@"; do [ "$prev" = -o ] && out="$arg"; prev="$arg"; done
echo "start $out" >> "$BUILD_LOG"
sleep 1
: > "$out"
echo "end $out" >> "$BUILD_LOG"
"""


def test_build_ahead_runs_the_builds_side_by_side_and_load_reuses_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler, log = tmp_path / "fake-cxx", tmp_path / "builds.log"
    compiler.write_text(FAKE_COMPILER)
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("BUILD_LOG", str(log))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_kernels.KERNELS_DIR_ENV, raising=False)
    prefill = cpu_kernels.CSRC / "paged_prefill.cpp"
    threads = cpu_kernels.build_ahead([DECODE, prefill])
    assert len(threads) == 2
    for thread in threads:
        thread.join(timeout=60)
    events = [line.split()[0] for line in log.read_text().splitlines()]
    assert events == ["start", "start", "end", "end"]  # one after the other would alternate
    for source in (DECODE, prefill):  # built: another call compiles nothing
        assert cpu_kernels.built_library(source).is_file()
    assert len(log.read_text().splitlines()) == 4


def test_build_ahead_skips_a_kernel_with_a_prebuilt_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cpu_kernels.KERNELS_DIR_ENV, str(tmp_path))
    best = next((isa for isa in ISA_LEVELS if isa.runs_on(read_cpu_features())), None)
    if best is None:
        pytest.skip("this CPU runs none of the prebuilt levels")
    (tmp_path / cpu_kernels.prebuilt_name(DECODE, best)).write_bytes(b"")
    assert cpu_kernels.build_ahead([DECODE]) == []


def test_under_a_cap_the_level_loaded_and_the_build_flags_follow_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$KVFERRY_MAX_ISA=avx2: the AVX2 library is chosen among every level's, and a build
    here gets AVX2's explicit flags, not -march=native (which would use all of this CPU)."""
    from kvferry.cpu_features import MAX_ISA_ENV

    if not AVX2.runs_on(read_cpu_features()):
        pytest.skip("this CPU lacks AVX2")
    _place_every_level(tmp_path)
    monkeypatch.setenv(cpu_kernels.KERNELS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(MAX_ISA_ENV, "avx2")
    found = cpu_kernels.find_prebuilt(DECODE, read_cpu_features())
    assert found is not None and found.isa == AVX2
    assert cpu_kernels.native_flags() == AVX2.compile_flags
    monkeypatch.delenv(MAX_ISA_ENV)
    assert cpu_kernels.native_flags() == ("-march=native",)


@pytest.mark.slow  # one real compile
def test_a_kernel_built_under_an_avx2_cap_has_no_avx512_instruction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The library built here under $KVFERRY_MAX_ISA=avx2 uses no zmm register; on a CPU
    with AVX-512 the uncapped build does (so the check can fail)."""
    from kvferry.cpu_features import MAX_ISA_ENV, host_cpu_features

    if shutil.which("objdump") is None:
        pytest.skip("no objdump")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(cpu_kernels.KERNELS_DIR_ENV, raising=False)
    monkeypatch.setenv(MAX_ISA_ENV, "avx2")

    def uses_zmm(library: Path) -> bool:
        listing = subprocess.run(["objdump", "-d", str(library)], capture_output=True, text=True, check=True)
        return "%zmm" in listing.stdout

    assert not uses_zmm(cpu_kernels.built_library(DECODE))
    if AVX512.runs_on(host_cpu_features()):
        monkeypatch.delenv(MAX_ISA_ENV)
        assert uses_zmm(cpu_kernels.built_library(DECODE))
