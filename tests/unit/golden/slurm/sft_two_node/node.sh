#!/bin/bash
# Rendered by `slipstream sft` for the run in /TMP/run: this node's part of the job, torchrun with
# 8 rank(s) of the 2-node fine-tuning, the rendezvous on the job's first node.
set -euo pipefail

job_id=${SLURM_JOB_ID:?this script runs inside a Slurm job (SLURM_JOB_ID is not set): submit job.sbatch with sbatch}
node_id=${SLURM_NODEID:?SLURM_NODEID is not set: run this script with srun, one task per node}
if [[ "${SLURM_JOB_NUM_NODES:-}" != "2" ]]; then
  echo "error: the job has ${SLURM_JOB_NUM_NODES:-?} node(s) but was rendered for slurm.num_nodes = 2; submit job.sbatch unchanged, or render it again" >&2
  exit 2
fi
mapfile -t hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set}")
if [[ "${#hosts[@]}" -ne 2 ]]; then
  echo "error: SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST} names ${#hosts[@]} host(s), expected 2" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1


echo "[slipstream] job ${job_id} node ${node_id} ($(hostname)): 8 sft rank(s), rendezvous ${hosts[0]}:29400"
exec /opt/venv/bin/python -m torch.distributed.run --nnodes 2 --node-rank "$node_id" \
  --nproc-per-node 8 --master-addr "${hosts[0]}" --master-port 29400 \
  -m slipstream sft -c /TMP/run/slurm/node_sft.toml
