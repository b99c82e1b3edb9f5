#!/usr/bin/env bash
# Runs a command as one Horovod rank per GPU (on CPU-only nodes, one per CPU socket) on every
# node of a SLURM allocation, through horovodrun (Gloo by default; nodes reach each other by ssh).
#   usage: sbatch [-N NODES] [--gpus-per-node=G] [sbatch options] slurm_multinode.sh [--dry-run] COMMAND [ARGS...]
#   e.g.   sbatch -N 2 --gpus-per-node=8 slurm_multinode.sh python dlrm.py --batch_size=65536
#          sbatch -N 4 slurm_multinode.sh .venv/bin/python dcnv2.py
# Nodes are taken to be alike: the count on the node running this script holds for every node.
# Environment (all optional):
#   LAUNCHER=gloo|mpi         horovodrun's controller (default gloo; mpi needs an MPI build of Horovod)
#   VENV=DIR                  put DIR/bin first on PATH (horovodrun and `python` from there); without
#                             it: horovodrun from PATH, else the submit directory's .venv
#   HOROVODRUN=PATH           the horovodrun to run (overrides VENV's)
#   HOROVODRUN_ARGS="..."     extra horovodrun options, e.g. "--network-interface ib0"
#   RANKS_PER_NODE=K          override the detected GPUs (or sockets) per node
#   DRY_RUN=1                 print the horovodrun command and exit (like --dry-run)
#   RESUME_FROM=DIR           add --restore_checkpoint_path=DIR to the command when DIR holds a
#                             checkpoint (DIR/latest): a requeued job resumes where it stopped
#   REQUEUE=1                 requeue the job (scontrol requeue) after a SIGTERM/SIGINT stopped it
#   HOROVOD_GLOO_TIMEOUT_SECONDS (default 300), HOROVOD_START_TIMEOUT (default 120),
#   OMP_NUM_THREADS / TF_NUM_INTRAOP_THREADS (CPU-only default: the cores of one socket)
# The #SBATCH defaults (1 node, whole nodes, 4 hours, log %x-%j.out in the submit directory,
# SIGTERM to this script 180 s before the time limit) yield to the same options on the sbatch
# command line; --oversubscribe undoes --exclusive. A SIGTERM or SIGINT this script receives goes to
# this node's ranks (not horovodrun, which kills its ranks 5 s after its own signal): the ranks agree
# on a stop, checkpoint and exit (docs/launchers.md#preemption-and-requeue); the script exits 143 or 130.
#SBATCH --job-name=dlrm-tf2
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:TERM@180
set -euo pipefail

die() { echo "error: $*" >&2; exit 2; }

# A stop (SIGTERM, SIGINT) from here on goes to this node's ranks once they are there; one before the
# launch launches nothing.
SIGNALLED="" DELIVERED="" LAUNCHED=""
# shellcheck disable=SC2329  # descendants, forward and stop run from the traps below
descendants() { local child; for child in $(pgrep -P "$1"); do echo "$child"; descendants "$child"; done; }
# shellcheck disable=SC2329
forward() {   # to this node's ranks: horovodrun's descendants with HOROVOD_RANK in their environment
  local pid
  [ -n "$LAUNCHED" ] || return 0
  for pid in $(descendants "$LAUNCHED"); do
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -q '^HOROVOD_RANK='; then
      kill -s "$1" "$pid" 2>/dev/null && DELIVERED=1
    fi
  done
}
# shellcheck disable=SC2329
stop() {
  SIGNALLED=$1 DELIVERED=""
  if [ -n "$LAUNCHED" ]; then
    echo "job ${SLURM_JOB_ID:-?}: SIG$1 received: passed to this node's ranks (they checkpoint and stop)" >&2
    forward "$1"
  else
    echo "job ${SLURM_JOB_ID:-?}: SIG$1 received before the launch: nothing is started" >&2
  fi
}
trap 'stop TERM' TERM
trap 'stop INT' INT

DRY_RUN=${DRY_RUN:-0}
case ${1:-} in
  -h|--help) sed -n '2,/^#SBATCH/{/^#SBATCH/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
  --dry-run) DRY_RUN=1; shift ;;
