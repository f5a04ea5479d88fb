#!/usr/bin/env bash
# down.sh - stop the local Slurm test cluster started by up.sh and remove its network.
# Safe to run at any time (does nothing when nothing is up). Stops processes by PID only: the PIDs in
# our pid files (checked against the expected program name) and whatever runs inside our node
# namespaces (slurmd, slurmstepd, job processes, anything a job left behind). Logs stay in $ROOT/log.
#   QUIET=1 bash down.sh
set -uo pipefail           # no -e: clean up as much as possible even when one step fails
. "$(dirname "$(readlink -f "$0")")/common.sh"
take_lock "$@"
[ "$(id -u)" = 0 ] || { echo "down.sh: must run as root" >&2; exit 1; }
say() { [ "${QUIET:-0}" = 1 ] || log "$@"; }
rc=0
fail() { echo "down.sh: $*" >&2; rc=1; }
t0=$(date +%s.%N)

alive() {  # running, not a zombie (a zombie waits for a parent that is not ours to reap it)
  local st                           # builtins only: this runs for every PID every 0.1 s
  { read -r st < "/proc/$1/stat"; } 2>/dev/null || return 1
  st=${st##*) }; [ "${st%% *}" != Z ]
}
# ours NAME [PIDFILE]: PIDs of this cluster's NAME daemon: the PID in PIDFILE if it runs NAME, and any
# NAME process started with this cluster's SLURM_CONF in its environment (up.sh exports it to every
# daemon), so daemons are found even when their pid files are gone
ours() {
  local name=$1 f=${2:-} pid comm d
  {
    if [ -n "$f" ] && [ -s "$f" ]; then
      pid=$(tr -dc 0-9 < "$f")
      { read -r comm < "/proc/$pid/comm"; } 2>/dev/null && [ "$comm" = "$name" ] && echo "$pid"
    fi
    for d in /proc/[0-9]*; do
      { read -r comm < "$d/comm"; } 2>/dev/null && [ "$comm" = "$name" ] || continue
      { tr '\0' '\n' < "$d/environ"; } 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF" && echo "${d#/proc/}"
    done
  } | sort -u
}
# stop GRACE_S PID...: SIGTERM, wait up to GRACE_S, then SIGKILL what is left
stop() {
  local grace=$1 p left; shift
  [ $# -gt 0 ] || return 0
  say "TERM $*"; kill -TERM "$@" 2>/dev/null
  for _ in $(seq $((grace * 10))); do
    left=(); for p in "$@"; do alive "$p" && left+=("$p"); done
    [ ${#left[@]} -eq 0 ] && return 0
    sleep 0.1
  done
  say "KILL ${left[*]}"; kill -KILL "${left[@]}" 2>/dev/null; sleep 0.2
}
ns_list() { for f in /run/netns/"$NS_PREFIX"*; do [ -e "$f" ] && basename "$f"; done; }
ns_pids() { local ns; for ns in $(ns_list); do ip netns pids "$ns" 2>/dev/null; done; }

# 1. Slurm: controller, every process in the node namespaces (slurmd, steps, jobs), slurmdbd.
#    All at once: slurmd does not kill running jobs when it stops, so they are signalled directly.
stop 5 $({ ours slurmctld "$ROOT/pids/slurmctld.pid"; ours slurmdbd "$ROOT/pids/slurmdbd.pid"; ours slurmd; ns_pids; } | sort -u)
left=$(ns_pids); [ -n "$left" ] && stop 2 $left      # children forked while we were stopping
# 2. the database and munged: only the instances up.sh started
stop 15 $(ours mariadbd "$ROOT/mysql/mariadbd.pid")
stop 5 $(ours munged "$ROOT/pids/munged.pid")
rm -f "$ROOT"/pids/*.pid "$ROOT/mysql/mariadbd.pid" "$MUNGE_SOCKET" "$DB_SOCKET"
left=$(for p in $(ns_pids; for d in slurmctld slurmdbd slurmd mariadbd munged; do ours $d; done); do
         alive "$p" && echo "$p"; done)
[ -z "$left" ] || fail "still running after SIGKILL: $(echo $left)"

# 3. network: namespaces (their veth pairs go with them), bridge, /etc/hosts lines
for ns in $(ns_list); do ip netns del "$ns" || fail "could not delete netns $ns"; done
if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE" || fail "could not delete $BRIDGE"; fi
if grep -qF "$HOSTS_TAG" /etc/hosts; then
  # rewrite in place (same inode): /etc/hosts may be a bind mount that cannot be replaced
  tmp=$(grep -vF "$HOSTS_TAG" /etc/hosts); printf '%s\n' "$tmp" > /etc/hosts
fi
rm -f "$ROOT/cluster.env"
say "down in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s"
exit "$rc"
