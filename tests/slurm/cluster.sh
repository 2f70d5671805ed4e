#!/usr/bin/env bash
# Local Slurm test cluster built from Linux network namespaces (Debian 12, Slurm 22.05).
#
# Usage (as root):
#   bash tests/slurm/cluster.sh deps            # apt-get install slurmctld slurmd slurm-client munge
#   bash tests/slurm/cluster.sh up [N]          # N compute nodes (1..4, default 2); re-running rebuilds
#   bash tests/slurm/cluster.sh status          # daemons + sinfo
#   bash tests/slurm/cluster.sh env             # prints: export SLURM_CONF=...  (eval it)
#   bash tests/slurm/cluster.sh exec NODE [CMD...]  # run CMD (default: bash) "on" NODE
#   bash tests/slurm/cluster.sh down            # idempotent, leaves nothing behind
#
# NODE is a full name (wls-node1), node1, the index (1), or ctl (the controller).
#
# Layout (PREFIX=${WL_SLURM_PREFIX:-wls}, SUBNET=${WL_SLURM_SUBNET:-10.78.0}):
#   PREFIX-switch        namespace holding bridge br0
#   PREFIX-ctl           slurmctld; eth0 = SUBNET.10/24
#   PREFIX-node0..N-1    one slurmd each; eth0 = SUBNET.11, .12, ... /24
#   root namespace       veth PREFIX-root = SUBNET.2/24 on the same bridge, so sbatch, srun,
#                        squeue, scontrol, scancel run here reach slurmctld and the slurmds
#                        directly (and slurmstepd reaches back to an srun run here).
#   munged               root namespace, private key + socket under /run/PREFIX-slurm/munge
#                        (a unix socket works across network namespaces); slurm.conf points
#                        every daemon and client at it (AuthInfo=socket=...).
#   /run/PREFIX-slurm/   slurm.conf, hosts, munge/, ctl/ (state, log, pid),
#                        node/PREFIX-nodeK/ (spool, slurmd.log, slurmd.pid: %n in slurm.conf).
# Daemons are started with `nsenter --net=/run/netns/X` + `unshare --uts --mount` (hostname =
# node name; /run/PREFIX-slurm/hosts bind-mounted over /etc/hosts so every node name
# resolves). Not `ip netns exec`: it remounts /sys, hides /sys/fs/cgroup and slurmd 22.05
# dies ("Unable to initialize cgroup plugin"). Jobs inherit these namespaces; all nodes
# share the one filesystem and the one process table.
#
# Client commands need SLURM_CONF (there is no /etc/slurm/slurm.conf):
#   eval "$(bash tests/slurm/cluster.sh env)"; sinfo; srun -N2 -n2 hostname
#
# Env: WL_SLURM_PREFIX (wls), WL_SLURM_SUBNET (10.78.0), WL_SLURM_KILLWAIT (30 s, Slurm's
# default: SIGKILL follows SIGTERM after it), WL_SLURM_MINJOBAGE (60 s a finished job stays
# visible to scontrol), WL_SLURM_UP_TIMEOUT (30 s for all nodes to be idle).
set -euo pipefail

PREFIX="${WL_SLURM_PREFIX:-wls}"
SUBNET="${WL_SLURM_SUBNET:-10.78.0}"
KILLWAIT="${WL_SLURM_KILLWAIT:-30}"
MINJOBAGE="${WL_SLURM_MINJOBAGE:-60}"
UP_TIMEOUT="${WL_SLURM_UP_TIMEOUT:-30}"
BASE_OCTET=11
CTL_OCTET=10
ROOT_OCTET=2
MAX_NODES=4
SWITCH_NS="${PREFIX}-switch"
CTL_NS="${PREFIX}-ctl"
ROOT_VETH="${PREFIX}-root"
BRIDGE="br0"
STATE_DIR="/run/${PREFIX}-slurm"
CONF="$STATE_DIR/slurm.conf"
MUNGE_DIR="$STATE_DIR/munge"
MUNGE_SOCKET="$MUNGE_DIR/munge.socket"
CTL_DIR="$STATE_DIR/ctl"
NODE_DIR="$STATE_DIR/node"
SCRIPT_PATH="$(readlink -f "${BASH_SOURCE[0]}")"
DEPS=(slurmctld slurmd slurm-client munge iproute2 util-linux)
TOOLS=(ip nsenter unshare flock mount slurmctld slurmd sinfo sbatch srun scontrol munged)
DAEMON_PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KILLED_PIDS=()

