"""The `vllm serve` command of the Kubernetes manifests (deploy/k8s/serving.yaml), parsed by the real vLLM's own
argument parser (the one its OpenAI server builds, from the vLLM environment `make test` installs): every flag the
manifest gives exists and takes the value given, so a vLLM upgrade that renames one fails here, not in a pod.

The parser's import takes ~20 s on the 2-core machine: one subprocess parses every engine container's command."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from support.vllm_install import require_vllm

from nexa_dagster.core.llm.vllm_env import vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm-engine")]

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "serving.yaml"
# what `vllm serve` itself does before its parser: the model as the positional model_tag
PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
out = []
for argv in json.loads(sys.argv[1]):
    try:
        a = parser.parse_args(argv)
        out.append({"ok": True, "model": a.model_tag, "served": a.served_model_name, "host": a.host, "port": a.port})
    except SystemExit as e:
        out.append({"ok": False, "code": e.code})
print(json.dumps(out))
"""


def _engine_commands() -> list[list[str]]:
    commands = []
    for doc in yaml.safe_load_all(MANIFESTS.read_text()):
        for container in (
            (doc or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        ):
            command = container.get("command", [])
            if command[:2] == ["vllm", "serve"]:
                commands.append([a.replace("$(NEXA_CHECKPOINT)", "/data/checkpoints/x") for a in command[2:]])
    return commands


def test_the_manifests_vllm_serve_flags_are_the_real_clis() -> None:
    require_vllm()
    commands = _engine_commands()
    assert len(commands) == 2, "one engine per colour"
    misspelled = [*commands[0], "--served-modle-name", "x"]
    out = subprocess.run(
        [str(vllm_python()), "-c", PARSE, json.dumps([*commands, misspelled])],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    *parsed, wrong = json.loads(out.stdout.strip().splitlines()[-1])
    for result in parsed:
        assert result == {
            "ok": True,
            "model": "/data/checkpoints/x",
            "served": ["nexa-moe"],
            "host": "127.0.0.1",
            "port": 8001,
        }
    assert wrong == {"ok": False, "code": 2}  # the same parser refuses a flag it does not have
    assert "unrecognized arguments: --served-modle-name" in out.stderr
