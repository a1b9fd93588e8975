"""The CPU's features, read at run time (logged with every benchmark result)."""

from __future__ import annotations

from pathlib import Path

from kvferry.cpu_features import read_cpu_features

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: avx2 avx512f avx512bw avx512_bf16 amx_tile amx_bf16 amx_int8\n"


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    (tmp_path / "avx2").write_text(AVX2_ONLY)
    (tmp_path / "amx").write_text(SAPPHIRE)
    plain = read_cpu_features(tmp_path / "avx2").summary()
    assert plain == {"avx2": True, "avx512": False, "bf16_flags": [], "wide_flags": []}
    wide = read_cpu_features(tmp_path / "amx").summary()
    assert wide["avx512"] and wide["bf16_flags"] == ["amx_bf16", "avx512_bf16"]
    assert read_cpu_features(tmp_path / "missing").summary()["wide_flags"] == []


def test_a_cap_drops_the_flags_above_its_level(tmp_path: Path, monkeypatch) -> None:
    from kvferry.cpu_features import MAX_ISA_ENV, host_cpu_features

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(SAPPHIRE.replace("avx512bw", "avx512bw avx512vl avx512dq avx512_vnni"))
    monkeypatch.setenv(MAX_ISA_ENV, "avx2")
    assert read_cpu_features(cpuinfo).flags == {"avx2"}
    assert "amx_bf16" in host_cpu_features(cpuinfo).flags  # the host's, uncapped
    monkeypatch.setenv(MAX_ISA_ENV, "avx512")
    assert read_cpu_features(cpuinfo).flags == {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    monkeypatch.setenv(MAX_ISA_ENV, "AVX512_BF16")
    assert read_cpu_features(cpuinfo).summary()["bf16_flags"] == ["avx512_bf16"]  # no AMX
    monkeypatch.delenv(MAX_ISA_ENV)
    assert read_cpu_features(cpuinfo) == host_cpu_features(cpuinfo)


def test_an_unknown_cap_is_refused(monkeypatch) -> None:
    import pytest

    from kvferry.cpu_features import MAX_ISA_ENV
    from kvferry.errors import ConfigError

    monkeypatch.setenv(MAX_ISA_ENV, "sse2")
    with pytest.raises(ConfigError, match="avx2, avx512, avx512_bf16"):
        read_cpu_features()


def test_the_cap_holds_torch_to_its_level_unless_told_otherwise(monkeypatch) -> None:
    import os

    from kvferry.cpu_features import MAX_ISA_ENV, torch_dispatch_caps

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "")  # restored after the test, like the others
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2_VNNI")
    monkeypatch.delenv(MAX_ISA_ENV, raising=False)
    assert torch_dispatch_caps() == {}
    monkeypatch.setenv(MAX_ISA_ENV, "avx2")
    assert torch_dispatch_caps() == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx2"
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX2_VNNI"  # given: kept


def test_half_precision_is_not_native_below_its_level(monkeypatch) -> None:
    import torch

    from kvferry.cpu_features import MAX_ISA_ENV, native_half_precision

    monkeypatch.setenv(MAX_ISA_ENV, "avx512")
    assert not native_half_precision(torch.bfloat16)
    assert not native_half_precision(torch.float16)
