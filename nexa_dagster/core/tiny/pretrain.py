"""The tiny profile's teacher and judge: a tiny MoE the project pretrains itself on the text that ships with Python.

A randomly initialised teacher answers noise and a random judge's verdicts carry nothing, so the demo's data would
carry no signal. No model can be downloaded here, so ``build_pretrained_tiny_lm`` makes one: the tokenizer and
model of ``tiny_model.build_tiny_causal_lm``, then a few hundred AdamW steps on CPython's documentation topics
(``pydoc_data.topics``, which every Python has), cast as the two jobs the tiny model does in the pipeline:

* teacher: the project's own teacher prompt (``configs/prompts/teacher.jinja`` with its system prompt) on a
  600-character window of a topic, answered by the text that *follows* that window in the same topic (what the
  documentation goes on to say, never a copy of the prompt, which SampleGate would reject as an echo); the loss is
  on every token, so the model also learns the documentation's words;
* judge: the judge's score prompt (``configs/prompts/judge.jinja``) answered by a score: 5 for the same topic's
  continuation, 3 for a window of another topic, 1 for a few symbols or shuffled words; the loss is on the score
  only.

The repository ships the result (``tiny_weights/tiny-pretrained-<key>/``, 2 MB), named by a hash of everything
that makes it (the recipe, the model preset, the corpus, the prompts, the chat template): the weights a build gives
depend on the CPU (PyTorch picks its kernels by the CPU's vector instructions, and 150 steps of AdamW carry a
last-bit difference far), so building them on each machine would give each machine another teacher, another judge
and other data. Every data root (``data/models/tiny-teacher``, each test's) gets a copy of the shipped bytes.
A changed recipe (another key) has no shipped model: it is built on first use, once per machine, into
``$NEXA_MODEL_CACHE`` (default ``~/.cache/nexa-dagster/models``), with a warning that the shipped one is stale;
``python -m nexa_dagster.core.tiny.pretrain --ship`` (``make tiny-models``) rebuilds the shipped copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from nexa_dagster import settings
from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.common.config import load_model_preset, read_text
from nexa_dagster.core.common.storage import directory_lock, publish_directory
from nexa_dagster.core.distill.teacher import render
from nexa_dagster.core.tiny.model import build_tiny_causal_lm, default_corpus
from nexa_dagster.core.training.hf_checkpoint import write_portable_configs
from nexa_dagster.core.training.init import load_mixtral_checkpoint
from nexa_dagster.core.training.model.moe import to_hf

RECIPE_VERSION = 2  # raise when the code below changes what it builds
SHIPPED_ROOT = Path(__file__).resolve().parent / "weights"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyPretrainRecipe:
    """Everything that decides the pretrained tiny model besides the corpus, prompts and preset (hashed with them)."""

    preset: str = "tiny"
    vocab_size: int = 2048
    seed: int = 0
    steps: int = 150
    batch_size: int = 8
    learning_rate: float = 1e-2
    warmup_steps: int = 10
    window_chars: int = 600  # the scale's max_chars_per_doc: what the teacher prompt shows of a document
    answer_chars: int = 200  # about the teacher's max_new_tokens (40) of text
    judge_share: float = 0.5  # of the examples in a batch


def recipe_key(recipe: TinyPretrainRecipe, corpus: list[str]) -> str:
    """A hash of what makes the model: a different recipe, preset, corpus, prompt or chat template, another key."""
    h = hashlib.sha256()
    parts = {
        "version": RECIPE_VERSION,
        "recipe": asdict(recipe),
        "preset": load_model_preset(recipe.preset),
        "teacher": read_text("prompts/teacher.jinja"),
        "system": read_text("prompts/teacher_system.txt"),
        "judge": read_text("prompts/judge.jinja"),
        "chat": read_text("chat_template.jinja"),
    }
    h.update(json.dumps(parts, sort_keys=True, default=str).encode())
    for doc in corpus:
        h.update(hashlib.sha256(doc.encode()).digest())
    return h.hexdigest()[:16]


def _cut(text: str, limit: int) -> str:
    """At most ``limit`` characters, ending on a word boundary."""
    if len(text) <= limit:
        return text.strip()
    return text[:limit].rsplit(None, 1)[0].strip()


class ExampleMaker:
    """Draws training conversations (teacher and judge) from the corpus with one seeded RNG."""

    def __init__(
        self, corpus: list[str], recipe: TinyPretrainRecipe, titles: list[str] | None = None
    ) -> None:
        self.render = render
        self.recipe = recipe
        self.docs = [d for d in corpus if len(d) > recipe.window_chars + recipe.answer_chars // 2]
        if len(self.docs) < 2:
            raise ValueError(
                f"tiny pretraining needs at least 2 documents longer than "
                f"{recipe.window_chars + recipe.answer_chars // 2} characters; got {len(self.docs)}"
            )
        self.titles = titles
        self.rng = random.Random(recipe.seed)
        self.teacher = read_text("prompts/teacher.jinja")
        self.system = read_text("prompts/teacher_system.txt").strip()
        self.judge = read_text("prompts/judge.jinja")

    def _window(self, doc: str) -> tuple[str, str]:
        """A window of ``doc`` (from its start half the time, as ingest cuts a document) and the text after it."""
        r = self.recipe
        last = max(0, len(doc) - r.window_chars - r.answer_chars // 2)
        start = 0 if self.rng.random() < 0.5 else self.rng.randrange(0, last + 1)
        if start:
            start = doc.find(" ", start) + 1 or start
        window = _cut(doc[start:], r.window_chars)
        rest = doc[start + len(window) :].lstrip()
        return window, _cut(rest, r.answer_chars)

    def _prompt(self, window: str) -> str:
        title = window.split("\n", 1)[0].strip()[:40] or "untitled"
        return self.render(self.teacher, title=title, text=window)

    def teacher_example(self) -> tuple[list[dict[str, str]], bool]:
        window, answer = self._window(self.rng.choice(self.docs))
        return [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self._prompt(window)},
            {"role": "assistant", "content": answer},
        ], False

    def judge_example(self) -> tuple[list[dict[str, str]], bool]:
        doc = self.rng.choice(self.docs)
        window, answer = self._window(doc)
        kind = self.rng.random()
        if kind < 0.4:
            score = "5"
        elif kind < 0.7:
            other = self.rng.choice([d for d in self.docs if d is not doc])
            answer, score = self._window(other)[1], "3"
        else:  # what a weak teacher writes: a few symbols or words shuffled beyond reading
            words = answer.split()
            self.rng.shuffle(words)
            junk = "".join(
                self.rng.choice("-_()[]{}.,:;'\"|#*=\n ") for _ in range(self.rng.randrange(0, 12))
            )
            answer, score = (
                (" ".join(words[: self.rng.randrange(1, 6)]) if self.rng.random() < 0.5 else junk),
                "1",
            )
        prompt = self.render(self.judge, prompt=self._prompt(window), response=answer)
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": score}], True


def _encode(
    tokenizer: Any, messages: list[dict[str, str]], answer_only: bool, max_len: int
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and its labels (-100 where nothing is learned)."""
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    p_ids = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(full, add_special_tokens=False)
    if len(ids) > max_len:  # keep the answer and the prompt's end (rare: a window is ~200 tokens)
        answer = ids[len(p_ids) :]
        p_ids = p_ids[len(p_ids) - (max_len - len(answer)) :]
        ids = p_ids + answer
    labels = list(ids)
    if answer_only:
        labels[: len(p_ids)] = [-100] * len(p_ids)
    return ids, labels


