# Shared by scripts/test, scripts/demo and scripts/bench: install packages, start a private
# etcd on loopback, stop it on exit. Source it; do not run it.

log() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }

install_packages() {
  local missing=()
  command -v etcd >/dev/null || missing+=(etcd-server)
  command -v etcdctl >/dev/null || missing+=(etcd-client)
  command -v protoc >/dev/null || missing+=(protobuf-compiler)
  [ -d /usr/include/google/protobuf ] || missing+=(libprotobuf-dev)
  [ -d /usr/share/zookeeper ] || missing+=(zookeeper)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq etcd-server etcd-client zookeeper protobuf-compiler libprotobuf-dev >/dev/null
  fi
}

port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# start_etcd CLIENT_PORT PEER_PORT: starts etcd in a fresh directory; sets ETCD_PID, ETCD_DIR.
start_etcd() {
  local client=$1 peer=$2
  for port in "$client" "$peer"; do
    if port_in_use "$port"; then
      log "port $port on 127.0.0.1 is already in use; choose free ports (see the top of $0)"
      exit 1
    fi
  done
  ETCD_DIR=$(mktemp -d /tmp/baton-etcd.XXXXXX)
  log "starting etcd on 127.0.0.1:$client (data in $ETCD_DIR)"
  etcd --name baton --data-dir "$ETCD_DIR/data" \
    --listen-client-urls "http://127.0.0.1:$client" --advertise-client-urls "http://127.0.0.1:$client" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "baton=http://127.0.0.1:$peer" >"$ETCD_DIR/etcd.log" 2>&1 &
  ETCD_PID=$!
  for _ in $(seq 1 100); do
    if ETCDCTL_API=3 etcdctl --endpoints "127.0.0.1:$client" endpoint health >/dev/null 2>&1; then
      return 0
    fi
    if ! kill -0 "$ETCD_PID" 2>/dev/null; then
      log "etcd failed to start:"; cat "$ETCD_DIR/etcd.log" >&2; exit 1
    fi
    sleep 0.1
  done
  log "etcd did not become healthy:"; tail -20 "$ETCD_DIR/etcd.log" >&2; exit 1
}

stop_etcd() {
  if [ -n "${ETCD_PID:-}" ]; then
    kill "$ETCD_PID" 2>/dev/null || true
    wait "$ETCD_PID" 2>/dev/null || true
    ETCD_PID=""
  fi
  if [ -n "${ETCD_DIR:-}" ]; then rm -rf "$ETCD_DIR"; fi
}
