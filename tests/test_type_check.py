"""`make test` (and so .ci/run) type-checks before it tests: mypy, strict on the packages
the scheduler and the connectors share. The check itself runs there, not here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def recipe(target: str) -> list[str]:
    """The command lines of a Makefile target."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{target}:"))
    body = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        if not line.strip().startswith("#"):
            body.append(line.strip())
    return body


def test_make_test_runs_mypy_before_pytest():
    commands = recipe("test")
    mypy = next(i for i, c in enumerate(commands) if c.split()[0].endswith("/mypy"))
    pytest = next(i for i, c in enumerate(commands) if "pytest" in c)
    assert mypy < pytest


def test_mypy_is_strict_on_the_whole_package_and_installed_by_make():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mypy = project["tool"]["mypy"]
    assert mypy["strict"] is True
    assert mypy["files"] == ["kvferry"]
    assert "exclude" not in mypy
    test_extra = project["project"]["optional-dependencies"]["test"]
    assert any(re.fullmatch(r"mypy==[\d.]+", requirement) for requirement in test_extra)  # pinned
    assert '".[test' in (ROOT / "Makefile").read_text()  # make install takes the test extra
