"""Checkable RL tasks built from the project's own ingested documents: prompts whose answer a program can verify.

The tiny teacher's answers carry no meaning, so a reward for resembling them cannot show that a model got better.
These tasks have one right answer taken from the document itself, of the kind ``configs/benchmarks/nexa_stdlib/``
asks about CPython's own docstrings (which module a docstring belongs to, the next words of one), here asked
about the Python reference documentation the pipeline ingests:

* ``topic`` (multiple choice): which reference topic a passage comes from (the document's title without its
  ``(part k)``), with ``choices`` candidate topics listed in the prompt. Listed, not open-ended, because a tiny
  model cannot spell a topic name it has never been asked for: with the candidates in front of it a policy can
  learn the task in a few dozen steps, chance is a known baseline (1/choices), and the verifier can refuse an
  answer that names several candidates (listing every choice is the obvious way to game an exact-match check).
* ``next_words``: the next ``next_words`` words of a passage, checked after normalisation (case, punctuation).

Train and held-out items are kept apart by a hash of the document id (``held_out``): a held-out prompt is a passage
no training prompt shows. The topics (the labels) are shared by both sides, as a classifier's labels are: the
held-out question is whether the policy names the topic of a passage it never saw, not whether it can copy a name it
was never rewarded for (which a tiny model cannot learn). A prompt text that occurs on both sides, or with two
answers (pydoc repeats some passages word for word), is left out whole. No train item that shares text with a
protected item (the frozen eval set, the frozen RL eval set, the lm-eval benchmark tasks:
``core.data.contamination``'s 13-gram index, the one packaging uses) is kept: ``decontaminated`` drops them and
says which; a held-out item is never trained on and is not checked. Every row carries ``prompt``, ``task``,
``answer``, ``reference`` (the answer as text, for the reference-F1 reward), ``choices``, ``item_id`` and
``doc_id``. Dagster-free.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nexa_dagster.core.common import storage
from nexa_dagster.core.common.config import RLTaskSettings
from nexa_dagster.core.common.jsonl import dumps
from nexa_dagster.core.data.contamination import ContaminationIndex
from nexa_dagster.core.packaging.jsonl_dataset import JsonlDataset

TOPIC = "topic"
NEXT_WORDS = "next_words"
_PART = re.compile(r"^(?P<topic>.+?)(?: \(part \d+\)|-part-\d+)$")  # "x (part 2)"; a file's "x-part-29"
_SALT = "nexa-rl-held-out"


@dataclass
class TaskBuild:
    """The rows of both sides and what was left out, with the reason."""

    train: list[dict[str, Any]] = field(default_factory=list)
    held_out: list[dict[str, Any]] = field(default_factory=list)
    contaminated: list[dict[str, str]] = field(default_factory=list)  # item_id, protected item, shared words
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> documents

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def topic_of(title: str) -> str:
    """The reference topic a document belongs to: its title without `` (part k)``."""
    match = _PART.match(title.strip())
    return (match.group("topic") if match else title).strip()


def _unit(key: str, seed: int) -> float:
    """A stable number in [0, 1) from ``key`` alone: the same item gets the same side and choices on every run."""
    return int(hashlib.sha256(f"{_SALT}:{seed}:{key}".encode()).hexdigest()[:12], 16) / float(16**12)


def held_out(doc_id: str, settings: RLTaskSettings) -> bool:
    """Whether a document's items are on the held-out side (never trained on): a hash of its id alone."""
    return _unit(f"doc:{doc_id}", settings.seed) < settings.held_out_fraction


def normalise_words(text: str) -> list[str]:
    """Words as the verifier compares them: lower case, letters, digits and hyphens inside names only."""
    return re.findall(r"[a-z0-9]+(?:[-_][a-z0-9]+)*", text.lower())


