"""``make run``: the whole tiny pipeline against the embedded Dagster instance, with a summary at the end.

The landed sample days run as nights, one after the other, as the schedule and sensors would run them: the day's
data, a training from the pretrained base on the snapshot so far, its evaluation beside the production model on
the same frozen eval set, and the promotion gate. Then the preference stage: the production model answers the days'
prompts, its answers are ranked into pairs (by the judge, or by a verifiable reward: ``preference.rank_by``), DPO
trains from it, and the gate compares the result with it on the judge's win rate. Then the RL stage: GRPO from the
model in production on checkable tasks built from the ingested documents (``core/rl/tasks.py``), gated on the
paired held-out reward difference on prompts it never trained on. The summary gives each night's two losses, their
difference with its interval and the gate's decision, the preference stage's pairs, held-out reward accuracy, win
rate and decision, and the RL stage's rewards in training, held-out rewards of both models and decision.

It runs the jobs the schedule and sensors run, in order, recording every run and materialization in
the instance in ``$DAGSTER_HOME`` (``.dagster_home/`` by default), so ``make ui`` afterwards shows the lineage
graph with every asset materialized.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from nexa_dagster import settings
from nexa_dagster.assets.partitions import daily_partitions
from nexa_dagster.core.common.config import REPO_ROOT, load_scale, resolve_path
from nexa_dagster.core.common.process_token import process_token, token_alive
from nexa_dagster.core.data.ingest import landed_days
from nexa_dagster.core.evaluation.promotion import ProductionRegistry
from nexa_dagster.core.serving.outcomes import describe, read_outcome
from nexa_dagster.core.tiny.install import install_tiny_models
from nexa_dagster.definitions import build_defs
from nexa_dagster.resources.build import local_model_dirs

LAUNCHER_TAG = "nexa/launcher"  # host:pid:start of the `make run` process that executes the run in-process


@dataclass(frozen=True)
class Night:
    """One night of ``make run``: the checkpoint trained on the data so far, what the gate decided and on what
    evidence, and what happened at deployment."""

    number: int
    day: str
    checkpoint_id: str
    eval_set_version: int | None = None
    candidate_loss: float | None = None
    production_id: str | None = None  # the production model it was compared with (None: there was none yet)
    production_loss: float | None = None
    difference: float | None = None  # candidate - production, on the same eval set
    interval: tuple[float, float] | None = None
    decision: str = "evaluation failed"  # promote | hold back | insufficient evidence | evaluation failed
    reason: str = "see the evaluation_job run in the UI"
    production_after: str | None = None  # production once the night is over
    n: int | None = None  # the examples (or verdicts) the decision rests on
    method: str = ""
    rule: str = ""
    outcome: str = ""  # what deployment did: deployed, held back: ..., failed: ...
    guards: str = ""  # what the guards on the examples that got worse found (core/evaluation/guards.py)
    attempt: int | None = None  # its place among the decisions on its eval set against its production model
    confidence: float | None = None  # the two-sided confidence it decided at (stricter on a later attempt)


def guard_line(report: Any) -> str:
    """The guards' verdict in one line: each reason that held the candidate back, else their figures."""
    guard = getattr(report, "guard", None)
    if not guard:
        return ""
    if guard["guard_verdict"] == "pass":
        return f"guards pass: {guard['summary']}"
    return f"guards: {guard['guard_verdict']}: {'; '.join(guard['guard_reasons'])}"


def night_of(
    number: int, day: str, checkpoint: Any, evaluation: Any, production_after: str | None, outcome: str = ""
) -> Night:
    """The night's figures from the evaluation run's eval_report output (which carries the gate's decision)."""
    try:
        report = evaluation.output_for_node("eval_report")
    except Exception:  # the evaluation failed: no report (its error is in the run's log above)
        return Night(
            number, day, checkpoint.checkpoint_id, production_after=production_after, outcome=outcome
        )
    interval = tuple(report.eval_loss_difference_interval) if report.eval_loss_difference_interval else None
    return Night(
        number,
        day,
        checkpoint.checkpoint_id,
        report.eval_set_version,
        report.eval_loss,
        report.production_checkpoint_id,
        report.production_eval_loss,
        report.eval_loss_difference,
        interval,
        report.gate_decision,
        report.gate_reason,
        production_after,
        report.gate_n if report.gate_n is not None else report.eval_examples,
        report.gate_method or "",
        report.gate_rule or "",
        outcome,
        guard_line(report),
        report.gate_attempt,
        report.gate_confidence,
    )


