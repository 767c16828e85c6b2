"""Which engine serves a model, decided before any engine starts: vLLM where it is installed for this host and can
run the model, refused with the reason (and the engine that can) where it cannot, and one line saying how to install
it where it is missing. The real engine on the real model: tests/integration/test_vllm_engine.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nexa_dagster.core.llm import vllm_env
from nexa_dagster.core.llm.base import LLMError
from nexa_dagster.core.llm.managed_server import (
    ManagedServer,
    choose_engine,
    default_inductor_cache,
    server_command,
)
from nexa_dagster.core.llm.vllm_models import (
    CPU_HEAD_SIZES,
    UnsupportedByVLLM,
    head_size,
    why_vllm_cannot_run,
)


def _model(tmp_path: Path, name: str, **config: object) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def _smollm2_like(tmp_path: Path) -> Path:
    # SmolLM2-135M: hidden 576 over 9 heads = 64
    return _model(
        tmp_path, "smol", architectures=["LlamaForCausalLM"], hidden_size=576, num_attention_heads=9
    )


def _tiny_like(tmp_path: Path) -> Path:
    # the tiny preset: hidden 64 over 4 heads = 16
    return _model(
        tmp_path, "tiny", architectures=["MixtralForCausalLM"], hidden_size=64, num_attention_heads=4
    )


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A vLLM environment as the install leaves it (stamp and interpreter; nothing is run from it here)."""
    env = tmp_path / "vllm-env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    stamp = {"device": "cpu", "architectures": ["LlamaForCausalLM", "MixtralForCausalLM"]}
    (env / vllm_env.STAMP).write_text(json.dumps(stamp))
    monkeypatch.setenv("NEXA_VLLM_ENV", str(env))
    monkeypatch.setattr(vllm_env, "device_kind", lambda: "cpu")
    return env


def test_head_size_is_head_dim_else_hidden_over_heads() -> None:
    assert head_size({"head_dim": 32, "hidden_size": 64, "num_attention_heads": 4}) == 32
    assert head_size({"hidden_size": 576, "num_attention_heads": 9}) == 64
    assert head_size({}) is None


def test_the_tiny_head_size_is_refused_on_a_cpu_and_the_real_model_is_not(tmp_path: Path) -> None:
    tiny, smol = _tiny_like(tmp_path), _smollm2_like(tmp_path)
    reason = why_vllm_cannot_run(tiny, "cpu")
    assert reason is not None and "head size is 16" in reason and "32, 64" in reason
    assert why_vllm_cannot_run(smol, "cpu") is None
    assert why_vllm_cannot_run(tiny, "cuda") is None  # a GPU build's attention takes 16
    moe32 = _model(tmp_path, "moe32", architectures=["MixtralForCausalLM"], head_dim=32, hidden_size=64)
    assert 32 in CPU_HEAD_SIZES and why_vllm_cannot_run(moe32, "cpu") is None


def test_an_architecture_vllm_lacks_is_refused(tmp_path: Path) -> None:
    odd = _model(
        tmp_path, "odd", architectures=["NexaOddForCausalLM"], hidden_size=512, num_attention_heads=8
    )
    reason = why_vllm_cannot_run(odd, "cpu", frozenset({"LlamaForCausalLM"}))
    assert reason == "vLLM has no implementation of its architecture NexaOddForCausalLM"
    assert "names no architecture" in str(why_vllm_cannot_run(_model(tmp_path, "none", hidden_size=8), "cpu"))


def test_asking_for_vllm_without_it_is_one_line_saying_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEXA_VLLM_ENV", str(tmp_path / "nothing-here"))
    smol = _smollm2_like(tmp_path)
    with pytest.raises(LLMError) as e:
        choose_engine(smol, "vllm")
    message = str(e.value)
    assert "\n" not in message and "make vllm" in message and str(tmp_path / "nothing-here") in message
    assert choose_engine(smol, "auto") == "transformers"  # auto: the engine there is


