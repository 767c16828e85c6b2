"""The `vllm serve` command of the Kubernetes manifests (deploy/k8s/serving.yaml), parsed by the real vLLM's own
argument parser (the one its OpenAI server builds, from the vLLM environment `make test` installs): every flag the
manifest gives exists and takes the value given, so a vLLM upgrade that renames one fails here, not in a pod.

The same process, which imports the serving CLI's modules from the environment without writing bytecode (as every
engine under PYTHONDONTWRITEBYTECODE does), finds each one's bytecode there: the install compiled what an engine's
start imports (``vllm_env``'s probe; pip installs without compiling), so no engine compiles it again.

The parser's import takes ~20 s on the 2-core machine: one subprocess parses every engine container's command."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from support.vllm_install import require_vllm

from nexa_dagster.core.common.installer import freeze, lock_pins
from nexa_dagster.core.llm.vllm_env import LOCKS, device_kind, installed_versions, lock_digest, vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm-engine")]

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "serving.yaml"
# what `vllm serve` itself does before its parser: the model as the positional model_tag
PARSE = """
import sys
sys.dont_write_bytecode = True  # what an engine under PYTHONDONTWRITEBYTECODE does: only the install's bytecode
import importlib.util, json, os, sysconfig
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
site = sysconfig.get_paths()["purelib"] + os.sep
imported = {getattr(m, "__file__", None) or "" for m in list(sys.modules.values())}
uncompiled = sorted(
    f for f in imported
    if f.startswith(site) and f.endswith(".py") and not os.path.exists(importlib.util.cache_from_source(f))
)
print(json.dumps({"parsed": out, "imported": sum(f.startswith(site) for f in imported), "uncompiled": uncompiled}))
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


@pytest.fixture(scope="module")
def parsed() -> tuple[dict, str]:
    """Every engine container's command and a misspelled one, parsed in one process of the vLLM environment: its
    last line's JSON, and its stderr."""
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
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_the_manifests_vllm_serve_flags_are_the_real_clis(parsed: tuple[dict, str]) -> None:
    result, stderr = parsed
    *flags, wrong = result["parsed"]
    for one in flags:
        assert one == {
            "ok": True,
            "model": "/data/checkpoints/x",
            "served": ["nexa-moe"],
            "host": "127.0.0.1",
            "port": 8001,
        }
    assert wrong == {"ok": False, "code": 2}  # the same parser refuses a flag it does not have
    assert "unrecognized arguments: --served-modle-name" in stderr


def test_what_an_engine_imports_from_the_environment_has_its_bytecode(parsed: tuple[dict, str]) -> None:
    result, _ = parsed
    assert (
        result["imported"] > 500
    )  # torch, transformers, vLLM's server: the check below has something to check
    assert result["uncompiled"] == [], (
        f"{len(result['uncompiled'])} modules without bytecode: {result['uncompiled'][:10]}"
    )


def test_the_environment_the_engines_run_in_is_its_lock() -> None:
    """On a CPU host the suite's vLLM environment is `vllm-cpu-constraints.txt`'s: stamped with its digest, and every
    package at its locked version (pip's freeze of the environment, local labels such as ``+cpu`` aside)."""
    require_vllm()
    if device_kind() != "cpu":
        pytest.skip("a GPU host's vLLM environment resolves the official wheel's ranges: no lock")
    stamp = installed_versions() or {}
    assert stamp.get("lock") == lock_digest("cpu"), (
        stamp.get("lock"),
        "the lock changed: make vllm installs it",
    )
    assert set(lock_pins(freeze(vllm_python()))) == {
        line for line in LOCKS["cpu"].read_text().splitlines() if line and not line.startswith("#")
    }
