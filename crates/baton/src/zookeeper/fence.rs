//! Fencing on ZooKeeper: a `multi` that checks the leader's entry, then applies the caller's
//! transaction.
//!
//! A ZooKeeper `multi` cannot read, nor compare values, nor check that a node is absent; it can
//! check a node's version, create, set and delete. So a [`FencedTxn`] runs in two steps:
//!
//! 1. **One atomic read** (a multi read): the leader's entry and every key the transaction
//!    names. The leader's czxid must be the token (else [`Error::Fenced`]). The comparisons are
//!    evaluated on the values read, the branch chosen, and its operations applied to those
//!    values in order (a get sees the puts and deletes before it in its branch).
//! 2. **One `multi`** that writes the outcome only if nothing it depends on changed since the
//!    read: first the fence, a `setData` of the leader's entry (same data) at the version read,
//!    which fails once the entry is gone (that leadership is over: its name is unique to it, and
//!    no entry can come ahead of it later) and also if another fenced transaction of the same
//!    leadership ran in between; then, for every key in key order, its new value (`setData` at
//!    the version read, or `create` for a key that was absent), its deletion (`delete` at the
//!    version read, children before parents), or, for a key only compared or read, a `check`
//!    of the version read, or for an absent one a `create` and `delete` in the same multi
//!    (which fails if it exists).
//!
//! If anything changed, the whole multi does nothing and the transaction starts again from the
//! read (a bounded number of times, within the caller's limit). So a fenced transaction on
//! ZooKeeper supports every comparison and operation of [`FencedTxn`], with the same outcome as
//! an atomic one. Its limits: keys are znodes under the chroot, so a key must be a valid
//! ZooKeeper path other than `/` (else [`Error::InvalidKey`]); a key whose znode has children
//! cannot be deleted, nor can a transaction need a request over ZooKeeper's default
//! `jute.maxbuffer` (1 MiB) ([`Error::Unsupported`]); missing parent znodes of a key are created, as
//! empty persistent nodes (also for a key that is only read); and a writer outside baton that
//! deletes and recreates a key between the read and the multi is not noticed when the new node
//! has the version the old one had (ZooKeeper versions restart at zero). Writers through baton
//! are always noticed, through the leader entry's version.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use zookeeper_client as zk;

use super::{ask, bounded, kept_changing, mkdir_or_exists, zk_error, MainSession, PERSISTENT};
use crate::backend::{BoxFuture, Fencer};
use crate::error::{Error, Result};
use crate::fenced::{FencedCompare, FencedOp, FencedTxn, FencedTxnResponse};
use crate::stats::Stats;

use std::sync::Arc;

/// How often a fenced transaction starts again after a concurrent change.
const ATTEMPTS: usize = 16;

const OP: &str = "fenced transaction";

/// ZooKeeper's default `jute.maxbuffer`: a server closes the connection of a client that sends
/// a longer request, which the client can only report as a lost connection (and every watch
/// of the main session breaks with it). So a longer multi is refused here, in one line.
const MAX_REQUEST: usize = 0xfffff;

/// What a multi spends on one operation besides its path and data (headers, version, ACL).
const OP_OVERHEAD: usize = 64;

/// The fence of one leadership: its leader entry, which exists with czxid `token` exactly
/// while that leadership holds.
pub(crate) struct ZkFencer {
    pub(super) main: Arc<MainSession>,
    pub(super) stats: Arc<Stats>,
    pub(super) chroot: String,
    /// The leader entry's path.
    pub(super) leader: String,
}

impl std::fmt::Debug for ZkFencer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkFencer")
            .field("leader", &self.leader)
            .finish()
    }
}

impl Fencer for ZkFencer {
    fn run<'a>(
        &'a self,
        election: &'a str,
        token: u64,
        txn: &'a FencedTxn,
        limit: Duration,
    ) -> BoxFuture<'a, Result<FencedTxnResponse>> {
        Box::pin(self.fenced(election, token, txn, limit))
    }
}

/// Keys of fenced operations are znodes under the chroot: each must be a path ZooKeeper takes,
/// and not the chroot itself.
pub(super) fn validate_keys(txn: &FencedTxn) -> Result<()> {
    let compared = txn.compares.iter().map(|compare| match compare {
        FencedCompare::Value { key, .. } => key.as_str(),
    });
    let operated = txn.then.iter().chain(&txn.otherwise).map(FencedOp::key);
    for key in compared.chain(operated) {
        let reason = if key == "/" {
            Some("must name a znode below the chroot, not the chroot itself")
        } else {
            crate::url::zookeeper_path_problem(key)
                .map(|_| "is not a valid ZooKeeper path (empty or dot segments, or characters ZooKeeper refuses)")
        };
        if let Some(reason) = reason {
            return Err(Error::InvalidKey {
                key: key.to_string(),
                reason,
            });
        }
    }
    Ok(())
}

