# Sourced (by .ci/run and scripts/clean_clone_times.py): every cache the project, or what it runs, keeps outside the
# clone, pointed at one new empty folder, `$caches`, which the caller removes. A clean clone must also be a clean
# start: nothing built by earlier work on the machine (a tiny model, a model fingerprint, DeepSpeed's compiled ops,
# a Hugging Face download, pip's wheels) may make the suite pass or `make run` look faster than a newcomer's.
caches=$(mktemp -d "${TMPDIR:-/tmp}/nexa-ci-caches.XXXXXX")
export XDG_CACHE_HOME="$caches/xdg" NEXA_CACHE_DIR="$caches/nexa" NEXA_MODEL_CACHE="$caches/nexa-models" \
       HF_HOME="$caches/hf" TORCH_EXTENSIONS_DIR="$caches/torch_extensions" MPLCONFIGDIR="$caches/matplotlib"
