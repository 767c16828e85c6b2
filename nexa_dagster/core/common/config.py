"""Loading of the YAML configuration in ``configs/``: scale presets, model presets, filters, prompts.

The configuration directory defaults to ``<repo>/configs`` and can be moved with ``NEXA_CONFIG_DIR``; the scale
preset defaults to ``tiny`` and is chosen with ``NEXA_SCALE`` so that the same code location runs the demo on a
laptop and the full run on a cluster.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from nexa_dagster import settings

REPO_ROOT = Path(__file__).resolve().parents[3]


def config_dir() -> Path:
    return Path(settings.CONFIG_DIR.get() or REPO_ROOT / "configs")


def resolve_path(path: str | os.PathLike[str]) -> Path:
    """Resolve a configured path: absolute paths stay, relative ones are relative to the repo root."""
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


# libyaml's parser where PyYAML has it (its wheels do): about 10x the pure-Python one (the 24 files of configs/ in
# 6.5 against 69 CPU-ms, measured 2026-12-06 on the 2-core Xeon), which every process that loads the code location
# paid at its start (the configuration check reads them all), and each Dagster run pays in two or more of them
_FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load(text)``, parsed by libyaml. A document libyaml refuses is parsed again by PyYAML's own
    loader, whose error quotes the offending line under a caret (libyaml's gives only its line and column)."""
    try:
        # a safe loader: CSafeLoader, or SafeLoader where PyYAML has no libyaml
        return yaml.load(text, Loader=_FAST_LOADER)
    except yaml.YAMLError:
        return yaml.safe_load(text)


def load_yaml(relative: str | os.PathLike[str]) -> Any:
    """``configs/<relative>`` parsed; an absolute path is read where it is (a blend kept outside ``configs/``).
    A missing file or invalid YAML raises an error naming the file."""
    path = config_dir() / relative
    try:
        return parse_yaml(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"configuration file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"invalid YAML in {path}: {e}") from e


def read_text(relative: str) -> str:
    return (config_dir() / relative).read_text(encoding="utf-8")


M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A configuration file that does not say what the code needs; the message names the file and the key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _known_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str] | None:
    """The keys the model accepts at ``loc`` (the parent of an unknown key), when it is a model's."""
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        sub = getattr(field, "annotation", None) if field else None
        candidates = [sub, *getattr(sub, "__args__", ())]
        nested = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nested is None:
            return None
        model = nested
    return sorted(model.model_fields)


def explain(error: ValidationError, model: type[BaseModel]) -> list[str]:
    """Pydantic's errors as ``key.path: what is wrong``, unknown keys first (with the known ones)."""
    problems = []
    for err in sorted(error.errors(), key=lambda err: err["type"] != "extra_forbidden"):
        loc = tuple(err["loc"])
        key = ".".join(str(p) for p in loc) or "(the whole file)"
        if err["type"] == "extra_forbidden":
            known = _known_keys(model, loc[:-1])
            problems.append(
                f"{key}: unknown key (a typo?)" + (f"; known keys: {', '.join(known)}" if known else "")
            )
        elif err["type"] == "missing":
            problems.append(f"{key}: missing (required)")
        else:
            problems.append(f"{key}: {err['msg']} (got {err.get('input')!r:.80})")
    return problems


def invalid_file(path: str | os.PathLike[str], error: ValidationError, model: type[BaseModel]) -> ConfigError:
    """One line per problem, each naming the file and the key."""
    return ConfigError("\n".join(f"{path}: {problem}" for problem in explain(error, model)))


def validated(model: type[M], relative: str | os.PathLike[str], data: Any) -> M:
    """``data`` read from ``configs/<relative>`` as a ``model``, or a ``ConfigError`` naming the file and key."""
    try:
        return model.model_validate({} if data is None else data)
    except ValidationError as e:
        raise invalid_file(config_dir() / relative, e, model) from None


def load_validated(model: type[M], relative: str | os.PathLike[str]) -> M:
    """``configs/<relative>`` (or an absolute path) read as a ``model``: the one sequence every configuration file
    goes through, so each names its file the same way when it is missing, not YAML, or says the wrong thing."""
    return validated(model, relative, load_yaml(relative))


class TeacherSampling(_Strict):
    max_new_tokens: int = Field(gt=0)
    temperature: float = Field(ge=0)
    top_p: float = Field(gt=0, le=1)
    seed: int = 0


