#!/bin/bash
# box.sh VENV — the ccsq systemd units of an installed wheel under a REAL systemd (the host's
# /lib/systemd/systemd, 252 on Debian 12), booted as PID 1 of private pid, mount, uts, ipc,
# net and cgroup namespaces, on an overlay of / (all writes go to a tmpfs that vanishes with
# the box: the host's /etc, /var, /usr/local stay untouched). Run by tests/test_systemd_real.py.
#
#   sudo tests/systemd_box/box.sh /opt/some/venv
#
# VENV: a virtual environment with the ccsq wheel installed NOT editable, made from a Python
# the units can see (e.g. /usr/bin/python3 -m venv /opt/x/venv && /opt/x/venv/bin/pip install
# ccsq-*.whl), at a path outside /home, /root, /tmp and /var/tmp. What gets installed is what
# an operator installs: the wheel's own VENV/share/ccsq/systemd/install.sh --venv VENV, run for
# real (user, /etc/ccsq, units, /usr/local/bin links, daemon-reload). The box sees the host's
# files through the overlay, so nothing is downloaded inside it and its network is loopback
# only from the start.
#   CCSQ_BOX_LOGS=DIR   keep the box's journal and console log in DIR
# The swarm runs with CURVE on (libsodium under the units' seccomp and W^X rules).
# The real units, with two drop-ins that only shorten waits so the run fits in the suite:
# broker WatchdogSec=6 (20 in the unit) and ccsq-recover@.timer OnActiveSec=3s (5min).
# Checks, one line each (PASS|FAIL name: evidence): boot, install (every unit of the wheel
# loaded, every /usr/local/bin/ccsq* link into VENV), (a) all active, (b) a worker
# SIGKILLed comes back alone, (c) a SIGSTOPped broker is killed by the watchdog and comes back,
# (d) no process of a unit survives its restart (also a stray one in its cgroup), (g) a crash
# loop is recovered by the timer, (e) stop leaves nothing, (x) exits 78 and 79 are not
# restarted (neither by systemd nor by the timer), (f) every item submitted across all of it is
# acknowledged and `ccsq gap-report` balances.
#
# Needs root, util-linux unshare/nsenter/setpriv, overlayfs, a cgroup2 mount, /lib/systemd/systemd.
# Nothing in the box can touch the host's processes (own pid ns), mounts (rprivate), network
# (own netns, lo only), kernel tunables (/proc/sys read-only), modules or clock (capabilities dropped).
# Exit status: 0 all checks passed, 1 a check failed, 2 the box could not be set up.
# Adapted from the project's shared tools/systemd-box/run.sh.
set -u
SELF=$(readlink -f "$0")

# ---------------------------------------------------------------- stage 1 (inside) ----
# PID 1 of the new pid namespace: build the root, pivot, exec systemd.
if [ "${1:-}" = __stage1 ]; then
    set -eu
    BOX=$2
    cut -d' ' -f4 /proc/self/stat > "$BOX/state/pid1"      # our pid as the host sees it
    mount --make-rprivate /
    mount -t tmpfs -o mode=0755,size=2g ccsq-box "$BOX/mnt"
    mkdir -p "$BOX/mnt/upper" "$BOX/mnt/work" "$BOX/mnt/root"
    mount -t overlay overlay -o "lowerdir=/,upperdir=$BOX/mnt/upper,workdir=$BOX/mnt/work" "$BOX/mnt/root"
    R=$BOX/mnt/root
    mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
    mount --bind "$R/proc/sys" "$R/proc/sys"; mount -o remount,bind,ro "$R/proc/sys" "$R/proc/sys"
    if [ -e "$R/proc/sysrq-trigger" ]; then
        mount --bind "$R/proc/sysrq-trigger" "$R/proc/sysrq-trigger"; mount -o remount,bind,ro "$R/proc/sysrq-trigger"
    fi
    mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$R/sys"
    mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$R/sys/fs/cgroup"   # root = our cgroup ns
    mount -t tmpfs -o mode=0755,nosuid tmpfs "$R/dev"
    for d in null zero full random urandom tty; do touch "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
    mkdir -p "$R/dev/pts" "$R/dev/shm" "$R/dev/mqueue"
    mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$R/dev/pts"
    ln -s pts/ptmx "$R/dev/ptmx"
    mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$R/dev/shm"
    mount -t mqueue mqueue "$R/dev/mqueue"
    ln -s /proc/self/fd "$R/dev/fd"
    for i in 0:stdin 1:stdout 2:stderr; do ln -s "/proc/self/fd/${i%%:*}" "$R/dev/${i#*:}"; done
    touch "$R/dev/console"; mount --bind "$(tty)" "$R/dev/console"      # the launcher's pty
    mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs "$R/run"
    mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$R/tmp"
    mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$R/var/tmp"
    # no host enablements (postgresql, timers, getty...): an empty /etc/systemd/system
    mount -t tmpfs -o mode=0755 tmpfs "$R/etc/systemd/system"
    mkdir -p "$R/etc/systemd/journald.conf.d"
    printf '[Journal]\nStorage=volatile\nRateLimitBurst=0\n' > "$R/etc/systemd/journald.conf.d/ccsq-box.conf"
    rm -rf "$R/etc/ccsq" "$R/var/lib/ccsq" "$R/var/cache/ccsq"     # a host's own ccsq install stays out
    echo ccsq-box > "$R/etc/hostname"; hostname ccsq-box
    cd "$R"; mkdir -p .oldroot; pivot_root . .oldroot; cd /; umount -l /.oldroot; rmdir /.oldroot
    echo "stage1: booting systemd"
    exec unshare --net setpriv \
        --bounding-set -sys_module,-sys_time,-sys_rawio,-syslog,-mac_admin,-mac_override,-wake_alarm,-block_suspend,-sys_pacct \
        env -i container=ccsq-box TERM=dumb /lib/systemd/systemd --unit=basic.target --log-level=info
