//! The PostgreSQL backend, `postgres://user[:password]@host:port/db?schema=NAME` (feature
//! `postgres`).
//!
//! Tables in the schema (created on first use, with a schema version): `sessions` (one row per
//! lease: its TTL and `expires_at`, decided only by the database's `clock_timestamp()`),
//! `elections` (one row per election with its `epoch`), `entries` (one row per candidate, bound
//! to its session, deleted with it), `data` (fenced values) and `fences` (for fencing inside the
//! user's own transactions, see [`fence_sql`]).
//!
//! - **Queue order is commit order**: an entry is created in one statement that bumps its
//!   election's epoch (`INSERT … ON CONFLICT DO UPDATE`), so the election's row lock serializes
//!   creators until they commit; the new epoch is the entry's position and, for the leader, its
//!   fencing token: a bigint that strictly increases per election and survives restarts.
//! - **Lease = session row**, renewed by a conditional `UPDATE … WHERE expires_at >
//!   clock_timestamp()`: a renewal is a statement whose answer baton sees, and the local
//!   deadline counts from the send time of the acknowledged one (rule 1). Rows of expired
//!   sessions are deleted by any live client (their entries go with them), no cron job.
//! - **Waiting**: deleting an entry notifies (`pg_notify`, one channel per schema) and only the
//!   candidate watching that entry wakes. To notice a crashed holder, a watcher also looks when
//!   the watched entry's session is due to expire, measured by the database's clock (no client
//!   clock is compared), and removes expired sessions then.
//! - **Behind a pooler in transaction mode** (PgBouncer): every statement is sent typed, on
//!   the unnamed statement (one round trip, nothing named left on a server connection), and
//!   only single statements or short explicit transactions are used, so everything works
//!   except LISTEN. A probe notification tells whether notifications reach the LISTEN
//!   connection; where they do not, watchers poll instead (every 250 ms on the leader's entry,
//!   250 ms times its place in line on others, at most every 5 s), so a graceful handoff can
//!   take up to 250 ms longer.
//! - **Fencing**: a fenced transaction locks the leader's entry row (`FOR UPDATE`), so the
//!   entry cannot be deleted (and no successor can lead) until the transaction ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton_core::{BackendLimits, ElectionConfig};
use tokio::sync::{mpsc, oneshot};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, NoTls};

mod connect;

use connect::Connector;

use crate::backend::{BoxFuture, Connection, Fencer};
use crate::clock::Clock;
use crate::driver::{
    Fired, LeasePool, Located, OneshotWatch, PlainEntrant, Position, Queue, QueueLease, ReadPoint,
    TokenMemory,
};
use crate::election::{CandidateSpec, Command, GuardContext, LeaderInfo, Leadership, Observed};
use crate::error::{Error, Result};
use crate::fenced::{FencedCompare, FencedOp, FencedTxn, FencedTxnResponse};
use crate::lease_driver::{start_lease, LeaseHandle, LeaseTransport};
use crate::stats::Stats;

const BACKEND: &str = "postgres";

/// The schema layout this release creates and expects.
const SCHEMA_VERSION: i32 = 1;

/// Bound on every statement (and on connecting).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Connections a backend may keep for its statements (renewals and notifications have their
/// own). It starts with one; the next is opened only when statements have waited
/// [`POOL_GROW_AFTER`] for a connection (many elections campaigning at once), so a process with
/// one election, like `baton run`, keeps three connections in all.
const POOL: usize = 2;

/// How long a statement waits for a busy connection before the pool opens another.
const POOL_GROW_AFTER: Duration = Duration::from_millis(20);

/// How often idle pooled connections that broke (a restarted server, `pg_terminate_backend`)
/// are replaced, so that the next statement (perhaps a resign) does not connect first.
const POOL_MENDING: Duration = Duration::from_secs(1);

/// Without notifications (behind a transaction-mode pooler), how often a waiter looks at the
/// leader's entry it waits on: the most a graceful handoff can be delayed. An entry further
/// back is looked at this often times its place in line (the next in line's entry every
/// 500 ms, and so on), so a waiter has caught up with its place by the time the line has
/// moved up to it, also when handoffs follow each other quickly.
const POLL_FAST: Duration = Duration::from_millis(250);

/// Without notifications, the longest pause between looks at a watched entry.
const POLL_SLOW: Duration = Duration::from_secs(5);

/// How long an observer's look at the leader may take before the observer says the database
/// cannot be seen (a hung connection, PgBouncer paused): the README's "not answering within a
/// second".
const OBSERVER_PATIENCE: Duration = Duration::from_secs(1);

/// How often a waiter without notifications looks at an entry with `ahead` entries before it.
fn poll_cadence(ahead: u32) -> Duration {
    POLL_FAST
        .saturating_mul(ahead.saturating_add(1))
        .min(POLL_SLOW)
}

/// Entries ahead of a watched one that a look counts: enough for [`poll_cadence`] to reach
/// [`POLL_SLOW`].
const AHEAD_COUNTED: u32 = 20;

/// How long the notification connection's probe may take before notifications are taken not
/// to arrive. Generous: a busy database (a storm of campaigns, each notifying) can hold a
/// notification back for seconds, and until the probe is decided watches poll anyway.
const PROBE_WAIT: Duration = Duration::from_secs(30);

/// How long connecting waits for that probe (a notification arrives in milliseconds where
/// they arrive at all; behind a pooler the rest of the wait goes on in the background).
const PROBE_PATIENCE: Duration = Duration::from_millis(300);

/// Leases are rows with an interval: any TTL from 100 ms, in milliseconds.
pub(crate) const LIMITS: BackendLimits = BackendLimits {
    min_ttl: Duration::from_millis(100),
    max_ttl: Duration::from_secs(365 * 86_400),
    ttl_step: Duration::from_millis(1),
};

/// A statement's failure as baton's error: a connection that is gone is `Unreachable`; the
/// database's own refusals (permission, bad request) are not retryable.
fn pg_error(operation: &'static str, error: tokio_postgres::Error) -> Error {
    crate::metrics::backend_error(operation);
    let Some(db) = error.as_db_error() else {
        return Error::Unreachable {
            backend: BACKEND,
            endpoints: String::new(),
            detail: format!("{} (during {operation})", one_line(&error)),
        };
    };
    // Class 08 connection exception (unreachable, above), 40 transaction rollback, 53
    // insufficient resources, 57 operator intervention (shutdown, terminated): transient. The
    // rest are refusals.
    let code = db.code().code();
    if is_connection_exception(code) {
        // No server behind the connection: PgBouncer answers so while it cannot log in to
        // PostgreSQL ("server login has been failing", 08P01).
        return Error::Unreachable {
            backend: BACKEND,
            endpoints: String::new(),
            detail: format!("{} ({code}) (during {operation})", db.message()),
        };
    }
    let retryable = ["40", "53", "57"].iter().any(|c| code.starts_with(c));
    Error::Backend {
        backend: BACKEND,
        operation,
        detail: format!("{} ({code})", db.message()),
        retryable,
        source: Some(Box::new(error)),
    }
}

/// SQLSTATE class 08, connection exception: no server behind the connection. PgBouncer answers
/// so while it cannot log in to PostgreSQL ("server login has been failing", 08P01).
fn is_connection_exception(code: &str) -> bool {
    code.starts_with("08")
}

/// An unreachable backend's error, naming `label` when it came from an established connection.
fn unreachable_at(label: &str, error: Error) -> Error {
    match error {
        Error::Unreachable {
            endpoints, detail, ..
        } if endpoints.is_empty() => Error::Unreachable {
            backend: BACKEND,
            endpoints: label.to_string(),
            detail,
        },
        other => other,
    }
}

/// A statement parameter with its PostgreSQL type. Every statement goes out typed: one round
/// trip (parse, bind, execute) on the unnamed statement, where a prepared one costs three, and
/// nothing named is left on the server connection, which a transaction-mode pooler
/// (PgBouncer) may hand to another client between statements.
fn p<T: Typed>(value: &T) -> (&(dyn ToSql + Sync), Type) {
    (value, T::TYPE)
}

/// A Rust type baton passes as a statement parameter, and its PostgreSQL type.
trait Typed: ToSql + Sync {
    const TYPE: Type;
}

impl Typed for String {
    const TYPE: Type = Type::TEXT;
}

impl Typed for &str {
    const TYPE: Type = Type::TEXT;
}

impl Typed for i64 {
    const TYPE: Type = Type::INT8;
}

impl Typed for i32 {
    const TYPE: Type = Type::INT4;
}

impl Typed for f64 {
    const TYPE: Type = Type::FLOAT8;
}

impl Typed for Vec<u8> {
    const TYPE: Type = Type::BYTEA;
}

/// The most telling line of an error (tokio-postgres nests the OS error).
fn one_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut deepest = error.to_string();
    let mut source = error.source();
    while let Some(current) = source {
        deepest = current.to_string();
        source = current.source();
    }
    deepest
}

/// Runs `call` within [`REQUEST_TIMEOUT`], counting it as a request and mapping its failure.
async fn bounded<T>(
    stats: &Stats,
    operation: &'static str,
    call: impl std::future::Future<Output = std::result::Result<T, tokio_postgres::Error>>,
) -> Result<T> {
    stats.request();
    uncounted(operation, call).await
}

/// [`bounded`] without counting a request (renewals are counted as renewals).
async fn uncounted<T>(
    operation: &'static str,
    call: impl std::future::Future<Output = std::result::Result<T, tokio_postgres::Error>>,
) -> Result<T> {
    match tokio::time::timeout(REQUEST_TIMEOUT, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(error)) => Err(pg_error(operation, error)),
        Err(_) => {
            crate::metrics::backend_error(operation);
            Err(Error::Timeout {
                operation,
                after_ms: REQUEST_TIMEOUT.as_millis() as u64,
            })
        }
    }
}

