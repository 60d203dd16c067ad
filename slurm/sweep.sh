#!/bin/bash
# One run of a table (configs/tables/*.yaml) per SLURM array task: task N trains run N of
# `mmlight sweep TABLE --dry_run` through slurm/train.sh (requeue, signal forwarding and resume
# included), then evaluates the table's checkpoint when its metric needs it (`mmlight test`).
#
#   mmlight sweep configs/tables/table4.yaml --dry_run                 # the runs and their indices
#   sbatch --array=0-14%4 slurm/sweep.sh configs/tables/table4.yaml   # 15 runs, at most 4 at a time
#   sbatch --array=3 slurm/sweep.sh configs/tables/table4.yaml        # run 3 alone (e.g. again)
#   mmlight collect configs/tables/table4.yaml                         # the table, once they are done
#
# Options after the table go to every mmlight command (e.g. --data.init_args.root /scratch/iwslt14).
# The #SBATCH lines below are train.sh's; override them on the sbatch command line as there (a
# table's runs usually need fewer GPUs: sbatch --gpus-per-node 1 --ntasks-per-node 1 ...).
# A run's folder is runs/tables/<table>/<cell>/seed<seed>/ whatever the job id, so a requeued task,
# or a resubmitted array, resumes or skips its run. Run from the repository root (sbatch's
# submission directory), where train.sh and the table are found.
#
#SBATCH --job-name=mmlight-sweep
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=10
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%A_%a.out

set -euo pipefail
if [ $# -lt 1 ] || [ -z "${SLURM_ARRAY_TASK_ID:-}" ]; then
    echo "usage: sbatch --array=0-N slurm/sweep.sh TABLE [mmlight overrides ...]" >&2
    exit 2
fi
table=$1
shift
task=$SLURM_ARRAY_TASK_ID
log=$(scontrol show job "$SLURM_JOB_ID" -o 2>/dev/null | sed -n 's/.*StdOut=\([^ ]*\).*/\1/p' || true)
record_failure() {
    mmlight sweep "$table" --task "$task" --failed "$1" --log "${log:-slurm job $SLURM_JOB_ID}" || true
    exit "$1"
}

# The arguments of this task's steps, one per line; none when the step is already done.
fit_args=$(mmlight sweep "$table" --task "$task" --print fit) || exit $?
if [ -n "$fit_args" ]; then
    mapfile -t fit <<< "$fit_args"  # the config, then its overrides: what train.sh takes
    # train.sh runs as a child so that the evaluation can follow; SLURM's warning signal reaches
    # this shell (--signal=B:...) and is passed on to train.sh, which forwards it to the tasks.
    bash "${SLURM_SUBMIT_DIR:-.}/slurm/train.sh" "${fit[@]}" "$@" &
    child=$!
    trap 'echo "mmlight sweep: SIGUSR1: passing it to train.sh"; kill -USR1 "$child" 2>/dev/null || true' USR1
    status=0
    wait "$child" || status=$?
    while kill -0 "$child" 2>/dev/null; do  # wait returned for the trapped signal: wait again
        status=0
        wait "$child" || status=$?
    done
    [ "$status" = 0 ] || record_failure "$status"
fi

eval_args=$(mmlight sweep "$table" --task "$task" --print eval -- "$@") || record_failure $?
if [ -n "$eval_args" ]; then
    mapfile -t evaluate <<< "$eval_args"  # e.g. test --config ... --ckpt_path .../best-*.ckpt
    echo "mmlight sweep: task $task: mmlight ${evaluate[0]} of the table's checkpoint"
    srun --kill-on-bad-exit=1 mmlight "${evaluate[@]}" --trainer.num_nodes "${SLURM_JOB_NUM_NODES}" \
        --trainer.devices "${SLURM_NTASKS_PER_NODE%%(*}" || record_failure $?
fi
echo "mmlight sweep: task $task done"
