#!/usr/bin/env bash
# A three-instance meshd cluster on loopback, with TLS and tokens: one etcd, one
# nats-server (JetStream, fsync always), three meshd serving HTTPS, each with client
# and admin bearer tokens and a shared cluster secret. It starts everything, checks
# that the cluster works (an event published on one instance is pulled and acked on
# another; every instance is a member; tokens are enforced), then stops it all
# (SIGTERM: meshd releases its partitions and exits 0) and removes its temp dir.
#
#   deploy/cluster-example/run.sh [--keep]     (--keep: leave it running; ^C stops)
#
# Needs: etcd (Debian's etcd-server), nats-server 2.12+ (MESHD_NATS_SERVER, or the one
# scripts/test installs in /var/tmp/meshd-tools/venv), openssl, curl, and meshd
# (MESHD_BIN, or target/debug/meshd built by cargo). A production cluster runs three or
# five etcd members and a JetStream cluster with replicas=3 (docs/operations.md).
set -euo pipefail

keep=0
[ "${1:-}" = "--keep" ] && keep=1
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
meshd=${MESHD_BIN:-${CARGO_TARGET_DIR:-$root/target}/debug/meshd}
nats=${MESHD_NATS_SERVER:-/var/tmp/meshd-tools/venv/bin/nats-server}
for tool in etcd openssl curl; do
    command -v "$tool" >/dev/null || { echo "cluster-example: $tool not found" >&2; exit 1; }
done
[ -x "$meshd" ] || { echo "cluster-example: no meshd at $meshd (cargo build -p meshd, or set MESHD_BIN)" >&2; exit 1; }
[ -x "$nats" ] || { echo "cluster-example: no nats-server at $nats (set MESHD_NATS_SERVER; scripts/test installs one)" >&2; exit 1; }

dir=$(mktemp -d -t meshd-cluster-example-XXXXXX)
pids=()
stop() {
    local rc=$?
    for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$dir"
    exit $rc
}
trap stop EXIT INT TERM
trap 'echo "cluster-example: failed at line $LINENO: $BASH_COMMAND" >&2' ERR

# A free loopback port.
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# TLS: a CA and one certificate for 127.0.0.1 that every instance serves.
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=meshd example CA" \
    -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
    -keyout "$dir/server.key" -out "$dir/server.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\n' >"$dir/san.ext"
openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
    -CAcreateserial -days 2 -extfile "$dir/san.ext" -out "$dir/server.pem" 2>/dev/null

