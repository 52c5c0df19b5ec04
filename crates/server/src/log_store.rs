//! The Raft log on disk: redb for durability, a copy of the unpurged log in memory for reads,
//! and one writer thread that makes every write durable with group commit.
//!
//! `append` returns as soon as the entries are in memory (openraft's contract) and hands them to
//! the writer thread. That thread takes everything queued since its last commit, writes it in one
//! redb transaction and commits it with an fsync, then reports every write in the batch as
//! flushed. So 64 clients writing at once share fsyncs instead of queueing behind one each, and
//! nothing is acknowledged before it is on disk (openraft answers a client only after the
//! entry's flush is reported and the entry is applied).

// openraft's storage traits return its `StorageError`, large as it is.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use openraft::storage::{LogFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::{Entry, ErrorSubject, ErrorVerb, LogId, OptionalSend, StorageError, Vote};
use redb::{Database, Durability, ReadableTable, TableDefinition};
use tokio::sync::oneshot;

use crate::raft::TypeConfig;

/// Log entries by index, each encoded with bincode.
const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("log");
/// Vote, last purged log id, committed log id, cluster id: bincode-encoded under fixed names.
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

const META_VOTE: &str = "vote";
const META_PURGED: &str = "last_purged";
const META_COMMITTED: &str = "committed";

type NodeId = u64;
type Result<T> = std::result::Result<T, StorageError<NodeId>>;

/// What the unpurged log looks like; shared by the store and its readers.
#[derive(Default)]
struct Cached {
    entries: BTreeMap<u64, Entry<TypeConfig>>,
    /// Each cached entry's encoded size, by index.
    sizes: BTreeMap<u64, u64>,
    last_purged: Option<LogId<NodeId>>,
    vote: Option<Vote<NodeId>>,
    committed: Option<LogId<NodeId>>,
}

/// One write for the writer thread, in the order openraft issued it.
enum Write {
    Append(Vec<(u64, Vec<u8>)>, Option<LogFlushed<TypeConfig>>),
    Truncate(u64, oneshot::Sender<io::Result<()>>),
    Purge(LogId<NodeId>),
    Vote(Vec<u8>, oneshot::Sender<io::Result<()>>),
    Committed(Vec<u8>),
}

/// The Raft log and vote, durable in `DIR/raft.redb`.
#[derive(Clone)]
pub struct LogStore {
    cached: Arc<Mutex<Cached>>,
    writer: Arc<Writer>,
    /// How big the unpurged log is, which memory holds too (see [`LogStore::growth`]).
    growth: Arc<Growth>,
}

/// The encoded bytes of the unpurged log, and a signal each time an append leaves them past a
/// bound: the server then takes a snapshot, which purges the log.
pub struct Growth {
    bytes: AtomicU64,
    /// No bound until [`LogStore::growth`] sets one.
    limit: AtomicU64,
    past: tokio::sync::Notify,
    /// Purges so far, and a wake-up for every waiter at each.
    purges: AtomicU64,
    purged: tokio::sync::Notify,
}

impl Growth {
    /// The encoded bytes of the unpurged log.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// The bound.
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    /// Waits for an append that leaves the log past the bound (one stored if none waited).
    pub async fn past_limit(&self) {
        self.past.notified().await
    }

    /// Counts a purge that freed `bytes`, and wakes whoever waits for one.
    fn count_purge(&self, bytes: u64) {
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
        self.purges.fetch_add(1, Ordering::Relaxed);
        self.purged.notify_waiters();
    }

    /// A log of `bytes` bounded at `limit`, for tests of what waits on it.
    #[cfg(test)]
    pub(crate) fn for_test(bytes: u64, limit: u64) -> Arc<Growth> {
        Arc::new(Growth {
            bytes: AtomicU64::new(bytes),
            limit: AtomicU64::new(limit),
            past: tokio::sync::Notify::new(),
            purges: AtomicU64::new(0),
            purged: tokio::sync::Notify::new(),
        })
    }

