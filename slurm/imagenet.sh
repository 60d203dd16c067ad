#!/bin/bash
# DeiT-small with MultiMax on ImageNet-1k (the paper's Table 2), 8 GPUs per node.
#
#   sbatch slurm/imagenet.sh                                   # shards in data/imagenet
#   DATA=/scratch/imagenet-shards sbatch slurm/imagenet.sh --trainer.max_epochs 1
#   CONFIG=configs/deit_small_softmax.yaml sbatch slurm/imagenet.sh     # the softmax twin
#   sbatch --nodes 2 slurm/imagenet.sh                          # 16 GPUs (lr scales with the global batch)
#
# Shards come from: mmlight prepare imagenet --src /path/to/ILSVRC2012 --out $DATA
# Everything else (signals, requeue, run directory, CPU override) works as in slurm/train.sh.
# CPUs: 16 loader workers per GPU (the configs' data.num_workers) + the training process and its
# threads, from BENCHMARKS.md ("Cores one GPU needs"). On nodes with fewer CPUs lower both; mmlight
# warns at fit start when the GPUs wait on the loader.
#
#SBATCH --job-name=deit-small-imagenet
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=18
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out

set -euo pipefail
# sbatch runs a copy of this script, so find train.sh from the submission directory.
exec bash "${SLURM_SUBMIT_DIR:-.}/slurm/train.sh" "${CONFIG:-configs/deit_small_multimax.yaml}" \
    --data.init_args.root "${DATA:-data/imagenet}" "$@"
