"""PPO-ptx in GRPO steps (``core/training/ptx.py``): which SFT row rides with each micro-batch, and what it adds.

Real components: the project's tiny Mixtral (``teacher_dir``) loaded as the training model, a packed file in the
packaging stage's format (``support.training_jobs.write_packed``), and GRPO's own micro-batch loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.training_jobs import write_packed

from nexa_dagster.core.training.data import labels_for, load_packed
from nexa_dagster.core.training.grpo import completion_batch, grpo_terms
from nexa_dagster.core.training.init import load_mixtral_checkpoint
from nexa_dagster.core.training.job import GRPOObjective
from nexa_dagster.core.training.ptx import PtxRows, ptx_loss_sum


@pytest.fixture
def tokenizer(teacher_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(teacher_dir)


@pytest.fixture
def packed(tmp_path: Path, tokenizer: Any) -> str:
    return write_packed(
        tmp_path / "sft.parquet", rows=5, vocab_size=len(tokenizer), pad_id=tokenizer.pad_token_id
    )


def test_every_row_once_per_epoch_in_a_seeded_order_the_same_on_a_resumed_run(
    packed: str, tokenizer: Any
) -> None:
    rows = PtxRows(packed, seed=3, vocab_size=len(tokenizer))
    first = [rows.index(p) for p in range(15)]
    assert sorted(first[:5]) == sorted(first[5:10]) == list(range(5)), first
    assert first[:5] != first[5:10], "each epoch has an order of its own"
    resumed = PtxRows(packed, seed=3, vocab_size=len(tokenizer))
    assert [resumed.index(p) for p in range(12, 15)] == first[12:15], "a position is a pure function"
    assert [PtxRows(packed, seed=4, vocab_size=len(tokenizer)).index(p) for p in range(5)] != first[:5]


def test_rows_of_another_vocabulary_are_refused_naming_the_file(packed: str) -> None:
    with pytest.raises(ValueError, match="outside the policy's vocabulary"):
        PtxRows(packed, seed=0, vocab_size=8)


def test_the_term_is_gamma_times_the_groups_completions_times_the_rows_mean_token_nll(
    packed: str,
    tokenizer,
    teacher_dir: Path,
) -> None:
    """Added to a micro-batch of K completions, the loop's division by the step's completions leaves gamma x the
    row's token-mean NLL (the attached row is the one its position names); GRPO's own terms are unchanged."""
    model = load_mixtral_checkpoint(str(teacher_dir)).train()
    rows = PtxRows(packed, seed=0, vocab_size=len(tokenizer))
    prompt = tokenizer.encode("Which module documents json?", add_special_tokens=False)
    batch = completion_batch(
        prompt, [[11, 12, 13], [14, 15]], torch.tensor([1.0, -1.0]), 0, torch.device("cpu")
    )
    rows.attach(batch, position=2, device=torch.device("cpu"))
    row = load_packed(packed)
    index = rows.index(2)
    real = int(row["attention_mask"][index].sum())  # attached without its trailing padding
    assert torch.equal(batch["ptx:input_ids"][0], row["input_ids"][index][:real])
    expected = model(
        input_ids=row["input_ids"][index : index + 1],
        position_ids=row["position_ids"][index : index + 1],
        labels=labels_for({k: v[index : index + 1] for k, v in row.items()}),
    ).lm_loss
    added, metric = ptx_loss_sum(model, batch, gamma=0.3, units=2)
    assert float(added.detach()) == pytest.approx(0.3 * 2 * float(expected.detach()), rel=1e-6)
    assert float(metric) == pytest.approx(2 * float(expected), rel=1e-6) and not metric.requires_grad
    config = GRPOObjective(
        prompts_path="p.jsonl", rewards=[{"name": "exact_answer"}], max_completion_tokens=4
    )
    grpo = grpo_terms(model, batch, config)  # the ptx entries are not GRPO's inputs
    del batch["ptx:input_ids"], batch["ptx:position_ids"], batch["ptx:labels"]
    assert float(grpo_terms(model, batch, config).loss_sum) == pytest.approx(float(grpo.loss_sum), abs=1e-7)


def test_a_row_attached_without_its_padding_adds_the_same_term_and_gradients(
    packed: str, tokenizer: Any, teacher_dir: Path
) -> None:
    """The padding after a packed row's last real token is cut off before the row rides with a micro-batch: the
    term and every gradient are those of the whole row (nothing learned attends to trailing padding)."""
    batches, grads = [], []
    for trim in (True, False):
        model = load_mixtral_checkpoint(str(teacher_dir)).train()
        batch: dict[str, torch.Tensor] = {}
        PtxRows(packed, seed=0, vocab_size=len(tokenizer), trim_padding=trim).attach(
            batch, 1, torch.device("cpu")
        )
        added, _ = ptx_loss_sum(model, batch, gamma=0.3, units=8)
        added.backward()
        batches.append((batch, float(added.detach())))
        grads.append({name: p.grad for name, p in model.named_parameters()})
    (trimmed, term), (whole, whole_term) = batches
    row = PtxRows(packed, seed=0, vocab_size=len(tokenizer)).index(1)
    real = int(load_packed(packed)["attention_mask"][row].sum())
    assert trimmed["ptx:input_ids"].shape[1] == real < whole["ptx:input_ids"].shape[1], "padding was cut off"
    assert term == pytest.approx(whole_term, rel=1e-6)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grad, grads[1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_ptx_coefficient_without_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="ptx_coef > 0 needs ptx_path"):
        GRPOObjective(prompts_path="p.jsonl", rewards=[{"name": "exact_answer"}], ptx_coef=0.3)
