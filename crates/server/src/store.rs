//! The replicated state machine: etcd v3's key-value store, leases and revision history,
//! sans I/O.
//!
//! Every write is a [`Command`] that travels through the Raft log; [`Store::apply`] is
//! deterministic (no clock, no randomness, no I/O), so replicas that apply the same log hold
//! equal stores. Reads ([`Store::range`], [`Store::events_since`]) are served outside the log.
//! The semantics follow etcd 3.4, so that etcd clients (etcdctl, Go's clientv3 concurrency
//! Mutex and Election, baton's own etcd backend) work unchanged.
//!
//! History: every change is kept as an [`Event`] whose `prev_kv` is the key's state before it.
//! A read at a past revision undoes the events newer than that revision; a watch replays them.
//! Events older than [`Store::compact_revision`] are dropped, so memory is bounded by the
//! history kept plus the live keys.

#![warn(missing_docs)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::proto::etcdserverpb::{
    CompactionResponse, DeleteRangeRequest, DeleteRangeResponse, LeaseGrantResponse,
    LeaseRevokeResponse, PutRequest, PutResponse, TxnRequest, TxnResponse,
};
use crate::proto::mvccpb::{Event, KeyValue};

mod check;
mod intervals;
mod read;
mod txn;
mod write;

#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod tests;

pub use read::in_range;
pub use txn::txn_is_read_only;

/// etcd's `MaxLeaseTTL`: a grant asking for more is refused.
pub const MAX_LEASE_TTL_SECONDS: i64 = 9_000_000_000;
/// The shortest lease granted; a grant asking for less (or for 0 or a negative TTL) gets this,
/// as etcd raises short TTLs to its minimum.
pub const MIN_LEASE_TTL_SECONDS: i64 = 1;
/// How deep transactions may nest (the outermost counts as 1). etcd has no such bound, but its
/// per-level operation budget and the request size keep real nesting shallow; a bound keeps the
/// recursion over untrusted input short.
pub const MAX_TXN_DEPTH: usize = 8;

/// One write as it travels through the Raft log. Deterministic: the same commands applied in
/// the same order to equal stores give equal stores and equal results. Never reads a clock,
/// never does I/O.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// etcd's Put.
    Put(PutRequest),
    /// etcd's DeleteRange.
    DeleteRange(DeleteRangeRequest),
    /// etcd's Txn; may only read, then it changes nothing and does not bump the revision.
    Txn(TxnRequest),
    /// Grant a lease. `id` is nonzero, chosen by the proposer; ttl in seconds.
    LeaseGrant {
        /// The lease's id.
        id: i64,
        /// The TTL asked for, in seconds.
        ttl_seconds: i64,
    },
    /// A client's revoke, or the leader's decision that the lease expired: deletes every key
    /// attached.
    LeaseRevoke {
        /// The lease's id.
        id: i64,
    },
    /// Drop the history older than `revision`.
    Compact {
        /// The new compact revision.
        revision: i64,
    },
}

/// The response to a [`Command`] that was applied.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CommandResponse {
    /// To [`Command::Put`].
    Put(PutResponse),
    /// To [`Command::DeleteRange`].
    DeleteRange(DeleteRangeResponse),
    /// To [`Command::Txn`].
    Txn(TxnResponse),
    /// To [`Command::LeaseGrant`]: `id` and the TTL granted (raised to the minimum).
    LeaseGrant(LeaseGrantResponse),
    /// To [`Command::LeaseRevoke`].
    LeaseRevoke(LeaseRevokeResponse),
    /// To [`Command::Compact`].
    Compact(CompactionResponse),
}

/// What applying one command did.
///
/// Top-level responses carry `header: None`; the service fills the header (revision =
/// `Applied::revision`). Responses nested in a txn carry a header with only the revision set,
/// as etcd's do.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Applied {
    /// The response, or why the command was rejected (a rejected command changed nothing).
    pub result: Result<CommandResponse, StoreError>,
    /// The store's revision after the command.
    pub revision: i64,
    /// The events the command made, in order, `prev_kv` filled whenever the key existed.
    pub events: Vec<Event>,
}

