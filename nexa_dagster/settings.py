"""Every environment variable nexa-dagster reads or sets, in one place: its name, its default and what it changes.

Nothing else in the package touches ``os.environ`` (the test-only fault hooks in ``core/common/faults.py`` aside).
Values are read when asked for, never cached at import, so a launcher or a test that sets a variable sees it take
effect. Most variables are deployment settings (where data lives, which backend serves the teacher); what a person
changes per run is run or resource config, shown in the Launchpad. ``docs/configuration.md`` lists the table below;
``tests/unit/test_settings.py`` checks that it does, and that no other module reads the environment.

A leaf module (the standard library only): the Dagster-free ``core`` may import it.
"""

from __future__ import annotations

import os
import re
import tempfile
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    """One environment variable: ``get()`` is its value, or ``default`` when it is unset or empty."""

    name: str
    default: str
    effect: str
    group: str = "deployment"

    def get(self) -> str:
        return os.environ.get(self.name) or self.default

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))


def _var(name: str, default: str, effect: str, group: str = "deployment") -> Variable:
    variable = Variable(name, default, effect, group)
    VARIABLES.append(variable)
    return variable


VARIABLES: list[Variable] = []

# -- where things live ------------------------------------------------------------------------------------------
DATA_ROOT = _var(
    "NEXA_DATA_ROOT", "", "the data root (default: pipeline.yaml's data_root); any fsspec URL for tables"
)
LANDING_ROOT = _var(
    "NEXA_LANDING_ROOT",
    "",
    "where days land, <root>/<YYYY-MM-DD>/ (default: pipeline.yaml's ingest.landing_root)",
)
RESULTS_ROOT = _var("NEXA_RESULTS_ROOT", "results", "reports, the leaderboard, deployment manifests")
CONFIG_DIR = _var("NEXA_CONFIG_DIR", "", "the configuration folder (default: configs/ of the repository)")
MLFLOW_TRACKING_URI = _var(
    "MLFLOW_TRACKING_URI", "", "an MLflow server instead of the SQLite store in the data root"
)
CACHE_DIR = _var(
    "NEXA_CACHE_DIR",
    "",
    "this machine's cache of model fingerprints, file facts and code versions (default: "
    "$XDG_CACHE_HOME/nexa-dagster, else ~/.cache/nexa-dagster)",
)
MODEL_CACHE = _var(
    "NEXA_MODEL_CACHE",
    "",
    "where a tiny model the repository does not ship is built (default: <cache>/models)",
)
VLLM_ENV = _var(
    "NEXA_VLLM_ENV",
    "",
    "the virtual environment vLLM runs from (`make vllm` installs it; default: <cache>/vllm-<release>-<cpu|cuda>)",
)
XDG_CACHE_HOME = _var("XDG_CACHE_HOME", "", "the base of the default caches (freedesktop convention)")