/// Opens one connection and spawns its driver; notifications, if any, go to `notices`.
async fn open(target: &Target, notices: Option<mpsc::UnboundedSender<String>>) -> Result<Client> {
    let connected = match &target.connector {
        Connector::Plain => connect_with(&target.config, NoTls, notices).await,
        Connector::Tls(tls) => connect_with(&target.config, tls.clone(), notices).await,
    };
    let error = match connected {
        Ok(client) => {
            // Every connection, not only the first: a setting changed (and connections
            // reopened) while baton runs must not go unnoticed. It is also the connection's
            // first statement: a pooler in front of a PostgreSQL that does not answer takes
            // the connection, then holds the statement.
            let settings = "SELECT current_setting('fsync')";
            let row = uncounted("connect", client.query_typed_one(settings, &[]))
                .await
                .map_err(|error| unanswered_is_unreachable(&target.label, error))?;
            warn_of_fsync_off(target, row.get(0));
            return Ok(client);
        }
        Err(Some(error)) => error,
        Err(None) => {
            return Err(Error::Unreachable {
                backend: BACKEND,
                endpoints: target.label.clone(),
                detail: "no answer within 5s".into(),
            })
        }
    };
    let refused = |detail: String, error: tokio_postgres::Error| Error::Backend {
        backend: BACKEND,
        operation: "connect",
        detail,
        retryable: false,
        source: Some(Box::new(error)),
    };
    if let Some(db) = error.as_db_error() {
        let code = db.code().code();
        let detail = format!("{} ({code})", db.message());
        if is_connection_exception(code) {
            return Err(Error::Unreachable {
                backend: BACKEND,
                endpoints: target.label.clone(),
                detail,
            });
        }
        // Too many connections, the server starting or shutting down: an outage to wait out.
        if code.starts_with("53") || code.starts_with("57") {
            return Err(Error::Backend {
                backend: BACKEND,
                operation: "connect",
                detail,
                retryable: true,
                source: Some(Box::new(error)),
            });
        }
        // Refused by the server (password, database, role): bad input, not an outage.
        return Err(refused(detail, error));
    }
    // TLS that cannot be had (a certificate that does not check out, a server without TLS
    // under sslmode=require) is a setting to fix, not an outage to wait out.
    let message = error.to_string();
    if message.contains("TLS") || is_rustls(&error) {
        let detail = format!("TLS: {}", one_line(&error));
        return Err(refused(detail, error));
    }
    Err(Error::Unreachable {
        backend: BACKEND,
        endpoints: target.label.clone(),
        detail: one_line(&error),
    })
}

/// Whether a rustls error is behind `error`.
fn is_rustls(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(error) = current {
        if error.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            if io
                .get_ref()
                .is_some_and(|inner| inner.is::<rustls::Error>())
            {
                return true;
            }
        }
        current = error.source();
    }
    false
}

/// Connects with `tls` and spawns the connection's driver; notifications, if any, go to
/// `notices`. `Err(None)`: no answer within [`REQUEST_TIMEOUT`].
async fn connect_with<T>(
    config: &tokio_postgres::Config,
    tls: T,
    notices: Option<mpsc::UnboundedSender<String>>,
) -> std::result::Result<Client, Option<tokio_postgres::Error>>
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket>,
    T::Stream: Send + 'static,
{
    let (client, mut connection) =
        match tokio::time::timeout(REQUEST_TIMEOUT, config.connect(tls)).await {
            Ok(Ok(pair)) => pair,
            Ok(Err(error)) => return Err(Some(error)),
            Err(_) => return Err(None),
        };
    tokio::spawn(async move {
        loop {
            let message = std::future::poll_fn(|cx| connection.poll_message(cx)).await;
            match message {
                Some(Ok(tokio_postgres::AsyncMessage::Notification(note))) => {
                    if let Some(notices) = &notices {
                        let _ = notices.send(note.payload().to_string());
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(_)) | None => return,
            }
        }
    });
    Ok(client)
}

/// Where connections go, and how.
#[derive(Clone)]
struct Target {
    config: tokio_postgres::Config,
    connector: Connector,
    /// `host:port,...`, for messages.
    label: String,
    /// `fsync = off` was warned of (once per backend, shared by its clones: the check runs on
    /// every connection).
    fsync_warned: Arc<AtomicBool>,
}

/// A few connections, each used by one task at a time (a transaction needs its connection to
/// itself); a broken one is replaced on its next use. Slots are taken into use in order, the
/// next only when the ones in use stay busy (see [`POOL`]).
struct Pool {
    target: Target,
    /// What warms a new connection (none until the schema exists).
    warm: std::sync::OnceLock<String>,
    slots: Vec<tokio::sync::Mutex<Option<Client>>>,
    /// Slots `0..in_use` are in use; the others have never been connected.
    in_use: AtomicUsize,
    next: AtomicUsize,
}

type PoolGuard<'a> = tokio::sync::MutexGuard<'a, Option<Client>>;

impl Pool {
    async fn get(&self) -> Result<tokio::sync::MappedMutexGuard<'_, Client>> {
        let mut slot = self.slot().await;
        if slot.as_ref().is_none_or(Client::is_closed) {
            *slot = Some(self.open_warm().await?);
        }
        Ok(tokio::sync::MutexGuard::map(slot, |client| {
            client.as_mut().expect("connected above")
        }))
    }

    /// A free slot in use; else the next one in turn when it comes free, or, once the wait has
    /// lasted [`POOL_GROW_AFTER`], a slot not in use yet.
    async fn slot(&self) -> PoolGuard<'_> {
        let in_use = self.in_use.load(Ordering::Acquire);
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        for i in 0..in_use {
            if let Ok(guard) = self.slots[(start + i) % in_use].try_lock() {
                return guard;
            }
        }
        let in_turn = self.slots[start % in_use].lock();
        if in_use >= self.slots.len() {
            return in_turn.await;
        }
        tokio::select! {
            guard = in_turn => guard,
            _ = tokio::time::sleep(POOL_GROW_AFTER) => self.grow(in_use).await,
        }
    }

    /// Takes slot `seen` into use (or, if another statement did so meanwhile, whatever comes
    /// free first).
    async fn grow(&self, seen: usize) -> PoolGuard<'_> {
        match self
            .in_use
            .compare_exchange(seen, seen + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            // Free but for a statement that saw the new count first (it connects the slot
            // then, and we wait our turn).
            Ok(_) => self.slots[seen].lock().await,
            Err(_) => Box::pin(self.slot()).await,
        }
    }

    /// Replaces every broken connection that no statement is using.
    async fn mend(&self) {
        let in_use = self.in_use.load(Ordering::Acquire);
        for slot in &self.slots[..in_use] {
            let Ok(mut slot) = slot.try_lock() else {
                continue;
            };
            if slot.as_ref().is_some_and(Client::is_closed) {
                if let Ok(client) = self.open_warm().await {
                    *slot = Some(client);
                }
            }
        }
    }

    /// Opens the connections in use (at connect, the first) and warms them for `schema`, so
    /// that none is opened (or warmed) on the handoff's path.
    async fn fill(&self, schema: &str) -> Result<()> {
        let _ = self.warm.set(warm_sql(schema));
        let in_use = self.in_use.load(Ordering::Acquire);
        for slot in &self.slots[..in_use] {
            let mut slot = slot.lock().await;
            match slot.as_ref() {
                Some(client) if !client.is_closed() => self.warm_up(client).await,
                _ => *slot = Some(self.open_warm().await?),
            }
        }
        Ok(())
    }

    /// Opens a connection and warms it: the first statement on `entries` in a server process
    /// loads the table's caches and compiles its notification trigger (about 2 ms here), which
    /// must not happen in the resign that hands over. A rolled-back insert and delete of a
    /// dummy entry does it; a role that cannot write warms nothing, and loses nothing.
    async fn open_warm(&self) -> Result<Client> {
        let client = open(&self.target, None).await?;
        self.warm_up(&client).await;
        Ok(client)
    }

    async fn warm_up(&self, client: &Client) {
        let Some(warm) = self.warm.get() else { return };
        if tokio::time::timeout(REQUEST_TIMEOUT, client.batch_execute(warm))
            .await
            .map_or(true, |done| done.is_err())
        {
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, client.batch_execute("ROLLBACK")).await;
        }
    }
}

/// The statements that warm a connection for `schema` (see [`Pool::open_warm`]); nothing of
/// them commits, and notifications of a rolled-back transaction are never sent.
fn warm_sql(schema: &str) -> String {
    format!(
        "BEGIN; \
         INSERT INTO {schema}.sessions (id, ttl, expires_at) VALUES (-1, '1s', clock_timestamp()); \
         INSERT INTO {schema}.entries VALUES ('', 0, '', '', '', -1); \
         DELETE FROM {schema}.entries WHERE election = '' AND position = 0; \
         ROLLBACK;"
    )
}

/// Candidates waiting for a deletion, and observers, by election; fed by the LISTEN
/// connection.
#[derive(Default)]
struct Hub {
    /// (election, position) → the watches of that entry (positions are never reused within
    /// an election, so a position names one incarnation of an entry).
    deletions: HashMap<(String, u64), Vec<oneshot::Sender<Fired<PgEntry>>>>,
    /// election → observers of its changes.
    observers: HashMap<String, Vec<mpsc::UnboundedSender<Seen>>>,
    /// Whether the LISTEN connection is up (notifications may be lost while it is not).
    listening: bool,
    /// Notifications do not reach the LISTEN connection (a pooler in transaction mode hands
    /// it a different server connection for every statement): watches poll instead.
    polling: bool,
}

