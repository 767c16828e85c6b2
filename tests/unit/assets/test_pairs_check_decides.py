"""The blocking pairs check decides, on pairs the pipeline made: ``make_pairs`` (the function ``preference_pairs``
runs) asks a policy behind a real OpenAI-compatible HTTP endpoint for K answers per prompt, and the endpoint turns
one prompt's requests away. The check fails that day (the rule make_pairs cannot keep: every answer it asked for
arrived), its run fails, its file is still on disk, and the real ``preference_dataset`` packs the other days and
refuses that one, naming it. Made again once the endpoint answers, the day passes and is packed."""

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
import pytest
from support.openai_stub import chat_payload, stub_server

from nexa_dagster.assets import preference
from nexa_dagster.core.distill.generation_store import GenerationStore
from nexa_dagster.core.distill.pairs import RewardScorer, make_pairs
from nexa_dagster.core.distill.sample_gate import load_gate_config
from nexa_dagster.core.evaluation.promotion import ProductionEntry, ProductionRegistry
from nexa_dagster.core.llm.base import SamplingParams
from nexa_dagster.core.llm.openai_compat import OpenAICompatibleClient
from nexa_dagster.core.rl.rewards import reward_function
from nexa_dagster.resources.configs import EvalSetsResource, PackagingResource, PromptsResource
from nexa_dagster.resources.io_manager import NexaIOManager
from nexa_dagster.resources.scale import ScaleResource
from nexa_dagster.resources.storage import StorageResource

GOOD, BAD = "2026-11-20", "2026-11-21"
REFUSED = "Question 0 of"  # the prompt the endpoint turns away while it is overloaded


def _prompts(day: str, n: int = 40) -> pd.DataFrame:
    """Checkable prompts of one day as preference_pairs' reward ranking answers them (the right answer as the
    reference)."""
    return pd.DataFrame(
        {
            "sample_id": [f"{day}-item{i}" for i in range(n)],
            "day": day,
            "system_prompt": "",
            "prompt": [
                f"Question {i} of {day}: which statement is this? Answer with one word." for i in range(n)
            ],
            "response": "assert",
            "answer": "assert",
            "completion_tokens": 1,
        }
    )


def _endpoint(overloaded: bool):
    def reply(n: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if overloaded and REFUSED in body["messages"][-1]["content"]:
            return 503, {"error": {"message": "overloaded"}}
        return 200, chat_payload("lambda")  # a wrong answer: every prompt gives a pair

    return reply


def _make_pairs(store: Path, day: str, overloaded: bool, eval_fraction: float) -> tuple[pd.DataFrame, Any]:
    with (
        stub_server(_endpoint(overloaded)) as (url, _, _),
        OpenAICompatibleClient(url, "stub", max_retries=0) as policy,
        GenerationStore(store) as generations,
    ):
        return make_pairs(
            _prompts(day),
            policy,
            RewardScorer(reward_function("exact_answer"), "exact_answer"),
            load_gate_config("filters.yaml"),
            generations,
            SamplingParams(8, 1.0, 0.95, 1),
            2,
            0.5,
            eval_fraction,
        )


class PairsRun(dg.Config):
    store: str  # the generation store (kept between the day's runs, as the asset's is)
    overloaded: bool
    fraction: float


@pytest.fixture
def pairs_asset() -> Any:
    """preference_pairs as the code location defines its key, partitions and blocking check, computed by the real
    make_pairs and ending as the real asset does (``pairs_outputs``)."""
    from nexa_dagster.definitions import defs

    real = defs.resolve_assets_def(dg.AssetKey("preference_pairs"))
    [check] = real.check_specs

    @dg.asset(key="preference_pairs", partitions_def=real.partitions_def, check_specs=[check])
    def pairs(context: dg.AssetExecutionContext, config: PairsRun) -> Iterator[Any]:
        frame, stats = _make_pairs(
            Path(config.store), context.partition_key, config.overloaded, config.fraction
        )
        check = preference.pairs_check(frame, 0.5, config.fraction, stats)
        yield from preference.pairs_outputs(frame, {"dagster/row_count": len(frame)}, check)

    return pairs


def test_a_day_whose_policy_answers_failed_fails_the_check_and_is_not_packed(
    pairs_asset: Any, tmp_path: Path, tiny_model_dir: Path
) -> None:
    data = tmp_path / "data"
    shutil.copytree(tiny_model_dir, data / "models" / "tiny-teacher")  # the student's tokenizer
    storage = StorageResource(data_root=str(data), results_root=str(tmp_path / "results"))
    ProductionRegistry(storage.production_pointer()).promote(
        ProductionEntry(checkpoint_id="ckpt-1", checkpoint_path=str(tiny_model_dir), metric="eval_loss")
    )
    eval_sets = EvalSetsResource()
    resources = {
        "io_manager": NexaIOManager(data_root=str(data), results_root=str(tmp_path / "results")),
        "storage": storage,
        "scale_preset": ScaleResource(name="tiny"),
        "eval_sets": eval_sets,
        "packaging_config": PackagingResource(),
        "prompts": PromptsResource(),
    }

    def make(day: str, overloaded: bool) -> dg.ExecuteInProcessResult:
        config = {"store": str(tmp_path / "store"), "overloaded": overloaded, "fraction": eval_sets.fraction}
        return dg.materialize(
            [pairs_asset],
            instance=instance,
            partition_key=day,
            resources=resources,
            run_config={"ops": {"preference_pairs": {"config": config}}},
            raise_on_error=False,
        )

    def pack() -> dg.ExecuteInProcessResult:
        others = [dg.SourceAsset("eval_set"), dg.SourceAsset("production_model")]
        return dg.materialize(
            [pairs_asset, preference.preference_dataset, *others],
            instance=instance,
            resources=resources,
            selection=[preference.preference_dataset.key],
        )

    with dg.instance_for_test() as instance:
        assert make(GOOD, overloaded=False).success
        failed = make(BAD, overloaded=True)
        [verdict] = failed.get_asset_check_evaluations()
        assert not failed.success and not verdict.passed
        assert re.match(r"2 of \d+ policy answers failed \(first error: HTTP 503", verdict.description or "")
        assert (data / "assets" / "preference_pairs" / f"{BAD}.parquet").exists()  # written before the check
        assert preference.refused_days(instance, [GOOD, BAD]) == [BAD]

        packed = pack().asset_materializations_for_node("preference_dataset")[0].metadata
        assert packed["days"].value == [GOOD] and packed["days_refused"].value == [BAD]

        assert make(BAD, overloaded=False).success  # the endpoint answers again: the failed answers are asked
        assert preference.refused_days(instance, [GOOD, BAD]) == []