die() { echo "cluster.sh: error: $*" >&2; exit 1; }
info() { echo "cluster.sh: $*" >&2; }

usage() {
  sed -n '2,13p' "$SCRIPT_PATH" | sed 's/^# \{0,1\}//'
}

need_root() { [[ $EUID -eq 0 ]] || die "must run as root"; }

# Serialise commands that change the cluster (up/down) on the script itself, so no lock
# file is left behind.
take_lock() {
  exec 9<"$SCRIPT_PATH"
  flock -w 120 9 || die "timed out waiting for another cluster.sh to finish"
}

check_names() {
  [[ "$PREFIX" =~ ^[a-z][a-z0-9]*$ ]] || die "WL_SLURM_PREFIX must be [a-z][a-z0-9]* (got '$PREFIX')"
  [[ ${#ROOT_VETH} -le 15 ]] || die "WL_SLURM_PREFIX too long (interface $ROOT_VETH > 15 chars)"
  [[ "$SUBNET" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "WL_SLURM_SUBNET must be A.B.C (got '$SUBNET')"
  [[ "$KILLWAIT" =~ ^[0-9]+$ ]] || die "WL_SLURM_KILLWAIT must be seconds (got '$KILLWAIT')"
  [[ "$MINJOBAGE" =~ ^[0-9]+$ ]] || die "WL_SLURM_MINJOBAGE must be seconds (got '$MINJOBAGE')"
}

node_name() { echo "${PREFIX}-node$1"; }
node_addr() { echo "${SUBNET}.$((BASE_OCTET + $1))"; }
ctl_addr() { echo "${SUBNET}.${CTL_OCTET}"; }
root_addr() { echo "${SUBNET}.${ROOT_OCTET}"; }

ns_exists() { [[ -e "/run/netns/$1" ]]; }

# Namespaces of this cluster that exist right now (controller and switch included).
cluster_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' |
    grep -E "^${PREFIX}-(node[0-9]+|ctl|switch)$" || true
}

node_indexes() {
  cluster_namespaces | sed -n "s/^${PREFIX}-node\([0-9][0-9]*\)$/\1/p" | sort -n
}

# Map "wls-node1" / "node1" / "1" to a namespace name; "ctl" / "wls-ctl" to the controller's.
resolve_host() {
  local arg="$1" idx
  case "$arg" in
    ctl | "${CTL_NS}") ns_exists "$CTL_NS" || die "$CTL_NS is not up (run: cluster.sh up)"
                       echo "$CTL_NS"; return 0 ;;
    "${PREFIX}"-node[0-9]*) idx="${arg#"${PREFIX}"-node}" ;;
    node[0-9]*) idx="${arg#node}" ;;
    *) idx="$arg" ;;
  esac
  [[ "$idx" =~ ^[0-9]+$ ]] || die "unknown node '$arg' (expected ${PREFIX}-nodeK, K or ctl)"
  ns_exists "$(node_name "$idx")" || die "node $(node_name "$idx") is not up (run: cluster.sh up)"
  node_name "$idx"
}

# Run a command "on" a host: its network namespace (nsenter, which leaves /sys and
# /sys/fs/cgroup alone), a private UTS namespace with hostname NAME, and a private mount
# namespace where the cluster's hosts file covers /etc/hosts.
in_host() {
  local name="$1"; shift
  # shellcheck disable=SC2016 # $0/$1/$@ are for the inner sh
  nsenter --net="/run/netns/$name" -- unshare --uts --mount --propagation private -- \
    /bin/sh -c 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"' \
    "$name" "$STATE_DIR/hosts" "$@"
}

# Environment of the daemons: minimal, and the cluster's slurm.conf.
daemon_env() {
  env -i PATH="$DAEMON_PATH" HOME=/root LANG=C.UTF-8 SLURM_CONF="$CONF" "$@"
}