/// What an observer hears: its election may have changed, look again.
#[derive(Debug)]
enum Seen {
    Changed,
}

/// A connection to PostgreSQL.
pub(crate) struct PgBackend {
    schema: String,
    channel: String,
    pool: Arc<Pool>,
    hub: Arc<Mutex<Hub>>,
    clock: Clock,
    leases: LeasePool<PgLease>,
    /// The sessions this backend has granted (an entry on one of them is our own).
    own_sessions: Mutex<std::collections::HashSet<(i64, i64)>>,
    tokens: TokenMemory,
    stats: Arc<Stats>,
}

impl std::fmt::Debug for PgBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgBackend")
            .field("at", &self.pool.target.label)
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

/// The SQL that creates baton's tables in `schema` (idempotent).
fn schema_sql(schema: &str, channel: &str) -> String {
    format!(
        r#"
CREATE TABLE IF NOT EXISTS {schema}.meta (version int NOT NULL);
CREATE TABLE IF NOT EXISTS {schema}.sessions (
    id bigserial PRIMARY KEY,
    ttl interval NOT NULL,
    expires_at timestamptz NOT NULL,
    -- A random key each holder proves in its renewals: a restored backup (its sequence handing
    -- out an id again) cannot make one holder's renewals keep another's row alive.
    key bigint NOT NULL DEFAULT (floor(random() * 9223372036854775807))::bigint
);
CREATE TABLE IF NOT EXISTS {schema}.elections (
    name text PRIMARY KEY,
    epoch bigint NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS {schema}.entries (
    election text NOT NULL,
    position bigint NOT NULL,
    name text NOT NULL,
    candidate text NOT NULL,
    value text NOT NULL,
    session bigint NOT NULL REFERENCES {schema}.sessions (id) ON DELETE CASCADE,
    PRIMARY KEY (election, position),
    UNIQUE (election, name),
    UNIQUE (election, candidate)
);
CREATE INDEX IF NOT EXISTS entries_session ON {schema}.entries (session);
CREATE TABLE IF NOT EXISTS {schema}.data (key text PRIMARY KEY, value bytea NOT NULL);
CREATE TABLE IF NOT EXISTS {schema}.fences (resource text PRIMARY KEY, token bigint NOT NULL);
CREATE OR REPLACE FUNCTION {schema}.entry_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        PERFORM pg_notify('{channel}',
            'D' || chr(9) || OLD.position || chr(9) || OLD.name || chr(9) || OLD.election);
        RETURN OLD;
    END IF;
    PERFORM pg_notify('{channel}',
        'I' || chr(9) || NEW.position || chr(9) || NEW.name || chr(9) || NEW.election);
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS entry_changed ON {schema}.entries;
CREATE TRIGGER entry_changed AFTER INSERT OR DELETE ON {schema}.entries
    FOR EACH ROW EXECUTE FUNCTION {schema}.entry_changed();
CREATE OR REPLACE FUNCTION {schema}.fence(resource text, token bigint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO {schema}.fences AS f (resource, token) VALUES (resource, token)
    ON CONFLICT ON CONSTRAINT fences_pkey DO UPDATE SET token = EXCLUDED.token
    WHERE f.token <= EXCLUDED.token;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'baton: stale fencing token % for %', token, resource
            USING ERRCODE = 'BT001';
    END IF;
END $$;
{durable}"#,
        durable = fence_durable_sql(schema)
    )
}

/// The SQL that makes every transaction that writes a fence (`fence()` in the caller's own
/// transaction) wait at commit for its record to be on disk (see [`DURABLE`]): a fence a crash
/// takes back lets an older token in again. A deferred trigger, so that it runs at commit,
/// after everything the transaction did: a `SET LOCAL synchronous_commit = off` after the
/// fence, or a function with a `SET synchronous_commit` clause around `fence()` (which puts
/// the session's setting back when it returns), cannot undo it. Enabled `ALWAYS`, so that a
/// session in `session_replication_role = replica` (which skips ordinary triggers) fences
/// durably too. What it cannot cover (`SET CONSTRAINTS … IMMEDIATE` moves it from commit to
/// that moment) the README says.
fn fence_durable_sql(schema: &str) -> String {
    format!(
        r#"
CREATE OR REPLACE FUNCTION {schema}.fence_durable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM {DURABLE};
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS fence_durable ON {schema}.fences;
CREATE CONSTRAINT TRIGGER fence_durable AFTER INSERT OR UPDATE ON {schema}.fences
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {schema}.fence_durable();
ALTER TABLE {schema}.fences ENABLE ALWAYS TRIGGER fence_durable;
"#
    )
}

/// tokio-postgres, as baton uses it: [`fence`] takes its clients and transactions.
pub use tokio_postgres;

/// The SQLSTATE of a stale token refused by `<schema>.fence` (a class of baton's own, so that
/// no framework takes it for a serialization failure worth retrying).
pub const STALE_TOKEN_SQLSTATE: &str = "BT001";

/// The SQL a script runs inside its own transaction to fence `resource` with its token (from
/// `BATON_TOKEN`), as parameters `$1` (text) and `$2` (bigint): a stale token raises an error
/// (SQLSTATE [`STALE_TOKEN_SQLSTATE`]), so nothing of the transaction commits. `schema` is
/// baton's schema (`?schema=` of the backend URL, `baton` by default).
pub fn fence_sql(schema: &str) -> String {
    format!("SELECT {schema}.fence($1, $2)")
}

/// Fences `resource` with `token` inside the caller's own transaction: records the token as
/// the resource's newest, or fails with [`Error::StaleToken`] if a newer one was recorded
/// there already — then the database refuses to commit anything of that transaction. Call it
/// in the transaction that does the work, before committing; `schema` is baton's schema.
///
/// ```no_run
/// # async fn work(leadership: &baton::Leadership, mut client: baton::postgres::tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
/// let transaction = client.transaction().await?;
/// baton::postgres::fence(&transaction, "baton", "invoices", leadership.token()).await?;
/// transaction.execute("UPDATE invoices SET sent = true WHERE id = 7", &[]).await?;
/// transaction.commit().await?;
/// # Ok(()) }
/// ```
pub async fn fence(
    client: &impl tokio_postgres::GenericClient,
    schema: &str,
    resource: &str,
    token: u64,
) -> Result<()> {
    crate::url::check_schema(schema).map_err(|reason| Error::InvalidUrl {
        url: format!("schema={schema}"),
        reason,
    })?;
    let stale = || Error::StaleToken {
        resource: resource.to_string(),
        token,
    };
    let Ok(signed) = i64::try_from(token) else {
        return Err(stale());
    };
    match client
        .query_typed(&fence_sql(schema), &[p(&resource), p(&signed)])
        .await
    {
        Ok(_) => Ok(()),
        Err(error)
            if error
                .as_db_error()
                .is_some_and(|db| db.code().code() == STALE_TOKEN_SQLSTATE) =>
        {
            Err(stale())
        }
        Err(error) => Err(pg_error("fence", error)),
    }
}

/// A statement a connection's server never answered: the backend at `label` is unreachable.
fn unanswered_is_unreachable(label: &str, error: Error) -> Error {
    match error {
        Error::Timeout { after_ms, .. } => Error::Unreachable {
            backend: BACKEND,
            endpoints: label.to_string(),
            detail: format!(
                "no answer to the first statement within {}s",
                after_ms / 1000
            ),
        },
        other => other,
    }
}

/// A select-list item that makes the transaction it runs in wait at commit until its record
/// is flushed to disk, whatever the session says: `synchronous_commit` raised to `on` until
/// the transaction ends from `off`, and from `local` and `remote_write`, which flush locally
/// but, under synchronous replication, not on the standby a failover must go to (`remote_apply`
/// stays). With `off`, a crash of PostgreSQL alone (no host crash needed) loses the last commits
/// it acknowledged: a lease comes back shorter than its holder counts on (two commands at
/// once), an election's epoch comes back lower (a token handed out twice). A check at connect
/// cannot see to it: through PgBouncer every statement may run on another server connection
/// (whose session another client may have `SET`), and a reload changes the setting of open
/// sessions. So every statement of baton's that writes returns this through each row it
/// writes (a statement that writes no row has nothing to lose; the campaign's epoch bump
/// returns it from its own `WITH`, which runs even when the entry is not made; a fenced
/// transaction's first statement, the check that its token leads, returns it), and a deferred
/// trigger runs it for the caller's transactions that fence ([`fence_durable_sql`]).
const DURABLE: &str = "set_config('synchronous_commit', CASE WHEN \
                       current_setting('synchronous_commit') IN ('off', 'local', 'remote_write') \
                       THEN 'on' ELSE current_setting('synchronous_commit') END, true)";

/// Warns, once per backend, that PostgreSQL runs with `fsync = off`: a crash of its host (not
/// of PostgreSQL alone) loses commits it acknowledged. Checked on every connection baton opens.
fn warn_of_fsync_off(target: &Target, fsync: &str) {
    if fsync == "off" && !target.fsync_warned.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            server = %target.label,
            "PostgreSQL runs with fsync = off: a crash of its host could take back renewals \
             and elections it acknowledged, and two candidates would lead at once"
        );
    }
}

