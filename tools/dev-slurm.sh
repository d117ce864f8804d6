#!/usr/bin/env bash
# A single-node Slurm 22.05 cluster on this machine, for development and the Slurm tests.
#
#   tools/dev-slurm.sh start    install what is missing (apt), write the configs, start the daemons,
#                               wait until the node is idle (idempotent: running daemons are kept)
#   tools/dev-slurm.sh stop     stop every daemon this script starts (idempotent)
#   tools/dev-slurm.sh status   say which daemons run and show the node; exit 0 only when all run
#
# Daemons: munged, mariadbd, slurmdbd (accounting: without it `sacct` fails and submitit never
# sees a cancelled job end), slurmctld, slurmd. There is no systemd here: each is started by
# hand with a PID file under $STATE. Settings come from ../shared/reference/platform.md, where
# each was measured. Needs root (or password-less sudo) for apt-get and the daemons.
set -euo pipefail

CLUSTER=seerd-dev
STATE=/run/seerd-dev-slurm            # PID files
LOGS=/var/log/seerd-dev-slurm
SPOOL=/var/spool/seerd-dev-slurm      # slurmctld state (job ids continue across restarts)
DBDIR=/var/lib/seerd-dev-slurm/mysql  # MariaDB data directory
# The client library's compiled-in socket path: slurmdbd finds the server there with no client config.
DBSOCK=/run/mysqld/mysqld.sock
CONF=/etc/slurm
# Lean on purpose (CI installs these on a fresh machine): the MariaDB server core without the
# full server package's galera/perl/rsync dependencies (the client core has my_print_defaults,
# which mariadb-install-db needs).
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server-core mariadb-client-core)
NODE_READY_TIMEOUT_S=${NODE_READY_TIMEOUT_S:-90}

if [[ $EUID -ne 0 ]]; then
    exec sudo -n -E "$0" "$@"
fi
export PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH

say() { echo "dev-slurm: $*"; }
die() { echo "dev-slurm: error: $*" >&2; exit 1; }

# A PID file names a live daemon (PID 1 reaps slowly here: a zombie counts as dead). A daemon
# that is exiting removes its own PID file, maybe between the test and the read: gone is dead.
alive() {
    local pidfile=$1 pid state
    pid=$(cat "$pidfile" 2>/dev/null) || return 1
    [[ -n $pid ]] || return 1
    [[ -r /proc/$pid/stat ]] || return 1
    state=$(sed 's/.*) //' "/proc/$pid/stat" | cut -d' ' -f1)
    [[ $state != Z && $state != X ]]
}

wait_until() {  # wait_until SECONDS WHAT COMMAND...
    local limit=$1 what=$2
    shift 2
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "timed out after ${limit}s waiting for $what (logs: $LOGS)"
        sleep 0.5
    done
}

install_packages() {
    local missing=() pkg
    for pkg in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    say "installing ${missing[*]}"
    # policy-rc.d 101: the packages' scripts must not try to start services (no init system here).
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    rm -f /usr/sbin/policy-rc.d
}

write_if_changed() {  # write_if_changed PATH MODE < content
    local path=$1 mode=$2 tmp
    tmp=$(mktemp)
    cat >"$tmp"
    if [[ -f $path ]] && cmp -s "$tmp" "$path"; then
        rm -f "$tmp"
    else
        install -m "$mode" "$tmp" "$path"
        rm -f "$tmp"
    fi
    chmod "$mode" "$path"
}

write_configs() {
    local host node_line
    host=$(hostname -s)
    mkdir -p "$CONF" "$STATE" "$LOGS" "$SPOOL/ctld" "$SPOOL/d"
    # The node as slurmd sees it (CPUs, sockets, cores, memory); RealMemory a little under the
    # measured figure so that a slurmd restart never finds "less memory than configured".
    node_line=$(slurmd -C | head -n1 | awk '{for (i = 1; i <= NF; i++) {
        if ($i ~ /^RealMemory=/) { split($i, kv, "="); $i = "RealMemory=" int(kv[2] * 0.95) } }
        print }')
    write_if_changed "$CONF/slurm.conf" 644 <<EOF
# Written by seerd tools/dev-slurm.sh: a single-node development cluster.
ClusterName=$CLUSTER
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
MailProg=/bin/true
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
KillWait=10
InactiveLimit=0
MinJobAge=300
$node_line State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    # slurmdbd reads the database as MariaDB's root over the local socket (unix_socket
    # authentication: no password anywhere). slurmdbd refuses a config readable by others.
    write_if_changed "$CONF/slurmdbd.conf" 600 <<EOF