/// Why a command or read was refused. Display gives etcd's exact message where etcd has one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum StoreError {
    /// A put, delete, range or compare named the empty key (gRPC InvalidArgument).
    #[error("etcdserver: key is not provided")]
    KeyNotProvided,
    /// A put named a lease that does not exist, a revoke an unknown lease, or a grant lease id 0
    /// (gRPC NotFound).
    #[error("etcdserver: requested lease not found")]
    LeaseNotFound,
    /// A grant named a lease id already in use (gRPC FailedPrecondition).
    #[error("etcdserver: lease already exists")]
    LeaseExists,
    /// A grant asked for more than [`MAX_LEASE_TTL_SECONDS`] (gRPC OutOfRange).
    #[error("etcdserver: too large lease TTL")]
    LeaseTtlTooLarge,
    /// A read or watch at a revision older than the compact revision, or a compaction at or
    /// below it (gRPC OutOfRange).
    #[error("etcdserver: mvcc: required revision has been compacted")]
    Compacted {
        /// The store's compact revision.
        compact_revision: i64,
    },
    /// A read or compaction at a revision the store has not reached (gRPC OutOfRange).
    #[error("etcdserver: mvcc: required revision is a future revision")]
    FutureRevision,
    /// A txn branch puts a key twice, or puts a key it also deletes (gRPC InvalidArgument).
    #[error("etcdserver: duplicate key given in txn request")]
    DuplicateKey,
    /// A txn level has more compares or ops than allowed (gRPC InvalidArgument).
    #[error("etcdserver: too many operations in txn request")]
    TooManyOperations,
    /// A put with ignore_value or ignore_lease on a missing key, or an empty op in a txn (gRPC
    /// InvalidArgument), as etcd answers both.
    #[error("etcdserver: key not found")]
    KeyNotFound,
    /// A put with ignore_value also gave a value (gRPC InvalidArgument).
    #[error("etcdserver: value is provided")]
    ValueProvided,
    /// A put with ignore_lease also gave a lease (gRPC InvalidArgument).
    #[error("etcdserver: lease is provided")]
    LeaseProvided,
    /// A range's sort order or sort target is not one of the enum's values (gRPC
    /// InvalidArgument; etcd 3.5's message).
    #[error("etcdserver: invalid sort option")]
    InvalidSortOption,
    /// A compare's result or target is not one of the enum's values (gRPC InvalidArgument).
    /// etcd 3.4 lets these through (an unknown result compares true); no client sends them.
    #[error("etcdserver: invalid compare")]
    InvalidCompare,
    /// Txns nested deeper than [`MAX_TXN_DEPTH`] (gRPC InvalidArgument). No etcd counterpart.
    #[error("etcdserver: txn nested too deeply")]
    TxnTooDeep,
    /// A write that adds data while the store holds its quota's worth (gRPC
    /// ResourceExhausted; etcd's message for its backend quota). Deletes still go through.
    #[error("etcdserver: mvcc: database space exceeded")]
    NoSpace,
}

/// Tuning that every replica must share: it is part of the state (and of the snapshot).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreConfig {
    /// Revisions of history kept for past reads and watches; history grows to twice this, then
    /// the oldest half is compacted away inside `apply`.
    pub history_revisions: i64,
    /// etcd's `--max-txn-ops`: compares, or ops in a branch, per txn level.
    pub max_txn_operations: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            history_revisions: 10_000,
            max_txn_operations: 128,
        }
    }
}

/// A lease as [`Store::lease`] shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseView {
    /// The TTL granted, in seconds.
    pub ttl_seconds: i64,
    /// The keys attached, sorted.
    pub keys: Vec<Vec<u8>>,
}

/// A granted lease: its TTL and the keys attached to it (kept in step with `KeyValue::lease`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Lease {
    ttl_seconds: i64,
    keys: BTreeSet<Vec<u8>>,
}