class TrainingSettings(_Strict):
    max_steps: int = Field(gt=0)
    micro_batch_size: int = Field(gt=0)
    gradient_accumulation_steps: int = Field(gt=0)
    learning_rate: float = Field(gt=0)
    warmup_steps: int = Field(ge=0)
    weight_decay: float = Field(ge=0)
    grad_clip: float = Field(gt=0)
    log_every: int = Field(gt=0)
    seed: int = 0
    num_procs: int = Field(gt=0)
    optimizer: Literal["adamw", "adam"] = "adamw"
    checkpoint_every: int = Field(
        default=0, ge=0, description="save resumable engine state every N steps (0: off)"
    )
    stall_timeout_s: float = Field(
        default=900.0, gt=0, description="fail the run when no step ends in this time"
    )
    progress_every_s: float = Field(default=10.0, gt=0, description='log "training steps: n/N" this often')
    activation_checkpointing: bool = False
    compile: bool = Field(default=False, description="torch.compile each decoder layer (GPU presets)")
    attention: Literal["auto", "sdpa", "flex", "causal"] = Field(
        default="auto",
        description="auto: within-document masks (FlexAttention on GPUs); causal: across documents",
    )
    prefetch: int = Field(default=2, ge=0, description="micro-batches prepared ahead by a background thread")


class BenchmarkSettings(_Strict):
    """``evaluation.benchmarks`` of a scale preset: lm-evaluation-harness tasks run on every evaluated model by the
    evaluation worker (``core.benchmarks``), offline, from the data files the task YAMLs name."""

    tasks: list[str] = Field(
        default_factory=list, description="harness task, group or tag names (empty: off)"
    )
    include_path: list[str] = Field(
        default_factory=lambda: ["configs/benchmarks"],
        description=(
            "folders of task YAMLs besides the harness's own (relative: to the repo root); a task's relative "
            "data_files are relative to its YAML's folder"
        ),
    )
    backend: Literal["hf", "vllm"] = Field(
        default="hf",
        description=(
            "hf: the harness's transformers backend, the checkpoint loaded in the worker; vllm: GPU hosts with vLLM"
        ),
    )
    num_fewshot: int | None = Field(default=None, ge=0, description="None: each task's own setting")
    limit: int | None = Field(
        default=None, gt=0, description="at most this many examples per task (None: all)"
    )
    batch_size: int = Field(default=8, gt=0)
    model_args: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "more model arguments for the backend (dtype, max_length; vllm: gpu_memory_utilization, ...)"
        ),
    )
    bootstrap_iters: int = Field(
        default=1000, ge=0, description="the harness's bootstrap for metrics that need it"
    )


class EvaluationSettings(_Strict):
    num_heldout_prompts: int = Field(gt=0)
    max_new_tokens: int = Field(gt=0)
    benchmarks: BenchmarkSettings = Field(default_factory=BenchmarkSettings)


class PretrainingSettings(_Strict):
    """The ``base_model`` stage: the training settings of the preset with these overrides, on pretrain_corpus."""

    max_steps: int = Field(
        gt=0, description="optimizer steps of pretraining (the SFT steps are training.max_steps)"
    )
    learning_rate: float | None = Field(default=None, gt=0, description="default: training.learning_rate")
    warmup_steps: int | None = Field(default=None, ge=0, description="default: training.warmup_steps")
    heldout_fraction: float = Field(
        default=0.1,
        gt=0,
        lt=1,
        description="corpus documents (by a hash of their tokens) never trained on: "
        "the base model's held-out perplexity",
    )

    def settings(self, training: TrainingSettings) -> TrainingSettings:
        """The SFT settings with pretraining's steps (and learning rate, warmup where set)."""
        update: dict[str, Any] = {"max_steps": self.max_steps}
        if self.learning_rate is not None:
            update["learning_rate"] = self.learning_rate
        if self.warmup_steps is not None:
            update["warmup_steps"] = self.warmup_steps
        return training.model_copy(update=update)