esac
[ $# -gt 0 ] || die "no command given: sbatch [-N NODES] slurm_multinode.sh python dlrm.py [flags]"
[ -n "${SLURM_JOB_NODELIST:-}" ] || die "not inside a SLURM allocation (SLURM_JOB_NODELIST is unset): submit with sbatch [-N NODES] slurm_multinode.sh $*"
command -v scontrol >/dev/null || die "scontrol not found on PATH (needed to expand SLURM_JOB_NODELIST)"

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
[ ${#NODES[@]} -gt 0 ] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' listed no node"

# Ranks per node: GPUs from SLURM (SLURM_GPUS_PER_NODE may read "8", "a100:8" or "gpu:a100:8(IDX:0-7)"),
# else the GPUs nvidia-smi lists, else CPU sockets.
count() { local n=${1%%(*}; n=${n##*:}; [[ $n =~ ^[0-9]+$ ]] && [ "$n" -gt 0 ] && echo "$n"; }
GPUS=$(count "${SLURM_GPUS_ON_NODE:-}" || count "${SLURM_GPUS_PER_NODE:-}" ||
       { command -v nvidia-smi >/dev/null && count "$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')"; } || echo 0)
if [ "$GPUS" -gt 0 ]; then
  PER_NODE=$GPUS DEVICE=GPU
else
  distinct() { { lscpu -p="$1" 2>/dev/null || true; } | awk '!/^#/ && !seen[$0]++ {n++} END {print n+0}'; }
  SOCKETS=$(distinct SOCKET)
  [ "$SOCKETS" -gt 0 ] || SOCKETS=1
  PER_NODE=$SOCKETS DEVICE="CPU socket"
  # One rank per socket: its threads are that socket's (physical) cores.
  CORES=$(distinct CORE,SOCKET)
  THREADS=$(( CORES / SOCKETS > 0 ? CORES / SOCKETS : 1 ))
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$THREADS}
  export TF_NUM_INTRAOP_THREADS=${TF_NUM_INTRAOP_THREADS:-$OMP_NUM_THREADS}
fi
if [ -n "${RANKS_PER_NODE:-}" ]; then
  [[ $RANKS_PER_NODE =~ ^[1-9][0-9]*$ ]] || die "RANKS_PER_NODE=$RANKS_PER_NODE is not a positive integer"
  PER_NODE=$RANKS_PER_NODE
fi

HOSTS=""
for node in "${NODES[@]}"; do HOSTS+="${HOSTS:+,}$node:$PER_NODE"; done
NP=$(( ${#NODES[@]} * PER_NODE ))

case ${LAUNCHER:-gloo} in
  gloo) CONTROLLER=--gloo ;;
  mpi) CONTROLLER=--mpi ;;
  *) die "LAUNCHER=$LAUNCHER: use gloo or mpi" ;;
esac

if [ -z "${VENV:-}" ] && [ -z "${HOROVODRUN:-}" ] && ! command -v horovodrun >/dev/null && [ -x "${SLURM_SUBMIT_DIR:-.}/.venv/bin/horovodrun" ]; then
  VENV=${SLURM_SUBMIT_DIR:-.}/.venv
fi
if [ -n "${VENV:-}" ]; then
  [ -d "$VENV/bin" ] || die "VENV=$VENV has no bin/ folder"
  VENV=$(cd "$VENV" && pwd)   # the ranks on other nodes get this PATH too
  export PATH="$VENV/bin:$PATH"
fi
HOROVODRUN=${HOROVODRUN:-horovodrun}
command -v "$HOROVODRUN" >/dev/null || [ "$DRY_RUN" = 1 ] ||
  die "$HOROVODRUN not found: set VENV (e.g. VENV=\$PWD/.venv) or HOROVODRUN"

# A rank that hangs or whose node drops off ends the job after this long (a rank that exits
# ends it at once: horovodrun stops the others) instead of the rest waiting on it until the
# time limit. Horovod's 30 s default also bounds the start-up rendezvous, too short where
# ranks import TensorFlow from a busy shared file system; likewise horovodrun's start timeout.
export HOROVOD_GLOO_TIMEOUT_SECONDS=${HOROVOD_GLOO_TIMEOUT_SECONDS:-300}
export HOROVOD_START_TIMEOUT=${HOROVOD_START_TIMEOUT:-120}

read -ra EXTRA <<< "${HOROVODRUN_ARGS:-}"
RESUME=()
if [ -n "${RESUME_FROM:-}" ] && [ -f "$RESUME_FROM/latest" ]; then
  RESUME=("--restore_checkpoint_path=$RESUME_FROM")
fi
CMD=("$HOROVODRUN" -np "$NP" -H "$HOSTS" "$CONTROLLER" "${EXTRA[@]}" "$@" "${RESUME[@]}")

echo "job ${SLURM_JOB_ID:-?}: ${#NODES[@]} node(s) x $PER_NODE rank(s) (one per $DEVICE) = $NP ranks${OMP_NUM_THREADS:+, $OMP_NUM_THREADS threads each}"
[ -z "${VENV:-}" ] || echo "VENV: $VENV"
printf 'launching:'
for arg in "${CMD[@]}"; do   # shell-quoted only where needed, so it can be pasted back
  if [[ $arg =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then printf ' %s' "$arg"; else printf ' %q' "$arg"; fi
done
printf '\n'
[ "$DRY_RUN" = 1 ] && exit 0

if [ -z "$SIGNALLED" ]; then
  "${CMD[@]}" &
  LAUNCHED=$!
fi
while [ -n "$LAUNCHED" ] && kill -0 "$LAUNCHED" 2>/dev/null; do   # a trapped signal ends a wait early: wait again
  if [ -n "$SIGNALLED" ] && [ -z "$DELIVERED" ]; then   # before this node's ranks started: until they have
    sleep 0.5
    forward "$SIGNALLED"
  else
    wait "$LAUNCHED" || true
  fi
done
STATUS=0
[ -z "$LAUNCHED" ] || wait "$LAUNCHED" || STATUS=$?
if [ -n "$SIGNALLED" ]; then
  if [ "${REQUEUE:-0}" = 1 ]; then
    echo "job ${SLURM_JOB_ID:-?}: stopped by SIG$SIGNALLED: requeued (scontrol requeue)" >&2
    scontrol requeue "${SLURM_JOB_ID:?}"
  fi
  exit $((128 + $(kill -l "$SIGNALLED")))
fi
exit "$STATUS"
