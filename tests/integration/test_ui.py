"""The UI as a person uses it: `dagster dev` on the loopback, driven by headless Chromium (Debian's package).

One session: shows a code change and a promotion on the asset pages, opens the asset graph of every group and
checks each stage asset is drawn, launches a partition of the daily pipeline from the Launchpad, waits for the run
to succeed, keeps a screenshot of the run that is not blank, and shows a configuration edit as unsynced.
"""

import contextlib
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import dagster as dg
import pytest
from support.pipeline_runs import configs_with
from support.sandbox import make_sandbox, materialize_command, sandbox_env
from support.services import free_port, missing

from nexa_dagster.core.common.config import REPO_ROOT
from nexa_dagster.core.common.processes import stop_process_group

# the Dagster UI driven by a real browser: left out of make test-fast
pytestmark = pytest.mark.slow

DAY = "2026-11-20"
LOCATION = "nexa_dagster.definitions"
GROUPS = {
    "ingest": ["raw_documents"],
    "distillation": ["teacher_samples"],
    "filtering": ["filtered_samples", "rejected_samples"],
    "packaging": ["sft_dataset"],
    "training": ["moe_checkpoint"],
    "evaluation": ["eval_report", "leaderboard"],
    "serving": ["model_deployment"],
}


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        missing("Chromium", "apt-get install chromium")
    return found


