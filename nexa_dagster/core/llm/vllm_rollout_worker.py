"""A vLLM engine for RL rollouts (and the reward gate's sampled answers), run by the vLLM environment's interpreter
and driven over its stdin and stdout by ``vllm_engine.VLLMEngine``.

Why a process of its own and not ``vllm serve``: the trainer wants exact token ids in and out (the prompt already
rendered and tokenized, the completion's ids and each sampled token's log-probability, the distribution it was
sampled from), a weight reload between two steps, and nothing else; vLLM's offline ``LLM`` gives all three without
an HTTP server, a port or a tokenizer round trip. It cannot run in the trainer's process: vLLM pins its own
``transformers`` and lives in its own environment (``vllm_env``).

This file imports only the standard library at module level, and vLLM inside ``main``: it runs under the vLLM
environment's interpreter, where the project is not installed (``python path/to/vllm_rollout_worker.py``).

The protocol, one JSON object per line each way; every request gets one reply, ``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``:

* at start, once the engine is built: ``{"ok": true, "ready": true, "vllm": "<version>"}``;
* ``{"op": "generate", "prompts": [[ids]], "max_tokens": n, "temperature": t, "top_p": p, "seeds": [s], "stop":
  [ids]}`` -> ``{"ok": true, "completions": [[ids]], "logprobs": [[float]]}``: one completion per prompt, sampled
  with its own seed (temperature 0: greedy), up to and with the first stop token; each token's log-probability
  under the distribution it was drawn from (``logprobs_mode="processed_logprobs"``: after temperature, as the
  trainer scores them);
* ``{"op": "load", "path": dir}`` -> ``{"ok": true, "seconds": s}``: the weights of ``dir``'s safetensors loaded in
  place (the filesystem transport: ``reload_weights`` on every worker of the engine), and the prefix cache dropped
  (its entries were computed with the old weights);
* ``{"op": "stop"}``: the engine shuts down and the process exits 0.

Its stdout carries the protocol alone: vLLM's own output goes to stderr, which the trainer writes to a log file and
quotes when the engine dies.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


class WeightSync:
    """Methods added to each of the engine's workers (vLLM's ``worker_extension_cls``): they run in the worker
    process, beside the model."""

    def load_checkpoint_weights(self, path: str) -> None:
        """The weights of ``path``'s safetensors, loaded in place (``reload_weights``), then vLLM 0.32's CPU MoE
        weights packed again: on a weight update its ``_setup_kernel`` copies the new expert weights into the
        packed tensors *unpacked* (it skips ``fused_experts.process_weights_after_loading``, the CPU prepack, when
        the kernel exists; measured: the experts' bytes change and the greedy tokens leave transformers'). On a
        GPU that step is a no-op for the unquantized experts, so it is left alone there."""
        from vllm.platforms import current_platform  # the vLLM environment's (see the module docstring)

        self.reload_weights(weights_path=path)  # type: ignore[attr-defined]
        if not current_platform.is_cpu():
            return
        for module in self.model_runner.model.modules():  # type: ignore[attr-defined]
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None:
                kernel.fused_experts.process_weights_after_loading(module)


def _reply(channel: Any, **fields: Any) -> None:
    channel.write(json.dumps(fields) + "\n")
    channel.flush()


def _generate(llm: Any, request: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams  # the vLLM environment's (see the module docstring)
    from vllm.inputs import TokensPrompt

    prompts, seeds = request["prompts"], request["seeds"]
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    params = [
        SamplingParams(
            max_tokens=int(request["max_tokens"]),
            temperature=float(request["temperature"]),
            top_p=float(request["top_p"]),
            seed=int(seed),
            logprobs=0,  # the sampled token's own log-probability only
            stop_token_ids=list(request["stop"]),
            detokenize=False,
        )
        for seed in seeds
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    completions, logprobs = [], []
    for output in outputs:
        sample = output.outputs[0]
        ids = list(sample.token_ids)
        completions.append(ids)
        logprobs.append(
            [float(step[token].logprob) for step, token in zip(sample.logprobs, ids, strict=True)]
        )
    return {"completions": completions, "logprobs": logprobs}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The engine's command line (``VLLMEngine`` writes it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", required=True, help="the Hugging Face checkpoint directory the engine starts on"
    )
    parser.add_argument(
        "--max-model-len", type=int, required=True, help="prompt + completion tokens, at most"
    )
    parser.add_argument(
        "--dtype", default="float32", help="the trainer's dtype: the same logits on both sides"
    )
    parser.add_argument("--run", default="", help="the training run it samples for (shown by ps; not used)")
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no torch.compile (a CPU host: what it costs at a start, vllm_engine.VLLMEngine says)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    channel = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's stdout ...
    os.dup2(2, 1)  # ... and everything vLLM prints goes to stderr
    import vllm  # the vLLM environment's (see the module docstring)

    llm = vllm.LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        logprobs_mode="processed_logprobs",  # the sampling distribution's (TRL's setting for its IS correction)
        enable_prefix_caching=False,  # every step's weights differ: nothing cached would be reused
        # vLLM 0.32 on a CPU: a request whose prompt is prefilled in chunks has its seeded generator rewound
        # (``set_offset``), which a CPU generator refuses and the engine dies ("CPU Generator does not use
        # offset", measured with 64 prompts of 20-140 tokens). Whole prefills only, within one step's token budget
        enable_chunked_prefill=False,
        distributed_executor_backend="uni",  # one process (VLLMEngine sets VLLM_ENABLE_V1_MULTIPROCESSING=0: why there)
        max_num_batched_tokens=max(args.max_model_len, 8192),
        seed=0,
        enforce_eager=args.enforce_eager,
        worker_extension_cls=f"{Path(__file__).stem}.WeightSync",  # this file, on the workers' path (PYTHONPATH)
    )
    _reply(channel, ok=True, ready=True, vllm=vllm.__version__)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            op = request.get("op")
            if op == "stop":
                _reply(channel, ok=True)
                break
            if op == "generate":
                _reply(channel, ok=True, **_generate(llm, request))
            elif op == "load":
                started = time.perf_counter()
                llm.collective_rpc("load_checkpoint_weights", args=(request["path"],))
                llm.reset_prefix_cache()
                _reply(channel, ok=True, seconds=time.perf_counter() - started)
            else:
                raise ValueError(f"unknown op {op!r}; generate, load or stop")
        except Exception as e:  # the trainer gets the reason and decides
            _reply(channel, ok=False, error=f"{type(e).__name__}: {e}")
            if type(e).__name__ == "EngineDeadError":  # nothing more can be served: exit, the log says why
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
