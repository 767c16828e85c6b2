"""GRPO's rollouts on a vLLM engine, with the trainer's weights synced to it before every rollout.

``rollout_engine: vllm`` (``GRPOObjective``). The engine is ``core/llm/vllm_engine.VLLMEngine`` (the vLLM
environment's interpreter driven over a pipe: token ids in, each completion's token ids and their sampling
log-probabilities out); this module adds the training weights and their sync.

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
(``<checkpoint>.vllm-rollout.log``); nothing falls back to another engine. The engine dies with the trainer: a
SIGKILLed worker leaves no engine behind.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from nexa_dagster.core.llm.vllm_engine import VLLMEngine, check_vllm_can_run
from nexa_dagster.core.training.grpo_rollout import AliasedMixtral

ROLLOUT_INSTEAD = (
    "sample its rollouts with rl.rollout_engine: transformers, which runs it (or widen its attention heads to a "
    "size vLLM takes: python -m nexa_dagster.core.llm.widen_heads)"
)


def check_vllm_can_sample(init_from: str) -> Path:
    """Refuse, before a model is built, rollouts vLLM cannot sample (not installed here, or a model it cannot
    run), with the reason and the ways out; the vLLM interpreter otherwise."""
    return check_vllm_can_run(init_from, ROLLOUT_INSTEAD)


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers' progress bars off for the block, as they were after it."""
    from transformers.utils import logging  # loaded by the sampler's Mixtral already

    was_off = not logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if not was_off:
            logging.enable_progress_bar()


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
        self.view = AliasedMixtral(model)
        self.stop_ids = list(eos_id) if isinstance(eos_id, list) else [eos_id]
        self.weights_root = run_dir.with_name(run_dir.name + ".vllm-weights")
        self.last_logprobs: list[list[float]] | None = None
        self.sync_s, self.syncs = 0.0, 0
        self._weights: Path | None = None
        dtype = str(next(self.view.hf.parameters()).dtype).removeprefix("torch.")
        self.engine_process = VLLMEngine(
            init_from,
            run_dir.with_name(run_dir.name + ".vllm-rollout.log"),
            max_model_len,
            dtype=dtype,
            label=str(run_dir),  # shown by ps: which run an engine samples for
            instead=ROLLOUT_INSTEAD,
        )
        self.weights_root.mkdir(parents=True, exist_ok=True)

    @property
    def device(self) -> torch.device:
        return self.view.device

    @property
    def version(self) -> str:
        return self.engine_process.version

    def describe(self) -> str:
        return (
            f"vLLM {self.version} (started in {self.engine_process.start_s:.0f} s; weights synced through "
            f"{self.weights_root})"
        )

    def sync(self) -> None:
        """The training tensors, written under a fresh directory and loaded by the engine in place."""
        started = time.perf_counter()
        self.view.sync()
        fresh = Path(tempfile.mkdtemp(prefix="step-", dir=self.weights_root))
        with _quiet_progress():  # a bar per step in the run's log says nothing
            self.view.hf.save_pretrained(fresh, safe_serialization=True)
        self.engine_process.load(fresh)
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
        completions, self.last_logprobs = self.engine_process.generate(
            prompts, max_new_tokens, temperature, top_p, seed, self.stop_ids
        )
        return completions

    def close(self) -> None:
        """Stop the engine and remove the synced weights."""
        self.engine_process.close()
        shutil.rmtree(self.weights_root, ignore_errors=True)
