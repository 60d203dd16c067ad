#!/bin/bash
# The WikiText-103 language model with MultiMax (the paper's Table 3): 4 GPUs, 2,048 tokens each, 50k steps.
#
#   sbatch slurm/wikitext103.sh                                  # shards in data/wikitext103
#   DATA=/scratch/wt103-shards sbatch slurm/wikitext103.sh --trainer.max_steps 1000
#   CONFIG=configs/lm_wikitext103_softmax.yaml sbatch slurm/wikitext103.sh   # the softmax baseline
#
# Shards come from: mmlight prepare wikitext103 --src /path/to/wikitext-103 --out $DATA
# Everything else (signals, requeue, run directory, multi-node, CPU override) works as in slurm/train.sh.
#
#SBATCH --job-name=lm-wikitext103
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

set -euo pipefail
# sbatch runs a copy of this script, so find train.sh from the submission directory.
exec bash "${SLURM_SUBMIT_DIR:-.}/slurm/train.sh" "${CONFIG:-configs/lm_wikitext103_multimax.yaml}" \
    --data.init_args.root "${DATA:-data/wikitext103}" "$@"
