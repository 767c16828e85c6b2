"""Retries pay: how many gate decisions were taken on one eval-set version against one production model, and the
level the next one must meet.

A candidate can be retrained (the run-config overrides of ``rl_checkpoint`` and the checkpoint assets, a night's
new data) and gated again on the same frozen eval set against the same production model until one passes: each
decision is another chance for a candidate that is no better to be promoted by the interval's one-sided error
``alpha = (1 - confidence) / 2``. So the decisions of one *family* (the evidence set and its version, and the
production model compared with) are counted, and attempt ``k`` decides at ``alpha_k = alpha * 2 ** (1 - k)``
(alpha spending): the first at the gate's own level, each later one at half the one before. However many candidates
are tried, the chance that any one of them was promoted while no better is at most ``alpha (1 + 1/2 + 1/4 + ...)
< 2 alpha`` (a union bound: it holds whatever the dependence between attempts, and attempts on one eval set are
strongly dependent). Why not Bonferroni's ``alpha / k`` for the k-th: its total over k attempts is ``alpha H_k``
(the harmonic number), which grows without bound (2.9 alpha after 10 attempts, 5.2 after 100). Why not Holm: it
needs every attempt's p-value at once, and the gate decides one candidate when it comes.

Attempt ``k`` runs the whole gate (its interval, the guards, the non-inferiority guards) at the two-sided
confidence ``1 - 2 alpha_k`` (``attempt_confidence``): 95 %, 97.5 %, 98.75 %, ... A re-evaluation of a checkpoint
already counted in the family keeps its number (the same figures, nothing new was tried); a new production model
or a new eval-set version starts a new family at attempt 1. An attempt is counted when its evaluation starts, so
two evaluations running at once get different numbers; one that then fails still counts (the safe side).

The counts live beside the production pointer, ``<data_root>/serving/gate_attempts.json`` (checkpoint ids only, no
paths: a moved data root keeps them), written to a temporary name and renamed into place, under an exclusive lock
where the data root is a local folder. Dagster-free.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nexa_dagster.core.common import storage

ATTEMPTS_FILE = ("serving", "gate_attempts.json")  # under the data root, beside serving/production.json


def attempt_confidence(confidence: float, number: int) -> float:
    """The two-sided confidence of attempt ``number`` (1-based) for a gate whose first attempt runs at
    ``confidence``: its one-sided error ``(1 - confidence) / 2`` halved for each earlier attempt."""
    if number < 1:
        raise ValueError(f"attempts are numbered from 1, got {number}")
    return 1 - (1 - confidence) / 2 ** (number - 1)


def family(evidence: str, version: int | None, production_id: str) -> str:
    """The key of the decisions that spend one error budget: the evidence set (``eval_set``, ``rl_eval_set``) and
    its version, and the production model the candidates are compared with."""
    return f"{evidence} v{version} vs {production_id}"


@dataclass(frozen=True)
class Attempt:
    """One gate decision's place in its family and the level it decides at."""

    family: str
    number: int
    confidence: float  # two-sided, of every interval this decision computes

    @property
    def one_sided_error(self) -> float:
        return (1 - self.confidence) / 2

    def describe(self) -> str:
        """What the decision's reason says about it."""
        earlier = self.number - 1
        return (
            f"attempt {self.number} on {self.family}: {self.confidence:.4g} interval, one-sided error "
            f"{self.one_sided_error:.4g}"
            + (
                f" (halved for each of {earlier} earlier decision{'s' if earlier > 1 else ''})"
                if earlier
                else ""
            )
        )

    def metadata(self) -> dict[str, Any]:
        return {
            "gate_attempt": self.number,
            "gate_attempt_family": self.family,
            "gate_confidence": self.confidence,
        }


class GateAttempts:
    """The families' attempts in the JSON file at ``path``: ``{"families": {family: [{"checkpoint_id", "at"}]}}``,
    in the order the attempts were counted."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)

    @classmethod
    def under(cls, data_root: str) -> GateAttempts:
        return cls(storage.join(data_root, *ATTEMPTS_FILE))

    def families(self) -> dict[str, list[dict[str, str]]]:
        if not storage.exists(self.path):
            return {}
        return dict(storage.read_json(self.path).get("families", {}))

    def count(self, key: str) -> int:
        """How many decisions the family has taken (0: none yet)."""
        return len(self.families().get(key, []))

    def reserve(self, key: str, checkpoint_id: str, confidence: float) -> Attempt:
        """The attempt of ``checkpoint_id`` in family ``key``: its earlier number when it was counted before, else
        the next one, recorded now."""
        with self._locked():
            families = self.families()
            entries = families.setdefault(key, [])
            ids = [e["checkpoint_id"] for e in entries]
            if checkpoint_id in ids:
                number = ids.index(checkpoint_id) + 1
            else:
                entries.append(
                    {
                        "checkpoint_id": checkpoint_id,
                        "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                    }
                )
                storage.write_json({"families": families}, self.path)
                number = len(entries)
        return Attempt(key, number, attempt_confidence(confidence, number))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock while a count is read and written, where the data root is a local folder (an object
        store has no lock: two evaluations starting at the same instant could then share a number)."""
        if "://" in self.path:
            yield
            return
        folder = Path(posixpath.dirname(self.path))
        folder.mkdir(parents=True, exist_ok=True)
        with storage.directory_lock(Path(self.path)):
            yield
