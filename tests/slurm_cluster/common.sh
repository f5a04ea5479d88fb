# common.sh - names shared by up.sh and down.sh (sourced, not run).
# Everything the cluster creates is named here, so down.sh can find and remove exactly that.
ROOT=${ROOT:-/tmp/slurm-test}        # all files: configs, state, logs, pid files, DB, fake devices
NS_PREFIX=slt-node                   # network namespaces slt-node1..N (/run/netns)
VETH_PREFIX=sltv                     # root-side veth ends sltv1..N (15-char limit on link names)
BRIDGE=sltbr0
HOSTS_TAG="# slurm-test-cluster"     # marks our /etc/hosts lines
SLURM_CONF=$ROOT/etc/slurm.conf      # daemons and clients find the config through this variable
MUNGE_SOCKET=$ROOT/munge/munge.sock  # a private munged: the host's /etc/munge and /run/munge stay untouched
DB_SOCKET=$ROOT/mysql/mysqld.sock    # a private MariaDB without networking
LOCK=$ROOT.lock                      # one user of the cluster at a time (see take_lock)
export SLURM_CONF

log() { echo "[$(basename "$0" .sh) $(date +%T)] $*"; }

# Serialise up/down across sessions that share this machine: re-run the calling script under
# `flock -o` (the lock is not inherited by the daemons the script starts). The pytest fixture holds
# the lock for its whole session and sets SLURM_TEST_LOCK_HELD=1 when it calls the scripts.
take_lock() {
  [ "${SLURM_TEST_LOCK_HELD:-}" = 1 ] && return 0
  mkdir -p "$(dirname "$LOCK")"
  local rc=0
  SLURM_TEST_LOCK_HELD=1 flock -o -E 75 -w "${LOCK_WAIT_S:-300}" "$LOCK" bash "$0" "$@" || rc=$?
  [ "$rc" = 75 ] && echo "$(basename "$0"): $LOCK is held by another session (${LOCK_WAIT_S:-300}s): $(cat "$LOCK" 2>/dev/null)" >&2
  exit "$rc"
}
