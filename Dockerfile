# One image for the whole deployment: the Dagster webserver, the daemon and the nexa_dagster code server run as
# separate containers of it (docker-compose.yaml). Multi-stage: compilers and pip caches stay in the build stage.
#
#   docker build -t nexa-dagster .                                   # CPU torch
#   docker build -t nexa-dagster:gpu --build-arg EXTRAS=gpu,k8s --build-arg CONSTRAINTS=/dev/null .
#                                            # GPU hosts (vLLM: its torch, not the lock's); a CUDA base for real work
#   docker run -p 127.0.0.1:3000:3000 -v nexa-data:/app/data nexa-dagster  # single container: dagster dev, SQLite;
#       published on the host's loopback only: Dagster has no login (docs/security.md; compose puts a proxy in front)
#   docker compose up --build                                        # Postgres + code server + webserver (behind
#                                                                    # the `ui` proxy) + daemon + serving (:8000/v1)

# ---- build: a virtual environment with the project installed (editable, so configs/ resolve under /app) ----
FROM python:3.11-slim AS build
ARG EXTRAS=k8s
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# constraints.txt: the versions `make install` installs (`make lock` writes it), so an image built next month has
# what the suite passed on (torch's own index serves few versions of torch's dependencies: the second install moves
# them to the lock's from PyPI). vLLM (the gpu extra) pins its own torch and transformers: CONSTRAINTS=/dev/null
ARG CONSTRAINTS=constraints.txt
COPY pyproject.toml README.md constraints.txt ./
COPY nexa_dagster ./nexa_dagster
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && /opt/venv/bin/pip install --no-cache-dir -c ${CONSTRAINTS} -e ".[${EXTRAS}]"

# ---- runtime ----
FROM python:3.11-slim
# g++: DeepSpeed compiles its CPU communication op on first use; munge/slurm clients are added by GPU-cluster images.
# haproxy: routes the serving service's endpoint to the blue or green engine (`nexa-dagster serve`).
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ haproxy \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 nexa
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    DAGSTER_HOME=/app/.dagster_home \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    DS_ACCELERATOR=cpu
WORKDIR /app
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
COPY configs ./configs
COPY sample_data ./sample_data
COPY workspace.yaml dagster.yaml ./
# two instance configs: embedded SQLite (single container) and production (Postgres; compose sets DAGSTER_HOME)
RUN mkdir -p .dagster_home .dagster_home_production data results \
    && cp dagster.yaml .dagster_home/dagster.yaml \
    && cp configs/dagster/production.yaml .dagster_home_production/dagster.yaml \
    && chown -R nexa:nexa /app
USER 1000

EXPOSE 3000 4000 8000
# every container's first process: `nexa-dagster exec` puts the database's password (the file DAGSTER_PG_PASSWORD_FILE
# names, a compose secret) into DAGSTER_PG_URL when that variable is set, then becomes the command (docs/security.md)
ENTRYPOINT ["python", "-m", "nexa_dagster.cli", "exec"]
CMD ["dagster", "dev", "-w", "workspace.yaml", "-h", "0.0.0.0", "-p", "3000"]