# Tokens and the cluster secret (files only the service user can read).
client_token=$(openssl rand -hex 24)
admin_token=$(openssl rand -hex 24)
echo "$client_token" >"$dir/client-tokens"
echo "$admin_token" >"$dir/admin-tokens"
openssl rand -hex 32 >"$dir/cluster-secret"
chmod 600 "$dir"/*-tokens "$dir/cluster-secret" "$dir"/*.key

# etcd and nats-server.
etcd_port=$(port); etcd_peer=$(port)
etcd --name example --data-dir "$dir/etcd" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer" \
    --initial-cluster "example=http://127.0.0.1:$etcd_peer" >"$dir/etcd.log" 2>&1 &
pids+=($!)
nats_port=$(port)
cat >"$dir/nats.conf" <<CONF
listen: 127.0.0.1:$nats_port
jetstream { store_dir: "$dir/nats", sync_interval: always }
max_payload: 2MB
CONF
"$nats" -c "$dir/nats.conf" >"$dir/nats.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
    curl -fs "http://127.0.0.1:$etcd_port/health" | grep -q '"health":"true"' && break
    sleep 0.1
done

# Three meshd instances.
ports=()
for i in 0 1 2; do
    p=$(port)
    ports+=("$p")
    "$meshd" serve --listen "127.0.0.1:$p" --data-dir "$dir/meshd-$i" --instance-id "example-$i" \
        --meta "etcd://127.0.0.1:$etcd_port" --log "nats://127.0.0.1:$nats_port" \
        --cluster-secret-file "$dir/cluster-secret" \
        --tls-cert "$dir/server.pem" --tls-key "$dir/server.key" --cluster-ca-file "$dir/ca.pem" \
        --client-token-file "$dir/client-tokens" --admin-token-file "$dir/admin-tokens" \
        >"$dir/meshd-$i.out" 2>"$dir/meshd-$i.log" &
    pids+=($!)
done

call() { # call INSTANCE TOKEN METHOD PATH [BODY]
    local url="https://127.0.0.1:${ports[$1]}$4"
    if [ $# -ge 5 ]; then
        curl -s --cacert "$dir/ca.pem" -H "Authorization: Bearer $2" -X "$3" \
            -H 'Content-Type: application/json' -d "$5" -w '\n%{http_code}' "$url" || true
    else
        curl -s --cacert "$dir/ca.pem" -H "Authorization: Bearer $2" -X "$3" -w '\n%{http_code}' "$url" || true
    fi
}
status() { tail -n1 <<<"$1"; }
body() { sed '$d' <<<"$1"; }
fail() { echo "cluster-example: $*" >&2; for i in 0 1 2; do echo "--- meshd-$i"; tail -n 20 "$dir/meshd-$i.log"; done >&2; exit 1; }

for i in 0 1 2; do
    ok=0
    for _ in $(seq 300); do
        r=$(curl -s --cacert "$dir/ca.pem" -w '\n%{http_code}' "https://127.0.0.1:${ports[$i]}/readyz" || true)
        if [ "$(status "$r")" = 200 ]; then ok=1; break; fi
        sleep 0.1
    done
    [ $ok = 1 ] || fail "instance $i not ready: $r"
done
echo "cluster-example: three instances ready (https://127.0.0.1:${ports[0]}, :${ports[1]}, :${ports[2]})"

# Tokens are enforced: no token 401, a client token cannot create topics (admin only).
r=$(curl -s --cacert "$dir/ca.pem" -w '\n%{http_code}' "https://127.0.0.1:${ports[0]}/v1/topics" || true)
[ "$(status "$r")" = 401 ] || fail "a request without a token answered $(status "$r")"
r=$(call 0 "$client_token" PUT /v1/topics/orders '{"partitions": 3}')
[ "$(status "$r")" = 403 ] || fail "a client token was let through to an admin route: $r"

r=$(call 0 "$admin_token" PUT /v1/topics/orders '{"partitions": 3}')
[ "$(status "$r")" = 201 ] || fail "topic: $r"
r=$(call 1 "$admin_token" PUT /v1/subscriptions/billing '{"topic": "orders", "start": "earliest"}')
[ "$(status "$r")" = 201 ] || fail "subscription: $r"
event='{"specversion":"1.0","id":"order-1","source":"/example","type":"order.created","data":{"n":1}}'
r=$(curl -s --cacert "$dir/ca.pem" -H "Authorization: Bearer $client_token" \
    -H 'Content-Type: application/cloudevents+json' -d "$event" -w '\n%{http_code}' \
    "https://127.0.0.1:${ports[0]}/v1/topics/orders/events" || true)
[ "$(status "$r")" = 201 ] || fail "publish: $r"

# Pulled and acked through another instance (forwarded to the partition's owner).
delivery=""
for _ in $(seq 50); do
    r=$(call 2 "$client_token" POST /v1/subscriptions/billing/pull '{"max_events": 10, "wait_ms": 1000}')
    [ "$(status "$r")" = 200 ] || fail "pull: $r"
    delivery=$(body "$r" | python3 -c 'import json,sys; d=json.load(sys.stdin)["deliveries"]; print(d[0]["delivery_id"] if d else "")')
    [ -n "$delivery" ] && break
done
[ -n "$delivery" ] || fail "the event was never delivered"
r=$(call 2 "$client_token" POST /v1/subscriptions/billing/ack "{\"delivery_ids\": [\"$delivery\"]}")
body "$r" | python3 -c 'import json,sys; a=json.load(sys.stdin); sys.exit(0 if len(a["acked"]) == 1 else 1)' || fail "ack: $r"

# Every instance is a member and every partition has an owner.
r=$(call 1 "$admin_token" GET /v1/cluster)
body "$r" | python3 -c '
import json, sys
c = json.load(sys.stdin)
members = {m["instance"] for m in c["members"]}
owned = [p for p in c["partitions"] if p["topic"] == "orders" and p["owner"]]
sys.exit(0 if members == {"example-0", "example-1", "example-2"} and len(owned) == 3 else 1)
' || fail "cluster view: $r"
echo "cluster-example: published on instance 0, pulled and acked on instance 2, 3 members, every partition owned"

if [ $keep = 1 ]; then
    echo "cluster-example: running; client token $client_token, admin token $admin_token, CA $dir/ca.pem; ^C stops"
    wait
fi

# A graceful stop: SIGTERM, every instance exits 0.
for i in 2 1 0; do
    pid=${pids[$((i + 2))]}
    kill -TERM "$pid"
    code=0
    wait "$pid" || code=$?
    [ "$code" = 0 ] || fail "instance $i exited $code after SIGTERM"
done
pids=("${pids[@]:0:2}")
echo "cluster-example: passed"
