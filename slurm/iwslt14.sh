#!/bin/bash
# The IWSLT14 de-en translation model with MultiMax attention (the paper's Table 4) on one GPU, as
# fairseq's recipe. Afterwards, `mmlight test --config CONFIG --ckpt_path runs/<name>/slurm-<job id>/
# checkpoints/best-*.ckpt` translates the test set and writes the hypotheses and BLEU.
#
#   sbatch slurm/iwslt14.sh                                      # shards in data/iwslt14
#   DATA=/scratch/iwslt14 sbatch slurm/iwslt14.sh --trainer.max_steps 1000
#   CONFIG=configs/nmt_iwslt14_entmax15.yaml sbatch slurm/iwslt14.sh    # another column of Table 4
#
# Shards come from: mmlight prepare iwslt14 --src /path/to/iwslt14 --out $DATA
# Everything else (signals, requeue, run directory, multi-node, CPU override) works as in slurm/train.sh.
#
#SBATCH --job-name=nmt-iwslt14
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=1
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

set -euo pipefail
# sbatch runs a copy of this script, so find train.sh from the submission directory.
exec bash "${SLURM_SUBMIT_DIR:-.}/slurm/train.sh" "${CONFIG:-configs/nmt_iwslt14_multimax.yaml}" \
    --data.init_args.root "${DATA:-data/iwslt14}" "$@"