def ci_label(confidence: float | None) -> str:
    """The interval's level as the summary prints it: "95% CI" at the gate's own level, "97.5% CI" on a second
    attempt against the same production model on the same eval set (``core.evaluation.attempts``)."""
    return f"{100 * (confidence or 0.95):.4g}% CI"


def attempt_line(attempt: int | None, confidence: float | None) -> str:
    """Why a decision ran at a stricter level: the earlier decisions on the same evidence against the same production
    model ("" for a first attempt, which runs at the gate's own level)."""
    if not attempt or attempt < 2:
        return ""
    return (
        f"attempt {attempt} against this production model on this eval set: every interval at {ci_label(confidence)}"
        f" (one-sided error halved for each of the {attempt - 1} earlier decision{'s' if attempt > 2 else ''})"
    )


def change(candidate_loss: float, production_loss: float) -> str:
    """How much better (or worse) the candidate is, as a person reads it: the loss per token in percent, and the
    perplexities (exp of the loss: the number of equally likely next tokens the model is as unsure as)."""
    percent = 100 * (candidate_loss - production_loss) / production_loss
    return (
        f"{abs(percent):.1f}% {'lower' if percent < 0 else 'higher'} loss (perplexity "
        f"{math.exp(production_loss):.1f} -> {math.exp(candidate_loss):.1f})"
    )


def summary_lines(nights: list[Night]) -> list[str]:
    """Night by night: both losses on the same eval set, the difference with its interval, the n and method behind
    it, the gate's decision with the rule that made it, and what deployment did."""
    lines = []
    for n in nights:
        head = f"night {n.number} ({n.day}) {n.checkpoint_id}:"
        gate_said_it = n.outcome.startswith("held back: the promotion gate")  # the decision already says so
        outcome = f"; {n.outcome}" if n.outcome and not gate_said_it else ""
        if n.candidate_loss is None:
            lines.append(f"{head} {n.decision} ({n.reason}){outcome}")
            continue
        evidence = f"eval set v{n.eval_set_version}, n = {n.n} examples"
        if n.production_loss is None:  # no production model yet (night 1), or one that could not be scored
            compared = (
                f"{evidence}: candidate {n.candidate_loss:.4f}, "
                f"{'no production model yet' if n.production_id is None else 'production not scored'}"
            )
            lines.append(f"{head} {compared} -> {n.decision} ({n.reason}){outcome}")
            continue
        low, high = n.interval if n.interval else (float("nan"), float("nan"))
        compared = (
            f"{evidence}: candidate {n.candidate_loss:.4f}, production "
            f"{n.production_loss:.4f} ({n.production_id}), difference {n.difference:+.4f} "
            f"{ci_label(n.confidence)} [{low:+.4f}, {high:+.4f}] ({n.method.split(' (')[0] or 'interval'}), "
            f"{change(n.candidate_loss, n.production_loss)}"
        )
        lines.append(f"{head} {compared} -> {n.decision} (rule: {n.rule}){outcome}")
        if n.guards:
            lines.append(f"  {n.guards}")
        if attempt_line(n.attempt, n.confidence):
            lines.append(f"  {attempt_line(n.attempt, n.confidence)}")
    return lines


@dataclass(frozen=True)
class PreferenceRun:
    """The preference stage of ``make run``: the pairs, the DPO checkpoint and what its gate decided."""

    pairs: int
    days: int
    mean_gap: float | None
    checkpoint_id: str
    parent: str | None
    reward_accuracy: float | None
    reward_margin: float | None
    heldout_pairs: int | None
    report: Any = None  # the EvalReport (None: the evaluation failed)
    outcome: str = ""