impl PgBackend {
    pub(crate) async fn connect(url: &str, schema: String) -> Result<PgBackend> {
        let (config, connector) = connect::configure(url, &|name| std::env::var(name).ok())?;
        let label = connect::label(&config);
        let channel = format!("baton_{schema}");
        let stats = Arc::new(Stats::default());
        let pool = Arc::new(Pool {
            target: Target {
                config,
                connector,
                label,
                fsync_warned: Arc::default(),
            },
            warm: std::sync::OnceLock::new(),
            slots: (0..POOL).map(|_| tokio::sync::Mutex::new(None)).collect(),
            in_use: AtomicUsize::new(1),
            next: AtomicUsize::new(0),
        });
        let backend = PgBackend {
            schema,
            channel,
            pool,
            hub: Arc::new(Mutex::new(Hub::default())),
            clock: Clock::new(),
            leases: LeasePool::default(),
            own_sessions: Mutex::default(),
            tokens: TokenMemory::default(),
            stats,
        };
        let unreachable = |error| unreachable_at(&backend.pool.target.label, error);
        backend.create_schema().await.map_err(unreachable)?;
        backend
            .pool
            .fill(&backend.schema)
            .await
            .map_err(unreachable)?;
        backend.listen().await;
        backend.mend_pool();
        Ok(backend)
    }

    /// Creates the tables on first use and checks the layout version. The DDL runs only when
    /// the schema is new (under an advisory lock, so concurrent first uses do not collide):
    /// re-running it on every connect would take table locks that stall every election in the
    /// schema while they wait. A schema of this layout that an earlier release made gets the
    /// `fence_durable` trigger once (see [`PgBackend::add_fence_durable`]).
    async fn create_schema(&self) -> Result<()> {
        const OP: &str = "create schema";
        let mut client = self.pool.get().await?;
        // One look, by name (nothing parsed): is the name a reserved word (it would need
        // quoting everywhere), does the schema exist, do baton's tables; and, for a schema an
        // earlier release made, does `fences` lack its `fence_durable` trigger, enabled
        // always (one disabled is put back), may we add it (we own the table), may we fence?
        let look = "WITH f AS (SELECT c.oid, c.relowner FROM pg_class c JOIN pg_namespace n \
                    ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = 'fences') \
                    SELECT EXISTS (SELECT 1 FROM pg_get_keywords() WHERE word = $1 \
                    AND catcode <> 'U'), EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1), \
                    EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = \
                    c.relnamespace WHERE n.nspname = $1 AND c.relname = 'meta'), \
                    EXISTS (SELECT 1 FROM f WHERE NOT EXISTS (SELECT 1 FROM pg_trigger t \
                    WHERE t.tgrelid = f.oid AND t.tgname = 'fence_durable' \
                    AND t.tgenabled = 'A')), \
                    EXISTS (SELECT 1 FROM f WHERE pg_has_role(f.relowner, 'USAGE')), \
                    EXISTS (SELECT 1 FROM f WHERE has_table_privilege(f.oid, 'INSERT'))";
        // The connect's first statement of its own: no answer is an unreachable backend.
        let row = bounded(
            &self.stats,
            OP,
            client.query_typed_one(look, &[p(&self.schema)]),
        )
        .await
        .map_err(|error| unanswered_is_unreachable(&self.pool.target.label, error))?;
        if row.get::<_, bool>(0) {
            return Err(Error::InvalidUrl {
                url: format!("schema={}", self.schema),
                reason: "a word PostgreSQL reserves; choose another schema name".into(),
            });
        }
        // (trigger missing, we own the table, we may fence), for a schema someone else made.
        let trigger = |row: &tokio_postgres::Row| {
            (row.get::<_, bool>(2) && row.get::<_, bool>(3)).then(|| (row.get(4), row.get(5)))
        };
        let mut missing = trigger(&row);
        if !row.get::<_, bool>(2) {
            let transaction = self.schema_lock(&mut client, OP).await?;
            // Again under the lock: another first use may have created them meanwhile (an
            // earlier release's, without the trigger, say).
            let row = bounded(
                &self.stats,
                OP,
                transaction.query_typed_one(look, &[p(&self.schema)]),
            )
            .await?;
            missing = trigger(&row);
            if !row.get::<_, bool>(2) {
                // CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema
                // exists: a schema made for a role without it must not be created again.
                let schema_exists: bool = row.get(1);
                if schema_exists {
                    self.refuse_foreign_tables(&transaction).await?;
                }
                let mut sql = schema_sql(&self.schema, &self.channel);
                if !schema_exists {
                    sql = format!("CREATE SCHEMA {};\n{sql}", self.schema);
                }
                bounded(&self.stats, OP, transaction.batch_execute(&sql)).await?;
                // Idempotent, should two first uses both get here (the row is the one guard
                // that never misses a committed creator: each statement reads afresh).
                let insert = format!(
                    "INSERT INTO {s}.meta (version) SELECT $1 WHERE NOT EXISTS \
                     (SELECT 1 FROM {s}.meta)",
                    s = self.schema
                );
                bounded(
                    &self.stats,
                    OP,
                    transaction.execute_typed(&insert, &[p(&SCHEMA_VERSION)]),
                )
                .await?;
            }
            bounded(&self.stats, OP, transaction.commit()).await?;
        }
        let version: Option<i32> = bounded(
            &self.stats,
            OP,
            client.query_typed_opt(
                &format!("SELECT max(version) FROM {}.meta", self.schema),
                &[],
            ),
        )
        .await?
        .and_then(|row| row.get(0));
        match version {
            Some(SCHEMA_VERSION) => {
                if let Some((owner, may_fence)) = missing {
                    self.add_fence_durable(&mut client, owner, may_fence).await;
                }
                Ok(())
            }
            other => Err(Error::Unsupported(format!(
                "schema {} has baton's layout version {other:?}; this release knows {}",
                self.schema, SCHEMA_VERSION
            ))),
        }
    }