fi

# ---------------------------------------------------------------- host side -----------
usage() { sed -n '2,31p' "$SELF" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -eq 1 ] || usage
[ "$(id -u)" -eq 0 ] || { echo "box.sh: needs root" >&2; exit 2; }
VENV=$1
INSTALLER=$VENV/share/ccsq/systemd/install.sh
[ -f "$INSTALLER" ] || { echo "box.sh: $INSTALLER not found (install the ccsq wheel into $VENV)" >&2; exit 2; }
[ -x "$VENV/bin/ccsq-brokerd" ] || { echo "box.sh: $VENV/bin/ccsq-brokerd not found" >&2; exit 2; }
[ -x /lib/systemd/systemd ] || { echo "box.sh: /lib/systemd/systemd not found" >&2; exit 2; }
CG2=$(findmnt -rn -t cgroup2 -o TARGET | head -1)
[ -n "$CG2" ] || { echo "box.sh: no cgroup2 mount on the host" >&2; exit 2; }

BOX=$(mktemp -d /tmp/ccsq-box.XXXXXX)
mkdir "$BOX/state" "$BOX/mnt"
HOSTCG=$CG2/$(basename "$BOX")
mkdir "$HOSTCG"
P="" HELPER="" BG_PIDS="" FAILS=0 PASSES=0
T_START=$(date +%s.%N)

