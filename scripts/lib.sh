# Shared by scripts/test and scripts/bench: install packages, start a private
# etcd (and ZooKeeper) on loopback, stop them on exit. Source it; do not run it.

log() { printf '[%s %dm%02ds] %s\n' "$(basename "$0")" $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }

install_packages() {
  local missing=()
  command -v etcd >/dev/null || missing+=(etcd-server)
  command -v etcdctl >/dev/null || missing+=(etcd-client)
  command -v protoc >/dev/null || missing+=(protobuf-compiler)
  [ -d /usr/include/google/protobuf ] || missing+=(libprotobuf-dev)
  [ -d /usr/share/zookeeper ] || missing+=(zookeeper)
  command -v pgbouncer >/dev/null || missing+=(pgbouncer)
  command -v openssl >/dev/null || missing+=(openssl)
  [ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || missing+=(faketime)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq etcd-server etcd-client zookeeper pgbouncer protobuf-compiler \
      libprotobuf-dev openssl faketime >/dev/null
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

# start_baton_server PORT BINARY: starts `BINARY server` (baton's own etcd-API server) on
# 127.0.0.1:PORT in a fresh data directory; sets BATON_SERVER_PID and BATON_SERVER_DIR.
start_baton_server() {
  local port=$1 binary=$2
  if port_in_use "$port"; then
    log "port $port on 127.0.0.1 is already in use; choose a free port (see the top of $0)"
    exit 1
  fi
  BATON_SERVER_DIR=$(mktemp -d /tmp/baton-server.XXXXXX)
  log "starting baton server on 127.0.0.1:$port (data in $BATON_SERVER_DIR)"
  mkfifo "$BATON_SERVER_DIR/ready"
  "$binary" server --listen "127.0.0.1:$port" --data "$BATON_SERVER_DIR/data" \
    >"$BATON_SERVER_DIR/ready" 2>"$BATON_SERVER_DIR/server.log" &
  BATON_SERVER_PID=$!
  local line=""
  if ! read -r -t 20 line <"$BATON_SERVER_DIR/ready" || [ -z "$line" ]; then
    log "baton server did not start:"; cat "$BATON_SERVER_DIR/server.log" >&2; exit 1
  fi
  # Keep the pipe drained (the server prints nothing more, but must never block on it).
  cat "$BATON_SERVER_DIR/ready" >/dev/null &
}

stop_baton_server() {
  if [ -n "${BATON_SERVER_PID:-}" ]; then
    kill "$BATON_SERVER_PID" 2>/dev/null || true
    wait "$BATON_SERVER_PID" 2>/dev/null || true
    BATON_SERVER_PID=""
  fi
  if [ -n "${BATON_SERVER_DIR:-}" ]; then rm -rf "$BATON_SERVER_DIR"; fi
}

# The Java class path of Debian's ZooKeeper (its jar's manifest names the libraries it needs).
ZK_CLASSPATH=/usr/share/java/zookeeper.jar

# start_zookeeper PORT [FSYNC]: starts a standalone ZooKeeper on 127.0.0.1:PORT in a fresh
# directory; sets ZK_PID and ZK_DIR. tickTime 200 ms: ZooKeeper expires sessions on tick
# boundaries, so a crashed holder's session ends within TTL + 200 ms (with the default 2 s tick,
# TTL + 2 s); sessions from 2 s to 60 s (set explicitly); no admin server, no connection limit
# per address (every baton Backend holds two connections). FSYNC (yes|no, default no: a test
# server) is ZooKeeper's forceSync; scripts/bench measures with yes.
start_zookeeper() {
  local port=$1 fsync=${2:-no}
  if port_in_use "$port"; then
    log "port $port on 127.0.0.1 is already in use; choose a free port (see the top of $0)"
    exit 1
  fi
  ZK_DIR=$(mktemp -d /tmp/baton-zk.XXXXXX)
  cat >"$ZK_DIR/zoo.cfg" <<EOF
tickTime=200
minSessionTimeout=2000
maxSessionTimeout=60000
initLimit=50
syncLimit=25
dataDir=$ZK_DIR/data
clientPort=$port
clientPortAddress=127.0.0.1
admin.enableServer=false
maxClientCnxns=0
4lw.commands.whitelist=srvr
forceSync=$fsync
EOF
  log "starting ZooKeeper on 127.0.0.1:$port (data in $ZK_DIR)"
  java -Xmx256m -cp "$ZK_CLASSPATH" org.apache.zookeeper.server.quorum.QuorumPeerMain \
    "$ZK_DIR/zoo.cfg" >"$ZK_DIR/zookeeper.log" 2>&1 &
  ZK_PID=$!
  for _ in $(seq 1 300); do
    # `ruok` answers before the server serves; `srvr` names its mode once it does.
    if zookeeper_ask "$port" srvr | grep -q '^Mode: '; then
      return 0
    fi
    if ! kill -0 "$ZK_PID" 2>/dev/null; then
      log "ZooKeeper failed to start:"; cat "$ZK_DIR/zookeeper.log" >&2; exit 1
    fi
    sleep 0.1
  done
  log "ZooKeeper did not start serving:"; tail -20 "$ZK_DIR/zookeeper.log" >&2; exit 1
}

# zookeeper_ask PORT WORD: the answer to a four-letter command (empty if none).
zookeeper_ask() {
  (
    exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 0
    printf '%s' "$2" >&3
    timeout 2 cat <&3
  ) 2>/dev/null || true
}

stop_zookeeper() {
  if [ -n "${ZK_PID:-}" ]; then
    kill "$ZK_PID" 2>/dev/null || true
    wait "$ZK_PID" 2>/dev/null || true
    ZK_PID=""
  fi
  if [ -n "${ZK_DIR:-}" ]; then rm -rf "$ZK_DIR"; fi
}

# The machine's PostgreSQL 15 (Debian's postgresql-15; its own cluster stays stopped).
PG_BIN=/usr/lib/postgresql/15/bin

# start_postgres PORT [tls]: a private PostgreSQL cluster on 127.0.0.1:PORT in a fresh directory, run
# as user postgres (its socket in that directory too), with pg_stat_statements loaded; a role
# and a database `baton` (password `baton`, scram-sha-256 over TCP). Sets PG_DIR (the newest)
# and adds it to PG_DIRS; stop_postgres stops every one. With `tls`, it offers TLS with a
# certificate from a CA of its own ($PG_DIR/ca.pem).
start_postgres() {
  local port=$1 tls=${2:-}
  if port_in_use "$port"; then
    log "port $port on 127.0.0.1 is already in use; choose a free port (see the top of $0)"
    exit 1
  fi
  PG_DIR=$(mktemp -d /tmp/baton-pg.XXXXXX)
  PG_DIRS="${PG_DIRS:-} $PG_DIR"
  chown postgres:postgres "$PG_DIR"
  log "starting PostgreSQL on 127.0.0.1:$port (data in $PG_DIR)"
  runuser -u postgres -- "$PG_BIN/initdb" -D "$PG_DIR/data" -U postgres --auth-local=trust \
    --auth-host=scram-sha-256 >"$PG_DIR/initdb.log" 2>&1 \
    || { log "initdb failed:"; cat "$PG_DIR/initdb.log" >&2; exit 1; }
  cat >>"$PG_DIR/data/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$PG_DIR'
shared_preload_libraries = 'pg_stat_statements'
max_connections = 1000
CONF
  if [ "$tls" = tls ]; then
    # A CA of its own and a server certificate for 127.0.0.1 and localhost (TLS is offered,
    # not required: host lines accept both). other-ca.pem is an unrelated CA, for the tests
    # of a certificate that does not check out.
    (
      cd "$PG_DIR"
      openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=baton test CA" \
        -keyout ca.key -out ca.pem
      openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=other CA" \
        -keyout other-ca.key -out other-ca.pem
      openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" -keyout server.key -out server.csr
      printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >san.ext
      openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 \
        -extfile san.ext -out server.pem
      chown postgres:postgres server.key server.pem
      chmod 600 server.key
    ) >"$PG_DIR/openssl.log" 2>&1 || { log "making certificates failed:"; cat "$PG_DIR/openssl.log" >&2; exit 1; }
    cat >>"$PG_DIR/data/postgresql.conf" <<CONF
ssl = on
ssl_cert_file = '$PG_DIR/server.pem'
ssl_key_file = '$PG_DIR/server.key'
CONF
  fi
  runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/postgres.log" -w start \
    >/dev/null || { log "PostgreSQL failed to start:"; cat "$PG_DIR/postgres.log" >&2; exit 1; }
  runuser -u postgres -- psql -h "$PG_DIR" -p "$port" -q -v ON_ERROR_STOP=1 -d postgres \
    -c "CREATE ROLE baton LOGIN PASSWORD 'baton'" -c "CREATE DATABASE baton OWNER baton" \
    -c "CREATE ROLE baton_readonly LOGIN PASSWORD 'readonly'" \
    -c "CREATE ROLE baton_limited LOGIN PASSWORD 'limited'" >/dev/null
  # A role without CREATE on the database, with a schema made for it.
  runuser -u postgres -- psql -h "$PG_DIR" -p "$port" -q -v ON_ERROR_STOP=1 -d baton \
    -c "CREATE SCHEMA limited AUTHORIZATION baton_limited" >/dev/null
  runuser -u postgres -- psql -h "$PG_DIR" -p "$port" -q -v ON_ERROR_STOP=1 -d baton \
    -c "CREATE EXTENSION pg_stat_statements" >/dev/null
}

stop_postgres() {
  local dir
  for dir in ${PG_DIRS:-}; do
    runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$dir"
  done
  PG_DIRS=""
  PG_DIR=""
}

# start_pgbouncer PORT PG_PORT: starts PgBouncer (transaction pooling, the mode that breaks
# session state such as LISTEN) on 127.0.0.1:PORT in front of the PostgreSQL on PG_PORT; sets
# PGB_PID and PGB_DIR. Users baton/baton and postgres (admin console) as in start_postgres.
start_pgbouncer() {
  local port=$1 pg_port=$2
  if port_in_use "$port"; then
    log "port $port on 127.0.0.1 is already in use; choose a free port (see the top of $0)"
    exit 1
  fi
  PGB_DIR=$(mktemp -d /tmp/baton-pgbouncer.XXXXXX)
  cat >"$PGB_DIR/pgbouncer.ini" <<CONF
[databases]
baton = host=127.0.0.1 port=$pg_port dbname=baton
; The same database under another name, for a test that PAUSEs it (what clients see of a
; PgBouncer whose PostgreSQL does not answer) without holding up the others.
paused = host=127.0.0.1 port=$pg_port dbname=baton
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = scram-sha-256
auth_file = $PGB_DIR/users.txt
pool_mode = transaction
max_client_conn = 2000
default_pool_size = 20
admin_users = postgres
logfile = $PGB_DIR/pgbouncer.log
pidfile = $PGB_DIR/pgbouncer.pid
CONF
  printf '"baton" "baton"\n"postgres" "postgres"\n' >"$PGB_DIR/users.txt"
  chown -R postgres:postgres "$PGB_DIR"
  log "starting PgBouncer (transaction pooling) on 127.0.0.1:$port"
  runuser -u postgres -- pgbouncer "$PGB_DIR/pgbouncer.ini" >"$PGB_DIR/stdout.log" 2>&1 &
  PGB_PID=$!
  for _ in $(seq 1 100); do
    if port_in_use "$port"; then return 0; fi
    if ! kill -0 "$PGB_PID" 2>/dev/null; then
      log "PgBouncer failed to start:"; cat "$PGB_DIR/stdout.log" "$PGB_DIR/pgbouncer.log" >&2; exit 1
    fi
    sleep 0.1
  done
  log "PgBouncer did not start listening:"; tail -20 "$PGB_DIR/pgbouncer.log" >&2; exit 1
}

stop_pgbouncer() {
  if [ -n "${PGB_PID:-}" ]; then
    kill "$PGB_PID" 2>/dev/null || true
    wait "$PGB_PID" 2>/dev/null || true
    PGB_PID=""
  fi
  if [ -n "${PGB_DIR:-}" ]; then rm -rf "$PGB_DIR"; fi
}