    /// Begins a transaction that holds the lock under which baton's schemas are created (so
    /// that concurrent first uses do not collide; earlier releases take the same one).
    async fn schema_lock<'c>(
        &self,
        client: &'c mut Client,
        op: &'static str,
    ) -> Result<tokio_postgres::Transaction<'c>> {
        let transaction = bounded(&self.stats, op, client.transaction()).await?;
        let lock = "SELECT pg_advisory_xact_lock(hashtext('baton schema'))";
        bounded(&self.stats, op, transaction.execute_typed(lock, &[])).await?;
        Ok(transaction)
    }

    /// Gives the `fences` of a schema an earlier release made its `fence_durable` trigger (see
    /// [`fence_durable_sql`]; one found disabled is put back), if we own the table; nothing
    /// else of the schema changes, so earlier releases still use it. Never waits long: not at
    /// all for this schema's upgrade lock (another process adding it: left to the next
    /// connect), and 200 ms for the table's lock (which waits for transactions that fence,
    /// while fences asked for meanwhile would wait behind it). A role that may fence but not
    /// add it is told so in a warning; one that may not fence (a read-only role) has nothing
    /// to say.
    async fn add_fence_durable(&self, client: &mut Client, owner: bool, may_fence: bool) {
        const OP: &str = "add fence_durable";
        if !owner {
            if may_fence {
                tracing::warn!(
                    schema = %self.schema,
                    "{}.fences lacks the trigger this release adds, which makes a transaction \
                     that fences wait for its commit to be on disk: a session with \
                     synchronous_commit = off could lose a fence in a crash; let the table's \
                     owner connect once",
                    self.schema
                );
            }
            return;
        }
        let added = async {
            let transaction = bounded(&self.stats, OP, client.transaction()).await?;
            // A key of this schema's own (the schema is made already): upgrades of other
            // schemas, and first uses, go on meanwhile.
            let lock = "SELECT pg_try_advisory_xact_lock(hashtext('baton schema'), hashtext($1))";
            let locked = bounded(
                &self.stats,
                OP,
                transaction.query_typed_one(lock, &[p(&self.schema)]),
            )
            .await?;
            if !locked.get::<_, bool>(0) {
                tracing::debug!(schema = %self.schema, "schema lock busy: fence_durable later");
                return Ok(());
            }
            let sql = format!(
                "SET LOCAL lock_timeout = '200ms'; {}",
                fence_durable_sql(&self.schema)
            );
            bounded(&self.stats, OP, transaction.batch_execute(&sql)).await?;
            bounded(&self.stats, OP, transaction.commit()).await
        }
        .await;
        if let Err(error) = added {
            tracing::warn!(
                schema = %self.schema,
                "cannot add to {}.fences the trigger this release adds, which makes a \
                 transaction that fences wait for its commit to be on disk ({error}); tried \
                 again at the next connect",
                self.schema
            );
        }
    }

    /// A schema without baton's layout (no `meta`) that has tables of the names baton uses (an
    /// application's own `sessions`, say) is not baton's to use: its `CREATE TABLE IF NOT
    /// EXISTS` would keep the other table, create the rest beside it, and fail at the first
    /// renewal, leaving them behind. Refused before anything is created (exit 2).
    async fn refuse_foreign_tables(
        &self,
        transaction: &tokio_postgres::Transaction<'_>,
    ) -> Result<()> {
        let taken = "SELECT string_agg(c.relname, ', ' ORDER BY c.relname) FROM pg_class c \
                     JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND \
                     c.relname IN ('sessions', 'elections', 'entries', 'data', 'fences')";
        let row = bounded(
            &self.stats,
            "create schema",
            transaction.query_typed_one(taken, &[p(&self.schema)]),
        )
        .await?;
        match row.get::<_, Option<String>>(0) {
            None => Ok(()),
            Some(names) => Err(Error::InvalidUrl {
                url: format!("schema={}", self.schema),
                reason: format!(
                    "the schema has tables that are not baton's ({names}; baton's would be \
                     created beside them): choose a schema of baton's own"
                ),
            }),
        }
    }

    /// Starts the task that replaces broken idle connections of the pool every
    /// [`POOL_MENDING`], for as long as the backend lives and is not closed.
    fn mend_pool(&self) {
        let pool = Arc::downgrade(&self.pool);
        let closing = self.leases.closing();
        tokio::spawn(async move {
            let mut closing = std::pin::pin!(closing);
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(POOL_MENDING) => {}
                    _ = closing.as_mut() => return,
                }
                let Some(pool) = pool.upgrade() else { return };
                pool.mend().await;
            }
        });
    }

    /// Starts the task that keeps the LISTEN connection up (reconnecting) and dispatches its
    /// notifications, for as long as the backend lives and is not closed. Where notifications
    /// do not arrive (a pooler in transaction mode), watches poll instead and the task ends.
    /// Waits up to [`PROBE_PATIENCE`] for the first connection's probe: until notifications
    /// are known to arrive (or not), watches look again every [`crate::driver::RETRY_PAUSE`].
    async fn listen(&self) {
        let (decided_tx, decided) = oneshot::channel::<()>();
        let hub = Arc::downgrade(&self.hub);
        let pool = self.pool.clone();
        let channel = self.channel.clone();
        let stats = self.stats.clone();
        let closing = self.leases.closing();
        tokio::spawn(async move {
            let mut closing = std::pin::pin!(closing);
            let mut decided = Some(decided_tx);
            loop {
                let Some(strong) = hub.upgrade() else { return };
                let subscribed = tokio::select! {
                    subscribed = subscribe(&pool, &channel, &strong, &stats) => subscribed,
                    _ = closing.as_mut() => return,
                };
                drop(decided.take());
                match subscribed {
                    Ok(Some((client, mut notes))) => {
                        {
                            let mut hub = strong.lock().unwrap_or_else(|e| e.into_inner());
                            for observers in hub.observers.values_mut() {
                                observers.retain(|o| o.send(Seen::Changed).is_ok());
                            }
                        }
                        drop(strong);
                        loop {
                            tokio::select! {
                                note = notes.recv() => match (note, hub.upgrade()) {
                                    (Some(note), Some(hub)) => dispatch(&hub, &note),
                                    (None, _) => break,
                                    (_, None) => return,
                                },
                                _ = closing.as_mut() => return,
                            }
                        }
                        drop(client);
                        // The connection broke: watches may miss deletions now; they look
                        // again.
                        let Some(strong) = hub.upgrade() else { return };
                        break_all(&strong);
                    }
                    Ok(None) => return poll_instead(&strong),
                    Err(_) => drop(strong),
                }
                tokio::select! {
                    _ = tokio::time::sleep(crate::driver::RETRY_PAUSE) => {}
                    _ = closing.as_mut() => return,
                }
            }
        });
        let _ = tokio::time::timeout(PROBE_PATIENCE, decided).await;
    }

    /// While notifications do not arrive, tells this backend's observers of `election` that one of our
    /// own candidates changed it (others' changes they find by polling).
    fn changed(&self, election: &str) {
        let mut hub = self.hub.lock().unwrap_or_else(|e| e.into_inner());
        if !hub.listening {
            if let Some(observers) = hub.observers.get_mut(election) {
                observers.retain(|o| o.send(Seen::Changed).is_ok());
            }
        }
    }

    /// Deletes the sessions whose time is up (their entries go with them, notifying).
    async fn clean_up(&self, client: &Client) -> Result<()> {
        let sql = format!(
            "DELETE FROM {}.sessions WHERE expires_at <= clock_timestamp() RETURNING {DURABLE}",
            self.schema
        );
        bounded(
            &self.stats,
            "remove expired sessions",
            client.execute_typed(&sql, &[]),
        )
        .await?;
        Ok(())
    }

    /// The first live entry of `election` (sessions not yet expired only).
    async fn first(&self, client: &Client, election: &str) -> Result<Option<LeaderInfo>> {
        let sql = format!(
            "SELECT e.position, e.value FROM {s}.entries e JOIN {s}.sessions ss ON ss.id = \
             e.session WHERE e.election = $1 AND ss.expires_at > clock_timestamp() \
             ORDER BY e.position LIMIT 1",
            s = self.schema
        );
        let row = bounded(
            &self.stats,
            "get leader",
            client.query_typed_opt(&sql, &[p(&election)]),
        )
        .await?;
        Ok(row.map(|row| describe(row.get(0), row.get(1))))
    }
}

/// Opens a connection, LISTENs on `channel` and checks that a notification sent through the
/// pool comes back on it: `None` if it does not (behind a pooler in transaction mode the
/// LISTEN stays on a server connection this one no longer has). Notifications arriving
/// meanwhile are dispatched.
async fn subscribe(
    pool: &Pool,
    channel: &str,
    hub: &Mutex<Hub>,
    stats: &Stats,
) -> Result<Option<(Client, mpsc::UnboundedReceiver<String>)>> {
    static PROBES: AtomicUsize = AtomicUsize::new(0);
    let (tx, mut notes) = mpsc::unbounded_channel();
    let client = open(&pool.target, Some(tx)).await?;
    bounded(
        stats,
        "listen",
        client.batch_execute(&format!("LISTEN {channel}")),
    )
    .await?;
    let probe = format!(
        "P\t{}-{}",
        std::process::id(),
        PROBES.fetch_add(1, Ordering::Relaxed)
    );
    {
        let sender = pool.get().await?;
        let notify = "SELECT pg_notify($1, $2)";
        bounded(
            stats,
            "listen",
            sender.query_typed(notify, &[p(&channel), p(&probe.as_str())]),
        )
        .await?;
    }
    let arrived = tokio::time::timeout(PROBE_WAIT, async {
        while let Some(note) = notes.recv().await {
            if note == probe {
                return true;
            }
            dispatch(hub, &note);
        }
        false
    })
    .await;
    match arrived {
        Ok(true) => {}
        // The connection closed before the probe could come back (terminated, say): that says
        // nothing of whether notifications arrive. Another connection tries again; taking it
        // for a pooler switched notifications off for good (an attack terminating baton's
        // connections every 100 ms left every handoff polling, 217 ms instead of 6).
        Ok(false) => {
            return Err(Error::Backend {
                backend: BACKEND,
                operation: "listen",
                detail: "the notification connection closed before its probe came back".into(),
                retryable: true,
                source: None,
            })
        }
        Err(_) => {
            // Leave nothing listening where we can (a pooler may run this elsewhere).
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, client.batch_execute("UNLISTEN *")).await;
            return Ok(None);
        }
    }
    hub.lock().unwrap_or_else(|e| e.into_inner()).listening = true;
    Ok(Some((client, notes)))
}

/// Notifications do not arrive: watches poll from now on (those waiting for a notification
/// are told to start again).
fn poll_instead(hub: &Mutex<Hub>) {
    tracing::warn!(
        "PostgreSQL notifications do not reach baton (a pooler in transaction mode, such as \
         PgBouncer?): waiters poll instead, so a handoff can take up to {} longer",
        crate::format_duration(POLL_FAST)
    );
    let mut hub = hub.lock().unwrap_or_else(|e| e.into_inner());
    hub.polling = true;
    hub.listening = false;
    // Nothing will be dispatched any more: watches registered meanwhile poll already (every
    // watch made before notifications were known to arrive does).
    hub.deletions.clear();
}

/// Routes one notification (`D|I <tab> position <tab> name <tab> election`) to its watchers
/// and observers.
fn dispatch(hub: &Mutex<Hub>, note: &str) {
    let mut parts = note.splitn(4, '\t');
    let (Some(kind), Some(position), Some(name), Some(election)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return;
    };
    let Ok(position) = position.parse::<u64>() else {
        return;
    };
    let mut hub = hub.lock().unwrap_or_else(|e| e.into_inner());
    if kind == "D" {
        let key = (election.to_string(), position);
        if let Some(watches) = hub.deletions.remove(&key) {
            for watch in watches {
                let _ = watch.send(Fired::Deleted {
                    entry: PgEntry {
                        election: election.to_string(),
                        name: name.to_string(),
                    },
                    position: Position(position),
                });
            }
        }
    }
    if let Some(observers) = hub.observers.get_mut(election) {
        observers.retain(|o| o.send(Seen::Changed).is_ok());
    }
}

/// The notification connection broke: every watch is broken, observers are told.
/// The notification connection broke: every watch is broken; observers look again (they say
/// the database is unavailable only if their own look fails: a reconnect is no outage).
fn break_all(hub: &Mutex<Hub>) {
    let mut hub = hub.lock().unwrap_or_else(|e| e.into_inner());
    hub.listening = false;
    for (_, watches) in hub.deletions.drain() {
        for watch in watches {
            let _ = watch.send(Fired::Broken);
        }
    }
    for observers in hub.observers.values_mut() {
        observers.retain(|o| o.send(Seen::Changed).is_ok());
    }
}

fn describe(position: i64, value: String) -> LeaderInfo {
    LeaderInfo::from_entry(u64::try_from(position).unwrap_or(0), value.as_bytes())
}

/// A lease: a session row.
#[derive(Debug)]
pub(crate) struct PgLease {
    id: i64,
    /// The session's random key (see the `sessions` table).
    key: i64,
    handle: LeaseHandle,
}

impl QueueLease for PgLease {
    fn handle(&self) -> &LeaseHandle {
        &self.handle
    }
}