# -- what runs and where ----------------------------------------------------------------------------------------
SCALE = _var("NEXA_SCALE", "tiny", "the default of the scale_preset resource (configs/scales/<name>.yaml)")
PARTITIONS_START = _var(
    "NEXA_PARTITIONS_START",
    "2026-11-01",
    "the first daily partition (read when the code location is imported)",
)
CLUSTER_BACKEND = _var(
    "NEXA_CLUSTER_BACKEND", "", "over pipeline.yaml's gpu_cluster.backend: local | slurm | kubernetes"
)
ACCELERATOR = _var("NEXA_ACCELERATOR", "", "over pipeline.yaml's gpu_cluster.accelerator: cpu | cuda")
SERVING_CONTROL_URL = _var(
    "NEXA_SERVING_CONTROL_URL", "", "the serving service's control API when it runs elsewhere (containers)"
)
SERVING_URL = _var("NEXA_SERVING_URL", "", "that service's OpenAI-compatible endpoint")
AUTOMATION = _var(
    "NEXA_AUTOMATION",
    "on",
    "off: the schedule and sensors start stopped on an instance that holds no on/off state for them "
    "(`make ui AUTOMATION=off`)",
)
SERVING_API_KEY_FILE = _var(
    "NEXA_SERVING_API_KEY_FILE",
    "",
    "a file (a Docker or Kubernetes secret, mode 600) holding the key or keys, one a line, that clients send to the "
    "serving endpoint (`Authorization: Bearer`); each at least 128 bits; required off loopback; re-read on SIGHUP",
)
SERVING_API_KEY = _var(
    "NEXA_SERVING_API_KEY",
    "",
    "refused: a key given as a value is inherited by every child process; use NEXA_SERVING_API_KEY_FILE",
)
SERVING_CONTROL_TOKEN_FILE = _var(
    "NEXA_SERVING_CONTROL_TOKEN_FILE",
    "",
    "a file holding the token of the serving service's control API, held by the service and the process that "
    "runs model_deployment (default on loopback: a fresh one in <data root>/serving/control-token, mode 600)",
)
SERVING_CONTROL_TOKEN = _var(
    "NEXA_SERVING_CONTROL_TOKEN",
    "",
    "refused: a token given as a value is inherited by every child process; use NEXA_SERVING_CONTROL_TOKEN_FILE",
)
UI_USER = _var(
    "NEXA_UI_USER", "nexa", "the user name the Dagster UI's proxy asks for (`nexa-dagster ui-proxy`)"
)
UI_PASSWORD_FILE = _var(
    "NEXA_UI_PASSWORD_FILE",
    "",
    "a file holding the password of the Dagster UI's proxy (a Docker secret; at least 128 bits)",
)
UI_PASSWORD = _var(
    "NEXA_UI_PASSWORD", "", "refused: a password given as a value is inherited; use NEXA_UI_PASSWORD_FILE"
)
SERVING_CHECKPOINT_ROOTS = _var(
    "NEXA_SERVING_CHECKPOINT_ROOTS",
    "",
    "more folders (separated by `:`) the serving service may load checkpoints from, beside "
    "<data root>/checkpoints",
)


def llm_variable(role: str, field: str) -> Variable:
    """``NEXA_<ROLE>_<FIELD>``: BACKEND, MODEL, URL (over pipeline.yaml's ``<role>_llm``) or API_KEY."""
    return next(v for v in VARIABLES if v.name == f"NEXA_{role.upper()}_{field}")


for _role in ("teacher", "judge", "policy"):
    _var(f"NEXA_{_role.upper()}_BACKEND", "", f"the {_role}'s backend: local | managed | openai", "llm")
    _var(
        f"NEXA_{_role.upper()}_MODEL", "", f"the {_role}'s local model directory or served model name", "llm"
    )
    _var(f"NEXA_{_role.upper()}_URL", "", f"the {_role}'s OpenAI-compatible base URL (openai backend)", "llm")
    _var(
        f"NEXA_{_role.upper()}_API_KEY",
        "",
        f"the {_role}'s key, read through dagster.EnvVar by the openai "
        "backend: never in a file, log or metadata",
        "llm",
    )