/// The whole replicated state; serialized (bincode), it is the Raft snapshot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Store {
    config: StoreConfig,
    revision: i64,
    compact_revision: i64,
    /// The live keys.
    kvs: BTreeMap<Vec<u8>, KeyValue>,
    leases: BTreeMap<i64, Lease>,
    /// Every event with revision >= `compact_revision`, oldest first.
    history: VecDeque<Event>,
    /// What the live keys and the history hold, in bytes: counted from the state when first
    /// needed (after a load) and kept in step from then on; derived, so never serialized.
    #[serde(skip)]
    sizes: Sizes,
    /// History is compacted, oldest first, to keep it within this many bytes (0: no bound).
    /// A member's setting, like `--history`, but outside the snapshot.
    #[serde(skip)]
    history_bytes: u64,
}

/// See `Store::sizes`.
#[derive(Clone, Copy, Debug, Default)]
struct Sizes {
    counted: bool,
    /// Live keys and values, each key twice (the map's and the key-value's), plus overhead.
    live: u64,
    /// The history's events, with their previous key-values.
    history: u64,
}

/// Derived from the state, which `Store`'s equality already compares.
impl PartialEq for Sizes {
    fn eq(&self, _: &Sizes) -> bool {
        true
    }
}

/// Memory a key-value takes beyond its bytes (its fields, a map or queue entry), roughly.
const ENTRY_OVERHEAD: u64 = 96;

/// What a live key-value costs: its key twice (as the map's key too), its value, overhead.
fn live_bytes(kv: &KeyValue) -> u64 {
    (2 * kv.key.len() + kv.value.len()) as u64 + ENTRY_OVERHEAD
}

/// What an event of the history costs, with the key-value before it.
fn event_bytes(event: &Event) -> u64 {
    let kv = |kv: &Option<KeyValue>| {
        kv.as_ref().map_or(0, |kv| {
            (kv.key.len() + kv.value.len()) as u64 + ENTRY_OVERHEAD
        })
    };
    kv(&event.kv) + kv(&event.prev_kv)
}

/// The revision an event happened at: a PUT's kv and a DELETE's tombstone both carry it as
/// `mod_revision`.
fn event_revision(event: &Event) -> i64 {
    event.kv.as_ref().map_or(0, |kv| kv.mod_revision)
}

impl Store {
    /// An empty store at revision 1 (an empty etcd reports revision 1), nothing compacted.
    pub fn new(config: StoreConfig) -> Store {
        Store {
            config,
            revision: 1,
            compact_revision: 0,
            kvs: BTreeMap::new(),
            leases: BTreeMap::new(),
            history: VecDeque::new(),
            sizes: Sizes::default(),
            history_bytes: 0,
        }
    }

    /// The byte counts, counted now if they were not yet (after a load).
    fn sizes(&mut self) -> &mut Sizes {
        if !self.sizes.counted {
            self.sizes = Sizes {
                counted: true,
                live: self.kvs.values().map(live_bytes).sum(),
                history: self.history.iter().map(event_bytes).sum(),
            };
        }
        &mut self.sizes
    }

    /// [`Store::bytes`] counted from the state, for tests of the counts kept in step.
    #[cfg(test)]
    pub(crate) fn bytes_from_scratch(&self) -> u64 {
        self.kvs.values().map(live_bytes).sum::<u64>()
            + self.history.iter().map(event_bytes).sum::<u64>()
    }

    /// Bytes the store holds: live keys and values, and history (see `live_bytes`).
    pub fn bytes(&mut self) -> u64 {
        let sizes = self.sizes();
        sizes.live + sizes.history
    }

    /// Bounds the history by bytes from now on (a member's start-up setting; 0: no bound): a
    /// write that takes it past `limit` compacts the oldest revisions down to half of it.
    pub fn set_history_bytes(&mut self, limit: u64) {
        self.history_bytes = limit;
    }

    /// The bound [`Store::set_history_bytes`] set.
    pub fn history_bytes(&self) -> u64 {
        self.history_bytes
    }

