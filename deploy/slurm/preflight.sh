#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/*; this file as
# /etc/slurm/prolog.d/50-gpuvigil-preflight.sh, run as root on each allocated node before the job
# starts): `gpuvigil preflight` proves the node fit. A non-zero exit makes Slurm drain the node
# (its reason: the verdict line) and requeue the job elsewhere.
#
#   PASS (0), WARN (1)  -> exit 0: the job starts; the line goes to syslog
#   FAIL (2)            -> exit 1: drained
#   CANNOT_CHECK (3)    -> GPUVIGIL_PREFLIGHT_NO_GPU=pass (default: a CPU node sharing the prolog)
#                          or =drain (GPU nodes: a node whose driver is gone must not take jobs)
#   anything else       -> exit 1 (gpuvigil itself failed: the node is not proven fit)
set -u
CONFIG="${GPUVIGIL_CONFIG:-/etc/gpuvigil/deploy.yaml}"
CHECKS="${GPUVIGIL_PREFLIGHT_CHECKS:-nvml,infiniband,dcgm}"
NO_GPU="${GPUVIGIL_PREFLIGHT_NO_GPU:-pass}"
set -- preflight --checks "$CHECKS"
[ -f "$CONFIG" ] && set -- "$@" --config "$CONFIG"
out=$(gpuvigil "$@" 2>&1)
rc=$?
logger -t gpuvigil-preflight -- "$out" 2>/dev/null || true
case $rc in
  0|1) exit 0 ;;
  3) [ "$NO_GPU" = drain ] && { echo "$out" >&2; exit 1; }; exit 0 ;;
  *) echo "$out" >&2; exit 1 ;;
esac
