#!/usr/bin/env bash
# Install (if needed) and start a one-node SLURM cluster on this host: Debian's slurmctld, slurmd
# and munge, run as root. Idempotent: a running cluster is left alone. Used by .ci/run and by the
# SLURM tests (tests/slurm/), which skip with this script's message when it cannot succeed.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
    echo "slurm-cluster: needs root to install and start slurmctld/slurmd/munged" >&2
    exit 3
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    (apt-get install -y -q slurmctld slurmd slurm-client munge || { apt-get update -q && apt-get install -y -q slurmctld slurmd slurm-client munge; }) >/dev/null \
        || { echo "slurm-cluster: could not install the SLURM packages with apt-get" >&2; exit 4; }
fi

host=$(hostname -s)
conf=/etc/slurm/slurm.conf
if ! grep -q "^NodeName=$host " "$conf" 2>/dev/null; then
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    cat > "$conf" <<CONF
ClusterName=mmlight-ci
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
# A requeued job's tasks (Lightning ignores SIGTERM while it auto-requeues) are killed 5 s after SIGTERM,
# not SLURM's default 30: the requeue tests wait that long on every requeue
KillWait=5
NodeName=$host CPUs=$(nproc) RealMemory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 )) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
fi

if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd

for _ in $(seq 60); do
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
    case "$state" in idle*|mixed*|allocated*) echo "slurm-cluster: $host is $state"; exit 0 ;; esac
    sleep 1
done
echo "slurm-cluster: node $host did not become idle (state: ${state:-none}); see /var/log/slurm/" >&2
exit 5
