#!/bin/sh
# Install the ccsq systemd units (what `make install-systemd` runs).
#
#   systemd/install.sh [--dry-run] [--venv DIR] [--root DIR]
#
#   --dry-run   print every step, change nothing
#   --venv DIR  link /usr/local/bin/{ccsq,ccsq-brokerd,ccsq-workerd,ccsq-completiond,ccsq-console}
#               to DIR/bin/...
#               (a virtual environment outside /home, /root, /tmp and /var/tmp whose base Python
#               is outside them too: the units run with ProtectHome=yes and PrivateTmp=yes)
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
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

bins="ccsq ccsq-brokerd ccsq-workerd ccsq-completiond ccsq-console ccsq-relayd"
units="ccsq-brokerd.service ccsq-workerd@.service ccsq-completion.service ccsq-recover@.service ccsq-recover@.timer ccsq-relayd@.service"
unit_dir="${root%/}/etc/systemd/system"

run() {
    echo "+ $*"
    if [ "$dry_run" -eq 0 ]; then "$@"; fi
}

# every unit must be here before the first step (a --dry-run fails the same way): a copy that
# lacks one (a wheel built from an incomplete data_files list) would stop halfway, after the
# user and /etc/ccsq but before the links and daemon-reload
missing=""
for unit in $units; do
    [ -f "$here/$unit" ] || missing="$missing $unit"
done
if [ -n "$missing" ]; then
    echo "install.sh: unit file(s) missing from $here:$missing; nothing was changed. This copy of the units is incomplete: reinstall ccsq from a wheel built by \`make dist\` from a current checkout, or run systemd/install.sh of the checkout" >&2
    exit 1
fi

if [ "$dry_run" -eq 0 ] && [ -z "$root" ] && [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: run as root (or with --dry-run, or --root DIR for a staging tree)" >&2
    exit 1
fi
# hidden PATH: why the units cannot see PATH (nothing when they can)
hidden() {
    case "$1" in
        /home|/home/*|/root|/root/*|/run/user|/run/user/*) echo "ProtectHome=yes hides /home, /root and /run/user from the units" ;;
        /tmp|/tmp/*|/var/tmp|/var/tmp/*) echo "PrivateTmp=yes gives each unit its own empty /tmp and /var/tmp" ;;
    esac
}
refuse_venv() {
    echo "install.sh: --venv $venv: $1; $2. Create the venv outside /home, /root, /tmp and /var/tmp from a Python that lives there too, e.g. /usr/bin/python3 -m venv /opt/ccsq/venv && /opt/ccsq/venv/bin/pip install ccsq-*.whl (docs/operations.md)" >&2
    exit 2
}
if [ -n "$venv" ]; then
    case "$venv" in
        /*) ;;
        *) echo "install.sh: --venv needs an absolute path" >&2; exit 2 ;;
    esac
    why=$(hidden "$venv")
    [ -z "$why" ] || refuse_venv "the units would not find it" "$why"
    real=$(readlink -f "$venv" 2>/dev/null || echo "$venv")
    why=$(hidden "$real")
    [ -z "$why" ] || refuse_venv "it resolves to $real" "$why"
    for bin in $bins; do
        [ -x "$venv/bin/$bin" ] || { echo "install.sh: $venv/bin/$bin not found (pip install ccsq into that venv first)" >&2; exit 2; }
    done
    # the venv's interpreter is a link to its base Python (pyvenv.cfg `home =`): a pyenv or
    # self-built Python under /root makes every unit fail with status 203/EXEC
    base_home=$(sed -n 's/^home *= *//p' "$venv/pyvenv.cfg" 2>/dev/null | head -1)
    for p in "$base_home" "$(readlink -f "$venv/bin/python3" 2>/dev/null)"; do
        [ -n "$p" ] || continue
        why=$(hidden "$p")
        [ -z "$why" ] || refuse_venv "its base Python is $p (pyvenv.cfg home = ${base_home:-?})" "$why, so the units would fail with status 203/EXEC"
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
    for bin in $bins; do
        run ln -sfn "$venv/bin/$bin" "/usr/local/bin/$bin"
    done
    # the units run as ccsq: every directory above the venv must let that user through
    if [ "$dry_run" -eq 0 ] && command -v runuser >/dev/null 2>&1 \
        && ! (cd / && runuser -u ccsq -- "$venv/bin/python3" -c 'import ccsq.common') >/dev/null 2>&1; then
        echo "install.sh: user ccsq cannot run $venv/bin/python3 -c 'import ccsq.common' (a directory on the way is not readable by others? e.g. chmod 0755 $(dirname "$venv")); the units would fail with status 203/EXEC" >&2
        exit 2
    fi
fi
if [ -d /run/systemd/system ]; then
    run systemctl daemon-reload
else
    echo "# systemd is not running here: skipped systemctl daemon-reload"
fi
cat <<'EOF'
# next: put brokerd.toml, workerd-N.toml (N = GPU index), completion.toml, authorized_keys.toml
# (and optionally ccsq.env: AWS_PROFILE=..., root:ccsq 0640) in /etc/ccsq
# (private keys: install -m 0600 -o ccsq -g ccsq ...), then for example
#   systemctl enable --now ccsq-brokerd.service
#   systemctl enable --now ccsq-workerd@0.service ccsq-workerd@1.service
#   systemctl enable --now ccsq-completion.service
# docs/operations.md explains the rest.
EOF
