#!/bin/bash
# Rendered by `slipstream rl` for the run in /TMP/run: the part of its Slurm job that runs on one node.
# The node's role comes from SLURM_NODEID (0: inference, 1: trainer). Each role's
# `slipstream rl` writes its processes' logs into <node run directory>/logs/; when it ends, this script writes its exit
# code to /TMP/run/slurm/job_<id>/<role>.exit, so that the other nodes stop too.
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
export SLIPSTREAM_LAUNCH_ID="job-${job_id}"  # trainer nodes start on the configs its first node writes for this job
module load cuda

python=/opt/venv/bin/python
exit_dir=/TMP/run/slurm/job_${job_id}
mkdir -p "$exit_dir"
overrides=()
# the inference deployment's nodes are the job's first 1: the router (or wide-EP head) on the first
inference_host=${hosts[0]}
inference_nodes=$(printf '"%s",' "${hosts[@]:0:1}")
overrides+=(--orchestrator.inference_url "http://${inference_host}:8123")
overrides+=(--inference.deployment.nodes "[${inference_nodes%,}]")
# the trainer's nodes are the last 1: torchrun's rendezvous and the weight transfer's store on the first
trainer_host=${hosts[1]}
overrides+=(--weights.master_addr "$trainer_host")
case "$node_id" in
  0) role=inference; node_dir=/TMP/run/slurm/nodes/inference_0; config=/TMP/run/slurm/node_inference.toml ;;
  1) role=trainer; node_dir=/TMP/run; config=/TMP/run/slurm/node_trainer.toml ;;
  *) echo "error: SLURM_NODEID=${node_id} is not a node of this layout (0..1)" >&2; exit 2 ;;
esac
peers=(inference trainer)
echo "[slipstream] node ${node_id} ($(hostname)): role ${role}, run directory ${node_dir}"

# a process of this run left on this node by an earlier job would hold the run directory: end it
"$python" -m slipstream.launch.stale "$node_dir" "$job_id"

"$python" -m slipstream rl -c "$config" ${overrides[@]+"${overrides[@]}"} &
launcher=$!
stop_launcher() { kill -TERM "$launcher" 2>/dev/null || true; }
trap stop_launcher TERM INT

stopped_for=""
peer_ended_at=""
while kill -0 "$launcher" 2>/dev/null; do
  for peer in "${peers[@]}"; do
    if [[ "$peer" != "$role" && -z "$stopped_for" && -f "$exit_dir/$peer.exit" ]]; then
      if [[ "$peer" == trainer_* && "$(cat "$exit_dir/$peer.exit")" == 0 ]]; then
        continue  # another trainer node's ranks finished: the first trainer node (orchestrator) ends the run
      fi
      now=$(date +%s)
      peer_ended_at=${peer_ended_at:-$now}
      # inference has nothing to save: it stops at once; the trainer gets slurm.grace_s to finish a checkpoint
      if [[ "$role" == inference* || $((now - peer_ended_at)) -ge 120 ]]; then
        echo "[slipstream] node ${node_id}: ${peer} ended (exit $(cat "$exit_dir/$peer.exit")); stopping ${role}"
        stopped_for=$peer
        stop_launcher
      fi
    fi
  done
  sleep 1
done
rc=0
wait "$launcher" || rc=$?
echo "$rc" > "$exit_dir/$role.exit"
if [[ "$stopped_for" != "" && "$role" == inference* ]]; then
  rc=0  # stopped because the trainer's node ended: that node's exit code is the job's
fi
echo "[slipstream] node ${node_id}: ${role} exited with ${rc}"
exit "$rc"