def preference_lines(p: PreferenceRun) -> list[str]:
    """The preference stage's summary: pairs, what DPO learned on held-out pairs, and the judge's verdict."""
    gap = f", mean score gap {p.mean_gap:.2f}" if p.mean_gap is not None else ""
    lines = [f"{p.pairs} pairs from {p.days} days of the production model's answers{gap}"]
    if p.reward_accuracy is not None:
        lines.append(
            f"{p.checkpoint_id} (DPO from {p.parent}): held-out reward accuracy {p.reward_accuracy:.2f}, "
            f"margin {p.reward_margin:+.3f} on {p.heldout_pairs} pairs"
        )
    r = p.report
    if r is None:
        lines.append(
            f"evaluation failed (see the evaluation_job run in the UI){'; ' + p.outcome if p.outcome else ''}"
        )
        return lines
    if r.reward_gate:  # pairs ranked by a reward: the same reward decides, on the frozen held-out RL prompts
        lines.append(reward_gate_line(r))
        if loss_guard_line(r):
            lines.append(loss_guard_line(r))
    elif r.win_rate_vs_production is not None and r.win_rate_interval:
        low, high = r.win_rate_interval
        lc = (
            f", length-controlled {r.length_controlled_win_rate:.3f} (answers {r.mean_length_change:+.0f} chars)"
            if r.length_controlled_win_rate is not None and r.mean_length_change is not None
            else ""
        )
        mode = r.judge_mode or "pairwise"
        usable = "order-consistent" if mode == "pairwise" else "decisive"
        headline = (
            f", headline {r.win_rate_headline:.3f} ({'flips' if mode == 'pairwise' else 'ties'} count half)"
            if r.win_rate_headline is not None
            else ""
        )
        method = (r.gate_method or "Wilson score interval").split(" over ")[0]
        lines.append(  # n counts the usable verdicts: a flip, a tie or an unreadable reply is no verdict
            f"{mode} judge win rate vs {r.production_checkpoint_id} {r.win_rate_vs_production:.3f} 95% CI "
            f"[{low:.3f}, {high:.3f}], n = {r.gate_n} {usable} verdicts of {r.win_rate_verdicts} prompts "
            f"({method}){headline}{lc}"
        )
        if mode == "pairwise" and r.judge_order_consistency is not None:
            apart = (
                f"order consistency {r.judge_order_consistency:.0%} ({r.judge_flips} flipped with the order)"
            )
        else:
            apart = f"{r.judge_ties} ties (each answer scored alone: no order to flip)"
        lines.append(f"judge: {apart}, {r.judge_unreadable} unreadable")
    outcome = f"; {p.outcome}" if p.outcome else ""
    first = (r.gate_reason or "").split(";")[0]  # a hold-back other than by the interval names its cause
    why = (
        f": {first}" if first.startswith(("judge unreliable", "non-regression guard", "contaminated")) else ""
    )
    lines.append(f"-> {r.gate_decision} (rule: {r.gate_rule}){why}{outcome}")
    if guard_line(r):
        on = "per-prompt reward differences" if r.reward_gate else "judge's per-prompt scores"
        lines.append(f"  {guard_line(r)} (the {on})")
    return lines


@dataclass(frozen=True)
class RLRun:
    """The RL stage of ``make run``: the GRPO checkpoint, its training's reward figures and what its gate decided."""

    checkpoint_id: str
    parent: str | None
    training: dict[
        str, float
    ]  # Checkpoint.rl_metrics: reward_first/final, held_out_reward, rollout_s, update_s
    report: Any = None  # the EvalReport (None: the evaluation failed)
    outcome: str = ""


def rl_lines(r: RLRun) -> list[str]:
    """The RL stage's summary: the reward in training, then both models on the frozen held-out prompts, the paired
    difference with its interval, n and rule, and what deployment did."""
    t = r.training
    lines = [
        f"{r.checkpoint_id} (GRPO from {r.parent}): rollout reward {t.get('reward_first', float('nan')):.3f} at "
        f"step 1 -> {t.get('reward_final', float('nan')):.3f} at the last step; rollouts "
        f"{t.get('rollout_s', float('nan')):.1f} s, updates {t.get('update_s', float('nan')):.1f} s"
    ]
    report = r.report
    if report is None or not report.reward_gate:
        lines.append(
            f"evaluation failed (see the evaluation_job run in the UI){'; ' + r.outcome if r.outcome else ''}"
        )
        return lines
    lines.append(reward_gate_line(report))
    if loss_guard_line(report):
        lines.append(loss_guard_line(report))
    outcome = f"; {r.outcome}" if r.outcome else ""
    lines.append(f"-> {report.gate_decision} (rule: {report.gate_rule}){outcome}")
    if guard_line(report):
        lines.append(f"  {guard_line(report)} (the per-prompt reward differences)")
    return lines