# -- libraries and child processes ------------------------------------------------------------------------------
DAGSTER_HOME = _var("DAGSTER_HOME", "", "the Dagster instance (make sets .dagster_home/)", "process")
HF_HUB_OFFLINE = _var(
    "HF_HUB_OFFLINE",
    "1",
    "never reach a model hub (set for servers and workers the project starts)",
    "process",
)
HF_DATASETS_OFFLINE = _var(
    "HF_DATASETS_OFFLINE", "1", "never reach the hub for a dataset (the benchmark worker)", "process"
)
HF_HUB_CACHE = _var(
    "HF_HUB_CACHE", "", "the hub cache `transformers serve` scans (default: beside its log)", "process"
)
OMP_WAIT_POLICY = _var(
    "OMP_WAIT_POLICY",
    "PASSIVE",
    "how idle OpenMP threads wait: written for every process the project starts by the thread policy (set "
    "NEXA_OMP_WAIT_POLICY, not this)",
    "process",
)
OMP_NUM_THREADS = _var(
    "OMP_NUM_THREADS",
    "",
    "OpenMP's threads (torch's intra-op threads): written for every process the project starts by the thread "
    "policy (set NEXA_THREADS, not this)",
    "process",
)
MKL_NUM_THREADS = _var(
    "MKL_NUM_THREADS", "", "MKL's threads: written by the thread policy, as OMP_NUM_THREADS", "process"
)
OPENBLAS_NUM_THREADS = _var(
    "OPENBLAS_NUM_THREADS",
    "",
    "numpy's OpenBLAS threads: written by the thread policy, as OMP_NUM_THREADS",
    "process",
)
THREADS = _var(
    "NEXA_THREADS",
    "",
    "torch's intra-op (OpenMP) threads per process: a number for every kind, and/or `kind=N` pairs separated by "
    "commas (kinds: step, training, evaluation, engine, shards; `4,engine=2`); default: the cores this process "
    "may use over the processes computing side by side (docs/configuration.md, Threads)",
    "process",
)
WAIT_POLICY = _var(
    "NEXA_OMP_WAIT_POLICY",
    "PASSIVE",
    "how idle OpenMP threads wait, for every kind and/or `kind=POLICY` pairs: PASSIVE (they sleep) or ACTIVE "
    "(they spin: faster only on cores no other process wants)",
    "process",
)
SIDE_BY_SIDE = _var(
    "NEXA_SIDE_BY_SIDE",
    "",
    "how many processes compute at once on this machine's cores, each given its share (default 1; the test "
    "suite's workers set their number)",
    "process",
)
XDIST_WORKER_COUNT = _var(
    "PYTEST_XDIST_WORKER_COUNT",
    "",
    "set by pytest-xdist in each test worker: the workers side by side (tests/conftest.py's NEXA_SIDE_BY_SIDE)",
    "process",
)
VLLM_CPU_KVCACHE_SPACE = _var(
    "VLLM_CPU_KVCACHE_SPACE",
    "1",
    "the KV cache, in GiB, of a vLLM engine on a CPU host (set for the engines the project starts)",
    "process",
)
DS_ACCELERATOR = _var(
    "DS_ACCELERATOR", "cpu", "DeepSpeed's accelerator; the training worker sets it from its job", "process"
)

# -- the worker protocol (set by the GPU-cluster resource and torchrun, read by the workers) ---------------------
LAUNCHER_PID = _var("NEXA_LAUNCHER_PID", "0", "the Dagster step process a local worker exits with", "worker")
WORKER_ECHO = _var("NEXA_WORKER_ECHO", "1", "0: a worker's progress goes to Dagster Pipes only", "worker")
PIPES_CONTEXT = _var(
    "DAGSTER_PIPES_CONTEXT", "", "set by Dagster Pipes: the worker reports to the run", "worker"
)
RANK = _var("RANK", "0", "torch.distributed rank (torchrun sets it)", "worker")
LOCAL_RANK = _var("LOCAL_RANK", "0", "the rank on this node", "worker")
LOCAL_WORLD_SIZE = _var("LOCAL_WORLD_SIZE", "1", "ranks on this node (torchrun sets it)", "worker")
WORLD_SIZE = _var("WORLD_SIZE", "1", "ranks in all", "worker")
MASTER_ADDR = _var("MASTER_ADDR", "127.0.0.1", "the rendezvous host", "worker")
MASTER_PORT = _var("MASTER_PORT", "", "the rendezvous port (a free one for a single process)", "worker")
SLURM_ARRAY_TASK_ID = _var(
    "SLURM_ARRAY_TASK_ID", "", "a packaging shard's index in a Slurm job array", "worker"
)
JOB_COMPLETION_INDEX = _var("JOB_COMPLETION_INDEX", "", "its index in a Kubernetes indexed Job", "worker")


