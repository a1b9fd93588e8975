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