def loss_guard_line(report: Any) -> str:
    """The eval-set loss of a post-trained candidate against production with its interval: the non-inferiority
    guard promotes only when the interval's high end is within its margin (the rule names the margin)."""
    if report.eval_loss_difference is None:
        return ""
    low, high = report.eval_loss_difference_interval or (float("nan"), float("nan"))
    return (
        f"eval-set loss (non-inferiority guard): difference {report.eval_loss_difference:+.4f} nats/token "
        f"{ci_label(report.gate_confidence)} [{low:+.4f}, {high:+.4f}]"
    )


def reward_gate_line(report: Any) -> str:
    """Both models' mean held-out reward on the frozen held-out RL prompts, the paired difference with its interval,
    n and method: what a reward gate decided on."""
    g = report.reward_gate
    low, high = g.get("interval_low"), g.get("interval_high")
    interval = f"[{low:+.3f}, {high:+.3f}]" if low is not None and high is not None else "(none)"
    production = g.get("production_reward")
    return (
        f"held-out reward ({', '.join(g['rewards'])}, {g.get('answers', 'greedy')}, RL eval set "
        f"v{g.get('rl_eval_set_version')}): "
        f"candidate {g['candidate_reward']:.3f}, production {report.production_checkpoint_id} "
        f"{'none' if production is None else f'{production:.3f}'}; difference {(g.get('difference') or 0.0):+.3f} "
        f"{ci_label(report.gate_confidence)} {interval}, n = {g.get('n')} prompts "
        f"({(report.gate_method or '').split(' (')[0]})"
        + (
            f"; {attempt_line(report.gate_attempt, report.gate_confidence)}"
            if (report.gate_attempt or 0) > 1
            else ""
        )
    )


def fail_orphaned_runs(instance: Any) -> list[str]:
    """Mark failed the runs a killed ``make run`` left STARTED (its process is gone); return their ids.

    Only runs tagged by ``make run`` on this host are touched: a run of the daemon or of another host is not ours
    to judge (the daemon's run monitoring handles those).
    """
    failed = []
    started = dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING])
    for record in instance.get_run_records(started):
        run = record.dagster_run
        token = run.tags.get(LAUNCHER_TAG)
        if token and token_alive(token) is False:
            instance.report_run_failed(
                run,
                f"the `make run` process that executed this run ({token}) is gone "
                "(killed?); marked failed by the next `make run`",
            )
            # a pool slot (the `gpu` pool of a training) it held would block every later training
            with contextlib.suppress(NotImplementedError):
                instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
            failed.append(run.run_id)
    return failed


def days_dagster_knows(
    days: list[str], landing_root: Path, partitions: dg.DailyPartitionsDefinition = daily_partitions
) -> tuple[list[str], list[str]]:
    """(the landed days that are daily partitions, one line for each landing folder that is not: what it is and
    what to do). A folder dated after today has no partition yet (Dagster adds a day's partition when it begins);
    one dated before NEXA_PARTITIONS_START never will."""
    first, last = partitions.get_first_partition_key(), partitions.get_last_partition_key()
    known, lines = [], []
    for day in days:
        if partitions.has_partition_key(day):
            known.append(day)
        elif last is not None and day > last:
            lines.append(
                f"skipped {landing_root / day}: dated after today (the last daily partition is {last}); run again "
                f"on {day} or later, or move its files to the folder of the day they landed"
            )
        else:
            lines.append(
                f"skipped {landing_root / day}: before the first daily partition {first}; set "
                f"NEXA_PARTITIONS_START={day} (or earlier) to process it"
            )
    return known, lines


