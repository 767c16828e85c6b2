# One image for the whole deployment: the Dagster webserver, the daemon (schedules, sensors, run queue) and the
# nexa_dagster code location. Run the webserver and the daemon as two containers of this image, sharing
# DAGSTER_HOME (use PostgreSQL storage in dagster.yaml for more than one host) and the data volume.
#
#   docker build -t nexa-dagster .
#   docker run -p 3000:3000 -v nexa-data:/app/data nexa-dagster                     # webserver + daemon
#   docker run -v nexa-data:/app/data nexa-dagster dagster-daemon run                # daemon alone
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    DAGSTER_HOME=/app/.dagster_home \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    DS_ACCELERATOR=cpu

RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ make && rm -rf /var/lib/apt/lists/*
WORKDIR /app

# CPU torch from PyTorch's CPU index keeps the image small; GPU hosts use the `gpu` extra and a CUDA base image.
COPY pyproject.toml README.md ./
COPY nexa_dagster ./nexa_dagster
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir -e .

COPY configs ./configs
COPY sample_data ./sample_data
COPY workspace.yaml dagster.yaml ./
RUN mkdir -p "$DAGSTER_HOME" && cp dagster.yaml "$DAGSTER_HOME/dagster.yaml"

EXPOSE 3000
# `dagster dev` runs webserver + daemon + code server in one container; split them for production.
CMD ["dagster", "dev", "-w", "workspace.yaml", "-h", "0.0.0.0", "-p", "3000"]