    /// A purge of `bytes`, for tests.
    #[cfg(test)]
    pub(crate) fn purge_for_test(&self, bytes: u64) {
        self.count_purge(bytes);
    }

    /// An append's signal that the log is past its bound, for tests.
    #[cfg(test)]
    pub(crate) fn signal_past_for_test(&self) {
        self.past.notify_one();
    }

    /// How many purges have shrunk the log so far.
    pub fn purges(&self) -> u64 {
        self.purges.load(Ordering::Relaxed)
    }

    /// Waits, for at most `wait`, until `done` holds; it is checked again after each purge
    /// (only a purge shrinks the log). Returns whether it held.
    async fn until(&self, wait: std::time::Duration, done: impl Fn() -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let purged = self.purged.notified();
            tokio::pin!(purged);
            // Registered before `done` is read: a purge in between still wakes us.
            purged.as_mut().enable();
            if done() {
                return true;
            }
            if tokio::time::timeout_at(deadline, purged).await.is_err() {
                return done();
            }
        }
    }

    /// Waits, for at most `wait`, until the log is at most `bytes` big.
    pub async fn at_most(&self, bytes: u64, wait: std::time::Duration) -> bool {
        self.until(wait, || self.bytes() <= bytes).await
    }

    /// Waits, for at most `wait`, for a purge after the `seen`th.
    pub async fn purged_after(&self, seen: u64, wait: std::time::Duration) -> bool {
        self.until(wait, || self.purges() > seen).await
    }
}

/// The writer thread's queue and the thread itself. The last `LogStore` to go closes the queue
/// and waits for the thread to commit what it holds and let go of the database, so that once a
/// server is shut down (every `LogStore` dropped), its data directory can be opened again in
/// the same process at once.
struct Writer {
    queue: mpsc::Sender<Write>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Our sender goes now (a disconnected one takes its place), so the thread's queue ends.
        self.queue = mpsc::channel().0;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Reads the in-memory copy of the unpurged log.
#[derive(Clone)]
pub struct LogReader {
    cached: Arc<Mutex<Cached>>,
}

impl LogStore {
    /// Opens (or creates) the log in `db`, loading the unpurged entries into memory, and starts
    /// the writer thread.
    pub fn open(db: Arc<Database>) -> io::Result<LogStore> {
        let cached = load(&db)?;
        let growth = Arc::new(Growth {
            bytes: AtomicU64::new(cached.sizes.values().sum()),
            limit: AtomicU64::new(u64::MAX),
            past: tokio::sync::Notify::new(),
            purges: AtomicU64::new(0),
            purged: tokio::sync::Notify::new(),
        });
        let (sender, queue) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("baton-raft-log".into())
            .spawn(move || write_loop(&db, &queue))?;
        Ok(LogStore {
            cached: Arc::new(Mutex::new(cached)),
            writer: Arc::new(Writer {
                queue: sender,
                thread: Some(thread),
            }),
            growth,
        })
    }

    /// The size of the unpurged log, kept in memory as well, signalling past `limit` bytes:
    /// the server takes a snapshot (which purges the log) then, not only every so many entries.
    pub fn growth(&self, limit: u64) -> Arc<Growth> {
        self.growth.limit.store(limit, Ordering::Relaxed);
        self.growth.clone()
    }

    /// Drops the sizes of the entries in `removed` from the count.
    fn forget_sizes(&self, removed: BTreeMap<u64, u64>) {
        self.growth.count_purge(removed.values().sum());
    }

    /// The last log entry folded into a snapshot and removed from the log, if any.
    pub fn last_purged(&self) -> Option<LogId<NodeId>> {
        self.cached().last_purged
    }

    fn send(&self, write: Write) -> Result<()> {
        self.writer.queue.send(write).map_err(|_| {
            io_error(
                ErrorSubject::Logs,
                ErrorVerb::Write,
                io::Error::other("the log writer stopped"),
            )
        })
    }

