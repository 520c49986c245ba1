#!/usr/bin/env bash
# Issue #20 as one background job on an 8-GPU machine staged with benchmarks/staging/gpu_stage.sh (run from the
# repository root, PYTHONPATH set): benchmarks/bench_node.py with every case (~13 min expected,
# 20 at most), the machine's GPUs, links, memory and versions beside it.
#
#   W=/tmp/w setsid nohup bash benchmarks/node_gpu.sh > /dev/null 2>&1 < /dev/null &
# Results: $W/node_bench.json (rewritten after each case), its log $W/node_bench.log, the machine in
# $W/machine.txt; the phases in $W/log.
#
# The timed dumps of 8 GPUs (~35 GB with the defaults) go to RAM: eight writers on one disk would
# measure the disk. /dev/shm if it has room, else a tmpfs mounted for the run, else the local disk
# (said in $W/log; results name the place as dump_dir).
set -uo pipefail
W=${W:-/tmp/w}
mkdir -p "$W"
free_gib() { df -P -k "$1" 2>/dev/null | awk 'NR == 2 { print int($4 / 1048576) }'; }
{
  echo "== $(date +%T) machine -> $W/machine.txt"
  { nvidia-smi; nvidia-smi topo -m; df -h /dev/shm /tmp; free -g; nproc
    python3 -c 'import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)'
  } > "$W/machine.txt" 2>&1
  dump_dir=/dev/shm/bench_node
  shm=$(free_gib /dev/shm)
  if [ "${shm:-0}" -lt 48 ]; then
    mkdir -p /tmp/bench_ram
    if mount -t tmpfs -o size=64G tmpfs /tmp/bench_ram; then
      dump_dir=/tmp/bench_ram/dumps
      echo "/dev/shm has ${shm:-no} GiB free: dumps to a 64 GiB tmpfs at /tmp/bench_ram"
    else
      dump_dir=/tmp/bench_node_dumps
      echo "/dev/shm has ${shm:-no} GiB free and no tmpfs could be mounted: dumps to the local disk"
    fi
  fi
  echo "== $(date +%T) bench_node.py, dumps to $dump_dir"
  timeout 1320 python3 benchmarks/bench_node.py --out "$W/node_bench.json" --dump-dir "$dump_dir" --budget 1200 \
    > "$W/node_bench.log" 2>&1
  echo "== $(date +%T) all done (exit status $?)"
  mountpoint -q /tmp/bench_ram && umount /tmp/bench_ram
} >> "$W/log" 2>&1
