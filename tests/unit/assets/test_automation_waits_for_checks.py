"""Automation downstream of a checked asset waits for its blocking checks: base_model_eval, requested by the
automation sensor once a base model and an eval set exist, is not requested while the eval set's blocking check
(its files match their manifest) failed, and is once it passes. The conditions are the code location's own,
evaluated by Dagster's public ``evaluate_automation_conditions`` on a real instance; only the asset bodies (and the
check's verdict) are stand-ins."""

from __future__ import annotations

import dagster as dg

from nexa_dagster.definitions import defs

EVAL = "base_model_eval"


def _stand_ins(eval_set_passes: bool) -> list[dg.AssetsDefinition]:
    specs = {s.key.to_user_string(): s for s in defs.resolve_all_asset_specs()}
    check = next(
        c for c in defs.resolve_asset_graph().asset_check_keys if c.asset_key == dg.AssetKey("eval_set")
    )
    check_spec = dg.AssetCheckSpec(check.name, asset="eval_set", blocking=True)

    @dg.multi_asset(specs=[specs["eval_set"].replace_attributes(deps=[])], check_specs=[check_spec])
    def eval_set():
        yield dg.MaterializeResult(asset_key="eval_set")
        yield dg.AssetCheckResult(check_name=check.name, passed=eval_set_passes)

    @dg.multi_asset(specs=[specs["base_model"].replace_attributes(deps=[])])
    def base_model() -> dg.MaterializeResult:
        return dg.MaterializeResult(asset_key="base_model")

    @dg.multi_asset(specs=[specs[EVAL]], check_specs=[])
    def evaluated() -> dg.MaterializeResult:
        return dg.MaterializeResult(asset_key=EVAL)

    return [eval_set, base_model, evaluated]


def _requested(result) -> set[str]:
    return {k for k in ("eval_set", "base_model", EVAL) if result.get_num_requested(dg.AssetKey(k))}


def test_base_model_eval_waits_for_the_eval_sets_blocking_check() -> None:
    with dg.instance_for_test() as instance:
        failing, passing = _stand_ins(eval_set_passes=False), _stand_ins(eval_set_passes=True)
        cursor = dg.evaluate_automation_conditions(defs=passing, instance=instance).cursor  # the first tick
        instance.add_dynamic_partitions("base_models", ["base-1"])  # a new base model (as base_model adds it)
        assert not dg.materialize(
            failing[:2], instance=instance, raise_on_error=False
        ).success  # check failed
        result = dg.evaluate_automation_conditions(defs=failing, instance=instance, cursor=cursor)
        assert _requested(result) == set()

        assert dg.materialize(passing[:2], instance=instance).success
        result = dg.evaluate_automation_conditions(defs=passing, instance=instance, cursor=result.cursor)
        assert _requested(result) == {EVAL}
