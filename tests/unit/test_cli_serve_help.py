"""`nexa-dagster serve --help` says every option's default and where the key and the token come from (issue 36: it
showed no defaults)."""

from __future__ import annotations

import pytest

from nexa_dagster.cli import main
from nexa_dagster.core.serving.service import default_loading_threads


def test_serve_help_shows_the_defaults_and_the_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for option, default in (
        ("--port", "8000"),
        ("--host", "127.0.0.1"),
        ("--control-port", "0"),
        ("--loading-nice", "10"),
        ("--loading-threads", str(default_loading_threads())),
        ("--continuous-batching", "True"),
    ):
        assert option in text and f"(default: {default})" in text, (option, text)
    assert "NEXA_SERVING_API_KEY_FILE" in text and "NEXA_SERVING_CONTROL_TOKEN" in text