class Demo:
    """The jobs of ``make run`` executed in this process against the instance in ``$DAGSTER_HOME``, each run tagged
    with this process (so a killed ``make run`` leaves no run that looks alive) and timed for the summary."""

    def __init__(self, defs: dg.Definitions, instance: dg.DagsterInstance) -> None:
        self.defs, self.instance = defs, instance
        self.storage = defs.resources["storage"]
        self.launcher = process_token()
        self.timings: dict[str, float] = {}
        self.nights: list[Night] = []

    def run(self, job_name: str, **kwargs: Any) -> dg.ExecuteInProcessResult:
        """One job, in process; its time recorded under the job, partition, night and asset subset it ran."""
        t = time.perf_counter()
        print(f"==> {job_name} {kwargs.get('partition_key', '')}".rstrip(), flush=True)
        quiet = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}  # DEBUG events stay in the UI
        kwargs.setdefault("raise_on_error", True)
        result = self.defs.resolve_job_def(job_name).execute_in_process(
            instance=self.instance, run_config=quiet, tags={LAUNCHER_TAG: self.launcher}, **kwargs
        )
        night = f" (night {len(self.nights) + 1})" if job_name in ("pretraining_job", "training_job") else ""
        subset = kwargs.get("asset_selection")  # a part of the job: named, so it is not the job's own line
        part = f" ({', '.join(k.to_user_string() for k in subset)})" if subset else ""
        label = f"{job_name} {kwargs.get('partition_key', '')}".strip() + night + part
        self.timings[label] = time.perf_counter() - t
        return result

    def production_id(self) -> str | None:
        current = ProductionRegistry(self.storage.production_pointer()).current()
        return current.checkpoint_id if current else None

    def outcome(self, checkpoint_id: str) -> str:
        """What deployment did with a checkpoint: deployed, held back: ..., failed: ..."""
        return describe(read_outcome(self.storage.deployment_dir(checkpoint_id)))

    def run_nights(self, days: list[str], with_rl: bool = False) -> tuple[Any, Any]:
        """Night by night, as the schedule and sensors run it: the day's data, a training on the snapshot so far,
        its evaluation beside production on the same frozen eval set, and the gate. The base is pretrained once,
        on the first night's corpus (corpus -> base -> SFT, init_from: base): from scratch, 24 steps on a dozen
        answers teach the tiny student nothing (its greedy answer is an immediate <|im_end|>, which the
        deployment's smoke test rightly refuses as no text). With an RL stage (``with_rl``) the held-out RL prompts
        are frozen before the base trains (``pretrain``). (the base model, its evaluation or None)"""
        base = base_eval = None
        for number, day in enumerate(days, start=1):
            print(f"\n--- night {number}: {day} ---", flush=True)
            self.run("daily_data_job", partition_key=day)
            if base is None:
                base = self.pretrain(with_rl)
            checkpoint = self.run("training_job").output_for_node("moe_checkpoint")
            if (
                number == 1
            ):  # the eval set frozen by this training holds the corpus documents the base is scored on
                scored = self.run(
                    "base_evaluation_job", partition_key=base.checkpoint_id, raise_on_error=False
                )
                base_eval = scored.output_for_node("base_model_eval") if scored.success else None
            evaluation = self.run(
                "evaluation_job", partition_key=checkpoint.checkpoint_id, raise_on_error=False
            )
            outcome = self.outcome(checkpoint.checkpoint_id)
            self.nights.append(night_of(number, day, checkpoint, evaluation, self.production_id(), outcome))
        return base, base_eval

    def pretrain(self, with_rl: bool) -> Any:
        """pretraining_job; with an RL stage, the held-out RL prompts frozen between the corpus and eval set and the
        base model (rl_prompts follows the eval set, base_model follows rl_eval_set): no base, and so no model the RL
        gate compares, trains on a passage the gate asks about. The frozen prompts are drawn from the documents so
        far (the first night's), which the corpus holds: base_model leaves those documents out, as it leaves out the
        eval set's."""
        if not with_rl:
            return self.run("pretraining_job").output_for_node("base_model")
        self.run("pretraining_job", asset_selection=[dg.AssetKey("pretrain_corpus"), dg.AssetKey("eval_set")])
        self.run("rl_training_job", asset_selection=[dg.AssetKey("rl_prompts"), dg.AssetKey("rl_eval_set")])
        return self.run("pretraining_job", asset_selection=[dg.AssetKey("base_model")]).output_for_node(
            "base_model"
        )

    def run_preference(self, days: list[str], scale: Any) -> PreferenceRun | str:
        """pretrain -> SFT -> preference: the production model answers every day's prompts, its answers are
        ranked into pairs, DPO trains from it, and the gate compares the result with it (as the sensors run it)."""
        print("\n--- preference: the production model's answers judged into pairs, then DPO ---", flush=True)
        pairs = [
            self.run("preference_pairs_job", partition_key=day).output_for_node("preference_pairs")
            for day in days
        ]
        if scale.rl is not None and scale.preference.rank_by == "reward":
            # the reward gate of a DPO checkpoint trained on reward-ranked pairs scores the frozen held-out prompts
            self.run(
                "rl_training_job", asset_selection=[dg.AssetKey("rl_prompts"), dg.AssetKey("rl_eval_set")]
            )
        trained = self.run("preference_training_job", raise_on_error=False)
        if not trained.success:
            return "DPO training failed: see the preference_training_job run in the UI"
        pref = trained.output_for_node("preference_checkpoint")
        evaluation = self.run("evaluation_job", partition_key=pref.checkpoint_id, raise_on_error=False)
        gaps = [g for frame in pairs for g in frame["score_gap"]]
        metrics = pref.preference_metrics or {}
        return PreferenceRun(
            sum(len(f) for f in pairs),
            len(days),
            sum(gaps) / len(gaps) if gaps else None,
            pref.checkpoint_id,
            pref.parent,
            metrics.get("reward_accuracy"),
            metrics.get("reward_margin"),
            int(metrics["pairs"]) if "pairs" in metrics else None,
            evaluation.output_for_node("eval_report") if evaluation.success else None,
            self.outcome(pref.checkpoint_id),
        )

    def run_rl(self) -> RLRun | str:
        """GRPO from the production model on the checkable tasks (rl_training_job), then its evaluation and gate
        (evaluation_job) as the checkpoint sensor runs it; the figures, or why there are none."""
        print(
            "\n--- RL: GRPO from the production model on checkable tasks, gated on held-out prompts ---",
            flush=True,
        )
        trained = self.run("rl_training_job", raise_on_error=False)
        if not trained.success:
            return "GRPO training failed: see the rl_training_job run in the UI"
        ckpt = trained.output_for_node("rl_checkpoint")
        evaluation = self.run("evaluation_job", partition_key=ckpt.checkpoint_id, raise_on_error=False)
        return RLRun(
            ckpt.checkpoint_id,
            ckpt.parent,
            ckpt.rl_metrics or {},
            evaluation.output_for_node("eval_report") if evaluation.success else None,
            self.outcome(ckpt.checkpoint_id),
        )