def _batch(tokenizer: Any, examples: list[tuple[list[int], list[int]]]) -> tuple[Any, Any]:
    """Right-padded ids and labels (padding learns nothing; a causal mask keeps it out of earlier positions)."""
    width = max(len(ids) for ids, _ in examples)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in examples])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in examples])
    return ids, labels


def pretrain(model_dir: Path, corpus: list[str], recipe: TinyPretrainRecipe) -> dict[str, float]:
    """Train the model saved in ``model_dir`` in place; return its first and last losses and the time taken.

    It trains the project's own MoE (``NexaMoEForCausalLM``: transformers' Mixtral is many times slower to train on
    a CPU) and saves it back as transformers' Mixtral. Each step is a teacher batch and a judge batch, their mean
    losses added, so the judge's one score token per example weighs as much as the teacher's answers.
    """
    t0, cpu0 = time.perf_counter(), time.process_time()
    threads = torch.get_num_threads()
    # one thread: this model is too small to gain from two, and on a busy machine (tests and runs beside it) two
    # OpenMP threads spin-wait for each other: measured 6x slower per step at a load average of 9 on 2 cores
    torch.set_num_threads(1)
    try:
        return _train(model_dir, corpus, recipe, t0, cpu0)
    finally:
        torch.set_num_threads(threads)


