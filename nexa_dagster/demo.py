"""``make run``: the whole tiny pipeline against the embedded Dagster instance, with a summary at the end.

It runs the same three jobs the schedule and sensors run, in order, recording every run and materialization in
the instance in ``$DAGSTER_HOME`` (``.dagster_home/`` by default), so ``make ui`` afterwards shows the lineage
graph with every asset materialized.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from nexa_dagster.core.config import REPO_ROOT, load_scale, resolve_path
from nexa_dagster.core.ingest import landed_days
from nexa_dagster.core.process_token import process_token, token_alive

LAUNCHER_TAG = "nexa/launcher"  # host:pid:start of the `make run` process that executes the run in-process


def fail_orphaned_runs(instance: Any) -> list[str]:
    """Mark failed the runs a killed ``make run`` left STARTED (its process is gone); return their ids.

    Only runs tagged by ``make run`` on this host are touched: a run of the daemon or of another host is not ours
    to judge (the daemon's run monitoring handles those).
    """
    import dagster as dg

    failed = []
    started = dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING])
    for record in instance.get_run_records(started):
        run = record.dagster_run
        token = run.tags.get(LAUNCHER_TAG)
        if token and token_alive(token) is False:
            instance.report_run_failed(run, f"the `make run` process that executed this run ({token}) is gone "
                                            "(killed?); marked failed by the next `make run`")
            # a pool slot (the `gpu` pool of a training) it held would block every later training
            with contextlib.suppress(NotImplementedError):
                instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)
            failed.append(run.run_id)
    return failed


def main() -> int:
    os.environ.setdefault("DAGSTER_HOME", str(REPO_ROOT / ".dagster_home"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    Path(os.environ["DAGSTER_HOME"]).mkdir(parents=True, exist_ok=True)

    import dagster as dg

    from nexa_dagster.definitions import defs

    t0 = time.perf_counter()
    instance = dg.DagsterInstance.get()
    orphans = fail_orphaned_runs(instance)
    if orphans:
        print(f"{len(orphans)} run(s) left STARTED by a killed `make run` marked failed: {', '.join(orphans)}")
    storage = defs.resources["storage"]
    landing_root = resolve_path(storage.landing_root)
    days = landed_days(landing_root)
    if not days:
        print(f"no landed documents under {landing_root}", file=sys.stderr)
        return 1
    scale = load_scale()
    print(f"nexa-dagster demo: scale={scale.name}, days={days}, DAGSTER_HOME={os.environ['DAGSTER_HOME']}")
    timings: dict[str, float] = {}
    launcher = process_token()

    def run(job_name: str, **kwargs: object) -> dg.ExecuteInProcessResult:
        t = time.perf_counter()
        print(f"==> {job_name} {kwargs.get('partition_key', '')}".rstrip(), flush=True)
        quiet = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}  # DEBUG events stay in the UI
        kwargs.setdefault("raise_on_error", True)
        result = defs.resolve_job_def(job_name).execute_in_process(instance=instance, run_config=quiet,
                                                                   tags={LAUNCHER_TAG: launcher}, **kwargs)
        timings[f"{job_name} {kwargs.get('partition_key', '')}".strip()] = time.perf_counter() - t
        return result

    for day in days:
        run("daily_data_job", partition_key=day)
    # corpus -> base -> SFT: the fine-tuning starts from a base pretrained on the landed documents (init_from:
    # base). From scratch, 24 steps on a dozen answers teach the tiny student nothing: its greedy answer is an
    # immediate <|im_end|>, which the deployment's smoke test rightly refuses as no text.
    pretraining = run("pretraining_job")
    base = pretraining.output_for_node("base_model")
    training = run("training_job")
    checkpoint = training.output_for_node("moe_checkpoint")
    evaluation = run("evaluation_job", partition_key=checkpoint.checkpoint_id, raise_on_error=False)
    run("leaderboard_job")

    total = time.perf_counter() - t0
    report = instance.get_latest_materialization_event(dg.AssetKey("eval_report"))
    deployment = instance.get_latest_materialization_event(dg.AssetKey("model_deployment"))
    md = {k: v.value for k, v in report.asset_materialization.metadata.items()} if report else {}
    dm = {k: v.value for k, v in deployment.asset_materialization.metadata.items()} if deployment else {}
    data_root = storage.root  # NEXA_DATA_ROOT / NEXA_RESULTS_ROOT honoured: where this run really wrote
    print("\n" + "=" * 78)
    print(f"nexa-dagster tiny pipeline finished in {total:.0f} s")
    for name, seconds in timings.items():
        print(f"  {name:<40} {seconds:6.1f} s")
    print(f"  base model        {base.path}  (pretrained on pretrain_corpus)")
    print(f"  checkpoint        {checkpoint.path}  ({checkpoint.num_steps} DeepSpeed steps, "
          f"train loss {checkpoint.training_loss:.3f})")
    print(f"  evaluation        eval-set v{md.get('eval_set_version')} loss {md.get('eval_loss')}  ppl {md.get('perplexity')}  "
          f"judge {md.get('judge_score')}  -> {storage.report_dir(checkpoint.checkpoint_id)}/")
    gate = [c for c in evaluation.get_asset_check_evaluations() if c.check_name == "beats_production"]
    reason = gate[0].metadata["reason"].value if gate else "?"
    if gate and gate[0].passed and evaluation.success:
        endpoint = dm.get("endpoint") if dm.get("endpoint", "").startswith("http") else None
        where = f"served at {endpoint}" if endpoint else \
            f"smoke-tested -> {storage.deployment_dir(checkpoint.checkpoint_id)}/deployment.json"
        print(f"  serving           {dm.get('engine')} smoke request {dm.get('smoke_latency_s')} s; {where}")
        print(f"  production        {checkpoint.checkpoint_id} promoted ({reason})")
    else:
        print(f"  production        not promoted: {reason}")
    print(f"  leaderboard       {storage.results_path('evaluation', 'leaderboard.csv')}")
    print(f"  data              {data_root}/  (tables under {data_root}/assets, MLflow at "
          f"{defs.resources['tracking'].uri()})")
    print("Open the UI to see the lineage graph with every asset materialized:  make ui  (http://127.0.0.1:3000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
