"""GRPO's rollouts on a vLLM engine, with the trainer's weights synced to it before every rollout.

``rollout_engine: vllm`` (``GRPOObjective``). The engine is ``core/llm/vllm_rollout_worker.py`` run by the vLLM
environment's interpreter (``vllm_env``: vLLM pins its own transformers, so it never shares the trainer's process),
driven over a pipe: token ids in, each completion's token ids and their sampling log-probabilities out.

**The weight sync, filesystem transport** (prime-rl's first transport): before a rollout, the training tensors are
written as a Hugging Face checkpoint (``save_pretrained`` of ``AliasedMixtral``: transformers' Mixtral on the same
storage, so no copy is made in memory) into a fresh directory beside the run's checkpoint, and the engine loads them
in place (``reload_weights``; the worker re-packs vLLM's CPU MoE weights, which vLLM 0.32 forgets on an update). The
engine samples from exactly the weights of the last update: on policy, as the transformers sampler. On GPUs the
same two calls would carry the tensors over NCCL instead of a file (TRL's server mode: ``init_communicator``, then
one broadcast per tensor into the engine's ``load_weights``; prime-rl's NCCL transport), which saves the write and
the read of every step; the pipe protocol and the rest of this class stay.

**The mismatch.** The engine's kernels are not the trainer's, so the probability the engine sampled a token with
differs slightly from the trainer's. ``last_logprobs`` keeps the engine's; the loss weights each completion by the
ratio of the trainer's probability to it (``grpo.sampling_correction``: TRL's ``vllm_importance_sampling_correction``).

**Seeds.** Every completion is sampled with its own seed, a pure function of the rollout's seed and its row: a
resumed run samples what an uninterrupted one did, whatever else the engine holds.

**Failures.** An engine that dies or stops answering fails the step with the last lines of its log
(``<checkpoint>.vllm-rollout.log``); nothing falls back to another engine. The engine dies with the trainer
(``PR_SET_PDEATHSIG``): a SIGKILLed worker leaves no engine behind.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import torch

from nexa_dagster import settings
from nexa_dagster.core.llm import vllm_env
from nexa_dagster.core.llm.base import LLMError
from nexa_dagster.core.llm.managed_server import with_parent_death_signal
from nexa_dagster.core.llm.vllm_models import refuse_unless_vllm_runs
from nexa_dagster.core.training.grpo_rollout import AliasedMixtral

WORKER = Path(vllm_env.__file__).with_name("vllm_rollout_worker.py")
START_TIMEOUT_S = 900.0  # an engine start: ~56 s on the 2-core machine idle, 3-4.5 min at load 10-14
CALL_TIMEOUT_S = 900.0  # one rollout or weight load; an engine silent for longer is taken for hung


ROLLOUT_INSTEAD = (
    "sample its rollouts with rl.rollout_engine: transformers, which runs it (or widen its attention heads to a "
    "size vLLM takes: python -m nexa_dagster.core.llm.widen_heads)"
)


def check_vllm_can_sample(init_from: str) -> Path:
    """The vLLM interpreter, after refusing what will fail: no vLLM for this host (one line saying how to install
    it), or a model it cannot run (the reason and the engine that can). Cheap: a stamp and a config read."""
    python = vllm_env.require_vllm()
    refuse_unless_vllm_runs(
        init_from, vllm_env.device_kind(), vllm_env.supported_architectures(), instead=ROLLOUT_INSTEAD
    )
    return python


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of one completion of a rollout: a pure function of the rollout's seed and the row."""
    digest = hashlib.sha256(f"vllm-row:{seed}:{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class VLLMSampler:
    """Rollouts on a vLLM engine on the training model's current weights (see the module docstring)."""

    engine = "vllm"

    def __init__(
        self,
        model: torch.nn.Module,
        init_from: str,
        run_dir: Path,
        eos_id: int | list[int],
        max_model_len: int,
    ) -> None:
        python = check_vllm_can_sample(init_from)
        self.view = AliasedMixtral(model)
        self.stop_ids = list(eos_id) if isinstance(eos_id, list) else [eos_id]
        self.weights_root = run_dir.with_name(run_dir.name + ".vllm-weights")
        self.log_path = run_dir.with_name(run_dir.name + ".vllm-rollout.log")
        self.last_logprobs: list[list[float]] | None = None
        self.sync_s, self.syncs = 0.0, 0
        self._weights: Path | None = None
        self._start(python, init_from, max_model_len)
        atexit.register(self.close)

    # -- the engine process ---------------------------------------------------------------------------------
    def _start(self, python: Path, init_from: str, max_model_len: int) -> None:
        self.weights_root.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [str(python), str(WORKER), "--model", init_from, "--max-model-len", str(max_model_len)]
        cmd += ["--run", str(self.log_path.with_name(self.log_path.name.removesuffix(".vllm-rollout.log")))]
        cmd += ["--dtype", str(next(self.view.hf.parameters()).dtype).removeprefix("torch.")]
        env = {
            **settings.child_environ("engine"),
            "PYTHONPATH": str(WORKER.parent),  # the workers import the weight-sync extension from it
            "HF_HUB_OFFLINE": "1",
            settings.VLLM_CPU_KVCACHE_SPACE.name: settings.VLLM_CPU_KVCACHE_SPACE.get(),
        }
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                with_parent_death_signal(cmd),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                text=True,
                start_new_session=True,
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(self.process.stdout, self._lines), daemon=True).start()
        started = time.monotonic()
        ready = self._reply(START_TIMEOUT_S, "start")
        self.version = str(ready.get("vllm"))
        self.start_s = time.monotonic() - started

    def _reply(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise LLMError(
                f"the vLLM rollout engine did not answer {what} in {timeout:.0f} s; {self._tail()}"
            ) from None
        if line is None:
            try:
                code: int | None = self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:  # stdout closed, the process still there: stop it
                self.close()
                code = self.process.returncode
            raise LLMError(f"the vLLM rollout engine exited with code {code} during {what}; {self._tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise LLMError(f"the vLLM rollout engine refused {what}: {reply.get('error')}; {self._tail()}")
        return reply

    def _call(self, what: str, **request: Any) -> dict[str, Any]:
        if self.process.poll() is not None:
            raise LLMError(
                f"the vLLM rollout engine is not running (exit {self.process.returncode}); {self._tail()}"
            )
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise LLMError(
                f"the vLLM rollout engine closed its input during {what}; {self._tail()}"
            ) from None
        return self._reply(CALL_TIMEOUT_S, what)

    def _tail(self, lines: int = 30) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            tail = []
        return f"last lines of {self.log_path}:\n" + "\n".join(tail)

    # -- the sampler's interface (BatchedSampler's) ------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.view.device

    def describe(self) -> str:
        return f"vLLM {self.version} (started in {self.start_s:.0f} s; weights synced through {self.weights_root})"

    def sync(self) -> None:
        """The training tensors, written under a fresh directory and loaded by the engine in place."""
        started = time.perf_counter()
        self.view.sync()
        fresh = Path(tempfile.mkdtemp(prefix="step-", dir=self.weights_root))
        self.view.hf.save_pretrained(fresh, safe_serialization=True)
        self._call("a weight load", op="load", path=str(fresh))
        if self._weights is not None:
            shutil.rmtree(self._weights, ignore_errors=True)
        self._weights = fresh
        self.sync_s += time.perf_counter() - started
        self.syncs += 1

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[list[int]], max_new_tokens: int, temperature: float, top_p: float, seed: int
    ) -> list[list[int]]:
        """Each prompt's completion token ids (up to and with the first end of turn) from the current weights;
        ``temperature`` 0: greedy. ``last_logprobs``: each token's log-probability the engine sampled it with."""
        self.sync()
        reply = self._call(
            "a rollout",
            op="generate",
            prompts=[list(p) for p in prompts],
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seeds=[row_seed(seed, row) for row in range(len(prompts))],
            stop=self.stop_ids,
        )
        self.last_logprobs = reply["logprobs"]
        return reply["completions"]

    def close(self) -> None:
        """Stop the engine (its answer to ``stop``, else SIGTERM then SIGKILL) and remove the synced weights."""
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            try:
                assert process.stdin is not None
                process.stdin.write(json.dumps({"op": "stop"}) + "\n")
                process.stdin.flush()
                process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        shutil.rmtree(self.weights_root, ignore_errors=True)


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    """The engine's stdout, line by line, into a queue the trainer reads with a timeout; ``None`` at its end."""
    for line in stream:
        if line.strip():
            lines.put(line)
    lines.put(None)