def main() -> int:
    settings.export_default(settings.DAGSTER_HOME, str(REPO_ROOT / ".dagster_home"))
    settings.export_default(settings.HF_HUB_OFFLINE)
    Path(settings.DAGSTER_HOME.get()).mkdir(parents=True, exist_ok=True)
    # one process runs every job: its workers fork from a warm Python that imports torch, transformers and
    # DeepSpeed once (core/cluster/warm_python.py), started now, beside the first day's data
    defs = build_defs(warm_workers=True)
    defs.resources["gpu_cluster"].prestart_warm()
    for path in install_tiny_models(
        local_model_dirs(defs.resources)
    ):  # the demo's own teacher, judge, tokenizer
        print(f"tiny model ready: {path}")

    t0 = time.perf_counter()
    instance = dg.DagsterInstance.get()
    orphans = fail_orphaned_runs(instance)
    if orphans:
        print(
            f"{len(orphans)} run(s) left STARTED by a killed `make run` marked failed: {', '.join(orphans)}"
        )
    demo = Demo(defs, instance)
    landing_root = resolve_path(demo.storage.landing_root)
    days, unknown = days_dagster_knows(landed_days(landing_root), landing_root)
    for line in unknown:  # one line each, and the other days still run
        print(line, file=sys.stderr)
    if not days:
        print(f"no landed documents under {landing_root} of a day Dagster knows", file=sys.stderr)
        return 1
    scale = load_scale()
    print(f"nexa-dagster demo: scale={scale.name}, days={days}, DAGSTER_HOME={settings.DAGSTER_HOME.get()}")

    base, base_eval = demo.run_nights(days, with_rl=scale.rl is not None)
    preference = (
        demo.run_preference(days, scale)
        if scale.preference is not None and demo.production_id() is not None
        else None
    )
    if isinstance(preference, str):
        print(preference)
    # SFT -> preference -> RL: GRPO from whatever is in production now, on checkable tasks
    rl = demo.run_rl() if scale.rl is not None and demo.production_id() else None
    demo.run("leaderboard_job")
    print_summary(demo, time.perf_counter() - t0, base, base_eval, preference, rl)
    return 0