def _choices(answer: str, topics: Sequence[str], doc_id: str, settings: RLTaskSettings) -> list[str]:
    """``settings.choices`` candidates: the answer and distractors, picked and ordered by hashes of the document
    (so the answer's position is uniform: always naming the first choice scores chance, 1/choices)."""
    others = sorted((t for t in topics if t != answer), key=lambda t: _unit(f"{doc_id}:{t}", settings.seed))
    picked = [answer, *others[: settings.choices - 1]]
    return sorted(picked, key=lambda t: _unit(f"order:{doc_id}:{t}", settings.seed))


def topic_prompt(passage: str, choices: Sequence[str]) -> str:
    return (
        "Which Python reference topic is this passage from?\n\n"
        f"{passage}\n\nChoices: {', '.join(choices)}\nAnswer with one of the choices."
    )


def next_words_prompt(passage: str, k: int) -> str:
    return f"Continue this passage with its next {k} words.\n\n{passage}"


def document_text(item: dict[str, Any]) -> str:
    """The words of the document an item shows, as the document has them: its passage (the prompt's block between
    the question and the choices; a passage is words joined by spaces, so it holds no blank line), followed by the
    answer for ``next_words`` (the held-out answer is the document's next words). The rest of a prompt is the
    template's, shared by every item: no evidence that a text quotes this one."""
    passage = item["prompt"].split("\n\n")[1]
    return f"{passage} {item['answer']}" if item["task"] == NEXT_WORDS else passage


def _row(
    task: str, doc_id: str, prompt: str, answer: str, choices: list[str], side: str, passage: str
) -> dict[str, Any]:
    return {
        "_passage": passage,  # what the question is about: two items on one passage must agree (``unambiguous``)
        "item_id": f"{task}:{doc_id}",
        "doc_id": doc_id,
        "task": task,
        "prompt": prompt,
        "answer": answer,
        "reference": answer,
        "choices": choices,
        "side": side,
    }


def document_items(
    doc_id: str, title: str, text: str, topics: Sequence[str], settings: RLTaskSettings, build: TaskBuild
) -> list[dict[str, Any]]:
    """The checkable items of one document (none when it is too short or has no title), each on its side."""
    words = text.split()
    topic = topic_of(title)
    side = "held_out" if held_out(doc_id, settings) else "train"
    items = []
    if TOPIC in settings.tasks:
        if not topic or len(topics) < settings.choices:
            build.skip("topic: no title, or fewer topics than choices")
        else:
            choices = _choices(topic, topics, doc_id, settings)
            passage = " ".join(words[: settings.passage_words])
            items.append(_row(TOPIC, doc_id, topic_prompt(passage, choices), topic, choices, side, passage))
    if NEXT_WORDS in settings.tasks:
        cut = _cut(words, settings)
        if cut is None:
            build.skip("next_words: no run of next words after the passage (too short, or symbols)")
        else:
            answer = " ".join(words[cut : cut + settings.next_words])
            passage = " ".join(words[:cut])
            prompt = next_words_prompt(passage, settings.next_words)
            items.append(_row(NEXT_WORDS, doc_id, prompt, answer, [], side, passage))
    return items


def _cut(words: Sequence[str], settings: RLTaskSettings) -> int | None:
    """Where the passage ends: the first position from ``passage_words`` on whose next ``next_words`` tokens are
    each one word (grammar symbols such as ``::=`` or ``*`` have no words to check)."""
    k = settings.next_words
    for cut in range(settings.passage_words, len(words) - k + 1):
        if all(len(normalise_words(w)) == 1 for w in words[cut : cut + k]):
            return cut
    return None


def unambiguous(items: list[dict[str, Any]], build: TaskBuild) -> list[dict[str, Any]]:
    """One item per task and passage: the pydoc topics repeat some passages word for word, and a passage on both
    sides would put a held-out question in training, a passage with two answers would reward a guess. Those are
    left out whole; a passage repeated with the same answer on one side is kept once."""
    by_prompt: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for item in items:
        by_prompt.setdefault((item["task"], item.pop("_passage")), []).append(item)
    kept = []
    for same in by_prompt.values():
        if len({(i["side"], i["answer"]) for i in same}) > 1:
            for _ in same:
                build.skip("prompt repeated with another answer or on the other side")
            continue
        kept.append(min(same, key=lambda i: i["item_id"]))  # whatever order the documents came in
        for _ in same[1:]:
            build.skip("prompt repeated")
    return kept


