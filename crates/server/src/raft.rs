//! openraft glue: the type configuration, the state machine around the sans-IO [`Store`], and
//! snapshots on disk.
//!
//! The state machine is not persisted entry by entry: the log is (see [`crate::log_store`]), and
//! a snapshot of the whole store is written to `DIR/snapshot` every
//! [`crate::ServerConfig::snapshot_every`] entries, and whenever the log grows past a quarter
//! of the quota. After a restart the store is the last
//! snapshot plus the committed log entries openraft applies again.

use std::io::{self, Cursor, Write as _};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use openraft::storage::{RaftStateMachine, Snapshot, SnapshotMeta};
use openraft::{
    BasicNode, Entry, EntryPayload, ErrorSubject, ErrorVerb, LogId, OptionalSend,
    RaftSnapshotBuilder, StorageError, StoredMembership,
};
use serde::{Deserialize, Serialize};

use crate::lease::LeaseKeeper;
use crate::proto::etcdserverpb::ResponseHeader;
use crate::store::{Command, CommandResponse, Store, StoreError};
use crate::watch::WatchHub;

openraft::declare_raft_types!(
    /// The Raft types of baton server: a log entry carries a [`Proposal`] (commands of several
    /// clients), applying it gives one [`Reply`] per command.
    pub TypeConfig:
        D = Proposal,
        R = Vec<Reply>,
);

/// The commands of one log entry, applied in order, each with a revision of its own.
///
/// Commands that arrive while an entry is being written wait and go together in the next one
/// (see `node::Proposer`): one log write, and one fsync, for as many clients as wrote at once.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Proposal(pub Vec<Command>);

/// A member's id in the Raft group (and its etcd member id).
pub type NodeId = u64;

/// What applying one log entry gave.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Reply {
    /// The store's revision after the entry.
    pub revision: i64,
    /// The command's result; `None` for Raft's own entries (blank, membership).
    pub result: Option<Result<CommandResponse, StoreError>>,
}

/// The applied state, shared by the state machine (writes) and the gRPC services (reads, watch
/// registration). One mutex, held briefly, so that a watch registers at an exact revision.
pub struct Core {
    /// The etcd semantics.
    pub store: Store,
    /// The last log entry applied to `store`.
    pub applied: Option<LogId<NodeId>>,
    /// The last membership applied.
    pub membership: StoredMembership<NodeId, BasicNode>,
    /// Watchers, told of every applied event under the same lock.
    pub watches: WatchHub,
    /// cluster_id, member_id and raft_term of response headers.
    pub header: ResponseHeader,
}

impl Core {
    /// A response header at `revision`.
    pub fn header(&self, revision: i64) -> ResponseHeader {
        ResponseHeader {
            revision,
            ..self.header
        }
    }
}

/// The shared applied state.
pub type SharedCore = Arc<Mutex<Core>>;

/// Locks the core; a panic elsewhere while holding it does not make the state unreadable.
pub fn lock(core: &SharedCore) -> MutexGuard<'_, Core> {
    core.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a snapshot holds, borrowed for writing.
#[derive(Serialize)]
struct SnapshotRef<'a> {
    store: &'a Store,
    applied: &'a Option<LogId<NodeId>>,
    membership: &'a StoredMembership<NodeId, BasicNode>,
}

/// What a snapshot holds, owned after reading.
#[derive(Deserialize)]
struct SnapshotOwned {
    store: Store,
    applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
}

/// The snapshot file: openraft's metadata and the encoded state.
#[derive(Serialize, Deserialize)]
struct SnapshotFile {
    meta: SnapshotMeta<NodeId, BasicNode>,
    data: Vec<u8>,
}

/// openraft's state machine: applies entries to the shared [`Core`].
pub struct StateMachine {
    core: SharedCore,
    leases: Arc<LeaseKeeper>,
    snapshot_path: PathBuf,
}