def print_summary(
    demo: Demo,
    total_s: float,
    base: Any,
    base_eval: Any,
    preference: PreferenceRun | str | None,
    rl: RLRun | str | None,
) -> None:
    """What ``make run`` made: each job's time, the base model, every night's decision, the preference and RL
    stages, what is in production and served, and where everything is."""
    print("\n" + "=" * 78)
    print(f"nexa-dagster tiny pipeline finished in {total_s:.0f} s ({len(demo.nights)} nights)")
    for name, seconds in demo.timings.items():
        print(f"  {name:<40} {seconds:6.1f} s")
    for line in base_lines(base, base_eval):
        print(line)
    print(
        "  nights            candidate vs production on the same frozen eval set (mean loss per token, "
        "lower is better)"
    )
    for line in summary_lines(demo.nights):
        print(f"    {line}")
    if isinstance(preference, PreferenceRun):
        print("  preference        DPO from the production model, judged against it on the same prompts")
        for line in preference_lines(preference):
            print(f"    {line}")
    elif preference:
        print(f"  preference        {preference}")
    if isinstance(rl, RLRun):
        print(
            "  rl                GRPO from the production model, gated on held-out prompts it never trained on"
        )
        for line in rl_lines(rl):
            print(f"    {line}")
    elif rl:
        print(f"  rl                {rl}")
    print(f"  production        {demo.production_id() or 'none'}")
    serving = serving_line(demo.instance)
    if serving:
        print(serving)
    storage = demo.storage
    data_root = storage.root  # NEXA_DATA_ROOT / NEXA_RESULTS_ROOT honoured: where this run really wrote
    print(f"  leaderboard       {storage.results_path('evaluation', 'leaderboard.csv')}")
    print(
        f"  data              {data_root}/  (tables under {data_root}/assets, MLflow at "
        f"{demo.defs.resources['tracking'].uri()})"
    )
    print(
        "Open the UI to see the lineage graph with every asset materialized:  make ui  (http://127.0.0.1:3000)"
    )


def base_lines(base: Any, base_eval: Any) -> list[str]:
    """The base model's summary: where it is and its loss on the frozen corpus documents no base trains on."""
    if base is None:
        return [""]
    lines = [f"  base model        {base.path}  (pretrained on pretrain_corpus)"]
    if base_eval is None:
        lines.append("                    its evaluation failed: see the base_evaluation_job run in the UI")
        return lines
    low, high = base_eval.loss_interval
    lines.append(
        f"                    eval set v{base_eval.eval_set_version}: loss {base_eval.loss:.4f} 95% CI "
        f"[{low:.4f}, {high:.4f}] (perplexity {base_eval.perplexity:.1f}) on {base_eval.documents} frozen "
        "corpus documents no base model trains on"
    )
    return lines


def serving_line(instance: dg.DagsterInstance) -> str:
    """What the latest model_deployment materialization served, and where ("" when nothing was deployed)."""
    deployment = instance.get_latest_materialization_event(dg.AssetKey("model_deployment"))
    dm = {k: v.value for k, v in deployment.asset_materialization.metadata.items()} if deployment else {}
    if not dm:
        return ""
    endpoint = dm.get("endpoint") if str(dm.get("endpoint", "")).startswith("http") else None
    where = (
        f"served at {endpoint}" if endpoint else f"smoke-tested -> {dm.get('endpoint') or 'deployment.json'}"
    )
    return (
        f"  serving           {dm.get('checkpoint_served')}: {dm.get('engine')} smoke "
        f"request {dm.get('smoke_latency_s')} s; {where}"
    )


if __name__ == "__main__":
    sys.exit(main())