class PreferenceSettings(_Strict):
    """The preference stage of a scale preset: pairs from the production model, then DPO from it."""

    completions_per_prompt: int = Field(default=2, ge=1, description="K answers of the policy per prompt")
    min_score_gap: float = Field(
        default=0.5, ge=0, description="a pair's chosen score minus its rejected score"
    )
    sampling: TeacherSampling = Field(
        default_factory=lambda: TeacherSampling(max_new_tokens=40, temperature=1.0, top_p=0.95, seed=4321),
        description="how the policy samples its K answers (diverse answers make pairs)",
    )
    validation_fraction: float = Field(
        default=0.1, gt=0, lt=1, description="pairs held out for reward accuracy"
    )
    beta: float = Field(
        default=0.1, gt=0, description="DPO's beta: how far the policy may move from its reference"
    )
    loss: Literal["sigmoid", "sigmoid_norm"] = Field(
        default="sigmoid", description="sigmoid: DPO; sigmoid_norm: DPO on length-normalised log-ratios"
    )
    sft_weight: float = Field(
        default=0.0,
        ge=0,
        description="weight of the chosen answers' NLL beside DPO's loss (TRL's `sft` loss type; RPO's alpha)",
    )
    max_steps: int = Field(default=24, gt=0)
    learning_rate: float | None = Field(
        default=None, gt=0, description="default: training.learning_rate / 10"
    )
    # (pipeline engineer) how the K answers are ranked into pairs: the judge's score, or a verifiable reward
    rank_by: Literal["judge", "reward"] = Field(
        default="judge", description="judge: pointwise judge score; reward: `reward` on the checkable tasks"
    )
    reward: str = Field(
        default="exact_answer", min_length=1, description="rank_by reward: a core.rl.rewards name"
    )
    warmup_steps: int | None = Field(default=None, ge=0, description="default: training.warmup_steps")

    def settings(self, training: TrainingSettings) -> TrainingSettings:
        """The SFT settings with the preference stage's steps and (a tenth of SFT's, by default) learning rate."""
        update: dict[str, Any] = {
            "max_steps": self.max_steps,
            "learning_rate": self.learning_rate or training.learning_rate / 10,
        }
        if self.warmup_steps is not None:
            update["warmup_steps"] = self.warmup_steps
        return training.model_copy(update=update)


class RLReward(_Strict):
    """One reward of the RL stage's sum: a name in ``core.rl.rewards.REWARDS`` and its weight."""

    name: str = Field(min_length=1)
    weight: float = 1.0


class RLTaskSettings(_Strict):
    """How ``rl_prompts`` builds the checkable tasks from the ingested documents (``core/rl/tasks.py``)."""

    tasks: list[Literal["topic", "next_words"]] = Field(default_factory=lambda: ["topic"], min_length=1)
    choices: int = Field(default=4, ge=2, le=10, description="topic: candidate topics listed in the prompt")
    passage_words: int = Field(default=40, ge=8, description="words of the document shown")
    next_words: int = Field(default=3, ge=1, le=10, description="next_words: words to continue with")
    held_out_fraction: float = Field(
        default=0.25, gt=0, lt=1, description="documents (by a hash of the id) held out for the RL gate"
    )
    seed: int = 0


