"""The language-model term mixed into RL steps: InstructGPT's PPO-ptx (Ouyang et al. 2022, eq. 2).

RL on a narrow task moves every weight of a small model, and with them the language model the task does not
exercise: on the tiny demo, 80 GRPO steps raised held-out reward and cost +0.14 nats/token on the eval set, which
the RL gate's loss guard rightly refuses. PPO-ptx adds ``gamma x`` the next-token loss of the policy's own SFT
data to every RL step, so the update keeps the language model where SFT left it.

Here one packed SFT row rides with each of a step's micro-batches (a prompt's group of completions). Which row is a
pure function of the run's seed and the position (a seeded epoch permutation, SFT's ``index_stream``): a resumed run
trains on the rows an uninterrupted one would have, with nothing to save. The term a micro-batch adds is ``gamma x
K x`` the row's mean token NLL (``K`` the group's completions), so after the loop divides by the step's completions a
step minimises the RL loss plus ``gamma x`` the mean over its rows of their token-mean NLL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nexa_dagster.core.training.data import Batch, labels_for, load_packed

PTX = "ptx:"  # the batch entries of the SFT row, beside the completions'


class PtxRows:
    """The packed SFT rows of ``path`` (a split manifest or packed Parquet), one per micro-batch of every step."""

    def __init__(self, path: str, seed: int, vocab_size: int, trim_padding: bool = True) -> None:
        """``trim_padding``: attach each row without the padding after its last real token (below); off for
        compiled layers, which trace one graph per width and take the packed rows' one width."""
        self.path, self.seed, self.trim_padding = path, seed, trim_padding
        self.rows = load_packed(path)
        self.count = int(self.rows["input_ids"].shape[0])
        top = int(self.rows["input_ids"].max())
        if top >= vocab_size:
            raise ValueError(
                f"ptx rows {path}: token id {top} is outside the policy's vocabulary ({vocab_size}): packed with "
                "another tokenizer than the policy's"
            )
        self._epoch: tuple[int, torch.Tensor] | None = None

    def index(self, position: int) -> int:
        """The row at global position ``position``: epoch ``position // count`` of a seeded permutation."""
        epoch, offset = divmod(position, self.count)
        if self._epoch is None or self._epoch[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch = (epoch, torch.randperm(self.count, generator=generator))
        return int(self._epoch[1][offset])

    def attach(self, batch: Batch, position: int, device: torch.device) -> None:
        """Put row ``index(position)`` into ``batch`` under ``ptx:`` keys (input ids, positions, targets).

        A packed row is its documents then padding to the pack size (a quarter of ``make run``'s rows: 396 real
        tokens of 512 on average). The padding is unlabelled and comes last, so no learned token attends to it and
        the term below takes nothing from it: cut off, the same loss and gradients for less of the step's work."""
        row = self.index(position)
        end = self.rows["input_ids"].shape[1]
        if self.trim_padding:
            end = int(self.rows["attention_mask"][row].nonzero().max()) + 1
        one = {k: v[row : row + 1, :end] for k, v in self.rows.items()}
        batch[f"{PTX}input_ids"] = one["input_ids"].to(device)
        batch[f"{PTX}position_ids"] = one["position_ids"].to(device)
        batch[f"{PTX}labels"] = labels_for(one).to(device)


def ptx_loss_sum(model: Callable[..., Any], batch: Batch, gamma: float, units: int) -> tuple[Any, Any]:
    """(``gamma x units x`` the attached row's mean token NLL, with gradient; that NLL times ``units``, detached,
    for the step metric): what a micro-batch of ``units`` completions adds for its SFT row."""
    labels = batch[f"{PTX}labels"]
    out = model(input_ids=batch[f"{PTX}input_ids"], position_ids=batch[f"{PTX}position_ids"], labels=labels)
    mean_nll = (
        out.lm_loss
    )  # the row's summed NLL over its learned tokens (targets shifted by one) / their count
    return gamma * units * mean_nll, (mean_nll * units).detach()