/// Grants and renewals of one session row, on a connection of its own (renewals never queue
/// behind other statements), one statement at a time in send order.
struct PgLeaseTransport {
    pool: Arc<Pool>,
    schema: String,
    stats: Arc<Stats>,
    id: i64,
    key: i64,
    answers: mpsc::UnboundedReceiver<Result<Duration>>,
    sends: mpsc::UnboundedSender<()>,
    on_grant: Option<oneshot::Sender<(i64, i64)>>,
}

impl LeaseTransport for PgLeaseTransport {
    async fn grant(&mut self, ttl: Duration) -> Result<Duration> {
        let sql = format!(
            "INSERT INTO {}.sessions (ttl, expires_at) VALUES \
             (make_interval(secs => $1), clock_timestamp() + make_interval(secs => $1)) \
             RETURNING id, key, {DURABLE}",
            self.schema
        );
        let seconds = ttl.as_secs_f64();
        let client = self.pool.get().await?;
        let row = bounded(
            &self.stats,
            "lease grant",
            client.query_typed_one(&sql, &[p(&seconds)]),
        )
        .await?;
        (self.id, self.key) = (row.get(0), row.get(1));
        if let Some(tx) = self.on_grant.take() {
            let _ = tx.send((self.id, self.key));
        }
        Ok(ttl)
    }

    async fn send_renewal(&mut self) -> Result<()> {
        self.stats.renewals.fetch_add(1, Ordering::Relaxed);
        // Sent and answered in order by the worker below (one statement at a time).
        self.sends.send(()).map_err(|_| Error::Closed)
    }

    fn reopen(&mut self) {
        // A new worker on a new connection. The old one ends after its statement (its input
        // closes), and its answers go where nobody reads them.
        let (id_tx, id_rx) = oneshot::channel();
        let _ = id_tx.send((self.id, self.key));
        (self.sends, self.answers) =
            spawn_renew_worker(self.pool.target.clone(), self.schema.clone(), id_rx);
    }

    async fn next_renewal(&mut self) -> Result<Duration> {
        // The renewal worker owns no connection of ours: answer here, in send order.
        match self.answers.recv().await {
            Some(answer) => answer,
            None => std::future::pending().await,
        }
    }

    async fn revoke(&mut self) -> Result<()> {
        let sql = format!(
            "DELETE FROM {}.sessions WHERE id = $1 AND key = $2 RETURNING {DURABLE}",
            self.schema
        );
        let (id, key) = (self.id, self.key);
        let client = self.pool.get().await?;
        bounded(
            &self.stats,
            "lease revoke",
            client.execute_typed(&sql, &[p(&id), p(&key)]),
        )
        .await?;
        Ok(())
    }
}

/// Starts a [`renew_worker`]; returns where to send renewals and where their answers come.
fn spawn_renew_worker(
    target: Target,
    schema: String,
    id: oneshot::Receiver<(i64, i64)>,
) -> (
    mpsc::UnboundedSender<()>,
    mpsc::UnboundedReceiver<Result<Duration>>,
) {
    let (sends_tx, sends_rx) = mpsc::unbounded_channel();
    let (answers_tx, answers_rx) = mpsc::unbounded_channel();
    tokio::spawn(renew_worker(target, schema, id, sends_rx, answers_tx));
    (sends_tx, answers_rx)
}

/// Runs renewals of session `id` one at a time, answering each with the TTL the row now has
/// (zero when the session is gone or expired).
async fn renew_worker(
    target: Target,
    schema: String,
    id: oneshot::Receiver<(i64, i64)>,
    mut sends: mpsc::UnboundedReceiver<()>,
    answers: mpsc::UnboundedSender<Result<Duration>>,
) {
    // Connected before the first renewal is due: connecting (with its password exchange) must
    // not eat into the first renewal interval.
    let mut client: Option<Client> = open(&target, None).await.ok();
    let Ok((id, key)) = id.await else { return };
    let sql = format!(
        "UPDATE {schema}.sessions SET expires_at = clock_timestamp() + ttl \
         WHERE id = $1 AND key = $2 AND expires_at > clock_timestamp() \
         RETURNING extract(epoch FROM ttl)::float8, {DURABLE}"
    );
    while sends.recv().await.is_some() {
        if answers.is_closed() {
            // Replaced (the lease driver gave up what was in flight): renewals still queued
            // here are not sent.
            return;
        }
        let answer = async {
            if client.as_ref().is_none_or(Client::is_closed) {
                client = Some(open(&target, None).await?);
            }
            let client = client.as_ref().expect("connected above");
            let row = uncounted(
                "lease keepalive",
                client.query_typed_opt(&sql, &[p(&id), p(&key)]),
            )
            .await?;
            Ok(row.map_or(Duration::ZERO, |row| {
                Duration::from_secs_f64(row.get::<_, f64>(0).max(0.0))
            }))
        }
        .await;
        if answers.send(answer).is_err() {
            return;
        }
    }
}

/// A candidate's entry: its election and its name there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PgEntry {
    election: String,
    name: String,
}

impl Queue for PgBackend {
    type Lease = PgLease;
    type Entry = PgEntry;
    type Entrant = PlainEntrant;
    type Watch = OneshotWatch<PgEntry>;

    fn stats(&self) -> &Stats {
        &self.stats
    }

    fn tokens(&self) -> &TokenMemory {
        &self.tokens
    }

    fn leases(&self) -> &LeasePool<Self::Lease> {
        &self.leases
    }

    fn entrant(&self, spec: &CandidateSpec, serial: u64) -> PlainEntrant {
        PlainEntrant::new(spec, serial)
    }

    async fn lease(&self, config: &ElectionConfig) -> Result<Arc<PgLease>> {
        self.leases
            .get(config, async {
                let (id_tx, id_rx) = oneshot::channel();
                let (worker_id_tx, worker_id_rx) = oneshot::channel();
                let (sends_tx, answers_rx) =
                    spawn_renew_worker(self.pool.target.clone(), self.schema.clone(), worker_id_rx);
                let transport = PgLeaseTransport {
                    pool: self.pool.clone(),
                    schema: self.schema.clone(),
                    stats: self.stats.clone(),
                    id: 0,
                    key: 0,
                    answers: answers_rx,
                    sends: sends_tx,
                    on_grant: Some(id_tx),
                };
                let handle = start_lease(transport, config.clone(), self.clock.clone()).await?;
                let (id, key) = id_rx.await.map_err(|_| Error::Closed)?;
                let _ = worker_id_tx.send((id, key));
                self.own_sessions
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert((id, key));
                Ok(PgLease { id, key, handle })
            })
            .await
    }

    fn entry_name(&self, entrant: &PlainEntrant, lease: &PgLease) -> PgEntry {
        PgEntry {
            election: entrant.election.clone(),
            name: format!("{:016x}-{:016x}-{}", lease.id, lease.key, entrant.serial),
        }
    }

    async fn create(
        &self,
        entrant: &PlainEntrant,
        entry: &PgEntry,
        lease: &PgLease,
    ) -> Result<Position> {
        const OP: &str = "create candidate entry";
        let s = &self.schema;
        // One statement: the epoch bump takes the election's row lock, held to commit, so
        // entries are numbered in commit order. Only under a live session.
        let insert = format!(
            "WITH e AS (INSERT INTO {s}.elections AS el (name) VALUES ($1) \
             ON CONFLICT (name) DO UPDATE SET epoch = el.epoch + 1 RETURNING epoch, {DURABLE}) \
             INSERT INTO {s}.entries (election, position, name, candidate, value, session) \
             SELECT $1, e.epoch, $2, $3, $4, $5 FROM e WHERE EXISTS (SELECT 1 FROM {s}.sessions \
             WHERE id = $5 AND key = $6 AND expires_at > clock_timestamp()) RETURNING position"
        );
        let holders = format!(
            "SELECT e.position, e.name, e.session, ss.expires_at > clock_timestamp() \
             FROM {s}.entries e JOIN {s}.sessions ss ON ss.id = e.session \
             WHERE e.election = $1 AND (e.name = $2 OR e.candidate = $3)"
        );
        let client = self.pool.get().await?;
        for _ in 0..3 {
            self.stats.request();
            let answer = tokio::time::timeout(
                REQUEST_TIMEOUT,
                client.query_typed_opt(
                    &insert,
                    &[
                        p(&entrant.election),
                        p(&entry.name),
                        p(&entrant.id),
                        p(&entrant.value),
                        p(&lease.id),
                        p(&lease.key),
                    ],
                ),
            )
            .await;
            let error = match answer {
                Ok(Ok(Some(row))) => {
                    self.changed(&entrant.election);
                    return Ok(Position(row.get::<_, i64>(0) as u64));
                }
                Ok(Ok(None)) => {
                    return Err(Error::Backend {
                        backend: BACKEND,
                        operation: OP,
                        detail: "the lease's session has expired".into(),
                        retryable: true,
                        source: None,
                    })
                }
                Ok(Err(error)) => error,
                Err(_) => {
                    return Err(Error::Timeout {
                        operation: OP,
                        after_ms: REQUEST_TIMEOUT.as_millis() as u64,
                    })
                }
            };
            let unique = error
                .as_db_error()
                .is_some_and(|db| db.code().code() == "23505");
            if !unique {
                return Err(pg_error(OP, error));
            }
            // Our name (an earlier attempt whose answer was lost: adopt it) or our id.
            let rows = bounded(
                &self.stats,
                OP,
                client.query_typed(
                    &holders,
                    &[p(&entrant.election), p(&entry.name), p(&entrant.id)],
                ),
            )
            .await?;
            let mut stale = false;
            for row in &rows {
                let (position, name, session, live): (i64, String, i64, bool) =
                    (row.get(0), row.get(1), row.get(2), row.get(3));
                if name == entry.name && session == lease.id {
                    return Ok(Position(position as u64));
                }
                if !live {
                    stale = true;
                    continue;
                }
                return Err(Error::DuplicateId {
                    election: entrant.election.clone(),
                    id: entrant.id.clone(),
                    entry: name,
                });
            }
            if stale {
                self.clean_up(&client).await?;
            }
        }
        Err(Error::protocol(
            BACKEND,
            OP,
            "the candidate's id keeps changing",
        ))
    }

