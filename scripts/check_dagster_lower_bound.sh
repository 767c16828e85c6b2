#!/usr/bin/env bash
# The lowest Dagster release pyproject.toml allows (dagster>=1.13,<1.14: 1.13.0 and its 0.29.0 libraries), checked:
# the code location loads under it (`dagster definitions validate`) and the asset tests that read what the UI shows
# pass (code versions, production's events, columns, checks, automation, freshness, and the tests that use private
# Dagster modules). Not part of `make test` (it installs packages); run it after a Dagster bump of the range, from
# the repository root, after `make install`, or through bench/dagster_lower_bound.py (timed):
#
#   scripts/check_dagster_lower_bound.sh [VENV]      # default VENV: /tmp/nexa-dagster-lower
#
# The venv holds only the Dagster packages at the lower bound; every other package (torch, transformers, ...) comes
# from .venv through a .pth file placed after the venv's own site-packages, so the check takes a minute, not a
# fresh torch install. The last line is one JSON object.
set -euo pipefail

LOWER=1.13.0
LIBS=0.29.0
VENV=${1:-/tmp/nexa-dagster-lower}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MAIN_SITE=$("$ROOT/.venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

python3.11 -m venv --clear "$VENV"
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
  "dagster==$LOWER" "dagster-shared==$LOWER" "dagster-pipes==$LOWER" "dagster-graphql==$LOWER" \
  "dagster-webserver==$LOWER" "dagster-pandera==$LIBS" "dagster-postgres==$LIBS"
echo "$MAIN_SITE" > "$SITE/zz_nexa_main_venv.pth"  # after the venv's own packages: the lower bound wins
echo "$ROOT" > "$SITE/zz_nexa_source.pth"

cd "$ROOT"
VERSION=$("$VENV/bin/python" -c "import dagster; print(dagster.__version__)")
test "$VERSION" = "$LOWER" || { echo "dagster $VERSION imported, not $LOWER" >&2; exit 1; }
export DAGSTER_HOME=${DAGSTER_HOME:-$(mktemp -d)} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the dev tools the tests call by name (hadolint, helm, ...) are in .venv/bin, not in this venv
export PATH="$PATH:$ROOT/.venv/bin"
"$VENV/bin/python" -m dagster definitions validate -m nexa_dagster.definitions
# the asset tests, and every test that reaches into Dagster's private modules (pyproject.toml says which and why):
# those are what a patch release can break
TESTS=(
  tests/unit/assets/test_code_versions.py tests/unit/assets/test_production.py
  tests/unit/assets/test_columns.py tests/unit/assets/test_checks.py tests/unit/assets/test_pairs_check_decides.py
  tests/unit/assets/test_automation_waits_for_checks.py tests/unit/assets/test_freshness.py
  tests/unit/sensors/test_missed_retries.py tests/unit/deploy/test_deployment_files.py
  tests/unit/deploy/test_helm_values.py tests/unit/test_definitions.py
)
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -n 0 "${TESTS[@]}" | tee "$VENV/pytest.log"
PASSED=$(tail -1 "$VENV/pytest.log" | grep -o '[0-9]* passed' | cut -d' ' -f1)
echo "{\"dagster\": \"$VERSION\", \"validate\": \"ok\", \"test_files\": ${#TESTS[@]}, \"passed\": ${PASSED:-0}}"
