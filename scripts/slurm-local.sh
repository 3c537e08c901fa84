#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine (Debian's slurm-wlm and munge, as
# root), to run launchers/slurm/rlix.sbatch unchanged; `pytest -m multinode` uses it.
#
#   bash scripts/slurm-local.sh up     # install if missing, configure, start the daemons
#   bash scripts/slurm-local.sh down   # stop them
#
# The node has no GPUs: submit with --gpus-per-node=0 (rlix-async then keeps the
# config's logical devices). Everything listens on 127.0.0.1 only.
set -euo pipefail
CONF=/etc/slurm
LOGS=/var/log/slurm

die() { echo "slurm-local: $*" >&2; exit 1; }

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  command -v apt-get >/dev/null || die "needs Debian's apt-get to install slurm-wlm and munge"
  apt-get update -qq >/dev/null || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurm-wlm munge >/dev/null || die "apt-get install slurm-wlm munge failed"
}

configure() {
  local host node
  host=$(hostname -s)
  # slurmd -C prints this node as slurm.conf wants it (CPUs, cores, memory)
  node=$(slurmd -C | head -1)
  [[ $node == NodeName=* ]] || die "slurmd -C printed no node line: $node"
  mkdir -p "$CONF" "$LOGS" /var/spool/slurmctld /var/spool/slurmd /etc/munge /run/munge
  cat >"$CONF/slurm.conf" <<EOF
ClusterName=rlix-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
# no cgroups in a container: track processes by parent, bind nothing
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2

$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
  chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
}

up() {
  [ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts daemons)"
  install
  down quiet
  configure
  runuser -u munge -- munged || die "munged did not start"
  slurmctld || die "slurmctld did not start (see $LOGS/slurmctld.log)"
  slurmd || die "slurmd did not start (see $LOGS/slurmd.log)"
  for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qx idle; then
      echo "slurm-local: node $(hostname -s) idle ($(sinfo -h -o '%c CPUs, %G'))"
      return 0
    fi
    sleep 1
  done
  die "the node did not become idle in 60 s: $(sinfo 2>&1 | tail -2)"
}

down() {
  pkill -x slurmd 2>/dev/null || true
  pkill -x slurmctld 2>/dev/null || true
  pkill -x munged 2>/dev/null || true
  for _ in $(seq 20); do
    pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || pgrep -x munged >/dev/null \
      || break
    sleep 0.5
  done
  # a fresh controller: no job or node state from an earlier run
  rm -rf /var/spool/slurmctld/* /var/spool/slurmd/*
  [ "${1:-}" = quiet ] || echo "slurm-local: stopped"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) die "usage: $0 up|down" ;;
esac
