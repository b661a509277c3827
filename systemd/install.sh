#!/bin/sh
# Install the ccsq systemd units (what `make install-systemd` runs).
#
#   systemd/install.sh [--dry-run] [--venv DIR] [--root DIR]
#
#   --dry-run   print every step, change nothing
#   --venv DIR  link /usr/local/bin/{ccsq,ccsq-brokerd,ccsq-workerd} to DIR/bin/...
#               (a virtual environment outside /home and /root: the units run with ProtectHome=yes)
#   --root DIR  install the unit files under DIR (a package or image staging tree) and stop
#               there: no user, no links, no daemon-reload
#
# Steps: create the system user and group `ccsq` (static, so the ledger and keys keep
# their owner across restarts and reinstalls), create /etc/ccsq (root:ccsq 0750),
# copy the units to /etc/systemd/system (0644), `systemctl daemon-reload`.
# It enables and starts nothing: docs/operations.md lists the next commands.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
dry_run=0
venv=""
root=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --venv) [ $# -ge 2 ] || { echo "install.sh: --venv needs a directory" >&2; exit 2; }; venv=$2; shift ;;
        --root) [ $# -ge 2 ] || { echo "install.sh: --root needs a directory" >&2; exit 2; }; root=$2; shift ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

units="ccsq-brokerd.service ccsq-workerd@.service ccsq-completion.service ccsq-recover@.service ccsq-recover@.timer ccsq-relayd@.service"
unit_dir="${root%/}/etc/systemd/system"

run() {
    echo "+ $*"
    if [ "$dry_run" -eq 0 ]; then "$@"; fi
}

if [ "$dry_run" -eq 0 ] && [ -z "$root" ] && [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: run as root (or with --dry-run, or --root DIR for a staging tree)" >&2
    exit 1
fi
if [ -n "$venv" ]; then
    case "$venv" in
        /home/*|/root/*|/root) echo "install.sh: $venv is hidden from the services by ProtectHome=yes; install the venv under /opt or /usr/local" >&2; exit 2 ;;
        /*) ;;
        *) echo "install.sh: --venv needs an absolute path" >&2; exit 2 ;;
    esac
    for bin in ccsq ccsq-brokerd ccsq-workerd ccsq-relayd; do
        [ -x "$venv/bin/$bin" ] || { echo "install.sh: $venv/bin/$bin not found (pip install ccsq into that venv first)" >&2; exit 2; }
    done
fi

if [ -z "$root" ]; then
    if getent passwd ccsq >/dev/null 2>&1; then
        echo "# user ccsq exists"
    else
        run useradd --system --user-group --home-dir /var/lib/ccsq --no-create-home \
            --shell /usr/sbin/nologin --comment ccsq ccsq
    fi
    run install -d -m 0750 -o root -g ccsq /etc/ccsq
fi

run install -d -m 0755 "$unit_dir"
for unit in $units; do
    run install -m 0644 "$here/$unit" "$unit_dir/$unit"
done

if [ -n "$root" ]; then
    echo "# staged under $root: no user, links or daemon-reload"
    exit 0
fi

if [ -n "$venv" ]; then
    for bin in ccsq ccsq-brokerd ccsq-workerd ccsq-relayd; do
        run ln -sfn "$venv/bin/$bin" "/usr/local/bin/$bin"
    done
fi
if [ -d /run/systemd/system ]; then
    run systemctl daemon-reload
else
    echo "# systemd is not running here: skipped systemctl daemon-reload"
fi
cat <<'EOF'
# next: put brokerd.toml, workerd-N.toml, completion.toml, authorized_keys.toml in /etc/ccsq
# (private keys: install -m 0600 -o ccsq -g ccsq ...), then for example
#   systemctl enable --now ccsq-brokerd.service
#   systemctl enable --now ccsq-workerd@0.service ccsq-workerd@1.service
#   systemctl enable --now ccsq-completion.service
# docs/operations.md explains the rest.
EOF
