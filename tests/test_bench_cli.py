"""`kvferry bench` hands its arguments to the benchmarks' package (kvferry_bench), which the
engine never imports: every benchmark answers as before, a missing package names the extra
to install, and a broken benchmark module is not hidden."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvferry.entrypoints.cli import main
from kvferry_bench.cli import BENCHES

BENCH_NAMES = [bench.name for bench in BENCHES]


# Run first in the child: the named module cannot be found, as if it were not installed.
HIDE_MODULE = """
import importlib.abc, sys
class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == {name!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hidden())
"""


def kvferry_without(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """`kvferry argv...` in a fresh interpreter that cannot find `module`."""
    code = HIDE_MODULE.format(name=module) + "from kvferry.entrypoints.cli import main\nmain(sys.argv[1:])\n"
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)


def help_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_every_benchmark_is_listed_by_kvferry_bench_help(capsys: pytest.CaptureFixture[str]) -> None:
    out = help_of(capsys, "bench", "--help")
    assert out.startswith("usage: kvferry bench")
    assert set(BENCH_NAMES) == {
        *(
            "throughput",
            "serve",
            "pd",
            "transfer",
            "hybrid",
            "peers",
            "soak",
            "goodput",
            "mla",
            "moe",
            "moe-split",
            "startup",
            "spec-decode",
        )
    }
    for name in BENCH_NAMES:
        assert name in out


@pytest.mark.parametrize(
    ("name", "option"),
    [
        ("throughput", "--hf-reference"),
        ("serve", "--request-rate"),
        ("pd", "--request-rate"),
        ("transfer", "--size-mb"),
        ("hybrid", "--prompt-tokens"),
        ("peers", "--vllm-venv"),
        ("soak", "--clients"),
        ("goodput", "--slo-ttft-ms"),
        ("startup", "--starts"),
    ],
)
def test_a_benchmarks_own_options_reach_its_help(
    capsys: pytest.CaptureFixture[str], name: str, option: str
) -> None:
    out = help_of(capsys, "--log-level", "WARNING", "bench", name, "--help")
    assert out.startswith(f"usage: kvferry bench {name}") and option in out


def test_the_command_line_alone_imports_no_benchmark() -> None:
    code = (
        "import sys\nfrom kvferry.entrypoints.cli import build_parser\n"
        "build_parser().parse_args(['bench', 'transfer', '--size-mb', '8'])\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvferry_bench')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.slow  # several seconds (make test-all)
def test_a_missing_benchmark_package_names_the_extra_to_install() -> None:
    done = kvferry_without("kvferry_bench", "bench", "transfer")
    assert done.returncode == 2
    assert "the benchmarks are not installed (pip install 'kvferry[bench]')" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # several seconds (make test-all)
def test_a_benchmark_missing_a_module_it_imports_is_shown_not_hidden() -> None:
    done = kvferry_without("httpx", "bench", "soak", "--help")  # soak.py imports httpx
    assert done.returncode == 1
    assert "ModuleNotFoundError: No module named 'httpx'" in done.stderr
    assert "kvferry[bench]" not in done.stderr
