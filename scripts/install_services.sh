#!/usr/bin/env bash
# Install what the test suite starts for itself (PostgreSQL, Slurm with munge, headless Chromium, HAProxy) from Debian's packages,
# where they are missing. Needs root (CI runs as root); does nothing for what is already installed.
set -euo pipefail
need=()
command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
command -v slurmctld >/dev/null 2>&1 || need+=(slurm-wlm)
command -v munged >/dev/null 2>&1 || need+=(munge)
command -v chromium >/dev/null 2>&1 || need+=(chromium)   # the UI test drives it headless (no browser download)
command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || need+=(haproxy)  # routes the serving endpoint
if [ ${#need[@]} -eq 0 ]; then
  echo "==> services already installed (postgresql, slurm-wlm, munge, chromium, haproxy)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "==> missing ${need[*]}: run as root, or: sudo apt-get install -y ${need[*]}" >&2
  exit 1
fi
echo "==> installing ${need[*]} (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
