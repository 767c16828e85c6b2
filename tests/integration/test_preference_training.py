"""DPO in the project's own training worker: equal to TRL's ``DPOTrainer``, exactly resumable, the router's aux loss
included, bad input refused before training.

Real components throughout: the tiny Mixtral of ``teacher_dir`` (the project's tokenizer and chat template), pairs
written in the packaging stage's format (``tests/support/preference_pairs.py``), the DeepSpeed engine on CPU, the
worker under ``torchrun`` for the resume test, and TRL 1.16 (a test-only dependency) as the oracle.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pandas as pd
import psutil
import pytest
from support.preference_pairs import (
    conversational_pairs,
    pair_records,
    preference_job,
    write_snapshot,
)
from support.services import descendants_matching
from support.training_jobs import end_process_group
from support.worker_launch import run_worker_command

from nexa_dagster.core.common.artifacts import COMPLETION_MARKER
from nexa_dagster.core.training.job import TrainingJob, TrainingResult
from nexa_dagster.resources.gpu_cluster import LocalGPUCluster

BETA = 0.1


@pytest.fixture(scope="module")
def tokenizer(teacher_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(teacher_dir)


# -- the oracle: TRL's DPOTrainer -------------------------------------------------------------------------------
def test_dpo_loss_and_every_gradient_equal_trl_dpotrainer(
    tmp_path: Path, teacher_dir: Path, tokenizer: Any
) -> None:
    """Same tiny Mixtral weights (policy: teacher_dir's weights moved by seeded noise; reference: teacher_dir), the
    same 8 conversational pairs (one or two turns of prompt, answers of 6-14 words): TRL tokenizes them into exactly
    the token ids of our packed pairs, TRL's reference log-probabilities equal the project's reference scoring, and
    for DPO sigmoid, its length-normalised variant and sigmoid with the router aux loss on (coefficient 0.02 on both
    sides), the project's loss, metrics and the gradient of every parameter equal TRL's within 1e-5."""
    import torch
    from datasets import Dataset
    from transformers import MixtralForCausalLM
    from trl import DPOConfig, DPOTrainer

    from nexa_dagster.core.training.init import load_mixtral_checkpoint
    from nexa_dagster.core.training.model.moe import NexaMoEForCausalLM
    from nexa_dagster.core.training.objective import micro_objective
    from nexa_dagster.core.training.preference import dpo_micro_terms, preference_terms, score_pairs
    from nexa_dagster.core.training.preference_data import (
        PairLayout,
        collate_packed,
        load_pairs,
        pack_pairs,
        pair_layout,
    )

    torch.manual_seed(0)
    rows = conversational_pairs(8)
    records = pair_records(tokenizer, rows, "oracle")
    train_path, _ = write_snapshot(tmp_path / "data", records, records[:1])
    pairs = load_pairs(train_path, tokenizer, max_length=512)
    pad = tokenizer.pad_token_id
    # two layouts of the same 8 pairs, each one micro-batch: four rows of 320 tokens holding several documents each,
    # and the run's default (16 rows as long as the longest document rounded up to 64)
    layouts = {"packed 4 x 320": PairLayout(rows=4, length=320), "default": pair_layout([pairs], 8)}

    reference = MixtralForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    policy = copy.deepcopy(reference)
    with torch.no_grad():  # policy != reference: non-zero log-ratios, rewards that differ between pairs
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))

    # the project's reference values: the reference checkpoint scored by the worker's own scoring
    ref_chosen, ref_rejected = score_pairs(
        load_mixtral_checkpoint(str(teacher_dir)),
        pairs,
        PairLayout(rows=2, length=256),
        pad,
        torch.device("cpu"),
    )
    pairs.with_reference(
        {
            p: (c, r)
            for p, c, r in zip(pairs.pair_ids, ref_chosen.tolist(), ref_rejected.tolist(), strict=True)
        }
    )

    def trl_trainer(loss_type: str, aux_coef: float, precompute: bool = False, sft: float = 0.0) -> Any:
        args = DPOConfig(
            output_dir=str(tmp_path / "trl"),
            beta=BETA,
            loss_type=[loss_type, "sft"] if sft else [loss_type],
            loss_weights=[1.0, sft] if sft else None,
            precompute_ref_log_probs=precompute,
            router_aux_loss_coef=aux_coef,
            per_device_train_batch_size=8,
            bf16=False,  # TRL's defaults: bf16 autocast and gradient checkpointing
            gradient_checkpointing=False,
            use_cpu=True,
            report_to="none",
            seed=0,
            dataloader_num_workers=0,
            max_length=1024,
        )
        return DPOTrainer(  # DPOTrainer rewrites the model's forward on the instance: hand it copies
            model=copy.deepcopy(policy).train(),
            ref_model=copy.deepcopy(reference),
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
        )

    # TRL's tokenization is our packed pairs' (the chat template's prompt/completion split), and TRL's own
    # reference log-probabilities are the project's reference values
    trainer = trl_trainer("sigmoid", 0.0, precompute=True)
    for i, record in enumerate(records):
        example = trainer.train_dataset[i]
        for ours, theirs in (
            ("prompt", "prompt_ids"),
            ("chosen", "chosen_ids"),
            ("rejected", "rejected_ids"),
        ):
            assert list(example[theirs]) == record[f"{ours}_input_ids"], (i, ours)
    # sums of ~30 fp32 log-probabilities around -130: equal to fp32 resolution (its spacing there is 1.5e-5)
    for key, values in (("ref_chosen_logps", ref_chosen), ("ref_rejected_logps", ref_rejected)):
        torch.testing.assert_close(
            torch.tensor(trainer.train_dataset[key]).double(), values, rtol=1e-6, atol=1e-5
        )
    assert ref_chosen.min() < -50, "log-probabilities of whole completions: the test scores real sequences"

    cases = (("sigmoid", 0.0, 0.0), ("sigmoid_norm", 0.0, 0.0), ("sigmoid", 0.02, 0.0), ("sigmoid", 0.0, 1.0))
    for loss_type, aux_coef, sft in cases:  # the last: DPO + TRL's sft loss (RPO), preference.sft_weight 1
        trainer = trl_trainer(loss_type, aux_coef, sft=sft)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
        trainer.precompute_ref_logps = True  # the reference values come with the batch, as in our worker
        batch["ref_chosen_logps"], batch["ref_rejected_logps"] = pairs.ref_chosen, pairs.ref_rejected
        trainer.model.train()
        trl_loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(batch))
        trl_loss.backward()
        trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

        theirs = dict(trainer.model.named_parameters())
        for name, layout in layouts.items():
            ours = NexaMoEForCausalLM(policy.config)
            missing, unexpected = ours.load_state_dict(policy.state_dict(), strict=False)
            assert not missing and not unexpected, (missing, unexpected)
            ours.train()
            [members] = list(pack_pairs(pairs, range(8), layout))  # all 8 pairs in one micro-batch
            ours_batch = collate_packed(pairs, members, layout, pad)
            assert ours_batch["input_ids"].shape == (layout.rows, layout.length)
            n = ours_batch["pair_index"].shape[0]
            for j, i in enumerate(ours_batch["pair_index"].tolist()):  # TRL's rows are our documents
                for slot, row in ((j, i), (n + j, 8 + i)):
                    document = ours_batch["input_ids"][ours_batch["segments"] == slot]
                    assert torch.equal(document, batch["input_ids"][row][batch["attention_mask"][row].bool()])
            terms = preference_terms(ours, ours_batch, BETA, loss_type)
            micro = dpo_micro_terms(terms, sft)
            _, loss = micro_objective(micro, weight=1 / 8, aux_coef=aux_coef, accumulation=1)
            loss.backward()

            case = f"{loss_type}, aux coef {aux_coef}, sft {sft}, layout {name}"
            assert abs(loss.item() - trl_loss.item()) < 1e-5, (case, loss.item(), trl_loss.item())
            sums = {k: float(v) / 8 for k, v in micro.metric_sums.items()}
            for key, trl_key in (
                ("reward_chosen", "rewards/chosen"),
                ("reward_rejected", "rewards/rejected"),
                ("reward_margin", "rewards/margins"),
                ("reward_accuracy", "rewards/accuracies"),
                ("logps_chosen", "logps/chosen"),
                ("logps_rejected", "logps/rejected"),
            ):
                assert sums[key] == pytest.approx(trl_metrics[trl_key], abs=1e-4), (case, key)
            if aux_coef:
                assert float(terms.aux_loss) == pytest.approx(trl_metrics["aux_loss"], abs=1e-6)

            assert set(theirs) == {n for n, _ in ours.named_parameters()}  # transformers' names, one to one
            worst, largest = 0.0, 0.0
            for param_name, p in ours.named_parameters():
                assert p.grad is not None and theirs[param_name].grad is not None, (case, param_name)
                worst = max(worst, (p.grad - theirs[param_name].grad).abs().max().item())
                largest = max(largest, p.grad.abs().max().item())
            print(
                f"{case}: |loss - TRL| {abs(loss.item() - trl_loss.item()):.2e}, max |grad - TRL| {worst:.2e}, max |grad| {largest:.2e}"
            )
            assert worst < 1e-5, (case, worst)
            assert worst < 1e-3 * largest, (
                f"{case}: gradients too small for the comparison to mean anything ({largest})"
            )
    packed = layouts["packed 4 x 320"]
    packed_rows = collate_packed(pairs, next(pack_pairs(pairs, range(8), packed)), packed, pad)
    starts = (packed_rows["position_ids"] == 0) & (packed_rows["attention_mask"] == 1)
    assert int(starts.sum()) == 16 and int(starts.sum(1).max()) >= 4, (
        "the packed layout's rows hold documents"
    )
    assert 0 < trl_metrics["rewards/accuracies"] < 1, "the pairs' rewards differ in sign: margins are tested"


# -- the router's aux loss in a real engine step ----------------------------------------------------------------
def test_a_step_minimises_dpo_plus_the_routers_aux_loss_without_padding(
    tmp_path: Path, teacher_dir: Path, tokenizer: Any
) -> None:
    """One optimizer step of the worker's loop on the real DeepSpeed engine (one gloo rank), 8 pairs, with the tiny
    preset's router_aux_loss_coef 0.02 and with 0: the objective differs by exactly 0.02 x the aux loss, the DPO
    part not at all; the aux loss is Mixtral's load-balancing loss with the padding left out (it differs from the
    one over every slot), and the engine's gradient is that of mean DPO loss + 0.02 x aux. A NaN loss then raises
    before its update, and no weight moves."""
    import torch

    from nexa_dagster.core.training.loop import Control, build_engine, build_model, optimizer_step
    from nexa_dagster.core.training.model.moe import to_hf
    from nexa_dagster.core.training.nonfinite import NonFiniteGuard
    from nexa_dagster.core.training.objective import micro_objective
    from nexa_dagster.core.training.preference import DPOLoss, score_pairs
    from nexa_dagster.core.training.preference_data import collate_packed, load_pairs, pack_pairs, pair_layout
    from nexa_dagster.core.training.worker import configure_environment

    records = pair_records(tokenizer, conversational_pairs(8, offset=40), "aux")
    held_out = pair_records(tokenizer, conversational_pairs(1, offset=300), "aux-v")
    train_path, validation_path = write_snapshot(tmp_path / "data", records, held_out)
    job = preference_job(tmp_path, teacher_dir, train_path, validation_path, steps=1, micro_batch=8)
    pairs = load_pairs(train_path, tokenizer, 512)
    layout = pair_layout([pairs], 8)
    reference = build_model(job, len(tokenizer), tokenizer)
    chosen, rejected = score_pairs(reference, pairs, layout, tokenizer.pad_token_id, torch.device("cpu"))
    pairs.with_reference(
        dict(zip(pairs.pair_ids, zip(chosen.tolist(), rejected.tolist(), strict=True), strict=True))
    )
    [members] = list(pack_pairs(pairs, range(8), layout))
    batch = collate_packed(pairs, members, layout, tokenizer.pad_token_id)
    assert (batch["attention_mask"] == 0).sum() > 20, (
        "the batch must hold padding for the check to mean anything"
    )
    # TRL's layout of the same pairs: 16 right-padded rows, prompt+chosen then prompt+rejected
    documents = [
        torch.from_numpy(np.concatenate([pairs.prompt[i], completion[i]]))
        for completion in (pairs.chosen, pairs.rejected)
        for i in range(8)
    ]
    padded = torch.nn.utils.rnn.pad_sequence(
        documents, batch_first=True, padding_value=tokenizer.pad_token_id
    )
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(d) for d in documents], batch_first=True)

    with torch.no_grad():  # Mixtral's own aux loss on TRL's rows: padding excluded through the attention mask
        hf = to_hf(reference).eval()
        hf.config.output_router_logits = True
        hf_aux = hf(input_ids=padded, attention_mask=mask).aux_loss
        every_slot = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).aux_loss
    say = lambda message: None  # noqa: E731
    objective = DPOLoss(job, tokenizer, say)
    model = build_model(job, len(tokenizer), tokenizer)
    _, total = micro_objective(objective.terms(model, batch), weight=1 / 8, aux_coef=0.02, accumulation=1)
    total.backward()
    by_hand = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))

    totals, norms = {}, {}
    with mock.patch.dict(os.environ):  # MASTER_PORT & co. must not leak into later tests' worker processes
        configure_environment(job)
        try:
            for coef in (0.02, 0.0):
                model = build_model(job, len(tokenizer), tokenizer)
                model.config.router_aux_loss_coef = coef
                engine = build_engine(model, job, world_size=1)
                totals[coef] = optimizer_step(
                    engine,
                    iter([batch]),
                    1,
                    Control(1),
                    NonFiniteGuard(engine, torch.device("cpu")),
                    1,
                    objective,
                )
                norms[coef] = float(engine.get_global_grad_norm())
            # a non-finite loss never reaches the weights (SFT's NonFiniteGuard): the step raises, nothing moves
            before = [p.detach().clone() for p in engine.module.parameters()]
            with pytest.raises(
                FloatingPointError, match="non-finite loss at step 2 .caught before its update"
            ):
                optimizer_step(
                    engine,
                    iter([batch]),
                    1,
                    Control(1),
                    NonFiniteGuard(engine, torch.device("cpu")),
                    2,
                    objective,
                    poison=True,
                )
            assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True))
        finally:
            end_process_group()  # and DeepSpeed's cached groups: the next in-process engine starts clean

    aux = float(totals[0.02].aux_loss)
    assert aux == pytest.approx(float(hf_aux), abs=1e-6) and abs(aux - float(every_slot)) > 1e-4
    assert float(totals[0.02].total - totals[0.02].loss) == pytest.approx(0.02 * aux, abs=1e-7)
    assert float(totals[0.0].total) == float(totals[0.0].loss)
    assert float(totals[0.02].loss) == pytest.approx(float(totals[0.0].loss), abs=1e-7)
    assert norms[0.02] == pytest.approx(float(by_hand), rel=1e-5) and norms[0.02] != pytest.approx(
        norms[0.0], rel=1e-4
    )


# -- static shapes ----------------------------------------------------------------------------------------------
def test_an_epoch_of_pairs_of_varied_lengths_reaches_the_model_in_at_most_four_shapes(
    tmp_path: Path, teacher_dir: Path, tokenizer: Any
) -> None:
    """122 training pairs (the demo run's count) and 20 held-out ones whose prompts and answers vary in length: the
    shapes of ``input_ids`` the model's forward receives while the reference values are scored, over an epoch of
    training micro-batches and while the held-out rewards are scored are at most 4 (packed: one). The same epoch
    right-padded per micro-batch (TRL's layout, the stage's before packing) gives more than 4: the count tells the
    layouts apart. On a GPU every new shape is a FlexAttention recompile."""
    import torch

    from nexa_dagster.core.training.data import index_stream
    from nexa_dagster.core.training.loop import build_model
    from nexa_dagster.core.training.preference import DPOLoss, score_pairs

    train = pair_records(tokenizer, conversational_pairs(122), "e")
    validation = pair_records(tokenizer, conversational_pairs(20, offset=300), "ev")
    job = preference_job(tmp_path, teacher_dir, *write_snapshot(tmp_path / "data", train, validation), 1, 4)
    objective = DPOLoss(job, tokenizer, lambda message: None)
    model = build_model(job, len(tokenizer), tokenizer)
    shapes: list[tuple[int, ...]] = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    cpu = torch.device("cpu")
    reference = {}
    for pairs in (objective.train, objective.validation):  # what objective.prepare scores
        chosen, rejected = score_pairs(model, pairs, objective.layout, objective.pad_id, cpu)
        reference.update(
            zip(pairs.pair_ids, zip(chosen.tolist(), rejected.tolist(), strict=True), strict=True)
        )
    objective.train.with_reference(reference)
    objective.validation.with_reference(reference)
    seen = 0
    with torch.no_grad():
        for batch in objective.batches(4, job.settings.seed, 0, 1, start=0):
            objective.terms(model, batch)
            seen += objective.units(batch)
            if seen >= len(train):
                break
    objective.evaluate(model, cpu, lambda message: None)
    print(f"packed: {len(shapes)} forwards, shapes {sorted(set(shapes))}")
    assert len(shapes) > 10 and len(set(shapes)) <= 4, sorted(set(shapes))

    order = list(itertools.islice(index_stream(len(train), job.settings.seed), len(train)))
    longest = [
        len(r["prompt_input_ids"]) + max(len(r["chosen_input_ids"]), len(r["rejected_input_ids"]))
        for r in train
    ]
    padded = {(8, max(longest[i] for i in order[k : k + 4])) for k in range(0, len(order), 4)}
    print(f"padded per micro-batch: {len(padded)} shapes")
    assert len(padded) > 4, "the demo-like pairs must vary enough for per-batch padding to show"


# -- two days at once ------------------------------------------------------------------------------------------
def test_a_pair_on_two_days_packed_together_trains_once_without_failing(
    tmp_path: Path, teacher_dir: Path
) -> None:
    """Two days packed at once by the packaging stage's own build, three of day 1's pairs on day 2 too (the same
    pair_id): the snapshot keeps them once, from day 1, and the worker's DPO (which refuses a repeated pair_id)
    trains on it to a complete checkpoint."""
    from support.preference_pairs import judged_pairs
    from transformers import AutoTokenizer

    from nexa_dagster.core.packaging.preference_dataset import build_preference_dataset, pairs_to_jsonl
    from nexa_dagster.core.packaging.sft_dataset import DayInput

    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    root = tmp_path / "preference"
    day1 = judged_pairs("2026-01-01", 10, 0.2)
    day2 = pd.concat(
        [judged_pairs("2026-01-02", 10, 0.2, start=50), day1.iloc[[1, 4, 6]].assign(day="2026-01-02")]
    )
    days = [
        DayInput((str(f["day"].iloc[0]),), pairs_to_jsonl(f.reset_index(drop=True), str(root)), len(f))
        for f in (day1, day2)
    ]
    snapshot = build_preference_dataset(days, tokenizer, str(teacher_dir), str(root), 0.25, 0.2)
    assert snapshot.cross_day_duplicates_dropped == 3 and sum(snapshot.pairs.values()) == 20
    job = preference_job(
        tmp_path,
        teacher_dir,
        snapshot.train_path,
        snapshot.validation_path,
        steps=2,
        dataset_run_hash=snapshot.run_hash,
    )
    (tmp_path / "job.json").write_text(job.model_dump_json())
    proc = run_worker_command(
        [sys.executable, "-m", "nexa_dagster.core.training.worker", "--job", str(tmp_path / "job.json")]
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    result = TrainingResult.model_validate_json((Path(job.output_dir) / "training_summary.json").read_text())
    assert (Path(job.output_dir) / COMPLETION_MARKER).exists()
    assert result.validation_pairs == snapshot.pairs["validation"] and result.reward_accuracy is not None


# -- exact resume -----------------------------------------------------------------------------------------------
def _torchrun(job: TrainingJob, tmp_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    job_file = tmp_path / f"{job.run_id}.json"
    job_file.write_text(job.model_dump_json())
    command = LocalGPUCluster(num_procs=2).worker_command(job_file, tmp_path / f"{job.run_id}-logs")
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def _metrics(job: TrainingJob) -> list[dict[str, float]]:
    return [json.loads(line) for line in (Path(job.output_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two ranks trained, killed and resumed: left out of make test-fast
def test_a_killed_two_rank_dpo_run_resumes_with_the_same_loss_at_every_step(
    tmp_path: Path, teacher_dir: Path, tokenizer: Any
) -> None:
    """2 gloo ranks under torchrun, 12 training pairs (2 per rank per step), state every 3 steps. An uninterrupted
    run, and beside it a run on a copy of the snapshot killed with SIGKILL (the whole torchrun group) during step 7,
    after its state of step 6, then relaunched: the relaunch reads the reference values its first attempt computed and
    gives the uninterrupted run's loss, reward metrics and grad norm at every step; both save a complete checkpoint
    that reports the held-out reward accuracy."""
    train = pair_records(tokenizer, conversational_pairs(12, offset=80), "r")
    validation = pair_records(tokenizer, conversational_pairs(4, offset=300), "v")
    base = preference_job(
        tmp_path,
        teacher_dir,
        *write_snapshot(tmp_path / "a", train, validation),
        steps=9,
        num_procs=2,
        checkpoint_every=3,
        lr=3e-3,
    )
    straight = base.model_copy(
        update={"run_id": "straight", "output_dir": str(tmp_path / "ckpt" / "straight")}
    )
    train_b, validation_b = write_snapshot(tmp_path / "b", train, validation)  # same pairs, a second snapshot
    killed = base.model_copy(
        update={
            "run_id": "killed",
            "output_dir": str(tmp_path / "ckpt" / "killed"),
            "train_path": train_b,
            "validation_path": validation_b,
        }
    )
    # both start at once (they share nothing; it saves the suite a launch); the killed one hangs after step 7
    uninterrupted = _torchrun(straight, tmp_path)
    proc = _torchrun(killed, tmp_path, env={"NEXA_FAULT_STALL_AT_STEP": "7"})
    latest = tmp_path / "ckpt" / "killed.state" / "latest"
    deadline = time.monotonic() + 240
    while not (latest.exists() and latest.read_text().strip() == "step00000006"):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    time.sleep(1.0)  # the ranks are now in step 7
    ranks = descendants_matching(proc.pid, "nexa_dagster.core.training.worker")
    assert len(ranks) == 2, [p.cmdline() for p in ranks]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(ranks, timeout=15)
    assert not alive, f"ranks {[p.pid for p in alive]} outlived their killed launcher"
    assert not (Path(killed.output_dir) / COMPLETION_MARKER).exists()
    out, _ = uninterrupted.communicate(timeout=300)
    assert uninterrupted.returncode == 0, out[-3000:]
    assert "reference log-probabilities of 16 pairs computed" in out
    assert "step 9/9 loss" in out and " margin " in out
    written = list((tmp_path / "b" / "prefs0001").glob("ref_logps-sha256-*.parquet"))
    assert len(written) == 1, "the first attempt stored the reference values beside its pairs"

    proc = _torchrun(killed, tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from step 6" in out and f"read from {written[0]}" in out
    keys = ("step", "loss", "reward_margin", "reward_accuracy", "logps_chosen", "logps_rejected", "grad_norm")
    resumed = [tuple(m[k] for k in keys) for m in _metrics(killed)]
    assert [r[0] for r in resumed] == list(range(1, 10))
    assert resumed == [tuple(m[k] for k in keys) for m in _metrics(straight)]
    summary = TrainingResult.model_validate_json(
        (Path(killed.output_dir) / "training_summary.json").read_text()
    )
    assert summary.resumed_from_step == 6 and summary.data_kind == "preference"
    assert summary.validation_pairs == 4 and summary.reward_accuracy is not None
    assert (Path(killed.output_dir) / COMPLETION_MARKER).exists()
    assert not (tmp_path / "ckpt" / "killed.state").exists()
    first = pd.read_parquet(next((tmp_path / "a" / "prefs0001").glob("ref_logps-*.parquet")))
    assert first.equals(pd.read_parquet(written[0])), (
        "the reference values are a function of pairs and checkpoint"
    )


# -- bad input --------------------------------------------------------------------------------------------------
def test_bad_pairs_and_a_foreign_reference_file_fail_before_training(
    tmp_path: Path, teacher_dir: Path, tokenizer: Any
) -> None:
    """An empty chosen answer (the chat template's end-of-turn tokens and nothing else), chosen identical to
    rejected, and a reference file whose sidecar names another checkpoint: each fails before a model is built,
    naming the pair or the file, and nothing is written to the checkpoint's place (nor a reference file computed
    from bad pairs). The last case runs the worker: exit 1, and a failure a relaunch would not fix."""
    from nexa_dagster.core.common.storage import write_json
    from nexa_dagster.core.llm.model_identity import model_fingerprint
    from nexa_dagster.core.training.loop import train
    from nexa_dagster.core.training.preference_data import reference_logps_file, sidecar_of

    good = pair_records(tokenizer, conversational_pairs(6, offset=120), "g")
    validation = pair_records(tokenizer, conversational_pairs(2, offset=320), "v")
    empty_answer = copy.deepcopy(good)
    empty_answer[3]["chosen_input_ids"] = tokenizer.apply_chat_template(
        [{"role": "assistant", "content": ""}], tokenize=True, return_dict=True
    )["input_ids"][-2:]
    assert tokenizer.decode(empty_answer[3]["chosen_input_ids"]) == "<|im_end|>\n"
    same = copy.deepcopy(good)
    same[4]["rejected_input_ids"] = same[4]["chosen_input_ids"]

    for name, records, message in (
        ("empty", empty_answer, r"row 3 \(pair_id 'g-0003'\): empty chosen answer"),
        ("same", same, r"row 4 \(pair_id 'g-0004'\): chosen and rejected are the same tokens"),
    ):
        job = preference_job(
            tmp_path / name,
            teacher_dir,
            *write_snapshot(tmp_path / name / "data", records, validation),
            steps=2,
        )
        with pytest.raises(ValueError, match=message):
            train(job)
        assert not Path(job.output_dir).exists() and not Path(job.output_dir).parent.exists()
        assert not list((tmp_path / name / "data").rglob("ref_logps-*")), "reference values of bad pairs"

    train_path, validation_path = write_snapshot(tmp_path / "foreign" / "data", good, validation)
    job = preference_job(tmp_path / "foreign", teacher_dir, train_path, validation_path, steps=2)
    ours = reference_logps_file(train_path, model_fingerprint(teacher_dir))
    pd.DataFrame(
        {
            "pair_id": [r["pair_id"] for r in good + validation],
            "ref_chosen_logps": -50.0,
            "ref_rejected_logps": -60.0,
        }
    ).to_parquet(ours)
    write_json(
        {
            "reference_id": "sha256:0123456789abcdef0123456789abcdef",
            "reference_path": "/models/another-sft",
            "dataset_run_hash": "prefs0001",
            "pairs": 8,
        },
        sidecar_of(ours),
    )
    (tmp_path / "job.json").write_text(job.model_dump_json())
    logs = tmp_path / "logs"
    proc = run_worker_command(
        [sys.executable, "-m", "nexa_dagster.core.training.worker", "--job", str(tmp_path / "job.json")]
        + ["--log-dir", str(logs)]
    )
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert f"reference log-probabilities {ours} were computed with checkpoint 'sha256:0123" in proc.stdout
    assert json.loads((logs / "worker.rank0.failure.json").read_text())["retryable"] is False
    assert not Path(job.output_dir).parent.exists()
