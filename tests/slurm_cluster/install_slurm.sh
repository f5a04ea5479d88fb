#!/usr/bin/env bash
# install_slurm.sh - install what the local Slurm test cluster needs (Debian bookworm, root).
# Idempotent: asks apt only for packages that are not installed yet. Quiet on success; on failure
# prints apt's output and exits non-zero.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "install_slurm.sh: must run as root" >&2; exit 1; }

# slurmctld/slurmd/slurm-client: Slurm 22.05; munge: authentication; slurmdbd + mariadb-server:
# accounting (submitit reads job states with sacct); iproute2/util-linux: netns, nsenter, unshare;
# procps: ps/kill; iputils-ping is not needed (tests ping over TCP).
PKGS=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server mariadb-client iproute2 util-linux procps)

need=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
[ ${#need[@]} -eq 0 ] && exit 0

t0=$(date +%s)
log=$(mktemp /tmp/install_slurm.XXXXXX.log)
export DEBIAN_FRONTEND=noninteractive
# No systemd here: the packages' postinst may try to start daemons through invoke-rc.d. Forbid that
# (policy-rc.d exit 101) so nothing outside up.sh runs a slurmctld/mariadbd; removed afterwards.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod 755 "$policy"; own_policy=1
fi
trap 'if [ "$own_policy" = 1 ]; then rm -f "$policy"; fi' EXIT
if ! { apt-get update -q && apt-get install -y -q --no-install-recommends "${need[@]}"; } >"$log" 2>&1; then
  echo "install_slurm.sh: apt-get failed for: ${need[*]}" >&2
  tail -40 "$log" >&2
  exit 1
fi
for b in slurmctld slurmd slurmdbd sbatch sacct munged mariadbd nsenter unshare ip; do
  command -v "$b" >/dev/null || { echo "install_slurm.sh: $b missing after install" >&2; exit 1; }
done
rm -f "$log"
echo "[install_slurm] installed ${need[*]} in $(( $(date +%s) - t0 ))s ($(dpkg-query -W -f='${Version}' slurmctld))"