impl StateMachine {
    /// A state machine over `core`, keeping snapshots in `data_dir`.
    pub fn new(core: SharedCore, leases: Arc<LeaseKeeper>, data_dir: &Path) -> StateMachine {
        StateMachine {
            core,
            leases,
            snapshot_path: snapshot_path(data_dir),
        }
    }
}

fn snapshot_path(data_dir: &Path) -> PathBuf {
    data_dir.join("snapshot")
}

/// Whether `data_dir` holds a snapshot (whatever its state).
pub fn has_snapshot(data_dir: &Path) -> bool {
    std::fs::symlink_metadata(snapshot_path(data_dir)).is_ok()
}

/// The state a member starts from: its last snapshot.
pub struct Restored {
    /// The store as of the snapshot.
    pub store: Store,
    /// The last entry the snapshot includes.
    pub applied: Option<LogId<NodeId>>,
    /// The membership as of the snapshot.
    pub membership: StoredMembership<NodeId, BasicNode>,
}

/// Reads the last snapshot in `data_dir`, if there is one: the state to start from.
pub fn load_snapshot(data_dir: &Path) -> io::Result<Option<Restored>> {
    let path = snapshot_path(data_dir);
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let file: SnapshotFile = decode(verified(&bytes, &path)?, &path)?;
    let state: SnapshotOwned = decode(&file.data, &path)?;
    Ok(Some(Restored {
        store: state.store,
        applied: state.applied,
        membership: state.membership,
    }))
}

fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8], path: &Path) -> io::Result<T> {
    bincode::deserialize(bytes).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} is not a baton server snapshot: {e}", path.display()),
        )
    })
}

/// What a snapshot file starts with, before the SHA-256 of the rest.
const SNAPSHOT_MAGIC: &[u8] = b"baton-server-snapshot-v1\n";

/// The encoded snapshot inside a file, once its checksum matches: a flipped byte would
/// otherwise decode into a wrong value, or a wrong revision (a fencing token), served silently.
fn verified<'a>(bytes: &'a [u8], path: &Path) -> io::Result<&'a [u8]> {
    use sha2::Digest;
    let corrupt = |what: &str| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is {what}: restore the data directory from a backup",
                path.display()
            ),
        )
    };
    let rest = bytes
        .strip_prefix(SNAPSHOT_MAGIC)
        .ok_or_else(|| corrupt("not a baton server snapshot"))?;
    if rest.len() < 32 {
        return Err(corrupt("truncated"));
    }
    let (sum, payload) = rest.split_at(32);
    if sha2::Sha256::digest(payload).as_slice() != sum {
        return Err(corrupt("corrupt (its checksum does not match)"));
    }
    Ok(payload)
}

