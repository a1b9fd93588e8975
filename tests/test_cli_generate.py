"""`kvferry generate`'s arguments: a model given without a prompt is refused, not answered;
the decode program is compiled only when --capture asks for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.config import CaptureMode
from kvferry.entrypoints import cli
from kvferry.entrypoints.engine_args import engine_config_from_args


def test_a_model_path_without_a_prompt_is_refused_naming_the_fix(
    tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The one positional is the prompt, so the embedded model would answer the path."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", str(tiny_llama), "--max-tokens", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "was read as the prompt" in err and f"kvferry generate {tiny_llama} 'your prompt'" in err


def test_a_prompt_that_names_no_file_is_a_prompt(tmp_path: Path) -> None:
    args = cli.build_parser().parse_args(["generate", str(tmp_path / "not-there")])
    cli.refuse_a_model_read_as_the_prompt(args)  # no error: an ordinary prompt
    args = cli.build_parser().parse_args(["generate", str(tmp_path), "the cat sees"])
    cli.refuse_a_model_read_as_the_prompt(args)  # the model given, then the prompt


def _generate_capture(argv: list[str]) -> CaptureMode:
    args = cli.generate_capture(cli.build_parser().parse_args(["generate", "smollm2", "the cat", *argv]))
    return engine_config_from_args(args).compilation.capture


def test_generate_decodes_eagerly_unless_capture_is_given() -> None:
    """One answer never pays back a compile: the default compiles nothing; an explicit
    --capture is kept."""
    assert _generate_capture([]) is CaptureMode.NEVER
    assert _generate_capture(["--capture", "auto"]) is CaptureMode.AUTO
    assert _generate_capture(["--capture", "always"]) is CaptureMode.ALWAYS
    assert _generate_capture(["--enforce-eager"]) is CaptureMode.NEVER