    async fn locate(
        &self,
        _entrant: &PlainEntrant,
        entry: &PgEntry,
        own: Position,
    ) -> Result<Located<PgEntry>> {
        let s = &self.schema;
        // One statement, one snapshot: our entry still there, and the one just ahead of it.
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {s}.entries WHERE election = $1 AND position = $2 \
             AND name = $3), p.position, p.name FROM (SELECT 1) AS one LEFT JOIN LATERAL \
             (SELECT position, name FROM {s}.entries WHERE election = $1 AND position < $2 \
             ORDER BY position DESC LIMIT 1) p ON true"
        );
        let position = own.0 as i64;
        let client = self.pool.get().await?;
        let row = bounded(
            &self.stats,
            "find predecessor",
            client.query_typed_one(&sql, &[p(&entry.election), p(&position), p(&entry.name)]),
        )
        .await?;
        if !row.get::<_, bool>(0) {
            return Ok(Located::Gone);
        }
        let ahead = row
            .get::<_, Option<i64>>(1)
            .zip(row.get::<_, Option<String>>(2))
            .map(|(position, name)| {
                (
                    PgEntry {
                        election: entry.election.clone(),
                        name,
                    },
                    Position(position as u64),
                )
            });
        Ok(Located::Exists {
            ahead,
            at: ReadPoint(0),
        })
    }

    async fn confirm(&self, entry: &PgEntry, own: Position) -> Result<Option<ReadPoint>> {
        let sql = format!(
            "SELECT 1 FROM {}.entries WHERE election = $1 AND position = $2 AND name = $3",
            self.schema
        );
        let position = own.0 as i64;
        let client = self.pool.get().await?;
        let row = bounded(
            &self.stats,
            "get own entry",
            client.query_typed_opt(&sql, &[p(&entry.election), p(&position), p(&entry.name)]),
        )
        .await?;
        Ok(row.map(|_| ReadPoint(0)))
    }

    async fn watch_deletion(
        &self,
        entry: &PgEntry,
        position: Position,
        _after: ReadPoint,
    ) -> Result<OneshotWatch<PgEntry>> {
        let (tx, fired) = oneshot::channel();
        let (note_tx, note_rx) = oneshot::channel();
        // Until notifications are known to arrive (the LISTEN connection's probe, or its
        // reconnection), the watch polls; it is also registered for the notification unless
        // notifications are known not to arrive.
        let (notified, polling) = {
            let mut hub = self.hub.lock().unwrap_or_else(|e| e.into_inner());
            // Registered before the entry is read: a deletion committed after that read
            // notifies a watch that is already there.
            if !hub.polling {
                let watches = hub
                    .deletions
                    .entry((entry.election.clone(), position.0))
                    .or_default();
                watches.retain(|watch| !watch.is_closed());
                watches.push(note_tx);
            }
            (!hub.polling, !hub.listening)
        };
        let own = entry_session(&entry.name).is_some_and(|session| {
            self.own_sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&session)
        });
        let looks = WatchLooks {
            pool: self.pool.clone(),
            schema: self.schema.clone(),
            stats: self.stats.clone(),
            entry: entry.clone(),
            position,
            own,
            notified,
            polling,
        };
        // The first look at once: the entry may be gone already.
        let task = tokio::spawn(looks.run(note_rx, tx));
        Ok(OneshotWatch::new(fired, Some(task), self.stats.clone()))
    }

    async fn delete(&self, _entrant: &PlainEntrant, entry: &PgEntry, own: Position) -> Result<()> {
        let sql = format!(
            "DELETE FROM {}.entries WHERE election = $1 AND position = $2 AND name = $3 \
             RETURNING {DURABLE}",
            self.schema
        );
        let position = own.0 as i64;
        let client = self.pool.get().await?;
        bounded(
            &self.stats,
            "delete candidate entry",
            client.execute_typed(&sql, &[p(&entry.election), p(&position), p(&entry.name)]),
        )
        .await?;
        self.changed(&entry.election);
        Ok(())
    }

    async fn delete_if_on_lease(
        &self,
        _entrant: &PlainEntrant,
        entry: &PgEntry,
        lease: &PgLease,
    ) -> Result<()> {
        let sql = format!(
            "DELETE FROM {}.entries WHERE election = $1 AND name = $2 AND session = $3 \
             RETURNING {DURABLE}",
            self.schema
        );
        let client = self.pool.get().await?;
        bounded(
            &self.stats,
            "delete candidate entry",
            client.execute_typed(&sql, &[p(&entry.election), p(&entry.name), p(&lease.id)]),
        )
        .await?;
        self.changed(&entry.election);
        Ok(())
    }

    fn guard(&self, entry: &PgEntry, _position: Position) -> GuardContext {
        Arc::new(PgFencer {
            pool: self.pool.clone(),
            schema: self.schema.clone(),
            stats: self.stats.clone(),
            election: entry.election.clone(),
        })
    }
}

/// A watch's own looks at its entry, which end it when the entry is gone; a notification ends
/// it sooner. It looks at once, then:
/// - with notifications, when the entry's session is due to expire (by the database's clock),
///   removing expired sessions then: a crashed holder is noticed by its successor, no cron job
///   needed. Entries on our own sessions need no looks (our lease driver knows when they end);
/// - without (polling): every [`POLL_FAST`] while the entry leads its election (its deletion is
///   a handoff, or a loss its holder must hear of as soon as its successor can), further back
///   at the [`poll_cadence`] of its place in line (our own entries, not leading: every
///   [`POLL_SLOW`]), and never later than its session is due.
struct WatchLooks {
    pool: Arc<Pool>,
    schema: String,
    stats: Arc<Stats>,
    entry: PgEntry,
    /// The incarnation watched: gone once no entry of that name has this position.
    position: Position,
    /// The entry is on a session of this backend.
    own: bool,
    /// Registered for the deletion's notification.
    notified: bool,
    /// Looks at the polling cadence (notifications not known to arrive).
    polling: bool,
}

/// What a look found: the entry is gone, or it is there with `ahead` entries before it (counted
/// up to [`AHEAD_COUNTED`]; none: it leads), and its session has `left`.
enum Look {
    Gone,
    There { ahead: u32, left: Duration },
}

impl WatchLooks {
    async fn run(
        self,
        mut note: oneshot::Receiver<Fired<PgEntry>>,
        fired: oneshot::Sender<Fired<PgEntry>>,
    ) {
        let mut notified = self.notified;
        let mut wait = Some(Duration::ZERO);
        loop {
            let pause = async {
                match wait {
                    Some(wait) => tokio::time::sleep(wait).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                outcome = &mut note, if notified => {
                    match outcome {
                        // Notifications turned out not to arrive: this watch polls anyway.
                        Err(_) if self.polling => {
                            notified = false;
                            continue;
                        }
                        Ok(deleted @ Fired::Deleted { .. }) => {
                            let _ = fired.send(deleted);
                        }
                        _ => {
                            let _ = fired.send(Fired::Broken);
                        }
                    }
                    return;
                }
                _ = pause => {}
            }
            match self.look().await {
                // Gone, perhaps before the first look (the watch was placed after a read that
                // saw it, so this incarnation was deleted since): a deletion like any other.
                Ok(Look::Gone) => {
                    let _ = fired.send(Fired::Deleted {
                        entry: self.entry.clone(),
                        position: self.position,
                    });
                    return;
                }
                Ok(Look::There { ahead, left }) => {
                    let due = left + Duration::from_millis(20);
                    wait = match (self.polling, self.own, ahead == 0) {
                        (false, false, _) => Some(due),
                        (false, true, _) => None,
                        // A leader's entry deleted behind its back: the waiter behind it sees
                        // that within POLL_FAST, so must the leader.
                        (true, true, true) => Some(POLL_FAST),
                        (true, true, false) => Some(POLL_SLOW),
                        (true, false, _) => Some(due.min(poll_cadence(ahead))),
                    };
                }
                Err(_) => {
                    let _ = fired.send(Fired::Broken);
                    return;
                }
            }
        }
    }

    /// One look (two statements when the entry's session has expired: removing it, then
    /// looking again).
    async fn look(&self) -> Result<Look> {
        let s = &self.schema;
        let look = format!(
            "SELECT extract(epoch FROM ss.expires_at - clock_timestamp())::float8, \
             (SELECT count(*) FROM (SELECT 1 FROM {s}.entries o WHERE o.election = e.election \
             AND o.position < e.position LIMIT {AHEAD_COUNTED}) a) FROM {s}.entries e \
             JOIN {s}.sessions ss ON ss.id = e.session \
             WHERE e.election = $1 AND e.position = $2 AND e.name = $3"
        );
        let client = self.pool.get().await?;
        let position = self.position.0 as i64;
        let params = [p(&self.entry.election), p(&position), p(&self.entry.name)];
        let read = || client.query_typed_opt(&look, &params);
        let row = bounded(&self.stats, "watch entry", read()).await?;
        let Some(mut row) = row else {
            return Ok(Look::Gone);
        };
        if row.get::<_, f64>(0) <= 0.0 {
            // Its session's time is up: remove it (and its entries), then look again.
            let clean = format!(
                "DELETE FROM {s}.sessions WHERE expires_at <= clock_timestamp() RETURNING {DURABLE}"
            );
            bounded(
                &self.stats,
                "remove expired sessions",
                client.execute_typed(&clean, &[]),
            )
            .await?;
            match bounded(&self.stats, "watch entry", read()).await? {
                Some(again) => row = again,
                None => return Ok(Look::Gone),
            }
        }
        Ok(Look::There {
            ahead: row.get::<_, i64>(1) as u32,
            left: Duration::from_secs_f64(row.get::<_, f64>(0).max(0.0)),
        })
    }
}

/// The session an entry name (`<session id>-<session key>-<serial>`, both in 16 hex digits)
/// is bound to: its id and key.
fn entry_session(name: &str) -> Option<(i64, i64)> {
    let hex = |text: Option<&str>| u64::from_str_radix(text?, 16).ok().map(|n| n as i64);
    Some((hex(name.get(..16))?, hex(name.get(17..33))?))
}

/// Fenced transactions: the leader's entry row is locked (`FOR UPDATE`) for the whole
/// transaction, after checking that it leads (first in line, session live by the database's
/// clock); a successor cannot lead until it ends.
struct PgFencer {
    pool: Arc<Pool>,
    schema: String,
    stats: Arc<Stats>,
    election: String,
}

impl std::fmt::Debug for PgFencer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgFencer")
            .field("election", &self.election)
            .finish()
    }
}