def _train(
    model_dir: Path, corpus: list[str], recipe: TinyPretrainRecipe, t0: float, cpu0: float
) -> dict[str, float]:
    torch.manual_seed(recipe.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_mixtral_checkpoint(str(model_dir), attention="causal")
    model.train()
    maker = ExampleMaker(corpus, recipe)
    max_len = int(model.config.max_position_embeddings)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / recipe.warmup_steps) * max(0.1, 1 - s / recipe.steps)
    )
    n_judge = round(recipe.batch_size * recipe.judge_share)
    losses: list[float] = []
    for _ in range(recipe.steps):
        loss = 0.0
        for n, make in ((recipe.batch_size - n_judge, maker.teacher_example), (n_judge, maker.judge_example)):
            if n:
                ids, labels = _batch(tokenizer, [_encode(tokenizer, *make(), max_len) for _ in range(n)])
                loss = loss + model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    hf = to_hf(model.eval())
    hf.generation_config = type(hf.generation_config).from_pretrained(str(model_dir))
    hf.save_pretrained(model_dir)
    write_portable_configs(model_dir)  # what transformers 4.x reads too, as build_tiny_causal_lm writes
    k = max(1, len(losses) // 10)
    return {
        "first_loss": sum(losses[:k]) / k,
        "last_loss": sum(losses[-k:]) / k,
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - cpu0,
        "steps": recipe.steps,
    }


def shipped_model(key: str) -> Path | None:
    """The pretrained tiny model the repository ships for recipe ``key``, if it ships one."""
    path = SHIPPED_ROOT / f"tiny-pretrained-{key}"
    return path if (path / COMPLETION_MARKER).exists() else None


def build_pretrained_tiny_lm(
    out_dir: str | os.PathLike[str], recipe: TinyPretrainRecipe | None = None, corpus: list[str] | None = None
) -> Path:
    """The pretrained tiny teacher/judge at ``out_dir``: a copy of the shipped model for this recipe, else of the
    machine's cached build (built there first if new).

    Both steps are atomic (written under a temporary name, renamed into place, completion marker last) and taken
    under a file lock, so concurrent first uses build once and nobody ever reads a half-written model.
    """
    recipe = recipe or TinyPretrainRecipe()
    out = Path(out_dir)
    if (out / COMPLETION_MARKER).exists():
        return out
    docs = corpus if corpus is not None else default_corpus()
    key = recipe_key(recipe, docs)
    source = shipped_model(key)
    if source is None:
        source = settings.model_cache_root() / f"tiny-pretrained-{key}"
        if recipe == TinyPretrainRecipe() and corpus is None:
            log.warning(
                "the repository ships no tiny model for recipe %s (a prompt, the chat template, the preset "
                "or the recipe changed): building one on this machine, whose weights depend on its CPU; "
                "`make tiny-models` rebuilds the shipped copy",
                key,
            )
        _build_cached(source, recipe, docs)
    out.parent.mkdir(parents=True, exist_ok=True)
    with directory_lock(out):
        if not (out / COMPLETION_MARKER).exists():
            publish_directory(out, lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True))
    return out


def _build_cached(cached: Path, recipe: TinyPretrainRecipe, docs: list[str]) -> None:
    """Build into ``cached`` unless a complete build is there; concurrent callers build once (file lock)."""
    if (cached / COMPLETION_MARKER).exists():
        return
    cached.parent.mkdir(parents=True, exist_ok=True)
    with directory_lock(cached):
        if not (cached / COMPLETION_MARKER).exists():
            _build_into(cached, recipe, docs)


def ship(recipe: TinyPretrainRecipe | None = None) -> Path:
    """Build the tiny model from nothing on this machine into ``SHIPPED_ROOT`` (replacing a stale shipped one).

    Run by a developer who changed what the key hashes, then committed: every machine then copies these bytes.
    """
    recipe = recipe or TinyPretrainRecipe()
    docs = default_corpus()
    target = SHIPPED_ROOT / f"tiny-pretrained-{recipe_key(recipe, docs)}"
    SHIPPED_ROOT.mkdir(parents=True, exist_ok=True)
    _build_into(target, recipe, docs)
    for stale in SHIPPED_ROOT.glob("tiny-pretrained-*"):
        if stale != target:
            shutil.rmtree(stale)
    return target


def _kernels() -> dict[str, str]:
    """What decided the float results of a build: PyTorch's version and the CPU kernels it picked."""
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
    }


def _build_into(cached: Path, recipe: TinyPretrainRecipe, corpus: list[str]) -> None:
    """Random tiny model -> pretrained, written to ``cached`` with a ``pretraining.json`` saying how it was made.

    Called under the build lock: a ``.<name>.*`` work directory beside it was left by a build that was killed."""
    for leftover in cached.parent.glob(f".{cached.name}.*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
    try:
        model_dir = build_tiny_causal_lm(
            work / "model",
            preset=recipe.preset,
            corpus=corpus,
            vocab_size=recipe.vocab_size,
            seed=recipe.seed,
        )
        stats = pretrain(model_dir, corpus, recipe)
        (model_dir / COMPLETION_MARKER).unlink()
        (model_dir / "pretraining.json").write_text(
            json.dumps(
                {
                    "recipe": asdict(recipe),
                    "key": cached.name,
                    "corpus": "pydoc_data.topics"
                    if corpus == default_corpus()
                    else f"{len(corpus)} documents",
                    "built_with": _kernels(),
                    **stats,
                },
                indent=2,
            )
            + "\n"
        )
        (model_dir / COMPLETION_MARKER).write_text("ok\n")
        if cached.exists():
            shutil.rmtree(cached)
        os.replace(model_dir, cached)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Rebuild the tiny teacher/judge the repository ships.")
    parser.add_argument(
        "--ship",
        action="store_true",
        required=True,
        help=f"build from nothing into {SHIPPED_ROOT} (then commit it)",
    )
    parser.parse_args()
    print(ship())
