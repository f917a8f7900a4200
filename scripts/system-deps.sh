#!/usr/bin/env bash
# Debian packages the service tests need: headless Chromium (the Recovery page test),
# PostgreSQL (`RELAY_METADATA_DB=postgres`) and, only when named, Slurm 22.05 + MUNGE (the
# namespace-host test bed of `make test-cluster`). Installs only what is missing; needs root.
# Arguments name a subset: `system-deps.sh chromium` (what tests/security's browser test needs),
# `system-deps.sh slurm` (slurmctld, slurmd, slurm-client, munge; without recommends).
set -euo pipefail
[ $# -gt 0 ] || set -- chromium postgresql
missing=()
for name in "$@"; do
    case "$name" in
        chromium) command -v chromium >/dev/null 2>&1 || missing+=(chromium) ;;
        postgresql) compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql) ;;
        slurm) for tool in slurmctld slurmd srun munged; do
                   command -v "$tool" >/dev/null 2>&1 || { missing+=(slurmctld slurmd slurm-client munge); break; }
               done ;;
        *) echo "system-deps: expected chromium, postgresql or slurm; found '$name'." >&2; exit 2 ;;
    esac
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "system-deps: expected root to apt-get install ${missing[*]}; found uid $(id -u)." \
         "Install them yourself: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
fi
echo "system-deps: installing ${missing[*]} (Debian packages)..."
apt-get update -qq
# Slurm's recommends pull in a mail server and more; the test bed needs none of them.
[[ " ${missing[*]} " == *" slurmd "* ]] && recommends=--no-install-recommends || recommends=
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $recommends "${missing[@]}" >/dev/null