class RLSettings(_Strict):
    """The RL stage of a scale preset: GRPO from the production model on verifiable rewards (``rl_checkpoint``).

    The sampling and loss fields are ``GRPOObjective``'s (``core/training/job.py``, which says why each default is
    what it is); the steps and learning rate override the preset's training settings, as DPO's do. One prompt's
    group of ``num_generations`` completions is one micro-batch, so ``settings`` sets the micro-batch size to K and
    the accumulation to the prompts per step over the ranks.
    """

    rewards: list[RLReward] = Field(
        default_factory=lambda: [RLReward(name="exact_answer")],
        min_length=1,
        description="what a completion is rewarded for (exact_answer: a checkable task, the demo's choice)",
    )
    num_generations: int = Field(default=8, ge=2, description="K completions per prompt (TRL's default)")
    prompts_per_step: int = Field(default=4, gt=0, description="B prompts per step: K x B rollouts per step")
    max_completion_tokens: int = Field(default=32, gt=0, description="longest sampled completion, in tokens")
    temperature: float = Field(default=1.0, gt=0, description="TRL's 1.0: sample the policy as it is")
    top_p: float = Field(default=1.0, gt=0, le=1, description="TRL's 1.0: no nucleus truncation")
    beta: float = Field(default=0.0, ge=0, description="KL weight to the starting model (TRL's 0.0)")
    ptx_coef: float = Field(
        default=0.0,
        ge=0,
        description="PPO-ptx's gamma: the SFT rows' LM loss mixed into every step (the latest sft_dataset's "
        "train split); 0: none, as TRL",
    )
    epsilon: float = Field(default=0.2, gt=0, description="the surrogate's clip range (TRL's 0.2)")
    loss_type: Literal["grpo", "dr_grpo"] = Field(
        default="dr_grpo", description="dr_grpo: no per-completion length normalisation (no pull to length)"
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        default="group",
        description="what the advantages are divided by: the group's std (TRL), the batch's, none",
    )
    rollout_engine: Literal["transformers", "vllm"] = Field(
        default="transformers",
        description=(
            "what samples the rollouts: transformers (on the training tensors) or vllm (an engine from `make vllm`, "
            "weights synced each step; not the tiny preset's head size 16 on a CPU, refused before a step)"
        ),
    )
    max_steps: int = Field(default=20, gt=0, description="optimizer steps, each on K x B fresh rollouts")
    learning_rate: float | None = Field(
        default=None, gt=0, description="default: training.learning_rate / 10 (post-training moves less)"
    )
    warmup_steps: int | None = Field(default=None, ge=0, description="default: training.warmup_steps")
    # (pipeline engineer) the tasks, and the frozen held-out prompts the reward gate compares both models on
    tasks: RLTaskSettings = Field(default_factory=RLTaskSettings)
    held_out_prompts: int = Field(default=64, gt=0, description="prompts of the frozen RL eval set")
    eval_samples: int = Field(
        default=0,
        ge=0,
        description="the reward gate's answers per held-out prompt, sampled at the rollouts' temperature and top_p "
        "(a prompt's reward: their mean, pass@1 from k samples); 0: one greedy answer",
    )
    eval_set_version: int = Field(default=1, ge=1, description="the frozen RL eval set's version")

    def settings(self, training: TrainingSettings) -> TrainingSettings:
        """The SFT settings with RL's steps, learning rate and batch shape (K completions per micro-batch)."""
        if self.prompts_per_step % training.num_procs:
            raise ValueError(
                f"rl.prompts_per_step {self.prompts_per_step} is not a multiple of training.num_procs "
                f"{training.num_procs}: every rank rolls out the same number of prompts"
            )
        update: dict[str, Any] = {
            "max_steps": self.max_steps,
            "learning_rate": self.learning_rate or training.learning_rate / 10,
            "micro_batch_size": self.num_generations,
            "gradient_accumulation_steps": self.prompts_per_step // training.num_procs,
        }
        if self.warmup_steps is not None:
            update["warmup_steps"] = self.warmup_steps
        return training.model_copy(update=update)


class ScalePreset(_Strict):
    """A scale factor in the Nemotron sense: the same recipe at tiny, small or full size."""

    name: str
    max_docs_per_day: int | None = Field(default=None, gt=0)
    max_chars_per_doc: int = Field(gt=0)
    generations_per_prompt: int = Field(gt=0)
    teacher: TeacherSampling
    pack_size: int = Field(gt=8)
    validation_fraction: float = Field(gt=0, lt=1)
    model_preset: str
    deepspeed_config: str
    training: TrainingSettings
    evaluation: EvaluationSettings
    init_from: str = Field(
        default="base",
        min_length=1,
        description=(
            "where moe_checkpoint starts: base (the latest base_model; scratch while none exists), production, "
            "scratch, or the path of a Mixtral-format Hugging Face checkpoint"
        ),
    )
    pretraining: PretrainingSettings | None = Field(
        default=None, description="the base_model stage (None: off)"
    )
    preference: PreferenceSettings | None = Field(
        default=None, description="the preference stage: pairs and DPO (None: off)"
    )
    rl: RLSettings | None = Field(
        default=None, description="the RL stage: GRPO on verifiable rewards (None: off)"
    )


def scale_name() -> str:
    return settings.SCALE.get()


def load_scale(name: str | None = None) -> ScalePreset:
    """The scale preset ``name`` (default ``NEXA_SCALE``), read once per configuration directory."""
    return _load_scale(str(config_dir()), name or scale_name())


@lru_cache(maxsize=16)
def _load_scale(directory: str, name: str) -> ScalePreset:
    # keyed by the directory too: a process that moves NEXA_CONFIG_DIR (the tests) must not get another's preset
    return load_validated(ScalePreset, f"scales/{name}.yaml")


class UpcyclingConfig(_Strict):
    """A model preset's ``upcycling`` block: how a dense checkpoint's MLPs become experts
    (``core/training/upcycle.py`` names the sources)."""

    router_init_std: float = Field(default=0.02, gt=0, description="the new router's normal std")
    expert_drop_ratio: float = Field(
        default=0.0, ge=0, le=1, description="Drop-Upcycling's r: share of each expert's units re-drawn"
    )


