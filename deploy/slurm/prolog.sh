#!/bin/sh
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/gpuvigil-jobmap.sh, runs as root on
# each allocated node before the job starts): record which job holds which GPU.
#
# Format: the one dcgm-exporter reads with --hpc-job-mapping-dir (one file per GPU index, named
# by the index, holding the id of each job on that GPU, one per line), so dcgm-exporter and
# gpuvigil share one folder. The epilog (epilog.sh) takes the job out again.
set -eu
DIR="${GPUVIGIL_JOB_MAP_DIR:-/run/gpuvigil/job-map}"
JOB="${SLURM_JOB_ID:?SLURM_JOB_ID not set: run me as a Slurm Prolog}"
# slurmd gives the prolog the job's GPU indices on this node (SLURM_JOB_GPUS); older releases
# only CUDA_VISIBLE_DEVICES / GPU_DEVICE_ORDINAL.
GPUS="${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-${GPU_DEVICE_ORDINAL:-}}}"
[ -n "$GPUS" ] || exit 0
mkdir -p "$DIR"
chmod 0755 "$DIR"
(
  # Jobs on one node start and end concurrently: one writer at a time.
  flock 9
  for gpu in $(printf '%s' "$GPUS" | tr ',' ' '); do
    case "$gpu" in ''|*[!0-9]*) continue ;; esac
    file="$DIR/$gpu"
    if ! grep -qx "$JOB" "$file" 2>/dev/null; then
      printf '%s\n' "$JOB" >> "$file"
      chmod 0644 "$file"
    fi
  done
) 9>"$DIR/.lock"
exit 0
