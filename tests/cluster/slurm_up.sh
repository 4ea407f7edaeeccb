#!/usr/bin/env bash
# A one-node Slurm cluster on 127.0.0.1 for the `slurm` tests: idempotent, needs root.
# Installs Debian's slurm-wlm and munge when missing, writes /etc/slurm/slurm.conf (CPUs = this
# machine's cores) and starts munged, slurmctld and slurmd directly (no systemd). Exit 0 once
# `sinfo` shows the node idle; exit 3 when the packages cannot be installed here.
set -euo pipefail

[ "$(id -u)" = 0 ] || { echo "slurm_up.sh: needs root" >&2; exit 3; }

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; } \
        || { echo "slurm_up.sh: cannot install slurm-wlm and munge" >&2; exit 3; }
fi

host=$(hostname -s)
cpus=$(getconf _NPROCESSORS_ONLN)  # not nproc: it follows OMP_NUM_THREADS
mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge
conf=/etc/slurm/slurm.conf
new=$(cat <<CONF
# written by tests/cluster/slurm_up.sh
ClusterName=ddptest
SlurmctldHost=${host}(127.0.0.1)
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmUser=root
SlurmdUser=root
MpiDefault=none
JobRequeue=1
KillWait=30
InactiveLimit=0
MinJobAge=600
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
)
changed=0
if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$new" ]; then
    printf '%s\n' "$new" > "$conf"
    changed=1
fi

if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || munged --force

if [ "$changed" = 1 ]; then
    pkill -x slurmctld 2>/dev/null || true
    pkill -x slurmd 2>/dev/null || true
    sleep 1
fi
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd

for _ in $(seq 1 60); do
    if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
        exit 0
    fi
    scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true
    sleep 0.5
done
echo "slurm_up.sh: the node did not come up; see /var/log/slurm/" >&2
sinfo >&2 || true
exit 1