/// Writes `file` durably, with its checksum: a temporary file, fsync, rename over the old one,
/// fsync the directory.
fn write_snapshot(path: &Path, file: &SnapshotFile) -> io::Result<()> {
    use sha2::Digest;
    let bytes = bincode::serialize(file).map_err(io::Error::other)?;
    let temporary = path.with_extension("tmp");
    let mut out = std::fs::File::create(&temporary)?;
    out.write_all(SNAPSHOT_MAGIC)?;
    out.write_all(&sha2::Sha256::digest(&bytes))?;
    out.write_all(&bytes)?;
    out.sync_all()?;
    std::fs::rename(&temporary, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

fn storage_error(verb: ErrorVerb, error: io::Error) -> StorageError<NodeId> {
    StorageError::from_io_error(ErrorSubject::StateMachine, verb, error)
}

/// Builds snapshots from a copy of the encoded state.
pub struct SnapshotBuilder {
    core: SharedCore,
    snapshot_path: PathBuf,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        // Encode under the lock (a consistent cut), write outside it.
        let (data, meta) = {
            let core = lock(&self.core);
            let data = bincode::serialize(&SnapshotRef {
                store: &core.store,
                applied: &core.applied,
                membership: &core.membership,
            })
            .map_err(|e| storage_error(ErrorVerb::Write, io::Error::other(e)))?;
            let id = match core.applied {
                Some(applied) => format!("{}-{}", applied.leader_id.term, applied.index),
                None => "0-0".to_string(),
            };
            let meta = SnapshotMeta {
                last_log_id: core.applied,
                last_membership: core.membership.clone(),
                snapshot_id: id,
            };
            (data, meta)
        };
        let file = SnapshotFile {
            meta: meta.clone(),
            data,
        };
        let path = self.snapshot_path.clone();
        let file = tokio::task::spawn_blocking(move || write_snapshot(&path, &file).map(|()| file))
            .await
            .map_err(|e| storage_error(ErrorVerb::Write, io::Error::other(e)))?
            .map_err(|e| storage_error(ErrorVerb::Write, e))?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(file.data)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), StorageError<NodeId>>
    {
        let core = lock(&self.core);
        Ok((core.applied, core.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Vec<Reply>>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut core = lock(&self.core);
        let mut replies = Vec::new();
        for entry in entries {
            core.applied = Some(entry.log_id);
            let entry_replies = match entry.payload {
                EntryPayload::Blank => Vec::new(),
                EntryPayload::Membership(membership) => {
                    core.membership = StoredMembership::new(Some(entry.log_id), membership);
                    Vec::new()
                }
                EntryPayload::Normal(Proposal(commands)) => commands
                    .iter()
                    .map(|command| {
                        let result = apply_command(&mut core, &self.leases, command);
                        Reply {
                            revision: core.store.revision(),
                            result: Some(result),
                        }
                    })
                    .collect(),
            };
            replies.push(entry_replies);
        }
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> SnapshotBuilder {
        SnapshotBuilder {
            core: self.core.clone(),
            snapshot_path: self.snapshot_path.clone(),
        }
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let data = snapshot.into_inner();
        let state: SnapshotOwned =
            decode(&data, &self.snapshot_path).map_err(|e| storage_error(ErrorVerb::Read, e))?;
        let file = SnapshotFile {
            meta: meta.clone(),
            data,
        };
        let path = self.snapshot_path.clone();
        tokio::task::spawn_blocking(move || write_snapshot(&path, &file))
            .await
            .map_err(|e| storage_error(ErrorVerb::Write, io::Error::other(e)))?
            .map_err(|e| storage_error(ErrorVerb::Write, e))?;
        let mut core = lock(&self.core);
        self.leases.reset_all(&state.store.leases());
        // The member's own settings outside the snapshot carry over to the installed state.
        let history_bytes = core.store.history_bytes();
        core.store = state.store;
        core.store.set_history_bytes(history_bytes);
        core.applied = state.applied;
        core.membership = state.membership;
        // Watchers registered against the old state cannot be told what changed in between.
        core.watches
            .cancel_all("etcdserver: member installed a snapshot; watch again");
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        let bytes = match std::fs::read(&self.snapshot_path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(storage_error(ErrorVerb::Read, e)),
        };
        let file: SnapshotFile = verified(&bytes, &self.snapshot_path)
            .and_then(|payload| decode(payload, &self.snapshot_path))
            .map_err(|e| storage_error(ErrorVerb::Read, e))?;
        Ok(Some(Snapshot {
            meta: file.meta,
            snapshot: Box::new(Cursor::new(file.data)),
        }))
    }
}

/// Applies one command, tells the lease keeper about leases granted and gone, and the watchers
/// about the events.
fn apply_command(
    core: &mut Core,
    leases: &LeaseKeeper,
    command: &Command,
) -> Result<CommandResponse, StoreError> {
    let applied = core.store.apply(command);
    if let Ok(response) = &applied.result {
        match (command, response) {
            (Command::LeaseGrant { .. }, CommandResponse::LeaseGrant(granted)) => {
                leases.granted(granted.id, granted.ttl);
            }
            (Command::LeaseRevoke { id }, _) => leases.revoked(*id),
            _ => {}
        }
    }
    if !applied.events.is_empty() {
        let header = core.header(applied.revision);
        core.watches.dispatch(&header, &applied.events, &core.store);
    }
    applied.result
}