@contextlib.contextmanager
def dagster_dev(env: dict[str, str], tmp_path: Path, workspace: Path) -> Iterator[str]:
    """``dagster dev`` of ``workspace`` on a free loopback port, until it answers; yields its base URL, then stops
    it (SIGTERM, then SIGKILL of whatever else its group keeps)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "dagster-dev.log", "wb") as log:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster"), "dev", "-w", str(workspace), "-h", "127.0.0.1"]
            + ["-p", str(port)],
            env=env,
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(base + "/server_info", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "dagster-dev.log"
                ).read_text(errors="replace")[-3000:]
                time.sleep(1)
        yield base
    finally:
        stop_process_group(server, grace_s=60)  # whatever else keeps it: SIGKILL, this test is about the UI


def shown_after_a_reload(
    page, open_page: Callable[[], None], text: str, exact: bool, timeout_s: float = 120
) -> None:  # noqa: ANN001
    """Open the page until it shows ``text``: a page opened while `dagster dev`'s code server is still coming back
    from a reload shows the old definitions and never updates by itself (seen once under load: the new code
    version did not show in 60 s on a page opened right after the reload's answer)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    deadline = time.monotonic() + timeout_s
    while True:
        open_page()
        try:
            page.get_by_text(text, exact=exact).first.wait_for(timeout=10_000)
            return
        except PlaywrightTimeout:
            assert time.monotonic() < deadline, f"{text!r} not shown {timeout_s:.0f} s after the reload"


def reload_location(base: str) -> None:
    """Reload the code location, as the UI's "Reload" button does."""
    reload = (
        b'{"query": "mutation { reloadRepositoryLocation(repositoryLocationName: \\"%s\\") { __typename } }"}'
    )
    request = urllib.request.Request(
        f"{base}/graphql", data=reload % LOCATION.encode(), headers={"Content-Type": "application/json"}
    )
    assert b"error" not in urllib.request.urlopen(request, timeout=120).read().lower()


def graph_and_a_launched_run(page, base: str, home: Path, tmp_path: Path) -> Path:  # noqa: ANN001
    """Every stage asset drawn in its group's graph; a partition of the daily job launched from the Launchpad
    succeeds; returns the screenshot of its run page."""
    for group, assets in GROUPS.items():
        page.goto(f"{base}/locations/{LOCATION}/asset-groups/{group}", wait_until="networkidle")
        for asset in assets:
            page.get_by_text(asset, exact=True).first.wait_for(timeout=60_000)
    page.screenshot(path=str(tmp_path / "graph.png"))

    # the Launchpad of the daily job: pick the day in its partition box, launch
    page.goto(f"{base}/locations/{LOCATION}/jobs/daily_data_job/playground", wait_until="networkidle")
    partition = page.get_by_placeholder("Partition")
    try:
        partition.click()
    except Exception:
        page.screenshot(path=str(tmp_path / "launch-failed.png"))
        raise
    partition.fill(DAY)
    page.get_by_role("menuitem", name=DAY).or_(page.get_by_text(DAY, exact=True)).last.click()
    page.get_by_text(f"partition: {DAY}").first.wait_for(timeout=30_000)
    page.get_by_role("button", name="Launch Run").click()
    try:
        page.wait_for_url("**/runs/**", timeout=60_000, wait_until="commit")  # client-side navigation
    except Exception:
        page.screenshot(path=str(tmp_path / "launch-failed.png"))
        raise
    run_id = page.url.rstrip("/").split("/")[-1]

    instance = dg.DagsterInstance.from_config(str(home))
    try:
        deadline = time.monotonic() + 600
        while (run := instance.get_run_by_id(run_id)) is None or not run.is_finished:
            assert time.monotonic() < deadline, "the run launched from the UI did not finish"
            time.sleep(2)
        errors = [
            str(e.dagster_event.event_specific_data)[:1500]
            for e in instance.all_logs(run_id)
            if e.dagster_event and e.dagster_event.is_failure
        ]
        assert run.status == dg.DagsterRunStatus.SUCCESS, errors
        assert run.tags["dagster/partition"] == DAY
        assert instance.get_materialized_partitions(dg.AssetKey("filtered_samples")) == {DAY}
    finally:
        instance.dispose()
    page.reload(wait_until="networkidle")
    page.get_by_text("Success").first.wait_for(timeout=60_000)
    shot = tmp_path / "run.png"
    page.screenshot(path=str(shot))
    return shot


def asset_pages(page, base: str, tmp_path: Path) -> None:  # noqa: ANN001
    """What the code location feeds the asset pages (docs/architecture.md): the run's check results and the column
    schema of raw_documents, and the freshness policy of eval_report."""
    page.goto(f"{base}/assets/raw_documents", wait_until="networkidle")
    for text in ("Columns", "doc_id", "n_chars"):
        page.get_by_text(text, exact=True).first.wait_for(timeout=60_000)
    page.screenshot(path=str(tmp_path / "asset.png"))
    page.goto(f"{base}/assets/raw_documents?view=checks", wait_until="networkidle")
    for text in ("raw_documents_are_new", "This is a blocking asset check.", "Passed"):
        page.get_by_text(text, exact=True).first.wait_for(timeout=60_000)
    page.screenshot(path=str(tmp_path / "checks.png"))
    page.goto(f"{base}/assets/eval_report", wait_until="networkidle")
    page.get_by_text("Freshness policy", exact=True).first.wait_for(timeout=60_000)
    page.get_by_text("Deadline: At 08:00 AM UTC").first.wait_for(timeout=60_000)  # pipeline.yaml: 2 + 6 h
    page.screenshot(path=str(tmp_path / "freshness.png"))


def stale_after_a_configuration_edit(
    page, base: str, env: dict[str, str], source: Path, configs: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    """pretrain_corpus materialized, then its configuration edited and the code location reloaded: its code
    version changed, and the asset page says it is unsynced. Materialized by the copy of the package the UI runs
    (``source`` the working directory, its training loop edited by then): a version from the installed package's
    sources would differ before any configuration edit."""
    corpus = subprocess.run(
        materialize_command("pretrain_corpus", None, "-d", str(source)),
        cwd=source,
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert corpus.returncode == 0, corpus.stderr[-3000:]
    page.goto(f"{base}/assets/pretrain_corpus", wait_until="networkidle")
    page.get_by_text("pretrain_corpus").first.wait_for(timeout=60_000)
    time.sleep(3)  # the page's status queries
    assert page.get_by_text("Unsynced", exact=False).count() == 0, "unsynced before any change"
    packaging = configs / "packaging.yaml"
    packaging.write_text(packaging.read_text().replace("rows_per_shard: 5000", "rows_per_shard: 4000"))
    reload_location(base)
    shown_after_a_reload(
        page,
        lambda: page.goto(f"{base}/assets/pretrain_corpus", wait_until="networkidle"),
        "Unsynced",
        exact=False,
    )
    page.screenshot(path=str(tmp_path / "stale.png"))


def pairs_made_from_production(root: Path):  # noqa: ANN201
    """On the instance under ``root``: ckpt-a promoted, then preference_pairs of DAY materialized (its spec as the
    code location defines it, a stand-in body), recording ckpt-a as its input; returns ``promote(checkpoint_id,
    previous)``, a later promotion recorded as model_deployment records one."""
    from nexa_dagster.assets.production import (
        production_model_asset,
        report_production_change,
    )
    from nexa_dagster.core.evaluation.promotion import ProductionEntry
    from nexa_dagster.definitions import defs

    def promote(checkpoint_id: str, previous: str | None) -> None:
        entry = ProductionEntry(
            checkpoint_id=checkpoint_id, checkpoint_path=str(root / checkpoint_id), metric="eval_loss"
        )
        with dg.DagsterInstance.from_config(str(root / "home")) as instance:
            report_production_change(instance, entry, "promotion", previous)

    specs = {s.key.to_user_string(): s for s in defs.resolve_all_asset_specs()}

    def stand_in(name: str, **changes: object) -> dg.AssetsDefinition:
        @dg.multi_asset(specs=[specs[name].replace_attributes(**changes)], name=f"{name}_stand_in")
        def materialize() -> dg.MaterializeResult:
            return dg.MaterializeResult(asset_key=name)

        return materialize

    promote("ckpt-a", None)
    with dg.DagsterInstance.from_config(str(root / "home")) as instance:
        assets = [production_model_asset, stand_in("filtered_samples", deps=[]), stand_in("preference_pairs")]
        assert dg.materialize(assets, instance=instance, partition_key=DAY).success
    return promote


def show_code_version(page, base: str, asset: str) -> None:  # noqa: ANN001 (a playwright Page)
    """The asset's page with its "Compute details" open, where the UI shows the code version (the section
    remembers whether it was open: it is clicked only while the code version is hidden)."""
    page.goto(f"{base}/assets/{asset}", wait_until="networkidle")
    details, label = (
        page.get_by_text("Compute details", exact=True),
        page.get_by_text("Code version", exact=True),
    )
    details.first.wait_for(timeout=60_000)
    deadline = time.monotonic() + 60
    while not label.first.is_visible():
        assert time.monotonic() < deadline, f"no code version on {asset}'s page"
        details.first.click()
        time.sleep(2)


def a_code_change_shows(page, base: str, source: Path, configs: Path, tmp_path: Path) -> None:  # noqa: ANN001
    """After an edit of the training loop in the copy ``source`` and a reload, moe_checkpoint's page shows its new
    code version (both versions derived here from the copy and ``configs``, before and after the edit)."""
    from nexa_dagster.assets import versions
    from nexa_dagster.definitions import ASSET_MODULES, config_resources

    assets = [a for a in dg.load_assets_from_modules(ASSET_MODULES) if isinstance(a, dg.AssetsDefinition)]
    before = versions.code_versions(assets, config_resources(), source, configs)["moe_checkpoint"]
    show_code_version(page, base, "moe_checkpoint")
    page.get_by_text(before, exact=True).first.wait_for(timeout=60_000)
    loop = source / "nexa_dagster" / "core" / "training" / "loop.py"
    loop.write_text(loop.read_text().replace("floor: float = 0.1", "floor: float = 0.2", 1))
    after = versions.code_versions(assets, config_resources(), source, configs)["moe_checkpoint"]
    assert after != before
    reload_location(base)
    shown_after_a_reload(page, lambda: show_code_version(page, base, "moe_checkpoint"), after, exact=True)
    assert page.get_by_text(before, exact=True).count() == 0
    page.screenshot(path=str(tmp_path / "code-version.png"))


def a_promotion_unsyncs_the_pairs(page, base: str, promote, tmp_path: Path) -> None:  # noqa: ANN001
    """After a promotion, production_model's page shows the new checkpoint and preference_pairs (made from the old
    one) is unsynced."""
    from nexa_dagster.assets.production import PRODUCTION_MODEL

    partitions = (
        f"{base}/assets/preference_pairs?view=partitions&partition={DAY}"  # where a day's state shows
    )
    page.goto(partitions, wait_until="networkidle")
    page.get_by_text(DAY).first.wait_for(timeout=60_000)
    time.sleep(5)  # the page's status queries
    assert page.get_by_text("Unsynced", exact=False).count() == 0, "unsynced before the promotion"
    promote("ckpt-b", "ckpt-a")
    page.goto(f"{base}/assets/{PRODUCTION_MODEL}", wait_until="networkidle")
    page.get_by_text("ckpt-b", exact=False).first.wait_for(timeout=60_000)
    page.screenshot(path=str(tmp_path / "production.png"))
    page.goto(partitions, wait_until="networkidle")
    page.get_by_text("Unsynced", exact=False).first.wait_for(timeout=60_000)
    page.screenshot(path=str(tmp_path / "pairs-stale.png"))


def test_the_ui_shows_every_stage_launches_a_run_and_shows_what_changed(tmp_path: Path) -> None:
    """One `dagster dev` and one browser, as a person's session: the code location runs from a copy of the package
    (its own workspace file, which the test edits) and a copy of configs/ (an asset's code version follows its
    configuration file). In order, so that no part sees another's changes: a training-loop edit shows as
    moe_checkpoint's new code version; a promotion unsyncs the pairs made from the old production model (both
    events on the instance, as a deployment run and a pairs run record them); every stage is drawn and a daily run
    launched from the Launchpad succeeds; the asset pages show their schema, checks and freshness; a configuration
    edit marks pretrain_corpus unsynced. One session where there were two saves a start of `dagster dev` and of
    Chromium; the suite's runs show no CPU saved within their spread (docs/measurements.md, "The slowest tests,
    run by run")."""
    browser_path = chromium()
    from playwright.sync_api import sync_playwright

    from nexa_dagster.assets import versions

    # the project's instance settings, with the one-time "join the community" dialog off: it opens a few seconds
    # after the first page, at a moment no test can wait for, and its backdrop swallows every click under it
    make_sandbox(tmp_path, [DAY], extra_settings="nux:\n  enabled: false\n")
    configs = configs_with(tmp_path / "configs", {})
    source = tmp_path / "src"
    shutil.copytree(
        versions.SOURCE_ROOT / "nexa_dagster",
        source / "nexa_dagster",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    # the code location imports the copy (its working directory first on sys.path)
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(
        f"load_from:\n  - python_module:\n      module_name: {LOCATION}\n      working_directory: {source}\n"
    )
    # the schedule and sensors stopped, as `make ui AUTOMATION=off` starts them: no part here looks at them, and the
    # daemon would launch runs on the session's assets meanwhile (a training once the corpus lands, a preference run on
    # the stand-in pairs), work no page is checked for
    home = tmp_path / "home"
    env = sandbox_env(tmp_path, NEXA_CONFIG_DIR=str(configs), NEXA_AUTOMATION="off")
    promote = pairs_made_from_production(tmp_path)  # production ckpt-a, and pairs of DAY answered by it

    with dagster_dev(env, tmp_path, workspace) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        a_code_change_shows(page, base, source, configs, tmp_path)
        a_promotion_unsyncs_the_pairs(page, base, promote, tmp_path)
        shot = graph_and_a_launched_run(page, base, home, tmp_path)
        asset_pages(page, base, tmp_path)
        stale_after_a_configuration_edit(page, base, env, source, configs, tmp_path)
        browser.close()

    from PIL import Image, ImageStat

    image = Image.open(shot).convert("L")
    assert image.size == (1600, 1000)
    assert ImageStat.Stat(image).stddev[0] > 10, "the screenshot is blank"
    assert len(image.getcolors(maxcolors=1_000_000) or []) > 50, "the screenshot is nearly one colour"


@pytest.fixture(autouse=True)
def _keep_screenshots(tmp_path: Path, request: pytest.FixtureRequest):  # noqa: ANN202
    """Copy the screenshots under results/ui/ for a person to look at (the temp dir is cleaned up)."""
    yield
    out = REPO_ROOT / "results" / "ui"
    for name in (
        "graph.png",
        "run.png",
        "launch-failed.png",
        "asset.png",
        "checks.png",
        "code-version.png",
        "production.png",
        "pairs-stale.png",
        "freshness.png",
        "stale.png",
    ):
        if (tmp_path / name).exists():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy(tmp_path / name, out / name)