/// What one key's read found: its value and version, or nothing.
type Read = Option<(Vec<u8>, i32)>;

/// The operation the multi makes for one key, in its order.
enum Step<'a> {
    /// A `setData` (or, for a key that was absent, a `create`).
    Write { key: &'a str, value: Vec<u8> },
    /// A `check` of the version read.
    Check { key: &'a str, version: i32 },
    /// A `create` and `delete`: the key is still absent.
    Absent { key: &'a str },
    /// A `delete` at the version read.
    Delete { key: &'a str, version: i32 },
}

impl ZkFencer {
    fn path(&self, key: &str) -> String {
        format!("{}{key}", self.chroot)
    }

    /// Runs `txn` only while the leader entry exists with czxid `token`, within `limit`.
    pub(super) async fn fenced(
        &self,
        election: &str,
        token: u64,
        txn: &FencedTxn,
        limit: Duration,
    ) -> Result<FencedTxnResponse> {
        txn.validate()?;
        validate_keys(txn)?;
        let fenced = || Error::Fenced {
            election: election.to_string(),
            token,
        };
        if self.leader.is_empty() {
            return Err(fenced());
        }
        let started = tokio::time::Instant::now();
        let left = || limit.saturating_sub(started.elapsed());
        // Every key the transaction names, in key order.
        let keys: BTreeSet<&str> = txn
            .compares
            .iter()
            .map(|compare| match compare {
                FencedCompare::Value { key, .. } => key.as_str(),
            })
            .chain(txn.then.iter().chain(&txn.otherwise).map(FencedOp::key))
            .collect();
        for _ in 0..ATTEMPTS {
            let client = bounded(left(), OP, self.main.client()).await??;
            // 1. One atomic read: the leader's entry and every key.
            let mut reader = client.new_multi_reader();
            reader
                .add_get_data(&self.leader)
                .map_err(|error| zk_error(OP, error))?;
            for key in &keys {
                reader
                    .add_get_data(&self.path(key))
                    .map_err(|error| zk_error(OP, error))?;
            }
            let results = ask(&self.stats, left(), OP, reader.commit())
                .await?
                .map_err(|error| zk_error(OP, error))?;
            let mut results = results.into_iter();
            let (leader_data, leader_version) = match results.next() {
                Some(zk::MultiReadResult::Data { data, stat }) if stat.czxid as u64 == token => {
                    (data, stat.version)
                }
                Some(
                    zk::MultiReadResult::Data { .. }
                    | zk::MultiReadResult::Error {
                        err: zk::Error::NoNode,
                    },
                ) => return Err(fenced()),
                Some(zk::MultiReadResult::Error { err }) => return Err(zk_error(OP, err)),
                _ => return Err(super::protocol(OP, "unexpected answer to a read")),
            };
            let mut read: BTreeMap<&str, Read> = BTreeMap::new();
            for (key, result) in keys.iter().zip(results) {
                let value = match result {
                    zk::MultiReadResult::Data { data, stat } => Some((data, stat.version)),
                    zk::MultiReadResult::Error {
                        err: zk::Error::NoNode,
                    } => None,
                    zk::MultiReadResult::Error { err } => return Err(zk_error(OP, err)),
                    _ => return Err(super::protocol(OP, "unexpected answer to a read")),
                };
                read.insert(key, value);
            }
            // 2. Evaluate on what was read.
            let succeeded = txn.compares.iter().all(|compare| match compare {
                FencedCompare::Value { key, value } => {
                    read[key.as_str()].as_ref().map(|(data, _)| data) == value.as_ref()
                }
            });
            let branch = if succeeded { &txn.then } else { &txn.otherwise };
            let mut state: BTreeMap<&str, Option<Vec<u8>>> = read
                .iter()
                .map(|(key, value)| (*key, value.as_ref().map(|(data, _)| data.clone())))
                .collect();
            let mut written = BTreeSet::new();
            let mut values = Vec::new();
            for op in branch {
                match op {
                    FencedOp::Put { key, value } => {
                        state.insert(key, Some(value.clone()));
                        written.insert(key.as_str());
                    }
                    FencedOp::Delete { key } => {
                        state.insert(key, None);
                        written.insert(key.as_str());
                    }
                    FencedOp::Get { key } => values.push(state[key.as_str()].clone()),
                }
            }
            // 3. One multi: the fence, then each key's outcome or a check that it is unchanged.
            let mut steps = Vec::new();
            let mut deletes = Vec::new();
            for key in &keys {
                match (&read[key], state.remove(key).flatten()) {
                    (_, Some(value)) if written.contains(key) => {
                        steps.push(Step::Write { key, value })
                    }
                    (Some((_, version)), Some(_)) => steps.push(Step::Check {
                        key,
                        version: *version,
                    }),
                    (Some((_, version)), None) if written.contains(key) => {
                        deletes.push(Step::Delete {
                            key,
                            version: *version,
                        })
                    }
                    (Some((_, version)), None) => steps.push(Step::Check {
                        key,
                        version: *version,
                    }),
                    (None, _) => steps.push(Step::Absent { key }),
                }
            }
            // Children before their parents.
            deletes.reverse();
            steps.extend(deletes);
            let mut multi = client.new_multi_writer();
            multi
                .add_set_data(&self.leader, &leader_data, Some(leader_version))
                .map_err(|error| zk_error(OP, error))?;
            let mut size = self.leader.len() + leader_data.len() + OP_OVERHEAD;
            // Which key each multi operation is for (index 0 is the fence).
            let mut ops: Vec<Option<&str>> = vec![None];
            for step in &steps {
                size += match step {
                    Step::Write { key, value } => self.path(key).len() + value.len(),
                    Step::Absent { key } => 2 * (self.path(key).len() + OP_OVERHEAD),
                    Step::Check { key, .. } | Step::Delete { key, .. } => self.path(key).len(),
                } + OP_OVERHEAD;
                let added = match step {
                    Step::Write { key, value } => match &read[key] {
                        Some((_, version)) => {
                            ops.push(Some(key));
                            multi.add_set_data(&self.path(key), value, Some(*version))
                        }
                        None => {
                            ops.push(Some(key));
                            multi.add_create(&self.path(key), value, &PERSISTENT)
                        }
                    },
                    Step::Check { key, version } => {
                        ops.push(Some(key));
                        multi.add_check_version(&self.path(key), *version)
                    }
                    Step::Absent { key } => {
                        ops.push(Some(key));
                        ops.push(Some(key));
                        let path = self.path(key);
                        multi
                            .add_create(&path, &[], &PERSISTENT)
                            .and_then(|()| multi.add_delete(&path, Some(0)))
                    }
                    Step::Delete { key, version } => {
                        ops.push(Some(key));
                        multi.add_delete(&self.path(key), Some(*version))
                    }
                };
                added.map_err(|error| zk_error(OP, error))?;
            }
            if size > MAX_REQUEST {
                return Err(Error::Unsupported(format!(
                    "ZooKeeper refuses requests over {MAX_REQUEST} bytes (its default \
                     jute.maxbuffer): this fenced transaction needs about {size}"
                )));
            }
            self.stats.request();
            let failure = match bounded(left(), OP, multi.commit()).await? {
                Ok(_) => return Ok(FencedTxnResponse { succeeded, values }),
                Err(zk::MultiWriteError::RequestFailed { source }) => {
                    // Perhaps applied, perhaps not: the caller must be told, not a retry.
                    return Err(zk_error(OP, source));
                }
                Err(zk::MultiWriteError::OperationFailed { index, source }) => (index, source),
            };
            match failure {
                // The leader entry is gone: that leadership is over.
                (0, zk::Error::NoNode) => return Err(fenced()),
                // Another fenced transaction of this leadership ran since the read.
                (0, zk::Error::BadVersion) => continue,
                (index, zk::Error::NoNode) => {
                    // A parent of a key to create is missing (or a key vanished): make the
                    // parents, then start again.
                    if let Some(Some(key)) = ops.get(index) {
                        let path = self.path(key);
                        if let Some((parent, _)) = path.rsplit_once('/') {
                            mkdir_or_exists(&self.stats, left(), OP, &client, parent).await?;
                        }
                    }
                    continue;
                }
                // A key changed since the read: start again.
                (_, zk::Error::BadVersion | zk::Error::NodeExists) => continue,
                (index, zk::Error::NotEmpty) => {
                    let key = ops.get(index).copied().flatten().unwrap_or_default();
                    return Err(Error::Unsupported(format!(
                        "ZooKeeper cannot delete the key {key:?}: its znode has children"
                    )));
                }
                (index, zk::Error::NoChildrenForEphemerals) => {
                    let key = ops.get(index).copied().flatten().unwrap_or_default();
                    return Err(Error::Unsupported(format!(
                        "ZooKeeper cannot create the key {key:?}: its parent is an ephemeral znode"
                    )));
                }
                (_, error) => return Err(zk_error(OP, error)),
            }
        }
        Err(kept_changing(
            OP,
            "the keys kept changing under concurrent writers",
        ))
    }
}