# Written by seerd tools/dev-slurm.sh.
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$LOGS/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=root
EOF
}

start_munge() {
    local pidfile=/run/munge/munged.pid
    alive "$pidfile" && return 0
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
            || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    rm -f /run/munge/munge.socket.2.lock
    runuser -u munge -- munged --pid-file="$pidfile"
    wait_until 20 munged munge -n
    say "munged running"
}

start_mariadb() {
    local pidfile=/run/mysqld/mysqld.pid
    alive "$pidfile" && return 0
    # The server core package (unlike the full server) creates no user for it.
    id mysql >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin mysql
    mkdir -p "$DBDIR" "$(dirname "$DBSOCK")"
    chown mysql:mysql "$DBDIR" "$(dirname "$DBSOCK")"
    if [[ ! -d $DBDIR/mysql ]]; then
        mariadb-install-db --user=mysql --datadir="$DBDIR" --auth-root-authentication-method=socket \
            --skip-test-db >"$LOGS/mariadb-install.log" 2>&1 || die "mariadb-install-db failed: $LOGS/mariadb-install.log"
    fi
    # Small buffers: accounting for a handful of test jobs needs little.
    nohup mariadbd --user=mysql --datadir="$DBDIR" --socket="$DBSOCK" --pid-file="$pidfile" \
        --skip-networking --innodb-buffer-pool-size=16M --log-error="$LOGS/mariadb.log" \
        >/dev/null 2>&1 </dev/null &
    wait_until 60 "mariadbd" test -S "$DBSOCK"
    say "mariadbd running"
}

start_slurmdbd() {
    alive "$STATE/slurmdbd.pid" && return 0
    slurmdbd
    wait_until 60 "slurmdbd (port 6819)" bash -c 'exec 3<>/dev/tcp/127.0.0.1/6819'
    say "slurmdbd running"
}

start_slurmctld() {
    alive "$STATE/slurmctld.pid" && return 0
    slurmctld
    wait_until 60 slurmctld scontrol ping
    say "slurmctld running"
}

start_slurmd() {
    alive "$STATE/slurmd.pid" && return 0
    slurmd -N "$(hostname -s)"
    say "slurmd running"
}

node_state() { sinfo -h -N -o '%T' 2>/dev/null | head -n1; }

node_ready() {
    local state
    state=$(node_state)
    case $state in
        idle*|mixed*|allocated*|completing*) return 0 ;;
        down*|drain*|fail*) scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true ;;
    esac
    return 1
}

accounting_ready() {
    sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx "$CLUSTER"
}

start() {
    install_packages
    write_configs
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurmctld
    # slurmctld registers its cluster with slurmdbd on its own; add it if that has not happened.
    if ! accounting_ready; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null 2>&1 || true
    fi
    wait_until 30 "the cluster in slurmdbd" accounting_ready
    start_slurmd
    wait_until "$NODE_READY_TIMEOUT_S" "node $(hostname -s) to be idle" node_ready
    say "cluster $CLUSTER up: node $(hostname -s) $(node_state)"
}

stop_daemon() {  # stop_daemon NAME PIDFILE
    local name=$1 pidfile=$2 pid
    alive "$pidfile" && pid=$(cat "$pidfile" 2>/dev/null) || { rm -f "$pidfile"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + 30))
    while alive "$pidfile"; do
        if ((SECONDS >= deadline)); then
            kill -KILL "$pid" 2>/dev/null || true
        fi
        ((SECONDS < deadline + 10)) || die "$name (pid $pid) does not stop"
        sleep 0.2
    done
    rm -f "$pidfile"
    say "$name stopped"
}

stop() {
    stop_daemon slurmd "$STATE/slurmd.pid"
    stop_daemon slurmctld "$STATE/slurmctld.pid"
    stop_daemon slurmdbd "$STATE/slurmdbd.pid"
    stop_daemon mariadbd /run/mysqld/mysqld.pid
    stop_daemon munged /run/munge/munged.pid
}

status() {
    local ok=0 entry name pidfile
    for entry in munged:/run/munge/munged.pid mariadbd:/run/mysqld/mysqld.pid slurmdbd:$STATE/slurmdbd.pid \
                 slurmctld:$STATE/slurmctld.pid slurmd:$STATE/slurmd.pid; do
        name=${entry%%:*}
        pidfile=${entry#*:}
        if alive "$pidfile"; then
            echo "$name: running (pid $(cat "$pidfile" 2>/dev/null))"
        else
            echo "$name: stopped"
            ok=3
        fi
    done
    if ((ok == 0)); then
        echo "node: $(node_state)"
        node_ready || ok=3
    fi
    return $ok
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