    fn cached(&self) -> std::sync::MutexGuard<'_, Cached> {
        self.cached.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// redb's page cache. The log is read from redb only at start-up (memory holds the unpurged
/// log), so its default of 1 GiB would mostly keep written pages alive: 200 writes of 1.4 MB
/// left the server at 760 MB, 600 MB with this (64 MiB: the same 64-client throughput).
const REDB_CACHE_BYTES: usize = 64 << 20;

/// Opens the redb database behind a data directory; one process at a time (redb locks it).
///
/// A damaged file (redb finds it corrupted, cut short or in a format it cannot read) is an
/// error of kind [`io::ErrorKind::InvalidData`]; every other failure (in use by another server,
/// a read-only file system, no permission) keeps its own kind, since the file is fine.
pub fn open_database(path: &Path) -> io::Result<Database> {
    // redb would make an empty file into a new, empty database: a log emptied by accident
    // would then start a new member from revision 1, fencing tokens included.
    if std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == 0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is empty", path.display()),
        ));
    }
    Database::builder()
        .set_cache_size(REDB_CACHE_BYTES)
        .create(path)
        .map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => io::Error::new(
                io::ErrorKind::WouldBlock,
                format!(
                    "{} is in use by another baton server (one server per data directory)",
                    path.display()
                ),
            ),
            redb::DatabaseError::Storage(redb::StorageError::Io(io))
                if io.kind() != io::ErrorKind::UnexpectedEof
                    && io.kind() != io::ErrorKind::InvalidData =>
            {
                io::Error::new(
                    io.kind(),
                    format!("{} cannot be opened: {io}", path.display()),
                )
            }
            other => io::Error::new(
                io::ErrorKind::InvalidData,
                format!("cannot open {}: {other}", path.display()),
            ),
        })
}

fn load(db: &Database) -> io::Result<Cached> {
    let txn = db.begin_write().map_err(io::Error::other)?;
    {
        // Create both tables on first use, so that reads below find them.
        txn.open_table(LOG).map_err(io::Error::other)?;
        txn.open_table(META).map_err(io::Error::other)?;
    }
    txn.commit().map_err(io::Error::other)?;
    let txn = db.begin_read().map_err(io::Error::other)?;
    let mut cached = Cached::default();
    let log = txn.open_table(LOG).map_err(io::Error::other)?;
    for item in log.iter().map_err(io::Error::other)? {
        let (index, bytes) = item.map_err(io::Error::other)?;
        let entry: Entry<TypeConfig> = decode(bytes.value())?;
        cached
            .sizes
            .insert(index.value(), bytes.value().len() as u64);
        cached.entries.insert(index.value(), entry);
    }
    let meta = txn.open_table(META).map_err(io::Error::other)?;
    let read = |name: &str| -> io::Result<Option<Vec<u8>>> {
        Ok(meta
            .get(name)
            .map_err(io::Error::other)?
            .map(|v| v.value().to_vec()))
    };
    if let Some(bytes) = read(META_VOTE)? {
        cached.vote = Some(decode(&bytes)?);
    }
    if let Some(bytes) = read(META_PURGED)? {
        cached.last_purged = Some(decode(&bytes)?);
    }
    if let Some(bytes) = read(META_COMMITTED)? {
        cached.committed = decode::<Option<LogId<NodeId>>>(&bytes)?;
    }
    Ok(cached)
}

/// How long writes that acknowledge nothing (the committed index, purges) wait to ride along
/// with the next write that does, before they are committed on their own.
const DEFER_UNACKNOWLEDGED: Duration = Duration::from_millis(200);

