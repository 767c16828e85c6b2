"""Which side of a split a sample (or a corpus document) is on, decided by a hash of its id alone.

Two independent rules, each stable whatever else arrives later (a sample never changes side):

* the **eval side** (``is_held_out``): ids that hash below the eval set's ``fraction`` are held out of every
  training split, so the frozen eval set (``core/evaluation/eval_set.py``) measures what no checkpoint trained on;
  pretraining applies it to corpus documents with ``corpus_fraction``;
* **train / validation** (``is_validation``) among the rest, with ``side_overrides`` so that neither is empty.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

_SALT = "nexa-eval-set"


def is_held_out(sample_id: str, fraction: float) -> bool:
    """Whether a sample belongs to the eval side (never trained on). Stable: depends on the id alone."""
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"{_SALT}:{sample_id}".encode()).hexdigest()[:8]
    return int(digest, 16) / 0xFFFFFFFF < fraction


def held_out_mask(sample_ids: Sequence[str], fraction: float) -> list[bool]:
    return [is_held_out(str(s), fraction) for s in sample_ids]


def split_hash(sample_id: str, seed: int) -> float:
    return int(hashlib.sha256(f"{seed}:{sample_id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def is_validation(sample_id: str, fraction: float, seed: int = 0) -> bool:
    """A stable split: a sample stays on its side whatever else arrives later."""
    return split_hash(sample_id, seed) < fraction


def side_overrides(sample_ids: Sequence[str], fraction: float, seed: int = 0) -> dict[str, str]:
    """The samples that must change side so that, with two or more samples, neither split is empty.

    With a dozen samples and a 10% fraction, the hash split leaves validation empty about one time in four (and a
    partition's sample ids depend on the teacher's answers): then the sample closest to the validation side
    (the smallest split hash) moves there; symmetrically for an empty train side. Deterministic, and empty as soon
    as both sides have a sample of their own.
    """
    hashes = {s: split_hash(s, seed) for s in set(sample_ids)}
    if len(hashes) < 2:
        return {}
    by_hash = sorted(hashes, key=lambda s: (hashes[s], s))
    validation = sum(h < fraction for h in hashes.values())  # is_validation, from the hashes already computed
    if validation == 0:
        return {by_hash[0]: "validation"}
    if validation == len(hashes):
        return {by_hash[-1]: "train"}
    return {}