def decontaminated(
    items: Iterable[dict[str, Any]], index: ContaminationIndex | None, build: TaskBuild
) -> list[dict[str, Any]]:
    """The train items that share no n-gram with a protected item (their prompt and answer both checked, the index's
    n and min_words), and every held-out item; the train items left out are recorded in ``build.contaminated`` with
    the item and the shared words. A held-out item is never trained on (it is the RL gate's evidence, and once
    frozen a protected item itself), so it is not checked: quoting the eval set or a benchmark harms nothing there,
    and leaving it out would only shrink the gate's n (the RL eval set is frozen from the first night's documents:
    on ``make run``'s, 93 held-out items remained of 125 when they were checked too)."""
    kept = []
    for item in items:
        on_train_side = item["side"] == "train"
        hit, example = (
            index.hits([item["prompt"], item["answer"]]) if index is not None and on_train_side else ([], "")
        )
        if hit:
            build.contaminated.append(
                {"item_id": item["item_id"], "protected": index.describe(hit[0]), "shared": example}
            )
            continue
        kept.append(item)
    return kept


def build_tasks(
    documents: Iterable[dict[str, Any]], settings: RLTaskSettings, index: ContaminationIndex | None
) -> TaskBuild:
    """Checkable items of every document (``doc_id``, ``title``, ``text``; a doc_id seen again is skipped),
    decontaminated against ``index`` and split into train and held-out sides, each sorted by item id."""
    build = TaskBuild()
    docs: dict[str, dict[str, Any]] = {}
    for doc in documents:
        if str(doc["doc_id"]) in docs:
            build.skip("document seen on an earlier day")
            continue
        docs[str(doc["doc_id"])] = doc
    topics = sorted({topic_of(str(d.get("title") or "")) for d in docs.values()} - {""})
    items = [
        item
        for doc_id, doc in docs.items()
        for item in document_items(
            doc_id, str(doc.get("title") or ""), str(doc["text"]), topics, settings, build
        )
    ]
    for item in sorted(decontaminated(unambiguous(items, build), index, build), key=lambda i: i["item_id"]):
        (build.held_out if item.pop("side") == "held_out" else build.train).append(item)
    return build


class RLPrompts(JsonlDataset):
    """``rl_prompts``: the reference-answer rows (``path``, the RL blend's JSONL) and the checkable task rows:
    ``tasks_path`` (train side, what GRPO trains on) and ``held_out_path`` (held-out side, what the frozen RL eval
    set is drawn from), with the counts and what decontamination left out."""

    tasks_run_hash: str = ""
    tasks_path: str = ""
    held_out_path: str = ""
    task_records: int = 0
    held_out_records: int = 0
    tasks_contaminated: int = 0


def write_task_rows(build: TaskBuild, out_root: str) -> tuple[str, str, str]:
    """Both sides as JSONL under ``<out_root>/<hash>/`` (content-addressed: the same documents and settings give
    the same folder, written once, each file atomically); returns (hash, train path, held-out path)."""
    train = b"".join(dumps(r) for r in build.train)
    held = b"".join(dumps(r) for r in build.held_out)
    run_hash = hashlib.sha256(train + b"\0" + held).hexdigest()[:16]
    directory = storage.join(out_root, run_hash)
    paths = (storage.join(directory, "train.jsonl"), storage.join(directory, "held_out.jsonl"))
    for path, body in zip(paths, (train, held), strict=True):
        if not storage.exists(path):
            with storage.atomic_writer(path) as f:
                f.write(body)
    return run_hash, *paths