cleanup() {
    trap - EXIT INT TERM
    local i
    if [ -n "${CCSQ_BOX_LOGS:-}" ] && [ -n "$P" ] && [ -d "/proc/$P" ]; then
        mkdir -p "$CCSQ_BOX_LOGS"
        B journalctl -b --no-pager -o short-precise > "$CCSQ_BOX_LOGS/journal.txt" 2>&1
        cp "$BOX/state/console.log" "$CCSQ_BOX_LOGS/console.log" 2>/dev/null
    fi
    if [ -n "$P" ] && [ -d "/proc/$P" ]; then
        B systemctl --no-block poweroff >/dev/null 2>&1
        for i in $(seq 40); do [ -d "/proc/$P" ] || break; sleep 0.25; done
        [ -d "/proc/$P" ] && kill -KILL "$P" 2>/dev/null     # PID 1 of the box: ends its pid ns
    fi
    for i in $BG_PIDS; do kill -KILL "$i" 2>/dev/null; done
    if [ -n "$HELPER" ]; then
        for i in $(seq 20); do [ -d "/proc/$HELPER" ] || break; sleep 0.25; done
        kill -TERM "$HELPER" 2>/dev/null
        wait "$HELPER" 2>/dev/null
    fi
    for i in $(seq 20); do [ -z "$(cat "$HOSTCG"/cgroup.procs 2>/dev/null)" ] && break; sleep 0.25; done
    find "$HOSTCG" -depth -type d -exec rmdir {} \; 2>/dev/null
    [ -d "$HOSTCG" ] && echo "cleanup: $HOSTCG still has processes: $(cat "$HOSTCG/cgroup.procs")" >&2
    if findmnt -rn -o TARGET | grep -q "^$BOX"; then
        echo "cleanup: something is mounted under $BOX on the host; left it" >&2
    else
        rm -rf "$BOX"
    fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# B CMD...: run CMD inside the box (all its namespaces, its root), clean environment
B() {
    nsenter -t "$P" -m -u -i -n -p -C -r -w -- setsid -w env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        HOME=/root LANG=C.UTF-8 TERM=dumb SYSTEMD_PAGER=cat SYSTEMD_COLORS=0 "$@"
}
prop() { B systemctl show -p "$2" --value "$1"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
check() {   # check NAME OK(0/1) EVIDENCE
    if [ "$2" -eq 0 ]; then PASSES=$((PASSES + 1)); echo "PASS $1: $3"; else FAILS=$((FAILS + 1)); echo "FAIL $1: $3"; fi
}
jgrep() {   # jgrep CURSOR-FILE REGEX: journal lines since the cursor matching REGEX
    B journalctl --no-pager -o cat --after-cursor="$(cat "$1")" 2>/dev/null | grep -E "$2"
}
mark() { B journalctl -n 1 -o cat --show-cursor --no-pager 2>/dev/null | sed -n 's/^-- cursor: //p' > "$BOX/state/$1.cursor"; echo "$BOX/state/$1.cursor"; }
alive() { [ -d "/proc/$1" ] && ! grep -q '^State:.*Z' "/proc/$1/status" 2>/dev/null; }
unit_pids() { B cat "/sys/fs/cgroup$(prop "$1" ControlGroup)/cgroup.procs" 2>/dev/null | tr '\n' ' '; }
box_pid_alive() { B sh -c "[ -d /proc/$1 ] && ! grep -q '^State:.*Z' /proc/$1/status"; }
within() { awk -v s="$(since "$1")" -v t="$2" 'BEGIN { exit !(s < t) }'; }
wait_active_new() {   # wait_active_new UNIT OLDPID TIMEOUT: prints the main pid; 0 once active with a new main pid
    local t0 pid st
    t0=$(now)
    while within "$t0" "$3"; do
        pid=$(prop "$1" MainPID); st=$(prop "$1" ActiveState)
        if [ "$st" = active ] && [ "$pid" != 0 ] && [ "$pid" != "$2" ]; then echo "$pid"; return 0; fi
        sleep 0.2
    done
    echo "$pid"; return 1
}
wait_journal() {   # wait_journal CURSOR-FILE REGEX TIMEOUT: 0 once a journal line since the cursor matches
    local t0; t0=$(now)
    while within "$t0" "$3"; do jgrep "$1" "$2" >/dev/null && return 0; sleep 0.3; done
    return 1
}
status_line() { for u in "$@"; do printf '%s=%s/%s pid=%s restarts=%s; ' "${u%.service}" "$(prop "$u" ActiveState)" "$(prop "$u" SubState)" "$(prop "$u" MainPID)" "$(prop "$u" NRestarts)"; done; }
oneline() { tr '\n' '|' | sed 's/|$//'; }

W0=ccsq-workerd@0.service W1=ccsq-workerd@1.service BR=ccsq-brokerd.service CO=ccsq-completion.service
UNITS="$BR $W0 $W1 $CO"
echo "box: $BOX, cgroup $HOSTCG, venv $VENV"

# ---- boot
setsid /usr/bin/python3 -c '
import os, subprocess, sys
log = open(sys.argv[1], "ab", buffering=0)
m, s = os.openpty()
p = subprocess.Popen(sys.argv[2:], stdin=s, stdout=s, stderr=s, start_new_session=True, close_fds=True)
os.close(s)
while True:
    try:
        b = os.read(m, 65536)
    except OSError:
        break
    if not b:
        break
    log.write(b)
sys.exit(p.wait())
' "$BOX/state/console.log" sh -c "echo \$\$ > '$HOSTCG/cgroup.procs' && exec unshare --pid --fork --mount --uts --ipc --cgroup --propagation private '$SELF' __stage1 '$BOX'" \
    </dev/null >"$BOX/state/helper.out" 2>&1 &
HELPER=$!
T_BOOT=$(now)
booted=1
for _ in $(seq 240); do
    [ -s "$BOX/state/pid1" ] && P=$(cat "$BOX/state/pid1")
    if [ -n "$P" ] && [ "$(cat "/proc/$P/comm" 2>/dev/null)" = systemd ]; then booted=0; break; fi
    [ -d "/proc/$HELPER" ] || break
    sleep 0.25
done
if [ $booted -ne 0 ]; then
    echo "box: systemd did not start; console:"; tail -30 "$BOX/state/console.log"; cat "$BOX/state/helper.out"; exit 2
fi
for _ in $(seq 180); do B test -S /run/systemd/private && break; sleep 0.5; done
state=$(B timeout 90 systemctl is-system-running --wait 2>&1)
check boot "$([ "$state" = running ] && echo 0 || echo 1)" "systemd $(B systemctl --version | head -1 | cut -d' ' -f2-3) is PID 1 of the box (host pid $P), is-system-running=$state after $(since "$T_BOOT") s; failed units: $(B systemctl --failed --no-legend --plain | awk '{ print $1 }' | oneline)"
[ "$state" = running ] || [ "$state" = degraded ] || { tail -30 "$BOX/state/console.log"; exit 2; }

# ---- install the units with the wheel's own installer, for real, then the two timing drop-ins
if ! out=$(B sh "$INSTALLER" --venv "$VENV" 2>&1); then
    echo "$out"; check install 1 "$INSTALLER --venv $VENV failed"; exit 1
fi
# everything the installer promises: each unit it carries loaded by systemd, each link into VENV
bad_units="" bad_links=""
for f in "$VENV"/share/ccsq/systemd/*.service "$VENV"/share/ccsq/systemd/*.timer; do
    u=$(basename "$f"); probe=$u
    case "$u" in *@.*) probe="${u%%@.*}@probe.${u##*@.}" ;; esac
    B cmp -s "$f" "/etc/systemd/system/$u" && [ "$(prop "$probe" LoadState)" = loaded ] || bad_units="$bad_units $u"
done
for bin in ccsq ccsq-brokerd ccsq-workerd ccsq-completiond ccsq-console ccsq-relayd; do
    [ "$(B readlink "/usr/local/bin/$bin")" = "$VENV/bin/$bin" ] || bad_links="$bad_links $bin"
done
if [ -n "$bad_units$bad_links" ]; then
    echo "$out"; check install 1 "$INSTALLER --venv $VENV: units not installed or not loaded:${bad_units:- none}; /usr/local/bin links missing:${bad_links:- none}"; exit 1
fi
B sh -euc '
mkdir -p /etc/systemd/system/ccsq-brokerd.service.d /etc/systemd/system/ccsq-recover@.timer.d
printf "[Service]\n# box: shorter than the unit'"'"'s 20 s so the test is quick\nWatchdogSec=6\n" > /etc/systemd/system/ccsq-brokerd.service.d/zz-box.conf
printf "[Timer]\n# box: shorter than the unit'"'"'s 5min\nOnActiveSec=\nOnActiveSec=3s\nAccuracySec=1s\n" > /etc/systemd/system/ccsq-recover@.timer.d/zz-box.conf
systemctl daemon-reload'
check install 0 "$INSTALLER --venv $VENV: $(ls "$VENV"/share/ccsq/systemd/ | grep -vc install.sh) units loaded, 6 links in /usr/local/bin, $(echo "$out" | grep -c '^+ ') steps incl. $(echo "$out" | grep -E '^\+ (useradd|systemctl)' | cut -c3-40 | oneline); drop-ins: broker WatchdogSec=6, recover timer OnActiveSec=3s"

# ---- a swarm (ccsq init), configured for the units as docs/operations.md says
B bash -euc '
ccsq init /root/swarm --handler sleep --workers 2 >/dev/null
cd /root/swarm
test -f workerd-0.toml && test -f workerd-1.toml
sed -i "s|^data_dir = .*|data_dir = \"/var/lib/ccsq/broker\"|" brokerd.toml admin.toml
for g in 0 1; do sed -i "s|^journal_dir = .*|journal_dir = \"/var/lib/ccsq/worker-$g\"|" workerd-$g.toml; done
sed -i "s|^claim_store = .*|claim_store = \"file:///var/lib/ccsq/blobs\"|" workerd-*.toml completion.toml producer.toml
sed -i "s|^database = .*|database = \"sqlite:////var/lib/ccsq/completion/results.db\"|" completion.toml
# CURVE with the allow-list, as `ccsq init` sets it for an endpoint beyond loopback (the box has only lo)
sed -i "s|^curve = false|curve = true|" *.toml
grep -q "^curve = true" brokerd.toml
install -d -m 0750 -o root -g ccsq /etc/ccsq/keys
install -m 0600 -o ccsq -g ccsq keys/*.key /etc/ccsq/keys/
install -m 0640 -o root -g ccsq keys/*.pub /etc/ccsq/keys/
install -m 0640 -o root -g ccsq *.toml /etc/ccsq/
printf "# box: every unit reads this optional file\nCCSQ_BOX_ENV=1\n" > /etc/ccsq/ccsq.env; chown root:ccsq /etc/ccsq/ccsq.env; chmod 0640 /etc/ccsq/ccsq.env
mkdir -p /tmp/items; chmod 0755 /tmp/items
' || { check swarm 1 "ccsq init / config copy failed"; exit 1; }

make_items() { B sh -c "mkdir -p /tmp/items/$1 && for i in \$(seq $2); do echo '$1 item '\$i' $(now)' > /tmp/items/$1/\$i.txt; done; chmod -R a+rX /tmp/items"; }
submit() {   # submit NAME [--wait]: ccsq submit as user ccsq
    B setpriv --reuid=ccsq --regid=ccsq --init-groups -- sh -c "ccsq submit --config /etc/ccsq/producer.toml --kind sleep $2 --timeout-s 150 /tmp/items/$1/*.txt"
}
acked() { grep -c ' acknowledged ' "$1"; }
TOTAL=0

# ---- (a) start everything: all active
C=$(mark a); T=$(now)
out=$(B timeout 150 systemctl start $UNITS 2>&1); rc=$?
bad=0; for u in $UNITS; do [ "$(prop "$u" ActiveState)" = active ] || bad=1; done
envok=1; bpid=$(prop $BR MainPID)
[ "${bpid:-0}" -gt 1 ] && B sh -c "tr '\\0' '\\n' < /proc/$bpid/environ" | grep -q '^CCSQ_BOX_ENV=1$' && envok=0
check a "$([ $rc -eq 0 ] && [ $bad -eq 0 ] && [ $envok -eq 0 ] && echo 0 || echo 1)" "systemctl start rc=$rc in $(since "$T") s; $(status_line $UNITS) broker environment has ccsq.env's CCSQ_BOX_ENV: $([ $envok -eq 0 ] && echo yes || echo no)${out:+; systemctl said: $(echo "$out" | head -1)}"
if [ $bad -ne 0 ]; then
    for u in $UNITS; do
        [ "$(prop "$u" ActiveState)" = active ] && continue
        echo "  $u: Result=$(prop "$u" Result) ExecMain=$(prop "$u" ExecMainCode)/$(prop "$u" ExecMainStatus); journal:"
        B journalctl --no-pager -o cat -u "$u" | tail -8 | sed 's/^/    /'
    done
    echo "RESULT: $PASSES passed, $FAILS failed (units do not start; stopped) in $(since "$T_START") s"; exit 1
fi
make_items A 10; TOTAL=$((TOTAL + 10))
submit A --wait > "$BOX/state/A.out" 2>&1; rcA=$?
check f1 "$([ $rcA -eq 0 ] && [ "$(acked "$BOX/state/A.out")" -eq 10 ] && echo 0 || echo 1)" "batch A: submit --wait rc=$rcA, $(acked "$BOX/state/A.out")/10 acknowledged before any fault $([ $rcA -eq 0 ] || tail -2 "$BOX/state/A.out" | oneline)"

# ---- (b) systemctl kill -s KILL ccsq-workerd@0: restarts on its own, the others keep running
make_items B 60; TOTAL=$((TOTAL + 60))
submit B --wait > "$BOX/state/B.out" 2>&1 &
SUBMIT_B=$!; BG_PIDS="$BG_PIDS $SUBMIT_B"
sleep 1
old_w0=$(prop $W0 MainPID); old_w0_all=$(unit_pids $W0)
others_before=""; for u in $BR $W1 $CO; do others_before="$others_before $(prop "$u" MainPID)"; done
C=$(mark b); T=$(now)
B systemctl kill -s KILL $W0
new_w0=$(wait_active_new $W0 "$old_w0" 40); rcb=$?
took=$(since "$T")
others_after=""; for u in $BR $W1 $CO; do others_after="$others_after $(prop "$u" MainPID)"; done
others_ok=1; [ "$others_before" = "$others_after" ] && others_ok=0
for u in $BR $W1 $CO; do [ "$(prop "$u" ActiveState)" = active ] || others_ok=1; done
check b "$([ $rcb -eq 0 ] && [ $others_ok -eq 0 ] && echo 0 || echo 1)" "worker@0 pid $old_w0 -> $new_w0 active again after $took s (NRestarts=$(prop $W0 NRestarts)); broker/worker@1/completion main pids [$others_before ] -> [$others_after ]"
left=""; for p in $old_w0_all; do box_pid_alive "$p" && left="$left $p"; done
check d1 "$([ -z "$left" ] && echo 0 || echo 1)" "worker@0 cgroup before the kill [$old_w0_all] -> still alive: [${left:- none}]; now [$(unit_pids $W0)]"
wait "$SUBMIT_B"; rcB=$?; BG_PIDS=${BG_PIDS/ $SUBMIT_B/}
check f2 "$([ $rcB -eq 0 ] && [ "$(acked "$BOX/state/B.out")" -eq 60 ] && echo 0 || echo 1)" "batch B (in flight across the worker@0 SIGKILL): submit --wait rc=$rcB, $(acked "$BOX/state/B.out")/60 acknowledged"

# ---- (c) SIGSTOP the broker: the watchdog kills and restarts it
make_items C 100; TOTAL=$((TOTAL + 100))
submit C "" > "$BOX/state/C1.out" 2>&1; rcC1=$?
old_b=$(prop $BR MainPID); old_b_all=$(unit_pids $BR)
C=$(mark c); T=$(now)
B kill -STOP "$old_b"
t_kill="" t_up=""
while within "$T" 60; do
    pid=$(prop $BR MainPID); sub=$(prop $BR SubState)
    if [ -z "$t_kill" ] && { [ "$pid" != "$old_b" ] || [ "$sub" != running ]; }; then t_kill=$(since "$T"); fi
    if [ -n "$t_kill" ] && [ "$pid" != 0 ] && [ "$pid" != "$old_b" ] && [ "$(prop $BR ActiveState)" = active ]; then t_up=$(since "$T"); break; fi
    sleep 0.2
done
okc=1
if [ -n "$t_up" ] && jgrep "$C" 'ccsq-brokerd.service: Watchdog timeout' >/dev/null; then okc=0; fi
check c "$okc" "WatchdogSec=$(prop $BR WatchdogUSec); SIGSTOP of broker pid $old_b -> watchdog acted after ${t_kill:-never} s, active again (pid $(prop $BR MainPID)) after ${t_up:-never} s; journal: $(jgrep "$C" 'brokerd.service: (Watchdog timeout|Main process exited|Failed with|Scheduled restart)' | oneline); faulthandler: $(jgrep "$C" 'Fatal Python error' | head -1)"
left=""; for p in $old_b_all; do box_pid_alive "$p" && left="$left $p"; done
check d2 "$([ -z "$left" ] && echo 0 || echo 1)" "broker cgroup before the watchdog kill [$old_b_all] -> still alive: [${left:- none}]"
submit C --wait > "$BOX/state/C2.out" 2>&1; rcC2=$?
check f3 "$([ $rcC1 -eq 0 ] && [ $rcC2 -eq 0 ] && [ "$(acked "$BOX/state/C2.out")" -eq 100 ] && echo 0 || echo 1)" "batch C (100 accepted just before the SIGSTOP, rc=$rcC1; waited for after the restart): resubmit --wait rc=$rcC2, $(grep -c ' dup ' "$BOX/state/C2.out") answered as duplicates, $(acked "$BOX/state/C2.out")/100 acknowledged"

# ---- (d) KillMode=mixed with a stray process in the unit's cgroup (e.g. a leaked inference process)
plant() {   # plant UNIT: a sleep in the box's pid ns, moved into UNIT's cgroup -> STRAY (host pid), STRAY_BOX
    local ns child=""
    nsenter -t "$P" -m -u -i -n -p -r -w -- /bin/sleep 900 </dev/null >/dev/null 2>&1 &
    ns=$!; BG_PIDS="$BG_PIDS $ns"; disown "$ns"
    for _ in $(seq 40); do child=$(tr -d ' ' < "/proc/$ns/task/$ns/children" 2>/dev/null); [ -n "$child" ] && break; sleep 0.05; done
    echo "$child" > "$HOSTCG$(prop "$1" ControlGroup)/cgroup.procs"
    STRAY=$child; STRAY_BOX=$(awk '/^NSpid:/ { print $3 }' "/proc/$child/status")
}
make_items D 40; TOTAL=$((TOTAL + 40))
submit D --wait > "$BOX/state/D.out" 2>&1 &
SUBMIT_D=$!; BG_PIDS="$BG_PIDS $SUBMIT_D"
plant $W1; s1=$STRAY s1box=$STRAY_BOX
inside=$(unit_pids $W1)
T=$(now)
B systemctl restart $W1
took=$(since "$T"); sleep 0.3
check d3 "$(! alive "$s1" && [ "$(prop $W1 ActiveState)" = active ] && echo 0 || echo 1)" "stray sleep (box pid $s1box) in worker@1's cgroup [$inside]; systemctl restart took $took s; stray alive afterwards: $(alive "$s1" && echo yes || echo no)"
plant $W1; s2=$STRAY s2box=$STRAY_BOX
old_w1=$(prop $W1 MainPID)
T=$(now)
B systemctl kill --kill-whom=main -s KILL $W1
new_w1=$(wait_active_new $W1 "$old_w1" 60); rcd=$?
took=$(since "$T"); sleep 0.3
check d4 "$([ $rcd -eq 0 ] && ! alive "$s2" && echo 0 || echo 1)" "SIGKILL of worker@1's main pid $old_w1 only, a stray sleep (box pid $s2box) beside it: new main $new_w1 active after $took s, stray alive: $(alive "$s2" && echo yes || echo no)"
wait "$SUBMIT_D"; rcD=$?; BG_PIDS=${BG_PIDS/ $SUBMIT_D/}
check f4 "$([ $rcD -eq 0 ] && [ "$(acked "$BOX/state/D.out")" -eq 40 ] && echo 0 || echo 1)" "batch D (across the worker@1 restarts): submit --wait rc=$rcD, $(acked "$BOX/state/D.out")/40 acknowledged"

# ---- (g) crash loop: SIGKILL worker@1 until systemd gives up; OnFailure= arms the recover timer,
# which (3 s here, 5 min in the unit) resets and starts it again by itself
C=$(mark g); T=$(now); kills=0
for _ in $(seq 10); do
    [ "$(prop $W1 ActiveState)" = failed ] && break
    pid=$(prop $W1 MainPID)
    if [ "$(prop $W1 ActiveState)" = active ] && [ "${pid:-0}" -gt 1 ]; then B kill -KILL "$pid"; kills=$((kills + 1)); fi
    for _ in $(seq 100); do
        st=$(prop $W1 ActiveState)
        if { [ "$st" = active ] && [ "$(prop $W1 MainPID)" != "$pid" ]; } || [ "$st" = failed ]; then break; fi
        sleep 0.2
    done
done
res=$(prop $W1 Result); st=$(prop $W1 ActiveState); t_fail=$(since "$T")
gave_up=$(jgrep "$C" 'workerd@1.service: (Start request repeated too quickly|Triggering OnFailure)' | sort -u | oneline)
new_w1=$(wait_active_new $W1 0 40); rcg=$?
t_back=$(since "$T")
rec=$(B journalctl --no-pager -o cat -u "ccsq-recover@$W1.service" | grep "^$W1 " | tail -1)
check g "$([ "$st" = failed ] && [ $rcg -eq 0 ] && echo "$rec" | grep -q 'start it again' && echo 0 || echo 1)" "$kills SIGKILLs in a row: worker@1 $st with Result=$res after $t_fail s (journal: $gave_up); the recover timer brought it back by itself: worker@1 $(prop $W1 ActiveState) pid $new_w1 after $t_back s; ccsq-recover@: '$rec'"

# ---- (f) the books balance
rep() { B setpriv --reuid=ccsq --regid=ccsq --init-groups -- ccsq gap-report --config /etc/ccsq/brokerd.toml --json 2>/dev/null; }
SUMM='
import json, sys
r = json.load(sys.stdin); n = int(sys.argv[1])
keys = ("received", "completed", "acknowledged", "dead", "expired", "redelivered", "duplicate_submits")
gaps = ", ".join("%s=%s" % (w["id"], w["count"]) for w in r["windows"] if w["count"])
c = r["counters"]
ok = r["balanced"] and c["received"] == n and c["acknowledged"] == n
print("ok" if ok else "bad", "balanced=%s" % r["balanced"], " ".join("%s=%s" % (k, c.get(k)) for k in keys),
      "gap windows hit: %s" % (gaps or "none"))
'
summ() { /usr/bin/python3 -c "$SUMM" "$TOTAL"; }
out=$(rep | summ 2>&1)
check f5 "$([ "${out%% *}" = ok ] && echo 0 || echo 1)" "gap-report (broker running) for $TOTAL items: ${out#* }"

# ---- (e) systemctl stop of everything leaves no processes
declare -A CGP; for u in $UNITS; do CGP[$u]=$(prop "$u" ControlGroup); done
C=$(mark e); T=$(now)
B timeout 150 systemctl stop $UNITS; rce=$?
took=$(since "$T")
bad=0; detail=""
for u in $UNITS; do
    st=$(prop "$u" ActiveState); res=$(prop "$u" Result); code=$(prop "$u" ExecMainCode)/$(prop "$u" ExecMainStatus)
    cg=$(B cat "/sys/fs/cgroup${CGP[$u]}/cgroup.procs" 2>/dev/null | wc -l)
    [ "$st" = inactive ] && [ "$res" = success ] && [ "$cg" -eq 0 ] || bad=1
    detail="$detail${u%.service}=$st/$res exit=$code procs-left=$cg; "
done
rest=$(B ps -e -o pid=,user=,args= | awk '$2 == "ccsq" || /ccsq-(brokerd|workerd|completiond)|ccsq completion/' | grep -v awk)
[ -z "$rest" ] || bad=1
sigkill=$(jgrep "$C" 'ccsq-.*(State .stop-sigterm. timed out|Killing process .* with signal SIGKILL|remains running)')
[ -z "$sigkill" ] || bad=1
check e "$([ $rce -eq 0 ] && [ $bad -eq 0 ] && echo 0 || echo 1)" "systemctl stop rc=$rce in $took s: $detail ccsq processes left: ${rest:-none}; SIGKILL/timeout lines: ${sigkill:-none}"
out=$(rep | summ 2>&1)
check f6 "$([ "${out%% *}" = ok ] && echo 0 || echo 1)" "gap-report after the stop (read-only ledger): ${out#* }"

# ---- (x) exits 78 (a config key that does not exist) and 79 (provider cuda, no GPU) are final:
# systemd does not restart them, and the recover timer they arm leaves them failed
B sh -euc '
printf "no_such_key = 1\n" >> /etc/ccsq/workerd-0.toml
sed -i "/^provider = /d" /etc/ccsq/workerd-1.toml; printf "provider = \"cuda\"\n" >> /etc/ccsq/workerd-1.toml'
C=$(mark x); T=$(now)
B timeout 60 systemctl start $W0 $W1 >/dev/null 2>&1
okx=0; detail=""
for u in $W0:78 $W1:79; do
    unit=${u%:*} want=${u#*:}
    wait_journal "$C" "ccsq-recover@$unit.service: Deactivated|ccsq-recover@$unit.service: Succeeded|^$unit exited" 30 || okx=1
    sleep 0.5
    st=$(prop "$unit" ActiveState) code=$(prop "$unit" ExecMainStatus) n=$(prop "$unit" NRestarts)
    rec=$(B journalctl --no-pager -o cat -u "ccsq-recover@$unit.service" | grep "^$unit" | tail -1)
    [ "$st" = failed ] && [ "$code" = "$want" ] && [ "$n" = 0 ] && echo "$rec" | grep -q "exited $want .*not restarted" || okx=1
    detail="$detail${unit%.service}: $st, exit $code, NRestarts=$n, ccsq-recover@: '$rec'; "
done
check x "$okx" "after $(since "$T") s: $detail"

echo "RESULT: $PASSES passed, $FAILS failed in $(since "$T_START") s"
[ $FAILS -eq 0 ]