impl Fencer for PgFencer {
    fn run<'a>(
        &'a self,
        election: &'a str,
        token: u64,
        txn: &'a FencedTxn,
        limit: Duration,
    ) -> BoxFuture<'a, Result<FencedTxnResponse>> {
        Box::pin(run_fenced(
            &self.pool,
            &self.schema,
            &self.stats,
            election,
            token,
            txn,
            limit,
        ))
    }
}

/// Runs `txn` only while `token` leads `election`, in one database transaction.
async fn run_fenced(
    pool: &Pool,
    schema: &str,
    stats: &Stats,
    election: &str,
    token: u64,
    txn: &FencedTxn,
    limit: Duration,
) -> Result<FencedTxnResponse> {
    txn.validate()?;
    let mut client = pool.get().await?;
    let work = async {
        let transaction = bounded(stats, "fenced transaction", client.transaction()).await?;
        let leads = format!(
            "SELECT {DURABLE} FROM {schema}.entries e JOIN {schema}.sessions ss \
             ON ss.id = e.session WHERE e.election = $1 AND e.position = $2 \
             AND ss.expires_at > clock_timestamp() \
             AND NOT EXISTS (SELECT 1 FROM {schema}.entries o WHERE o.election = $1 \
             AND o.position < $2) FOR UPDATE OF e"
        );
        let position = i64::try_from(token).unwrap_or(i64::MAX);
        let held = bounded(
            stats,
            "fenced transaction",
            transaction.query_typed_opt(&leads, &[p(&election), p(&position)]),
        )
        .await?;
        if held.is_none() {
            return Err(Error::Fenced {
                election: election.to_string(),
                token,
            });
        }
        let get = format!("SELECT value FROM {schema}.data WHERE key = $1 FOR UPDATE");
        let mut succeeded = true;
        for compare in &txn.compares {
            let FencedCompare::Value { key, value } = compare;
            let row = bounded(
                stats,
                "fenced transaction",
                transaction.query_typed_opt(&get, &[p(key)]),
            )
            .await?;
            let found: Option<Vec<u8>> = row.map(|row| row.get(0));
            if found.as_ref() != value.as_ref() {
                succeeded = false;
            }
        }
        let put = format!(
            "INSERT INTO {schema}.data (key, value) VALUES ($1, $2) \
             ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value"
        );
        let delete = format!("DELETE FROM {schema}.data WHERE key = $1");
        let mut values = Vec::new();
        for op in if succeeded { &txn.then } else { &txn.otherwise } {
            match op {
                FencedOp::Put { key, value } => {
                    bounded(
                        stats,
                        "fenced transaction",
                        transaction.execute_typed(&put, &[p(key), p(value)]),
                    )
                    .await?;
                }
                FencedOp::Delete { key } => {
                    bounded(
                        stats,
                        "fenced transaction",
                        transaction.execute_typed(&delete, &[p(key)]),
                    )
                    .await?;
                }
                FencedOp::Get { key } => {
                    let row = bounded(
                        stats,
                        "fenced transaction",
                        transaction.query_typed_opt(&get, &[p(key)]),
                    )
                    .await?;
                    values.push(row.map(|row| row.get(0)));
                }
            }
        }
        bounded(stats, "fenced transaction", transaction.commit()).await?;
        Ok(FencedTxnResponse { succeeded, values })
    };
    match tokio::time::timeout(limit, work).await {
        Ok(result) => result,
        Err(_) => Err(Error::Timeout {
            operation: "fenced transaction",
            after_ms: limit.as_millis() as u64,
        }),
    }
}

impl Connection for PgBackend {
    fn limits(&self) -> BackendLimits {
        LIMITS
    }

    fn stats(&self) -> crate::StatsSnapshot {
        self.stats.snapshot()
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(self.leases.close())
    }

    fn spawn_candidate(
        self: Arc<Self>,
        spec: CandidateSpec,
        commands_rx: mpsc::Receiver<Command>,
        commands: mpsc::Sender<Command>,
        leaderships: mpsc::Sender<Box<Result<Leadership>>>,
    ) {
        crate::driver::spawn(self, spec, commands_rx, commands, leaderships);
    }

    fn leader<'a>(&'a self, election: &'a str) -> BoxFuture<'a, Result<Option<LeaderInfo>>> {
        Box::pin(async move {
            let client = self.pool.get().await?;
            self.first(&client, election).await
        })
    }

    fn participants<'a>(&'a self, election: &'a str) -> BoxFuture<'a, Result<Vec<LeaderInfo>>> {
        Box::pin(async move {
            let sql = format!(
                "SELECT e.position, e.value FROM {s}.entries e JOIN {s}.sessions ss ON ss.id = \
                 e.session WHERE e.election = $1 AND ss.expires_at > clock_timestamp() \
                 ORDER BY e.position",
                s = self.schema
            );
            let client = self.pool.get().await?;
            let rows = bounded(
                &self.stats,
                "get candidates",
                client.query_typed(&sql, &[p(&election)]),
            )
            .await?;
            Ok(rows
                .iter()
                .map(|row| describe(row.get(0), row.get(1)))
                .collect())
        })
    }

    fn spawn_observer(
        self: Arc<Self>,
        election: String,
        tx: mpsc::Sender<Observed>,
    ) -> BoxFuture<'static, Result<()>> {
        Box::pin(async move {
            if self.leases.is_closed() {
                return Err(Error::Closed);
            }
            let (seen_tx, mut seen) = mpsc::unbounded_channel();
            self.hub
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .observers
                .entry(election.clone())
                .or_default()
                .push(seen_tx);
            let backend = self.clone();
            let closing = self.leases.closing();
            tokio::spawn(async move {
                let mut closing = std::pin::pin!(closing);
                // What was said last: a leader (or none), or why the database cannot be seen.
                // Said again only when it changes: an outage is one line, not one per look.
                let mut last: Option<std::result::Result<Option<LeaderInfo>, String>> = None;
                // A crashed leader's row stays until someone removes its expired session: look
                // every second too (and say so when the database cannot be seen); without
                // notifications, as often as a waiter looks at the leader.
                let mut probe = tokio::time::interval(POLL_FAST);
                probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut looked = tokio::time::Instant::now();
                let mut look = true;
                loop {
                    if !look {
                        // A tick: with notifications, only once a second.
                        let listening = backend
                            .hub
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .listening;
                        look = !listening || looked.elapsed() >= Duration::from_secs(1);
                    }
                    if look {
                        looked = tokio::time::Instant::now();
                        let current = tokio::time::timeout(OBSERVER_PATIENCE, async {
                            let client = backend.pool.get().await?;
                            // Best effort: a read-only role observes without removing.
                            let _ = backend.clean_up(&client).await;
                            backend.first(&client, &election).await
                        })
                        .await
                        .unwrap_or_else(|_| {
                            Err(Error::Unreachable {
                                backend: BACKEND,
                                endpoints: backend.pool.target.label.clone(),
                                detail: format!(
                                    "no answer within {}",
                                    crate::format_duration(OBSERVER_PATIENCE)
                                ),
                            })
                        })
                        .map_err(|error| error.to_string());
                        let said = match &current {
                            _ if last.as_ref() == Some(&current) => None,
                            Ok(leader) => Some(Observed::Leader(leader.clone())),
                            Err(reason) => Some(Observed::Unavailable {
                                reason: reason.clone(),
                            }),
                        };
                        last = Some(current);
                        if let Some(said) = said {
                            if tx.send(said).await.is_err() {
                                return;
                            }
                        }
                    }
                    tokio::select! {
                        event = seen.recv() => match event {
                            Some(Seen::Changed) => {
                                look = true;
                                continue;
                            }
                            None => return,
                        },
                        _ = probe.tick() => {}
                        _ = closing.as_mut() => return,
                        _ = tx.closed() => return,
                    }
                    look = false;
                }
            });
            Ok(())
        })
    }

    fn fenced_txn<'a>(
        &'a self,
        election: &'a str,
        token: u64,
        txn: &'a FencedTxn,
        limit: Duration,
    ) -> BoxFuture<'a, Result<FencedTxnResponse>> {
        Box::pin(run_fenced(
            &self.pool,
            &self.schema,
            &self.stats,
            election,
            token,
            txn,
            limit,
        ))
    }
}