def test_asking_for_vllm_on_a_model_it_cannot_run_names_the_reason_and_the_engine_that_can(
    tmp_path: Path, installed: Path
) -> None:
    with pytest.raises(UnsupportedByVLLM) as e:
        ManagedServer(_tiny_like(tmp_path), tmp_path / "logs", engine="vllm")
    assert "head size is 16" in str(e.value) and "engine='transformers'" in str(e.value)
    odd = _model(tmp_path, "odd", architectures=["Gpt2ForCausalLM"], hidden_size=512, num_attention_heads=8)
    with pytest.raises(UnsupportedByVLLM, match="architecture Gpt2ForCausalLM"):
        choose_engine(odd, "vllm")  # the installed vLLM's registry, from its stamp, decides


def test_auto_takes_vllm_where_it_is_installed_and_runs_the_model(tmp_path: Path, installed: Path) -> None:
    smol = ManagedServer(_smollm2_like(tmp_path), tmp_path / "logs")
    assert smol.engine == "vllm" and smol.device == "cpu"
    assert ManagedServer(_tiny_like(tmp_path), tmp_path / "logs").engine == "transformers"
    cmd = server_command(smol.model_dir, 9001, "vllm", "cpu")
    assert cmd[:3] == [str(installed / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert (
        cmd[cmd.index("--model") + 1] == smol.model_dir
    )  # the CPU build's `vllm` CLI cannot start (vllm_env)
    assert "--enforce-eager" in cmd and cmd[cmd.index("--dtype") + 1] == "float32"
    # the model in the engine core's process on a CPU (vllm_device_args: why), unless a lab's flag comes after
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    mine = server_command(
        smol.model_dir, 9001, "vllm", "cpu", extra_args=["--distributed-executor-backend", "mp"]
    )
    assert mine[-2:] == ["--distributed-executor-backend", "mp"]  # last on the line: argparse keeps it
    on_gpu = server_command(smol.model_dir, 9001, "vllm", "cuda")
    assert on_gpu[:3] == [str(installed / "bin" / "vllm"), "serve", smol.model_dir]
    assert "--enforce-eager" not in on_gpu and "--distributed-executor-backend" not in on_gpu


def test_an_environment_stamped_for_another_device_is_not_vllm_for_this_one(
    installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert vllm_env.vllm_python("cpu") == installed / "bin" / "python"
    assert vllm_env.vllm_python("cuda") is None  # a CPU build on a GPU host: install the GPU one
    (installed / vllm_env.STAMP).unlink()  # an install that did not finish
    assert vllm_env.vllm_python("cpu") is None


def test_vllm_rollouts_on_a_model_vllm_cannot_run_are_refused_before_a_step(
    tmp_path: Path, installed: Path
) -> None:
    """``rl.rollout_engine: vllm`` on the tiny preset (head size 16): refused with the reason and the two ways out
    (transformers rollouts, or widened heads); a model vLLM runs passes and gets the interpreter."""
    from nexa_dagster.core.training.vllm_sampler import check_vllm_can_sample

    with pytest.raises(UnsupportedByVLLM) as e:
        check_vllm_can_sample(str(_tiny_like(tmp_path)))
    assert "head size is 16" in str(e.value) and "rl.rollout_engine: transformers" in str(e.value)
    assert "widen_heads" in str(e.value) and e.value.permanent
    assert check_vllm_can_sample(str(_smollm2_like(tmp_path))) == installed / "bin" / "python"


def test_vllm_rollouts_without_vllm_are_one_line_saying_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nexa_dagster.core.training.vllm_sampler import check_vllm_can_sample

    monkeypatch.setenv("NEXA_VLLM_ENV", str(tmp_path / "nothing-here"))
    with pytest.raises(LLMError) as e:
        check_vllm_can_sample(str(_smollm2_like(tmp_path)))
    assert "\n" not in str(e.value) and "make vllm" in str(e.value)


def test_the_harness_vllm_backend_without_the_harness_in_the_vllm_environment_is_one_line(
    tmp_path: Path, installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``evaluation.benchmarks.backend: vllm`` needs the harness beside vLLM (the install puts it there): an
    environment stamped without it, and none at all, are one line naming ``make vllm``; stamped with it, the
    environment's interpreter runs the harness. (``resolve_tasks`` asks this before any model loads.)"""
    from nexa_dagster.core.evaluation.benchmarks import BenchmarkError, _harness_in_vllm_env

    with pytest.raises(BenchmarkError) as e:
        _harness_in_vllm_env()
    assert "\n" not in str(e.value) and "make vllm" in str(e.value) and "backend: hf" in str(e.value)
    stamp = json.loads((installed / vllm_env.STAMP).read_text())
    (installed / vllm_env.STAMP).write_text(json.dumps({**stamp, "lm_eval": "0.4.13"}))
    assert _harness_in_vllm_env() == installed / "bin" / "python"
    monkeypatch.setenv("NEXA_VLLM_ENV", str(tmp_path / "nothing-here"))
    with pytest.raises(BenchmarkError, match="make vllm"):
        _harness_in_vllm_env()


def test_the_vllm_environment_holds_the_projects_harness_release() -> None:
    """The harness on the vllm backend is the release the hf backend runs (pyproject.toml's pin): the same tasks'
    code on both sides of a comparison."""
    import tomllib

    from nexa_dagster.core.common.config import REPO_ROOT

    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert vllm_env.LM_EVAL_REQUIREMENT in deps


def test_a_vllm_engine_gets_a_temporary_folder_of_its_own_and_keeps_torchs_cache(
    tmp_path: Path, installed: Path
) -> None:
    """`vllm serve` leaves its ZMQ sockets and its distributed-init file in the temporary folder even on a clean
    stop: each engine gets a folder of its own (removed by ``stop``, also after a start that never began its
    process), and torch inductor's cache stays where torch would put it (a person's own choice kept)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # torch: seconds, this test only

    smol = ManagedServer(_smollm2_like(tmp_path), tmp_path / "logs")
    env = smol._vllm_env({})
    assert smol.scratch is not None and smol.scratch.is_dir() and smol.scratch.name.startswith("nexa-vllm-")
    assert env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] == str(smol.scratch)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == default_inductor_cache() == default_cache_dir()
    assert env["VLLM_CPU_KVCACHE_SPACE"]
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # else vLLM's CPU platform turns "uni" into "mp"
    scratch = smol.scratch
    smol.stop()
    assert not scratch.exists() and smol.scratch is None
    mine = smol._vllm_env({"TORCHINDUCTOR_CACHE_DIR": "/data/inductor"})
    assert mine["TORCHINDUCTOR_CACHE_DIR"] == "/data/inductor"
    smol.stop()
    tiny = ManagedServer(_tiny_like(tmp_path), tmp_path / "logs", engine="transformers")
    assert tiny._vllm_env({}) == {} and tiny.scratch is None


def test_a_vllm_engine_s_precompiled_headers_land_in_torchs_shared_folder_not_its_own(
    tmp_path: Path, installed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Torch keeps inductor's precompiled C++ headers under the temporary folder's ``torchinductor_<user>``, whatever
    ``TORCHINDUCTOR_CACHE_DIR`` says: in the engine's own temporary folder each start compiled the header again
    (4.5-6.5 CPU-s) into a folder ``stop`` removes. torch's own function, run as the engine runs it (its temporary
    folder the engine's), names a folder that is the shared one, and ``stop`` leaves what is in it."""
    import tempfile

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # torch: seconds, this test only

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the host's /tmp, made for this test
    (tmp_path / "tmp").mkdir()
    shared = Path(default_cache_dir())
    smol = ManagedServer(_smollm2_like(tmp_path), tmp_path / "logs")
    env = smol._vllm_env({})
    monkeypatch.setattr(tempfile, "tempdir", env["TMPDIR"])  # as inside the engine
    in_engine = Path(default_cache_dir()) / "precompiled_headers"
    assert in_engine.parent.parent == smol.scratch and in_engine.parent.is_symlink()
    in_engine.mkdir()
    (in_engine / "header.h.gch").write_bytes(b"compiled")  # what torch writes there
    assert (shared / "precompiled_headers" / "header.h.gch").read_bytes() == b"compiled"
    smol.stop()
    assert not in_engine.parent.parent.exists()  # the engine's folder gone with its link
    assert (shared / "precompiled_headers" / "header.h.gch").read_bytes() == b"compiled"  # the header kept