    /// Refuses a write that puts (a put, or a txn that may put on some branch, nested txns
    /// included) while the live keys and values take `quota` bytes or more, as etcd refuses
    /// puts under its space alarm; deletions (also in a txn), revocations and compactions
    /// always pass, and free room at once (history is bounded apart, see
    /// [`Store::set_history_bytes`]).
    /// Checked before proposing, as etcd checks its backend quota: the refused write never
    /// takes a place in the log.
    pub fn check_quota(&mut self, command: &Command, quota: u64) -> Result<(), StoreError> {
        let adds = match command {
            Command::Put(_) => true,
            Command::Txn(request) => txn::txn_may_put(request),
            _ => false,
        };
        if adds && self.sizes().live >= quota {
            return Err(StoreError::NoSpace);
        }
        Ok(())
    }

    /// The revision of the last change.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// Reads and watches before this revision are refused; 0 until the first compaction.
    pub fn compact_revision(&self) -> i64 {
        self.compact_revision
    }

    /// Changes how much history is kept from now on (a member's `--history` at start-up).
    /// History is replicated state: a group of several members must change it through the log.
    pub fn set_history_revisions(&mut self, revisions: i64) {
        self.config.history_revisions = revisions.max(1);
    }

    /// The configuration the store was made with.
    pub fn config(&self) -> StoreConfig {
        self.config
    }

    /// The checks that do not depend on the state, which etcd makes before proposing: a command
    /// that fails them would be rejected by `apply` too, so the service may answer without
    /// going through the log.
    pub fn precheck(&self, command: &Command) -> Result<(), StoreError> {
        match command {
            Command::Put(request) => check::put(request),
            Command::DeleteRange(request) => check::delete(request),
            Command::Txn(request) => check::txn(request, self.config.max_txn_operations),
            Command::LeaseGrant { ttl_seconds, .. } => check::lease_ttl(*ttl_seconds),
            Command::LeaseRevoke { .. } | Command::Compact { .. } => Ok(()),
        }
    }

    /// Applies one command from the log. A rejected command changes nothing.
    pub fn apply(&mut self, command: &Command) -> Applied {
        let before = self.revision;
        let result = match command {
            Command::Put(request) => self.put(request).map(CommandResponse::Put),
            Command::DeleteRange(request) => {
                self.delete_range(request).map(CommandResponse::DeleteRange)
            }
            Command::Txn(request) => self.txn(request).map(CommandResponse::Txn),
            Command::LeaseGrant { id, ttl_seconds } => self
                .lease_grant(*id, *ttl_seconds)
                .map(CommandResponse::LeaseGrant),
            Command::LeaseRevoke { id } => self.lease_revoke(*id).map(CommandResponse::LeaseRevoke),
            Command::Compact { revision } => self.compact(*revision).map(CommandResponse::Compact),
        };
        let events = if self.revision > before {
            self.events_of_last_revision()
        } else {
            Vec::new()
        };
        self.auto_compact();
        Applied {
            result,
            revision: self.revision,
            events,
        }
    }

    /// The events at the current revision: the tail of the history.
    fn events_of_last_revision(&self) -> Vec<Event> {
        let first = self
            .history
            .partition_point(|event| event_revision(event) < self.revision);
        self.history.range(first..).cloned().collect()
    }

    /// The lease `id`, if granted and not revoked.
    pub fn lease(&self, id: i64) -> Option<LeaseView> {
        self.leases.get(&id).map(|lease| LeaseView {
            ttl_seconds: lease.ttl_seconds,
            keys: lease.keys.iter().cloned().collect(),
        })
    }

    /// Every lease as (id, ttl_seconds), sorted by id.
    pub fn leases(&self) -> Vec<(i64, i64)> {
        self.leases
            .iter()
            .map(|(id, lease)| (*id, lease.ttl_seconds))
            .collect()
    }

    /// The number of live keys.
    pub fn key_count(&self) -> usize {
        self.kvs.len()
    }
}
