#!/bin/bash
# gpuvigil observation level L1 for every Slurm job, without touching training code.
#
# Install as the TaskProlog (slurm.conf: TaskProlog=/etc/slurm/gpuvigil-taskprolog-l1.sh). Slurm
# runs it before each task and exports every "export NAME=value" line it prints into the task's
# environment; the user's script does not change. See docs/levels.md.
#
#   GPUVIGIL_FR_ROOT         where ranks write Flight Recorder dumps and create their pipes
#                            (gpuvigil serve: sources.flight_recorder); default /var/tmp/gpuvigil-fr
#   GPUVIGIL_INSPECTOR_ROOT  where the NCCL Inspector writes (sources.nccl_inspector);
#                            default /var/tmp/gpuvigil-nccl-inspector
#   GPUVIGIL_INSPECTOR_LIB   libnccl-profiler-inspector.so (built from NVIDIA/nccl ext-profiler/inspector);
#                            unset or missing: the Inspector stays off, Flight Recorder still on
#   GPUVIGIL_INSPECTOR_PROM  1: Prometheus textfile mode (node_exporter textfile collector, 30 s minimum);
#                            0 (default): JSON records, every GPUVIGIL_INSPECTOR_INTERVAL_US (default 1 s)
set -u
job="${SLURM_JOB_ID:-unknown}"
fr_root="${GPUVIGIL_FR_ROOT:-/var/tmp/gpuvigil-fr}"
insp_root="${GPUVIGIL_INSPECTOR_ROOT:-/var/tmp/gpuvigil-nccl-inspector}"
fr_dir="$fr_root/$job"
mkdir -p "$fr_dir" 2>/dev/null && chmod 0770 "$fr_dir" 2>/dev/null

# PyTorch Flight Recorder: keep the last 2000 collectives per rank; dump every rank when the NCCL
# watchdog times out; dump on demand when anything is written to the rank's pipe
# (<prefix><rank>.pipe, created by torch's watchdog thread). Dumps: <prefix><rank>.
echo "export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}"
echo "export TORCH_NCCL_TRACE_BUFFER_SIZE=${TORCH_NCCL_TRACE_BUFFER_SIZE:-2000}"
echo "export TORCH_NCCL_DUMP_ON_TIMEOUT=1"
echo "export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=$fr_dir/fr_dump_"
echo "export TORCH_FR_DUMP_TEMP_FILE=$fr_dir/fr_dump_"
echo "export TORCH_NCCL_DEBUG_INFO_PIPE_FILE=$fr_dir/fr_pipe_"

# NCCL Inspector (NCCL >= 2.23 profiler plugin API): per-communicator, per-collective records.
lib="${GPUVIGIL_INSPECTOR_LIB:-}"
if [ -n "$lib" ] && [ -r "$lib" ]; then
  insp_dir="$insp_root/$job"
  mkdir -p "$insp_dir" 2>/dev/null && chmod 0770 "$insp_dir" 2>/dev/null
  echo "export NCCL_PROFILER_PLUGIN=$lib"
  echo "export NCCL_INSPECTOR_ENABLE=1"
  echo "export NCCL_INSPECTOR_DUMP_DIR=$insp_dir"
  if [ "${GPUVIGIL_INSPECTOR_PROM:-0}" = "1" ]; then
    echo "export NCCL_INSPECTOR_PROM_DUMP=1"
    echo "export NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS=30000000"
  else
    echo "export NCCL_INSPECTOR_DUMP_THREAD_INTERVAL_MICROSECONDS=${GPUVIGIL_INSPECTOR_INTERVAL_US:-1000000}"
  fi
fi
exit 0
