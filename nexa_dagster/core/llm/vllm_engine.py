"""A vLLM engine for token-level sampling: GRPO's rollouts and the evaluation's sampled answers.

The engine is ``vllm_rollout_worker.py`` run by the vLLM environment's interpreter (``vllm_env``: vLLM pins its own
transformers, so it never shares the caller's process), driven over a pipe, one JSON line each way: token ids in
(the caller renders and tokenizes), each completion's token ids and their sampling log-probabilities out, weights
reloadable in place. Every completion is sampled with its own seed, so a result does not depend on what else the
engine holds or held: a resumed run, or another model scored in the same evaluation, draws the same numbers.

An engine that dies or stops answering is an ``LLMError`` quoting the last lines of its log (``log_path``); nothing
falls back to another engine. It dies with the thread that started it (``PR_SET_PDEATHSIG``): a SIGKILLed caller
leaves no engine behind (it runs in one process: see the worker's docstring for why).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import queue
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from nexa_dagster import settings
from nexa_dagster.core.llm import vllm_env
from nexa_dagster.core.llm.base import LLMError
from nexa_dagster.core.llm.managed_server import with_parent_death_signal
from nexa_dagster.core.llm.vllm_models import SERVE_INSTEAD, refuse_unless_vllm_runs

WORKER = Path(__file__).with_name("vllm_rollout_worker.py")
START_TIMEOUT_S = (
    900.0  # an engine start: 12-56 s on the 2-core machines idle (eager), 3-4.5 min at load 10-14
)
CALL_TIMEOUT_S = 900.0  # one batch or weight load; an engine silent for longer is taken for hung


def check_vllm_can_run(model_dir: str | Path, instead: str = SERVE_INSTEAD) -> Path:
    """The vLLM interpreter, after refusing what will fail: no vLLM for this host (one line saying how to install
    it), or a model it cannot run (the reason and, ``instead``, the engine that can). A stamp and a config read."""
    python = vllm_env.require_vllm()
    refuse_unless_vllm_runs(
        model_dir, vllm_env.device_kind(), vllm_env.supported_architectures(), instead=instead
    )
    return python


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of one row of a batch: a pure function of the batch's seed and the row."""
    digest = hashlib.sha256(f"vllm-row:{seed}:{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class VLLMEngine:
    """``VLLMEngine(model_dir, log_path, max_model_len)``: started at once; ``generate``, ``load``, ``close``."""

    def __init__(
        self,
        model_dir: str | Path,
        log_path: Path,
        max_model_len: int,
        dtype: str = "float32",
        label: str = "",
        instead: str = SERVE_INSTEAD,
    ) -> None:
        python = check_vllm_can_run(model_dir, instead)
        self.log_path = log_path
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [str(python), str(WORKER), "--model", str(model_dir), "--max-model-len", str(max_model_len)]
        cmd += ["--dtype", dtype, "--run", label or str(log_path)]
        if vllm_env.device_kind() == "cpu":
            # Eager on a CPU, as the served engines are (managed_server.vllm_device_args). bench/vllm_compile.py on
            # the 2-core Xeon (SmolLM2-135M, 32 prompts of 10-122 words x 32 tokens): ready in 21 s eager, 61 s
            # compiled (82 s with empty caches), generation 1.12x eager's: repaid after ~86,000 generated tokens,
            # and paid again at every start (each resume, each evaluation's sampling). Tests and short runs lose
            # 40-60 s a start; a CPU GRPO run of many steps would gain (docs/stages/rl.md). On a GPU vLLM compiles.
            cmd.append("--enforce-eager")
        env = {
            **settings.child_environ("engine"),
            "PYTHONPATH": str(WORKER.parent),  # the engine imports the weight-sync extension from it
            "HF_HUB_OFFLINE": "1",
            settings.VLLM_CPU_KVCACHE_SPACE.name: settings.VLLM_CPU_KVCACHE_SPACE.get(),
            # The engine core and its worker in the engine's one process: in processes of their own, the worker's
            # reader of the engine's shared-memory queue spins a core for a second after every call (vLLM 0.32's
            # SpinCondition, busy_loop_s=1; measured: 96-99 % of a core, the trainer's next second at a third of its
            # speed on 2 cores)
            **vllm_env.ONE_PROCESS,
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
        atexit.register(self.close)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(self.process.stdout, self._lines), daemon=True).start()
        started = time.monotonic()
        self.version = str(self._reply(START_TIMEOUT_S, "start").get("vllm"))
        self.start_s = time.monotonic() - started

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        stop: Sequence[int],
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Each prompt's completion token ids (up to and with the first ``stop`` token; temperature 0: greedy) and
        each token's log-probability under the distribution it was drawn from; row ``i`` seeded ``row_seed(seed,
        i)``."""
        reply = self._call(
            "a batch",
            op="generate",
            prompts=[list(p) for p in prompts],
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seeds=[row_seed(seed, row) for row in range(len(prompts))],
            stop=list(stop),
        )
        return reply["completions"], reply["logprobs"]

    def load(self, weights_dir: Path) -> None:
        """The weights of ``weights_dir``'s safetensors, loaded in place."""
        self._call("a weight load", op="load", path=str(weights_dir))

    def close(self) -> None:
        """Stop the engine: its answer to ``stop``, else SIGTERM, then SIGKILL."""
        process = getattr(self, "process", None)
        if process is None or process.poll() is not None:
            return
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

    # -- the pipe ---------------------------------------------------------------------------------------------
    def _call(self, what: str, **request: Any) -> dict[str, Any]:
        if self.process.poll() is not None:
            raise LLMError(f"the vLLM engine is not running (exit {self.process.returncode}); {self._tail()}")
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise LLMError(f"the vLLM engine closed its input during {what}; {self._tail()}") from None
        return self._reply(CALL_TIMEOUT_S, what)

    def _reply(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise LLMError(
                f"the vLLM engine did not answer {what} in {timeout:.0f} s; {self._tail()}"
            ) from None
        if line is None:
            try:
                code: int | None = self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:  # stdout closed, the process still there: stop it
                self.close()
                code = self.process.returncode
            raise LLMError(f"the vLLM engine exited with code {code} during {what}; {self._tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise LLMError(f"the vLLM engine refused {what}: {reply.get('error')}; {self._tail()}")
        return reply

    def _tail(self, lines: int = 30) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            tail = []
        return f"last lines of {self.log_path}:\n" + "\n".join(tail)


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    """The engine's stdout, line by line, into a queue read with a timeout; ``None`` at its end."""
    for line in stream:
        if line.strip():
            lines.put(line)
    lines.put(None)
