"""``bench/generation.py``'s ``--engine`` values are checked when its arguments are parsed: a run that compares
engines one after the other must not measure the first for minutes and then die on a typo in the last."""

import pytest
from support.repo_scripts import load_script

BENCH = load_script("bench/generation.py")


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("auto", ("auto", "", None)),
        ("transformers:1", ("transformers", "", 1)),
        ("vllm@mp", ("vllm", "mp", None)),
        ("vllm@mp:2", ("vllm", "mp", 2)),
    ],
)
def test_engine_specs_parse(spec: str, parsed: tuple[str, str, int | None]) -> None:
    assert BENCH.parse_engine(spec) == parsed


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("transformers@mp", "only for vllm"),
        ("vllm@ray", "the executor suffix is @mp"),
        ("vlm", "the engine is one of"),
        ("vllm:two", "whole number of threads"),
        ("vllm:0", "whole number of threads"),
    ],
)
def test_a_wrong_engine_is_refused_before_any_engine_runs(
    spec: str, reason: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    measured: list[object] = []
    monkeypatch.setattr(BENCH, "measure", lambda *a: measured.append(a) or {})
    with pytest.raises(SystemExit) as exit_:
        BENCH.main(["--engine", "transformers", "--engine", spec])
    assert exit_.value.code == 2  # argparse's usage error
    assert reason in capsys.readouterr().err
    assert measured == []  # refused before the first (valid) engine was measured