/// The writer thread: commit everything queued since the last commit in one transaction.
/// Writes nobody waits for are held back and go with the next one somebody does: every client
/// write moves the committed index, and a transaction of its own for it would cost as much as
/// the write (and keep the writer busy just when the next write arrives).
fn write_loop(db: &Database, queue: &mpsc::Receiver<Write>) {
    let mut held: Vec<Write> = Vec::new();
    loop {
        // With writes held back, wait only so long; then (or when the log closes) they go alone.
        let next = if held.is_empty() {
            match queue.recv() {
                Ok(write) => Some(write),
                Err(_) => return,
            }
        } else {
            queue.recv_timeout(DEFER_UNACKNOWLEDGED).ok()
        };
        let held_long_enough = next.is_none();
        let mut batch = std::mem::take(&mut held);
        batch.extend(next);
        while let Ok(write) = queue.try_recv() {
            batch.push(write);
        }
        if !held_long_enough && !batch.iter().any(waited_for) {
            held = batch;
            continue;
        }
        let result = commit(db, &batch).map_err(|e| e.to_string());
        let reported = batch.iter().any(waited_for);
        for write in batch {
            let outcome = result.clone().map_err(io::Error::other);
            match write {
                Write::Append(_, Some(flushed)) => flushed.log_io_completed(outcome),
                Write::Truncate(_, done) | Write::Vote(_, done) => {
                    let _ = done.send(outcome);
                }
                Write::Append(_, None) | Write::Purge(_) | Write::Committed(_) => {}
            }
        }
        match result {
            // A waiter got the error: openraft turns it into a fatal stop of this member, and
            // the server exits saying why.
            Err(_) if reported => {}
            // Only the committed index or a purge failed: harmless (openraft re-derives both),
            // and the next write somebody waits for meets the same disk and stops the member
            // with its own line.
            Err(error) => tracing::debug!(%error, "the Raft log could not be written"),
            Ok(()) => {}
        }
    }
}

/// Whether somebody waits for this write to be durable (appends, truncations, votes); the
/// committed index and purges are not (openraft re-derives them after a crash).
fn waited_for(write: &Write) -> bool {
    !matches!(write, Write::Purge(_) | Write::Committed(_))
}

fn commit(db: &Database, batch: &[Write]) -> io::Result<()> {
    let mut txn = db.begin_write().map_err(redb_io)?;
    // Only batches that acknowledge something need an fsync; the committed index alone can
    // wait for the next one (openraft re-derives it after a crash).
    let durable = batch.iter().any(waited_for);
    txn.set_durability(if durable {
        Durability::Immediate
    } else {
        Durability::Eventual
    });
    {
        let mut log = txn.open_table(LOG).map_err(redb_io)?;
        let mut meta = txn.open_table(META).map_err(redb_io)?;
        for write in batch {
            match write {
                Write::Append(entries, _) => {
                    for (index, bytes) in entries {
                        log.insert(*index, bytes.as_slice()).map_err(redb_io)?;
                    }
                }
                Write::Truncate(since, _) => {
                    log.retain_in(*since.., |_, _| false).map_err(redb_io)?;
                }
                Write::Purge(upto) => {
                    log.retain_in(..=upto.index, |_, _| false)
                        .map_err(redb_io)?;
                    meta.insert(META_PURGED, encode(upto).as_slice())
                        .map_err(redb_io)?;
                }
                Write::Vote(bytes, _) => {
                    meta.insert(META_VOTE, bytes.as_slice()).map_err(redb_io)?;
                }
                Write::Committed(bytes) => {
                    meta.insert(META_COMMITTED, bytes.as_slice())
                        .map_err(redb_io)?;
                }
            }
        }
    }
    txn.commit().map_err(redb_io)
}

/// redb's many error types as one I/O error (the writer reports them, it does not branch on them).
fn redb_io(error: impl Into<redb::Error>) -> io::Error {
    io::Error::other(error.into())
}

fn encode<T: serde::Serialize>(value: &T) -> Vec<u8> {
    // Serializing plain data into a Vec cannot fail.
    bincode::serialize(value).expect("bincode serializes plain data")
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> io::Result<T> {
    bincode::deserialize(bytes).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("corrupt Raft log record: {e}"),
        )
    })
}

fn io_error(
    subject: ErrorSubject<NodeId>,
    verb: ErrorVerb,
    error: io::Error,
) -> StorageError<NodeId> {
    StorageError::from_io_error(subject, verb, error)
}

