#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/gpuvigil-jobmap.sh): the job has ended on
# this node; take its id out of each GPU's job-mapping file (prolog.sh wrote them), and remove a
# file no job holds any more. Never fails the epilog: a failed epilog drains the node.
DIR="${GPUVIGIL_JOB_MAP_DIR:-/run/gpuvigil/job-map}"
JOB="${SLURM_JOB_ID:-}"
[ -n "$JOB" ] && [ -d "$DIR" ] || exit 0
(
  flock 9
  for file in "$DIR"/*; do
    [ -f "$file" ] || continue
    case "${file##*/}" in *[!0-9]*) continue ;; esac
    if grep -qx "$JOB" "$file"; then
      grep -vx "$JOB" "$file" > "$file.tmp" || true
      if [ -s "$file.tmp" ]; then mv "$file.tmp" "$file"; else rm -f "$file.tmp" "$file"; fi
    fi
  done
) 9>"$DIR/.lock"
exit 0
