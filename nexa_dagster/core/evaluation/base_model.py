"""A base model's evaluation: its loss on the frozen eval set's corpus documents, with an interval over documents.

The documents are those an eval-set version froze from the pretraining corpus (``core.eval_set``), which no base
model ever trains on (``core.training.corpus``); the evaluation worker scores them as it scores SFT examples (every
token but a document's first), and this turns its per-document sums into the mean loss per token and perplexity
with an interval over documents (``core.evaluation.paired.mean_loss_interval``: the gate's method, the skew-corrected
t-interval by default). Dagster-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nexa_dagster.core.common import storage
from nexa_dagster.core.evaluation.paired import DEFAULT_INTERVAL_METHOD, Interval, mean_loss_interval
from nexa_dagster.core.evaluation.scoring import perplexity_of


@dataclass(frozen=True)
class CorpusScores:
    """One model's loss on the frozen corpus documents: per document and overall, with its interval."""

    document_ids: list[str]
    nll: list[float]
    tokens: list[int]
    loss: Interval

    @property
    def perplexity(self) -> Interval:
        return Interval(
            perplexity_of(self.loss.estimate),
            perplexity_of(self.loss.low),
            perplexity_of(self.loss.high),
            self.loss.confidence,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "loss": self.loss.estimate,
            "loss_interval": [self.loss.low, self.loss.high],
            "perplexity": self.perplexity.estimate,
            "perplexity_interval": [self.perplexity.low, self.perplexity.high],
            "confidence": self.loss.confidence,
            "documents": len(self.document_ids),
            "tokens": sum(self.tokens),
            "per_document": [
                {"document_id": d, "nll": n, "tokens": t}
                for d, n, t in zip(self.document_ids, self.nll, self.tokens, strict=True)
            ],
        }


def corpus_scores(
    corpus_path: str,
    nll: list[float],
    tokens: list[int],
    confidence: float = 0.95,
    resamples: int = 2000,
    method: str = DEFAULT_INTERVAL_METHOD,
) -> CorpusScores:
    """The worker's per-document sums for ``corpus_path`` (the frozen ``corpus.parquet``, in its order), summed up."""
    ids = [str(i) for i in storage.read_parquet(corpus_path)["sample_id"]]
    if len(ids) != len(nll) or len(nll) != len(tokens):
        raise ValueError(f"{corpus_path} holds {len(ids)} documents but {len(nll)} were scored")
    return CorpusScores(ids, nll, tokens, mean_loss_interval(nll, tokens, confidence, method, resamples))
