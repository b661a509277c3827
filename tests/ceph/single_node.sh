#!/bin/sh
# A throwaway single-node Ceph for tests/test_deploy_radosgw.py: one monitor, one
# BlueStore OSD on a 3 GiB sparse file, radosgw (beast) on loopback, auth none,
# pools of size 1. Everything lives under DIR; daemons write DIR/asok/<name>.pid.
# Usage: single_node.sh DIR MON_PORT RGW_PORT ACCESS_KEY SECRET_KEY
# Needs Debian 12's ceph-mon ceph-osd radosgw ceph-common (Ceph 16.2, Pacific).
set -eu
D=$1 MON_PORT=$2 RGW_PORT=$3 ACCESS=$4 SECRET=$5
mkdir -p "$D/mon" "$D/osd0" "$D/rgw" "$D/log" "$D/asok"
FSID=$(cat /proc/sys/kernel/random/uuid)
cat > "$D/ceph.conf" <<CONF
[global]
fsid = $FSID
mon host = v1:127.0.0.1:$MON_PORT
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
auth supported = none
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon warn on pool no redundancy = false
osd crush chooseleaf type = 0
run dir = $D/asok
admin socket = $D/asok/\$name.asok
log file = $D/log/\$name.log
pid file = $D/asok/\$name.pid
ms bind ipv4 = true
ms bind ipv6 = false
[mon]
mon data = $D/mon/\$cluster-\$id
[osd]
osd data = $D/osd\$id
osd objectstore = bluestore
bluestore block path = $D/osd\$id.block
bluestore block create = true
bluestore block size = 3221225472
osd memory target = 939524096
bluestore cache autotune = false
bluestore cache size = 134217728
osd max object name len = 256
osd max object namespace len = 64
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$RGW_PORT
rgw data = $D/rgw
CONF
C="-c $D/ceph.conf"
monmaptool --create --addv a "v1:127.0.0.1:$MON_PORT" --fsid "$FSID" "$D/monmap" >/dev/null
ceph-authtool --create-keyring "$D/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-mon $C --mkfs -i a --monmap "$D/monmap" --keyring "$D/keyring"
ceph-mon $C -i a
timeout 60 ceph $C -s >/dev/null  # the monitor is in quorum
UUID=$(cat /proc/sys/kernel/random/uuid)
ID=$(timeout 60 ceph $C osd new "$UUID")
ceph-osd $C -i "$ID" --mkfs --osd-uuid "$UUID" 2>"$D/log/osd-mkfs.err"
# Ceph 16 with auth none: the OSD's first monitor command may go out before it has the
# monmap (fsid 0, "wrong fsid", exit 250): start it again
for _ in 1 2 3 4 5; do ceph-osd $C -i "$ID" 2>>"$D/log/osd-start.err" && break; sleep 1; done
for _ in $(seq 120); do timeout 10 ceph $C osd stat | grep -q "1 up" && break; sleep 0.5; done
radosgw $C -n client.rgw.a
for _ in $(seq 240); do curl -s -o /dev/null "http://127.0.0.1:$RGW_PORT/" && break; sleep 0.5; done
timeout 60 radosgw-admin $C user create --uid=ccsq --display-name=ccsq --access-key="$ACCESS" --secret="$SECRET" >/dev/null
echo "radosgw ready on http://127.0.0.1:$RGW_PORT"
