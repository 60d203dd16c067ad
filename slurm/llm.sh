#!/bin/bash
# A Llama-style decoder on FineWeb-edu (configs/llm/): 8 GPUs, 16 x 1,024 tokens each, 4 accumulated
# batches (524,288 tokens a step), 19,073 steps = 10B tokens.
#
#   sbatch slurm/llm.sh                                             # 124M, shards in data/fineweb-edu
#   DATA=/scratch/fineweb-edu-shards sbatch slurm/llm.sh --trainer.max_steps 1000
#   CONFIG=configs/llm/llama_350m_softmax.yaml sbatch slurm/llm.sh  # the 350M recipe
#   sbatch slurm/llm.sh --model.init_args.model.attention.name multimax   # another reweighting
#
# Shards come from: mmlight prepare text --src /path/to/fineweb-edu/sample/10BT --out $DATA --vocab-size 32768
# Everything else (signals, requeue, run directory, multi-node, CPU override) works as in slurm/train.sh.
#
#SBATCH --job-name=llm
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
# sbatch runs a copy of this script, so find train.sh from the submission directory.
exec bash "${SLURM_SUBMIT_DIR:-.}/slurm/train.sh" "${CONFIG:-configs/llm/llama_124m_softmax.yaml}" \
    --data.init_args.root "${DATA:-data/fineweb-edu}" "$@"