class ModelPreset(_Strict):
    """``configs/models/<name>.yaml``: a Mixtral-architecture model's shape (the vocabulary comes from the tokenizer).

    Only keys listed here are accepted: ``transformers`` keeps unknown config keys silently, so a typo would train
    a different model than the one asked for.
    """

    architecture: Literal["MixtralForCausalLM"] = "MixtralForCausalLM"
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    num_local_experts: int = Field(gt=0)
    num_experts_per_tok: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    vocab_size: int | None = Field(default=None, gt=0, description="informational: the tokenizer decides")
    rope_theta: float = Field(default=1e6, gt=0)
    router_aux_loss_coef: float = Field(default=0.001, ge=0)
    tie_word_embeddings: bool = False
    rms_norm_eps: float | None = Field(default=None, gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    hidden_act: str | None = None
    initializer_range: float | None = Field(default=None, gt=0)
    sliding_window: int | None = Field(default=None, gt=0)
    attention_dropout: float | None = Field(default=None, ge=0, le=1)
    router_jitter_noise: float | None = Field(default=None, ge=0)
    upcycling: UpcyclingConfig | None = None  # used only when init_from is a dense checkpoint


def load_model_preset(name: str) -> dict[str, Any]:
    """The preset's keys as written in its file (checked against ``ModelPreset``)."""
    relative = f"models/{name}.yaml"
    data = load_yaml(relative)
    return validated(ModelPreset, relative, data).model_dump(exclude_unset=True)


def load_deepspeed_config(name: str) -> dict[str, Any]:
    path = config_dir() / "deepspeed" / name
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class ModelsConfig(_Strict):
    teacher: str = Field(min_length=1)
    judge: str = Field(min_length=1)
    student_tokenizer: str = Field(min_length=1)


class ScheduleConfig(_Strict):
    nightly_retrain_hour_utc: int = Field(default=2, ge=0, le=23)
    # how long a night may take: its evaluation is overdue (freshness FAIL in the UI) this many hours after the
    # schedule's hour (nexa_dagster/assets/freshness.py)
    nightly_deadline_hours: int = Field(default=6, ge=1, le=23)


class PipelineConfig(_Strict):
    """``configs/pipeline.yaml``. The sections that configure a Dagster resource (``gpu_cluster``, ``teacher_llm``,
    ``judge_llm``, ``ingest``, ``eval_set``) are checked against that resource's class where it is built, when the
    code location loads (``nexa_dagster/definitions.py``), so the list of each resource's keys lives in one place."""

    data_root: str = Field(min_length=1)
    ingest: dict[str, Any] = Field(
        description="landing_root (the storage resource's) and the ingest resource's "
        "fields (resources/configs.py: IngestResource)"
    )
    models: ModelsConfig
    gpu_cluster: dict[str, Any] = Field(default_factory=dict)
    teacher_llm: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "backend (local | managed | openai) and that backend's fields (resources/llm.py), under NEXA_TEACHER_*"
        ),
    )
    judge_llm: dict[str, Any] = Field(
        default_factory=dict, description="the same for the judge (NEXA_JUDGE_*)"
    )
    policy_llm: dict[str, Any] = Field(
        default_factory=dict,
        description="the same for the production model answering preference prompts (NEXA_POLICY_*); no model: "
        "the production checkpoint (local/managed)",
    )
    schedule: ScheduleConfig = ScheduleConfig()
    eval_set: dict[str, Any] = Field(
        default_factory=dict,
        description="the eval_sets resource's fields (resources/configs.py: EvalSetsResource)",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "partitions_start_date" in data:
            raise ValueError(
                "partitions_start_date moved to the environment variable NEXA_PARTITIONS_START (the "
                "daily partitions are defined when the code location is imported, before any file "
                "is read); remove the key"
            )
        return data


def pipeline_config() -> PipelineConfig:
    """``configs/pipeline.yaml``, validated: an unknown or missing key fails naming the file and the key."""
    return load_validated(PipelineConfig, "pipeline.yaml")


def load_pipeline_config() -> dict[str, Any]:
    """``pipeline_config()`` as plain data (defaults filled in, dates as ISO strings)."""
    return pipeline_config().model_dump(mode="json")