# ---------------------------------------------------------------------------- deps
cmd_deps() {
  need_root
  local missing=() pkg
  for pkg in "${DEPS[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$pkg")
    fi
  done
  if [[ ${#missing[@]} -eq 0 ]]; then
    info "deps: all present (${DEPS[*]})"
    return 0
  fi
  command -v apt-get >/dev/null 2>&1 || die "deps: missing ${missing[*]} and no apt-get"
  info "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # The packaged services do not start here (policy-rc.d); that is expected: we start the
  # daemons by hand.
  if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  info "deps: done"
}

missing_tools() {
  local t
  for t in "${TOOLS[@]}"; do
    command -v "$t" >/dev/null 2>&1 || echo "$t"
  done
}

check_tools() {
  if [[ -n "$(missing_tools)" ]]; then
    cmd_deps
    local m; m="$(missing_tools | tr '\n' ' ')"
    [[ -z "$m" ]] || die "missing tools after deps: $m"
  fi
}

# ---------------------------------------------------------------------------- down
# pids of this shell and its ancestors: never kill those (e.g. `exec wls-node0 cluster.sh down`).
self_and_ancestors() {
  local pid=$$
  while [[ -n "$pid" && "$pid" != 0 ]]; do
    echo "$pid"
    pid="$(awk '{print $4}' "/proc/$pid/stat" 2>/dev/null || true)"
  done
}

# True if PID exists and is not a zombie.
alive() {
  local state
  state="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)"
  [[ -n "$state" && "$state" != Z && "$state" != X ]]
}

# Kill every process that lives in a namespace of ours (daemons, slurmstepds, job
# processes, stray `exec` shells). Only processes inside our namespaces are touched.
kill_ns_processes() {
  local ns="$1" pids=() keep pid try
  keep=" $(self_and_ancestors | tr '\n' ' ') "
  for try in 1 2 3 4 5 6 7 8 9 10 11 12; do
    pids=()
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do
      [[ "$keep" == *" $pid "* ]] || { alive "$pid" && pids+=("$pid"); }
    done
    [[ ${#pids[@]} -eq 0 ]] && return 0
    KILLED_PIDS+=("${pids[@]}")
    if [[ $try -lt 6 ]]; then kill -TERM "${pids[@]}" 2>/dev/null || true
    else kill -KILL "${pids[@]}" 2>/dev/null || true; fi
    sleep 0.2
  done
  info "down: processes left in $ns: ${pids[*]}"
}

# Kill a daemon by pid file, only if it is still the process we started.
kill_pidfile() {
  local pidfile="$1" match="$2" pid i
  [[ -f "$pidfile" ]] || return 0
  pid="$(cat "$pidfile" 2>/dev/null || true)"
  if [[ "$pid" =~ ^[0-9]+$ ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$match"; then
    KILLED_PIDS+=("$pid")
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 30; i++)); do
      alive "$pid" || break
      sleep 0.1
    done
    if alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$pidfile"
}

# Wait (briefly) until killed processes are fully gone, zombies included: pid 1 in some
# containers reaps orphans lazily, and `pgrep slurm` would still list them.
wait_reaped() {
  local i pid left
  [[ ${#KILLED_PIDS[@]} -eq 0 ]] && return 0
  for ((i = 0; i < 50; i++)); do
    left=0
    for pid in "${KILLED_PIDS[@]}"; do
      [[ -e "/proc/$pid" ]] && { left=1; break; }
    done
    [[ $left -eq 0 ]] && return 0
    sleep 0.1
  done
}

do_down() {
  local ns f
  KILLED_PIDS=()
  # slurmctld first (so nothing is requeued or rescheduled while nodes go away), then the
  # slurmds and everything they started; by pid file first (also covers a namespace deleted
  # behind our back), then whatever is left inside our namespaces.
  kill_pidfile "$CTL_DIR/slurmctld.pid" slurmctld
  if [[ -d "$NODE_DIR" ]]; then
    for f in "$NODE_DIR"/*/slurmd.pid; do
      [[ -e "$f" ]] && kill_pidfile "$f" slurmd
    done
  fi
  for ns in $(cluster_namespaces); do
    kill_ns_processes "$ns"
  done
  # munged last: slurmctld/slurmd talk to it while shutting down.
  kill_pidfile "$MUNGE_DIR/munged.pid" munged
  for ns in $(cluster_namespaces); do
    ip netns del "$ns" 2>/dev/null || true
  done
  # Deleting the switch namespace deletes the peer and so the root end; be explicit anyway.
  if ip link show dev "$ROOT_VETH" >/dev/null 2>&1; then
    ip link del dev "$ROOT_VETH" 2>/dev/null || true
  fi
  local created_run_netns=0
  [[ -f "$STATE_DIR/created_run_netns" ]] && created_run_netns=1
  rm -rf "${STATE_DIR:?}"
  wait_reaped
  # `ip netns add` made /run/netns a (shared, self-bind) mount point; undo that if we were
  # the ones who did and no namespace at all is left (umount refuses while any
  # namespace of anyone is mounted under it).
  if [[ $created_run_netns -eq 1 ]] && [[ -d /run/netns && -z "$(ls -A /run/netns 2>/dev/null)" ]]; then
    if umount /run/netns 2>/dev/null; then rmdir /run/netns 2>/dev/null || true; fi
  fi
}

cmd_down() {
  need_root
  check_names
  take_lock
  do_down
  info "down: cluster '${PREFIX}' removed"
}

# ---------------------------------------------------------------------------- up
write_hosts_file() {
  local n="$1" j
  {
    echo "127.0.0.1	localhost"
    echo "::1	localhost ip6-localhost ip6-loopback"
    echo "ff02::1	ip6-allnodes"
    echo "ff02::2	ip6-allrouters"
    echo "$(root_addr)	${PREFIX}-root"
    echo "$(ctl_addr)	${CTL_NS}"
    for ((j = 0; j < n; j++)); do
      echo "$(node_addr "$j")	$(node_name "$j")"
    done
  } >"$STATE_DIR/hosts"
}

write_slurm_conf() {
  local n="$1" j nodes=""
  for ((j = 0; j < n; j++)); do nodes+="${nodes:+,}$(node_name "$j")"; done
  cat >"$CONF" <<EOF
# Slurm test cluster '${PREFIX}', generated by $SCRIPT_PATH; removed by 'cluster.sh down'.
ClusterName=${PREFIX}
SlurmctldHost=${CTL_NS}($(ctl_addr))
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job is held cred_expire+1 s before it may start again (default 120).
AuthInfo=socket=${MUNGE_SOCKET},cred_expire=10
StateSaveLocation=${CTL_DIR}/state
SlurmctldPidFile=${CTL_DIR}/slurmctld.pid
SlurmctldLogFile=${CTL_DIR}/slurmctld.log
SlurmdSpoolDir=${NODE_DIR}/%n/spool
SlurmdPidFile=${NODE_DIR}/%n/slurmd.pid
SlurmdLogFile=${NODE_DIR}/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
# The fake nodes all share this machine's CPUs.
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MinJobAge=${MINJOBAGE}
KillWait=${KILLWAIT}
JobRequeue=1
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=DEFAULT Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=4000 State=UNKNOWN
EOF
  for ((j = 0; j < n; j++)); do
    echo "NodeName=$(node_name "$j") NodeAddr=$(node_addr "$j")" >>"$CONF"
  done
  # OverSubscribe=FORCE:4: up to 4 jobs may share a core (no gang scheduling: they simply
  # run side by side), so tests can run several multi-task jobs at once.
  echo "PartitionName=debug Nodes=${nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4" >>"$CONF"
}

wait_pidfile() {
  local pidfile="$1" what="$2" log="$3" i
  for ((i = 0; i < 100; i++)); do
    if [[ -s "$pidfile" ]] && alive "$(cat "$pidfile")"; then return 0; fi
    sleep 0.1
  done
  up_failed "$what did not start (no live pid in $pidfile)" "$log"
}

# Print the tails of the daemons' logs and die; the cluster is left up for debugging.
up_failed() {
  local msg="$1" log seen=" "
  shift
  {
    echo "cluster.sh: error: $msg"
    for log in "$@" "$MUNGE_DIR/munged.log" "$CTL_DIR/slurmctld.log" "$NODE_DIR"/*/slurmd.log "$STATE_DIR"/*.out; do
      [[ -s "$log" && "$seen" != *" $log "* ]] || continue
      seen+="$log "
      echo "---- tail $log"
      tail -n 25 "$log"
    done
    echo "cluster.sh: cluster left up for debugging; 'cluster.sh down' removes it"
  } >&2
  exit 1
}

start_munged() {
  install -d -m 755 "$MUNGE_DIR"
  dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
  chmod 600 "$MUNGE_DIR/munge.key"
  daemon_env munged --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCKET" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
    --seed-file="$MUNGE_DIR/munged.seed" >"$STATE_DIR/munged.out" 2>&1 9<&- ||
    up_failed "munged failed to start" "$STATE_DIR/munged.out"
  wait_pidfile "$MUNGE_DIR/munged.pid" munged "$MUNGE_DIR/munged.log"
  chmod 755 "$MUNGE_DIR"
}

start_slurmctld() {
  mkdir -p "$CTL_DIR/state"
  in_host "$CTL_NS" env -i PATH="$DAEMON_PATH" HOME=/root LANG=C.UTF-8 SLURM_CONF="$CONF" \
    slurmctld -f "$CONF" >"$STATE_DIR/slurmctld.out" 2>&1 9<&- ||
    up_failed "slurmctld failed to start" "$STATE_DIR/slurmctld.out"
  wait_pidfile "$CTL_DIR/slurmctld.pid" slurmctld "$CTL_DIR/slurmctld.log"
}

start_slurmd() {
  local idx="$1" name
  name="$(node_name "$idx")"
  mkdir -p "$NODE_DIR/$name/spool"
  in_host "$name" env -i PATH="$DAEMON_PATH" HOME=/root LANG=C.UTF-8 SLURM_CONF="$CONF" \
    slurmd -f "$CONF" -N "$name" >"$STATE_DIR/$name.out" 2>&1 9<&- ||
    up_failed "slurmd on $name failed to start" "$STATE_DIR/$name.out"
}

# sinfo lines "NODE STATE" for this cluster.
node_states() {
  SLURM_CONF="$CONF" sinfo -h -N -o '%N %T' 2>/dev/null || true
}

wait_idle() {
  local n="$1" deadline states idle
  deadline=$((SECONDS + UP_TIMEOUT))
  while true; do
    states="$(node_states)"
    idle="$(echo "$states" | awk '$2 == "idle"' | sort -u | wc -l)"
    [[ "$idle" -eq "$n" ]] && return 0
    ((SECONDS < deadline)) || break
    sleep 0.1
  done
  up_failed "nodes not idle after ${UP_TIMEOUT}s; sinfo says: $(echo "${states:-nothing}" | tr '\n' ';')"
}

add_link() {
  local ns="$1" ifname_port="$2" addr="$3" mac="$4"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip -n "$ns" link add eth0 address "$mac" type veth peer name "$ifname_port" netns "$SWITCH_NS"
  ip -n "$SWITCH_NS" link set "$ifname_port" master "$BRIDGE" up
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
}

cmd_up() {
  need_root
  check_names
  local n="${1:-2}" i t0
  [[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 && "$n" -le $MAX_NODES ]] || die "N must be 1..$MAX_NODES (got '$n')"
  check_tools
  take_lock
  t0=$SECONDS
  if [[ -n "$(cluster_namespaces)" || -d "$STATE_DIR" ]] || ip link show dev "$ROOT_VETH" >/dev/null 2>&1; then
    info "up: tearing down the existing cluster first"
    do_down
  fi
  if ip -4 route show | grep -q "^${SUBNET//./\\.}\.0/24 "; then
    die "${SUBNET}.0/24 is already routed in the root namespace (another cluster? set WL_SLURM_SUBNET)"
  fi

  local run_netns_was_mounted=0
  mountpoint -q /run/netns 2>/dev/null && run_netns_was_mounted=1
  install -d -m 755 "$STATE_DIR" "$NODE_DIR"
  [[ $run_netns_was_mounted -eq 1 ]] || touch "$STATE_DIR/created_run_netns"
  echo "$n" >"$STATE_DIR/nodes"
  write_hosts_file "$n"
  write_slurm_conf "$n"

  # The switch: one bridge in its own namespace; the root namespace gets a port too.
  ip netns add "$SWITCH_NS"
  ip -n "$SWITCH_NS" link set lo up
  ip -n "$SWITCH_NS" link add "$BRIDGE" type bridge
  ip -n "$SWITCH_NS" link set "$BRIDGE" up
  ip link add "$ROOT_VETH" address "02:78:00:00:00:$(printf '%02x' "$ROOT_OCTET")" \
    type veth peer name porthost netns "$SWITCH_NS"
  ip -n "$SWITCH_NS" link set porthost master "$BRIDGE" up
  ip addr add "$(root_addr)/24" dev "$ROOT_VETH"
  ip link set "$ROOT_VETH" up
  add_link "$CTL_NS" portctl "$(ctl_addr)" "02:78:00:00:00:$(printf '%02x' "$CTL_OCTET")"
  for ((i = 0; i < n; i++)); do
    add_link "$(node_name "$i")" "port$i" "$(node_addr "$i")" \
      "02:78:00:00:00:$(printf '%02x' $((BASE_OCTET + i)))"
  done

  start_munged
  start_slurmctld
  for ((i = 0; i < n; i++)); do start_slurmd "$i"; done
  for ((i = 0; i < n; i++)); do
    wait_pidfile "$NODE_DIR/$(node_name "$i")/slurmd.pid" "slurmd on $(node_name "$i")" \
      "$NODE_DIR/$(node_name "$i")/slurmd.log"
  done
  wait_idle "$n"
  info "up: $n nodes idle after $((SECONDS - t0))s on ${SUBNET}.0/24 (controller $CTL_NS, root namespace $(root_addr))"
  SLURM_CONF="$CONF" sinfo
  echo "export SLURM_CONF=$CONF"
}

# ---------------------------------------------------------------------------- status
cmd_status() {
  local name pid
  if [[ -z "$(cluster_namespaces)" ]]; then
    echo "cluster '${PREFIX}': down"
    [[ -d "$STATE_DIR" ]] && echo "  (stale state dir $STATE_DIR; run: cluster.sh down)"
    return 0
  fi
  echo "cluster '${PREFIX}': up (SLURM_CONF=$CONF)"
  pid="$(cat "$MUNGE_DIR/munged.pid" 2>/dev/null || true)"
  echo "munged:    ${pid:-none}$([[ -n "$pid" ]] && ! alive "$pid" && echo ' (dead)')"
  pid="$(cat "$CTL_DIR/slurmctld.pid" 2>/dev/null || true)"
  echo "slurmctld: ${pid:-none}$([[ -n "$pid" ]] && ! alive "$pid" && echo ' (dead)') on $CTL_NS $(ctl_addr)"
  for idx in $(node_indexes); do
    name="$(node_name "$idx")"
    pid="$(cat "$NODE_DIR/$name/slurmd.pid" 2>/dev/null || true)"
    echo "slurmd:    ${pid:-none}$([[ -n "$pid" ]] && ! alive "$pid" && echo ' (dead)') on $name $(node_addr "$idx")"
  done
  SLURM_CONF="$CONF" sinfo || true
}

# ---------------------------------------------------------------------------- env
cmd_env() {
  echo "export SLURM_CONF=$CONF"
}

# ---------------------------------------------------------------------------- exec
cmd_exec() {
  need_root
  [[ $# -ge 1 ]] || die "usage: cluster.sh exec NODE [CMD...]"
  local name; name="$(resolve_host "$1")"; shift
  [[ -f "$STATE_DIR/hosts" ]] || die "no $STATE_DIR/hosts (run: cluster.sh up)"
  [[ $# -ge 1 ]] || set -- bash
  export SLURM_CONF="$CONF"
  in_host "$name" "$@"
}

# ---------------------------------------------------------------------------- main
main() {
  local cmd="${1:-}"
  [[ $# -gt 0 ]] && shift
  case "$cmd" in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) cmd_env ;;
    exec) cmd_exec "$@" ;;
    deps) cmd_deps ;;
    -h | --help | help) usage ;;
    *) usage >&2; exit 2 ;;
  esac
}

main "$@"