# the Dagster instance's database, its password inside (configs/dagster/production.yaml reads it): the Dagster
# processes and the runs they start need it, no worker, engine or proxy does
PG_URL = _var(
    "DAGSTER_PG_URL",
    "",
    "the Dagster instance's PostgreSQL URL, password included (configs/dagster/production.yaml); never given "
    "to a child the project starts",
    "process",
)
PG_PASSWORD_FILE = _var(
    "DAGSTER_PG_PASSWORD_FILE",
    "",
    "a file holding the database's password (a Docker or Kubernetes secret): `nexa-dagster exec <program>` puts it "
    "into DAGSTER_PG_URL (given without one) for the Dagster process it becomes",
    "process",
)
LLM_API_KEY_FILES = tuple(
    _var(
        f"NEXA_{role.upper()}_API_KEY_FILE",
        "",
        f"a file holding the {role}'s key (a Docker or Kubernetes secret), instead of NEXA_{role.upper()}_API_KEY",
        "llm",
    )
    for role in ("teacher", "judge", "policy")
)

# secrets and where they are: read by the process that needs them (the serving service, the UI proxy, the Dagster
# step whose openai backend reads NEXA_<ROLE>_API_KEY through dagster.EnvVar), never handed to a child (an engine,
# HAProxy, a worker's probe): a process's environment is readable in /proc/<pid>/environ by its user, and outlives
# the read
SECRET_VARIABLES = (
    SERVING_API_KEY,
    SERVING_API_KEY_FILE,
    SERVING_CONTROL_TOKEN,
    SERVING_CONTROL_TOKEN_FILE,
    UI_PASSWORD,
    UI_PASSWORD_FILE,
    *(llm_variable(role, "API_KEY") for role in ("teacher", "judge", "policy")),
    *LLM_API_KEY_FILES,
    PG_URL,
    PG_PASSWORD_FILE,
)