async fn wait(
    done: oneshot::Receiver<io::Result<()>>,
    subject: ErrorSubject<NodeId>,
) -> Result<()> {
    let outcome = done
        .await
        .unwrap_or_else(|_| Err(io::Error::other("the log writer stopped")));
    outcome.map_err(|e| io_error(subject, ErrorVerb::Write, e))
}

fn read_range<RB: RangeBounds<u64>>(cached: &Cached, range: RB) -> Vec<Entry<TypeConfig>> {
    let start = range.start_bound().cloned();
    let end = range.end_bound().cloned();
    if let (Bound::Included(s) | Bound::Excluded(s), Bound::Included(e) | Bound::Excluded(e)) =
        (start, end)
    {
        if s > e {
            return Vec::new();
        }
    }
    cached
        .entries
        .range((start, end))
        .map(|(_, e)| e.clone())
        .collect()
}

impl RaftLogReader<TypeConfig> for LogReader {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>> {
        let cached = self.cached.lock().unwrap_or_else(|e| e.into_inner());
        Ok(read_range(&cached, range))
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>> {
        Ok(read_range(&self.cached(), range))
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogReader;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>> {
        let cached = self.cached();
        let last = cached
            .entries
            .values()
            .next_back()
            .map(|e| e.log_id)
            .or(cached.last_purged);
        Ok(LogState {
            last_purged_log_id: cached.last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> LogReader {
        LogReader {
            cached: self.cached.clone(),
        }
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<()> {
        self.cached().vote = Some(*vote);
        let (done, wait_for) = oneshot::channel();
        self.send(Write::Vote(encode(vote), done))?;
        // A vote is spoken only once it is durable: wait until the writer committed it.
        wait(wait_for, ErrorSubject::Vote).await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>> {
        Ok(self.cached().vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId<NodeId>>) -> Result<()> {
        self.cached().committed = committed;
        self.send(Write::Committed(encode(&committed)))
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>> {
        Ok(self.cached().committed)
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<()>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut encoded = Vec::new();
        {
            let mut cached = self.cached();
            for entry in entries {
                let bytes = encode(&entry);
                let size = bytes.len() as u64;
                // An entry written again at an index (after a truncation) replaces the old one.
                let old = cached.sizes.insert(entry.log_id.index, size).unwrap_or(0);
                self.growth.bytes.fetch_add(size, Ordering::Relaxed);
                self.growth.bytes.fetch_sub(old, Ordering::Relaxed);
                encoded.push((entry.log_id.index, bytes));
                cached.entries.insert(entry.log_id.index, entry);
            }
        }
        if self.growth.bytes() > self.growth.limit() {
            self.growth.past.notify_one();
        }
        self.send(Write::Append(encoded, Some(callback)))
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<()> {
        {
            let mut cached = self.cached();
            cached.entries.split_off(&log_id.index);
            let removed = cached.sizes.split_off(&log_id.index);
            self.forget_sizes(removed);
        }
        let (done, wait_for) = oneshot::channel();
        self.send(Write::Truncate(log_id.index, done))?;
        wait(wait_for, ErrorSubject::Logs).await
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<()> {
        {
            let mut cached = self.cached();
            cached.last_purged = Some(log_id);
            let keep = cached.entries.split_off(&(log_id.index + 1));
            cached.entries = keep;
            let keep = cached.sizes.split_off(&(log_id.index + 1));
            let removed = std::mem::replace(&mut cached.sizes, keep);
            self.forget_sizes(removed);
        }
        self.send(Write::Purge(log_id))
    }
}

/// Who this data directory belongs to: chosen at random when the directory is created.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct Identity {
    /// The etcd cluster id in response headers.
    pub cluster_id: u64,
    /// This member's id (Raft node id and etcd member id).
    pub member_id: u64,
}

const META_IDENTITY: &str = "identity";

/// What a damaged data directory's error says to do.
pub const DAMAGED_ADVICE: &str =
    "restore the data directory from a backup, or move it away to start an empty server";

/// Creates the Raft log of a new data directory at `path`, with a new member identity:
/// made under a temporary name and renamed into place once durable, so that `path` exists
/// only holding an identity. A start that fails half-way (a full disk) leaves no log that a
/// later start would take for a damaged one, and a log without an identity is never a new one.
pub fn create_database(path: &Path) -> io::Result<(Database, Identity)> {
    let staged = path.with_extension("redb.new");
    match std::fs::remove_file(&staged) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let made = (|| {
        let identity = write_new_identity(&open_database(&staged)?)?;
        std::fs::File::open(&staged)?.sync_all()?;
        std::fs::rename(&staged, path)?;
        if let Some(dir) = path.parent() {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok((open_database(path)?, identity))
    })();
    if made.is_err() {
        let _ = std::fs::remove_file(&staged);
    }
    made
}

/// The member identity of an existing log; a log without one was not made by
/// [`create_database`] (emptied, or replaced by another file) and is refused as damaged.
pub fn existing_identity(db: &Database, path: &Path) -> io::Result<Identity> {
    let txn = db.begin_read().map_err(io::Error::other)?;
    let identity = match txn.open_table(META) {
        Ok(meta) => meta
            .get(META_IDENTITY)
            .map_err(io::Error::other)?
            .map(|v| v.value().to_vec()),
        Err(redb::TableError::TableDoesNotExist(_)) => None,
        Err(e) => return Err(io::Error::other(e)),
    };
    match identity {
        Some(bytes) => decode(&bytes),
        None => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "the Raft log {} holds no member identity; it is damaged: {DAMAGED_ADVICE}",
                path.display()
            ),
        )),
    }
}

/// Gives a new log its member identity (random ids; nonzero, since etcd clients treat member
/// id 0 as "none").
fn write_new_identity(db: &Database) -> io::Result<Identity> {
    let identity = Identity {
        cluster_id: rand::random::<u64>() | 1,
        member_id: rand::random::<u64>() | 1,
    };
    let txn = db.begin_write().map_err(io::Error::other)?;
    txn.open_table(META)
        .map_err(io::Error::other)?
        .insert(META_IDENTITY, encode(&identity).as_slice())
        .map_err(io::Error::other)?;
    txn.commit().map_err(io::Error::other)?;
    Ok(identity)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn growth(bytes: u64, limit: u64) -> Arc<Growth> {
        Growth::for_test(bytes, limit)
    }

    #[tokio::test(start_paused = true)]
    async fn at_most_waits_for_the_purge_that_shrinks_the_log_enough() {
        let log = growth(300, 100);
        assert!(
            log.at_most(300, Duration::from_secs(1)).await,
            "already small enough"
        );
        let purger = {
            let log = log.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                log.count_purge(50); // 250: not yet
                tokio::time::sleep(Duration::from_millis(100)).await;
                log.count_purge(200); // 50
            })
        };
        let started = tokio::time::Instant::now();
        assert!(log.at_most(100, Duration::from_secs(1)).await);
        assert_eq!(started.elapsed(), Duration::from_millis(200));
        purger.await.unwrap();
        // No purge comes: false once the wait is over, not before.
        log.bytes.store(500, Ordering::Relaxed);
        let started = tokio::time::Instant::now();
        assert!(!log.at_most(100, Duration::from_secs(1)).await);
        assert_eq!(started.elapsed(), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_purge_before_the_wait_begins_is_not_missed() {
        let log = growth(300, 100);
        let seen = log.purges();
        // The snapshot (and its purge) finished before the task got round to waiting.
        log.count_purge(300);
        let started = tokio::time::Instant::now();
        assert!(log.purged_after(seen, Duration::from_secs(1)).await);
        assert_eq!(started.elapsed(), Duration::ZERO);
        // A later wait needs a later purge.
        assert!(!log.purged_after(log.purges(), Duration::from_secs(1)).await);
    }
}
