#!/bin/bash
# Train any mmlight config on a SLURM cluster, one task per GPU (Lightning's convention).
#
#   sbatch slurm/train.sh CONFIG [mmlight overrides ...]
#   sbatch slurm/train.sh configs/deit_small_multimax.yaml --trainer.max_epochs 1
#   sbatch --nodes 4 slurm/train.sh CONFIG                      # multi-node: change --nodes alone
#   sbatch -p PARTITION -A ACCOUNT slurm/train.sh CONFIG        # or SBATCH_PARTITION / SBATCH_ACCOUNT
#   SBATCH_GPUS_PER_NODE=4 sbatch --ntasks-per-node 4 slurm/train.sh CONFIG   # another GPU count
#
# CPU-only test cluster (no GPUs, gloo): give the task count and drop the GPU request:
#   sbatch --ntasks-per-node 2 --gpus-per-node 0 --cpus-per-task 1 slurm/train.sh CONFIG --trainer.accelerator cpu
#
# Command-line sbatch options (and SBATCH_* variables) override the #SBATCH lines below.
# The run lives in runs/<name>/slurm-<job id>/ (TensorBoard version = job id). A requeued job keeps
# its id, so it finds its own checkpoints there and resumes (--ckpt_path last); 5 minutes before
# the time limit SLURM signals the batch shell, which forwards the signal to the training tasks:
# at the end of the step under way they save hpc_ckpt_<n>.ckpt and requeue the job (SlurmRequeue).
#
#SBATCH --job-name=mmlight
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=10
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: sbatch slurm/train.sh CONFIG [mmlight overrides ...]" >&2
    exit 2
fi
config=$1
shift
tasks_per_node=${SLURM_NTASKS_PER_NODE%%(*}  # "8" or "8(x4)"
echo "mmlight: job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NUM_NODES} node(s) x ${tasks_per_node} task(s): ${config} $*"

# The shell receives SLURM's warning signal (B: above) and forwards it to srun, which passes it to
# every task; signalling the step directly does not always reach the Python processes. The tasks
# then save hpc_ckpt_<n>.ckpt at the end of a step and requeue the job, which ends this shell too. Where it cannot
# requeue (no scontrol inside a container), this shell requeues the job after a grace period.
srun_pid=
on_warning_signal() {
    echo "mmlight: SIGUSR1: forwarding it to the training tasks"
    [ -n "$srun_pid" ] && kill -USR1 "$srun_pid"
    (sleep "${MMLIGHT_REQUEUE_GRACE:-120}" && echo "mmlight: requeueing from the batch script" \
        && scontrol requeue "$SLURM_JOB_ID") &
}
trap on_warning_signal USR1

srun --kill-on-bad-exit=1 mmlight fit --config "$config" \
    --trainer.num_nodes "${SLURM_JOB_NUM_NODES}" --trainer.devices "${tasks_per_node}" \
    --ckpt_path last "$@" &
srun_pid=$!
# wait returns early when a trapped signal arrives; wait again until srun itself ends.
status=0
while kill -0 "$srun_pid" 2>/dev/null; do
    wait "$srun_pid" && status=0 || status=$?
done
exit "$status"