# What a child may inherit beside the project's own variables (VARIABLES less SECRET_VARIABLES): an allow-list, so
# a secret the launching process holds under a name no one foresaw (a cloud key, a database URL, a CI token) stays
# there. Each entry is what a worker, an engine, HAProxy, pip or sbatch needs: the system's (PATH, HOME, locale,
# temporary folder, proxies and CA bundles for pip), the interpreter's (PYTHON*, VIRTUAL_ENV), torch's, DeepSpeed's
# and the accelerators' (MASTER_ADDR and the ranks are the project's own variables; torchrun sets TORCHELASTIC_*),
# the Hugging Face libraries', Slurm's client and job variables (SLURM_CONF: which cluster sbatch reaches), Dagster
# Pipes' bootstrap, the fault tests' hooks and coverage's subprocess hooks.
INHERITED_NAMES = frozenset(
    {
        *("PATH", "HOME", "USER", "LOGNAME", "SHELL", "HOSTNAME", "TERM", "TZ", "LANG", "LANGUAGE"),
        *("TMPDIR", "TMP", "TEMP", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH"),
        *(
            "CC",
            "CXX",
            "CUDA_HOME",
            "CUDA_PATH",
            "ROCM_PATH",
            "ATEN_CPU_CAPABILITY",
            "TOKENIZERS_PARALLELISM",
        ),
        *("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"),
        *("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"),
    }
)
INHERITED_PREFIXES = (
    *("LC_", "XDG_", "PYTHON", "CUDA_", "NVIDIA_", "ROCR_", "HIP_", "NCCL_", "GLOO_", "TORCH", "PYTORCH_"),
    *("TRITON_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "DS_", "DEEPSPEED_", "HF_", "TRANSFORMERS_", "VLLM_"),
    *("SLURM_", "SBATCH_", "DAGSTER_PIPES_", "NEXA_FAULT_", "COV_CORE_", "COVERAGE_"),
)
# pip's own configuration (an index URL may carry the index's token): for a pip child alone (``environ(PIP)``)
PIP = ("PIP_",)
# uv's (core/common/installer.py installs with it; its cache follows XDG_CACHE_HOME): for a uv child alone
UV = ("UV_",)
# a name that says it holds a secret is left out even under an allowed prefix (HF_TOKEN, VLLM_API_KEY, ...);
# TOKENIZERS_PARALLELISM is not one (the word must stand between underscores)
SECRET_NAME = re.compile(
    r"(?:^|_)(?:TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|API_?KEY|ACCESS_KEY|PRIVATE_KEY)(?:_|$)"
)


def inherited(name: str, extra_prefixes: tuple[str, ...] = ()) -> bool:
    """Whether a child may get the variable ``name`` (see ``INHERITED_NAMES``)."""
    if name in _SECRET_NAMES or SECRET_NAME.search(name.upper()):
        return False
    return (
        name in INHERITED_NAMES
        or name in _OWN_NAMES
        or name.startswith(INHERITED_PREFIXES)
        or name.startswith(extra_prefixes)
    )


def environ(extra_prefixes: tuple[str, ...] = ()) -> Mapping[str, str]:
    """The environment for a child process (a server, a worker, HAProxy, pip, sbatch, a test's subprocess): the
    variables ``inherited`` allows, so never a secret (``SECRET_VARIABLES``: the serving service's, the UI's, the
    LLM endpoints' keys, the database URL) nor any variable the project does not know a child needs.
    ``extra_prefixes``: more a particular child needs (``PIP`` for pip)."""
    return {k: v for k, v in os.environ.items() if inherited(k, extra_prefixes)}


# -- threads: how many each process computes with, and how its idle ones wait ------------------------------------
# torch starts one OpenMP thread per core, and libgomp's idle threads spin. Processes that share cores (the suite's
# two workers and every torch process each starts, a step beside another, an engine beside a worker) then spin
# against each other: transformers' generate ran 9-28x slower than with one thread or with sleeping threads on the
# loaded 2-core machine (issue 49; docs/measurements.md, "Threads"; bench/threads.py). So every process the project
# starts gets its kind's share of the cores and threads that sleep when idle: ``child_environ(kind)`` for a child,
# ``core/common/threads.use`` inside a process. A lab overrides it with NEXA_THREADS and NEXA_OMP_WAIT_POLICY.
WAIT_POLICIES = ("PASSIVE", "ACTIVE")


@dataclass(frozen=True)
class ProcessKind:
    """A kind of process the project starts: which processes it is, and why its share is what it is."""

    name: str
    processes: str
    share: str  # its threads, by default
    why: str


PROCESS_KINDS = {
    kind.name: kind
    for kind in (
        ProcessKind(
            "step",
            "Dagster's code server, run and step processes, `make run`'s process, a test worker",
            "cores / side by side",
            "it computes (the local teacher and judge, scoring, tables) while its workers and engines wait, and "
            "waits while they compute; a small model takes one thread of it (core/llm/local.py)",
        ),
        ProcessKind(
            "training",
            "a training worker: one per rank (DeepSpeed under torchrun), GRPO's rollouts inside it",
            "cores / (ranks on the node x side by side)",
            "a node's ranks compute at once (LOCAL_WORLD_SIZE; the worker sets it again on its own node, which "
            "may not be its launcher's)",
        ),
        ProcessKind(
            "evaluation",
            "an evaluation worker: the eval set's scores, the benchmarks",
            "cores / side by side",
            "one process, while the step that started it waits",
        ),
        ProcessKind(
            "engine",
            "`transformers serve`: the managed teacher and judge, the smoke request's engine, the serving "
            "service's engines",
            "cores / side by side",
            "it computes while its client waits; an engine loading beside one that serves gets the serving "
            "service's loading_threads instead",
        ),
        ProcessKind(
            "shards",
            "a packaging shard pool's worker process",
            "cores / (pool workers x side by side)",
            "the pool's workers run at once",
        ),
    )
}


@dataclass(frozen=True)
class ThreadPolicy:
    """What one process computes with: ``threads`` OpenMP/MKL/OpenBLAS threads (torch's intra-op threads) and
    the OpenMP wait policy of its idle threads."""

    kind: str
    threads: int
    wait_policy: str

    def variables(self) -> dict[Variable, str]:
        """The variables that carry it: read by the libraries when they load (libgomp's wait policy only then)."""
        n = str(self.threads)
        counts = (OMP_NUM_THREADS, MKL_NUM_THREADS, OPENBLAS_NUM_THREADS)
        return {**{v: n for v in counts}, OMP_WAIT_POLICY: self.wait_policy}

    def env(self) -> dict[str, str]:
        return {v.name: value for v, value in self.variables().items()}


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a taskset or a Slurm allocation), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform (macOS)
        return os.cpu_count() or 1


def side_by_side() -> int:
    """How many processes compute at once on these cores: NEXA_SIDE_BY_SIDE, else the test suite's xdist workers
    (inherited by every process a test starts), else 1."""
    for variable in (SIDE_BY_SIDE, XDIST_WORKER_COUNT):
        if variable.is_set():
            return _positive(variable.name, variable.get())
    return 1


def thread_policy(kind: str, alongside: int = 1, cores: int | None = None) -> ThreadPolicy:
    """The policy of a ``kind`` process (``PROCESS_KINDS``) started with ``alongside - 1`` others of its launch
    (ranks, pool workers): ``NEXA_THREADS``'s number for it if a lab set one, else ``cores`` (default: this
    process's) over everything computing at once, at least 1; ``NEXA_OMP_WAIT_POLICY``'s wait policy."""
    if kind not in PROCESS_KINDS:
        raise ValueError(f"unknown process kind {kind!r}: one of {', '.join(PROCESS_KINDS)}")
    chosen = _per_kind(THREADS, kind)
    if chosen:
        threads = _positive(THREADS.name, chosen)
    else:
        threads = max(1, (cores or usable_cores()) // (max(1, alongside) * side_by_side()))
    wait = _per_kind(WAIT_POLICY, kind).upper() or WAIT_POLICY.default
    if wait not in WAIT_POLICIES:
        raise ValueError(f"{WAIT_POLICY.name}={WAIT_POLICY.get()!r}: a wait policy is one of {WAIT_POLICIES}")
    return ThreadPolicy(kind, threads, wait)


def child_environ(kind: str, alongside: int = 1) -> dict[str, str]:
    """``environ()`` for a ``kind`` child, with its thread policy written over the thread variables this process
    runs with (a step's share is not a training rank's)."""
    return {**environ(), **thread_policy(kind, alongside).env()}


def _per_kind(variable: Variable, kind: str) -> str:
    """``variable``'s value for ``kind``: its ``kind=VALUE`` entry, else its bare ``VALUE``, else ``""``."""
    bare = own = ""
    for entry in filter(None, (e.strip() for e in variable.get().split(","))):
        name, sep, value = (part.strip() for part in entry.rpartition("="))
        if sep and name not in PROCESS_KINDS:
            raise ValueError(
                f"{variable.name}={variable.get()!r}: unknown process kind {name!r} (one of "
                f"{', '.join(PROCESS_KINDS)})"
            )
        if not sep:
            bare = value
        elif name == kind:
            own = value
    return own or bare


def _positive(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{name}={value!r}: a whole number of at least 1")
    return number


class SecretUnreadable(ValueError):
    """A ``*_FILE`` variable names a file that cannot be read, or an empty one: the message names both."""


def secret_from_file(variable: Variable) -> str:
    """The secret in the file ``variable`` (a ``*_FILE`` variable) names; ``""`` when the variable is unset."""
    return read_secret_file(variable.name, variable.get()) if variable.is_set() else ""


def read_secret_file(name: str, path: str) -> str:
    """The secret in ``path`` (given by the variable ``name``), surrounding whitespace stripped. A file that cannot
    be read or holds nothing is an error naming the variable and the path: a secret silently empty would be sent
    as no key at all."""
    try:
        value = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise SecretUnreadable(f"{name}={path}: the file cannot be read ({e})") from e
    if not value:
        raise SecretUnreadable(f"{name}={path}: the file is empty")
    return value


def export(variable: Variable, value: str) -> None:
    """Set a variable for this process and the libraries and children it starts."""
    os.environ[variable.name] = value


def whole_environ() -> dict[str, str]:
    """Every variable of this process, secrets included: for the warm Python (``core/cluster/warm_python.py``) to
    tell its launcher what its imports set, never for a child's environment (that is ``environ()``)."""
    return dict(os.environ)


def replace_environ(env: Mapping[str, str]) -> None:
    """This process's whole environment becomes ``env``: a worker forked from the warm Python takes the one its
    launcher built for it, as a fresh process would get it."""
    os.environ.clear()
    os.environ.update(env)


def export_default(variable: Variable, value: str | None = None) -> None:
    """Set a variable unless it is set already (``value`` defaults to the variable's own default)."""
    os.environ.setdefault(variable.name, variable.default if value is None else value)


def cache_root() -> Path:
    """This machine's cache folder: facts about this machine's files and models, never data."""
    if CACHE_DIR.is_set():
        return Path(CACHE_DIR.get())
    base = Path(XDG_CACHE_HOME.get()) if XDG_CACHE_HOME.is_set() else Path.home() / ".cache"
    return base / "nexa-dagster"


def model_cache_root() -> Path:
    """Where a tiny model the repository does not ship is built (the temporary directory without a writable home)."""
    if MODEL_CACHE.is_set():
        return Path(MODEL_CACHE.get())
    base = cache_root() / "models"
    try:
        base.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable home (a locked-down container)
        base = Path(tempfile.gettempdir()) / "nexa-dagster-models"
    return base


def pg_url() -> str:
    """``DAGSTER_PG_URL`` with the password of ``DAGSTER_PG_PASSWORD_FILE``'s file put in (URL-quoted), or as it is
    when that variable is unset. A URL that holds a password already, or none, beside the file is an error: which
    one counts would be a guess."""
    url = PG_URL.get()
    if not PG_PASSWORD_FILE.is_set():
        return url
    password = secret_from_file(PG_PASSWORD_FILE)
    parts = urllib.parse.urlsplit(url)
    if not parts.username or parts.password is not None:
        raise SecretUnreadable(
            f"{PG_PASSWORD_FILE.name} is set: {PG_URL.name} must name a user and no password "
            "(postgresql+psycopg2://USER@HOST:PORT/DB)"
        )
    netloc = f"{parts.username}:{urllib.parse.quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


_SECRET_NAMES = frozenset(v.name for v in SECRET_VARIABLES)
_OWN_NAMES = frozenset(v.name for v in VARIABLES) - _SECRET_NAMES


def thread_policy_table() -> str:
    """The table of process kinds docs/configuration.md carries (checked by a test)."""
    lines = [
        "| kind | processes | threads (default, at least 1) | idle threads (default) | why |",
        "|---|---|---|---|---|",
    ]
    for kind in PROCESS_KINDS.values():
        wait = f"{WAIT_POLICY.default}: they sleep"
        lines.append(f"| `{kind.name}` | {kind.processes} | {kind.share} | {wait} | {kind.why} |")
    return "\n".join(lines)


def markdown_table() -> str:
    """The table docs/configuration.md carries (checked by a test)."""
    lines = ["| variable | default | what it changes |", "|---|---|---|"]
    for v in VARIABLES:
        effect = v.effect.replace("|", "\\|")  # "local | slurm" would split the cell
        lines.append(f"| `{v.name}` | {f'`{v.default}`' if v.default else ''} | {effect} |")
    return "\n".join(lines)
