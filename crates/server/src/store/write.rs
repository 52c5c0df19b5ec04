//! Writes: put, delete, leases and compaction. Each top-level write checks everything first,
//! then changes the store through infallible primitives, so a rejected command changes nothing.

use std::collections::BTreeSet;

use crate::proto::etcdserverpb::{
    CompactionResponse, DeleteRangeRequest, DeleteRangeResponse, LeaseGrantResponse,
    LeaseRevokeResponse, PutRequest, PutResponse,
};
use crate::proto::mvccpb::{event::EventType, Event, KeyValue};

use super::{
    check, event_bytes, event_revision, live_bytes, Lease, Store, StoreError, MIN_LEASE_TTL_SECONDS,
};

impl Store {
    pub(super) fn put(&mut self, request: &PutRequest) -> Result<PutResponse, StoreError> {
        check::put(request)?;
        self.check_lease_exists(request.lease)?;
        self.check_put_target(request)?;
        let revision = self.revision + 1;
        let prev = self.write_put(request, revision);
        self.revision = revision;
        Ok(PutResponse {
            header: None,
            prev_kv: prev.filter(|_| request.prev_kv),
        })
    }

    /// A put with ignore_value or ignore_lease needs the key to exist (etcd's `ErrKeyNotFound`).
    pub(super) fn check_put_target(&self, request: &PutRequest) -> Result<(), StoreError> {
        let needs_key = request.ignore_value || request.ignore_lease;
        if needs_key && !self.kvs.contains_key(&request.key) {
            return Err(StoreError::KeyNotFound);
        }
        Ok(())
    }

    /// Lease 0 is "no lease"; any other must be granted.
    pub(super) fn check_lease_exists(&self, lease: i64) -> Result<(), StoreError> {
        if lease != 0 && !self.leases.contains_key(&lease) {
            return Err(StoreError::LeaseNotFound);
        }
        Ok(())
    }

    pub(super) fn delete_range(
        &mut self,
        request: &DeleteRangeRequest,
    ) -> Result<DeleteRangeResponse, StoreError> {
        check::delete(request)?;
        let revision = self.revision + 1;
        let prev_kvs = self.write_delete(&request.key, &request.range_end, revision);
        if !prev_kvs.is_empty() {
            self.revision = revision;
        }
        Ok(delete_response(prev_kvs, request.prev_kv, None))
    }

    /// Puts at `revision` (checked before: the lease exists, and the key does if ignore_* is
    /// set). Returns the key's previous state.
    pub(super) fn write_put(&mut self, request: &PutRequest, revision: i64) -> Option<KeyValue> {
        // Counted before the change, then kept in step with it.
        self.sizes();
        let prev = self.kvs.get(&request.key).cloned();
        let kv = match &prev {
            Some(prev) => KeyValue {
                key: request.key.clone(),
                create_revision: prev.create_revision,
                mod_revision: revision,
                version: prev.version.saturating_add(1),
                value: if request.ignore_value {
                    prev.value.clone()
                } else {
                    request.value.clone()
                },
                lease: if request.ignore_lease {
                    prev.lease
                } else {
                    request.lease
                },
            },
            None => KeyValue {
                key: request.key.clone(),
                create_revision: revision,
                mod_revision: revision,
                version: 1,
                value: request.value.clone(),
                lease: if request.ignore_lease {
                    0
                } else {
                    request.lease
                },
            },
        };
        self.move_to_lease(
            &kv.key,
            prev.as_ref().map_or(0, |prev| prev.lease),
            kv.lease,
        );
        let event = Event {
            r#type: EventType::Put as i32,
            kv: Some(kv.clone()),
            prev_kv: prev.clone(),
        };
        self.sizes.live += live_bytes(&kv);
        self.sizes.live -= prev.as_ref().map_or(0, live_bytes);
        self.sizes.history += event_bytes(&event);
        self.kvs.insert(kv.key.clone(), kv);
        self.history.push_back(event);
        prev
    }

    /// Deletes every live key in [key, range_end) at `revision`, in key order. Returns the
    /// deleted key-values.
    pub(super) fn write_delete(
        &mut self,
        key: &[u8],
        range_end: &[u8],
        revision: i64,
    ) -> Vec<KeyValue> {
        let keys: Vec<Vec<u8>> = self.live(key, range_end).map(|kv| kv.key.clone()).collect();
        keys.into_iter()
            .filter_map(|key| self.write_delete_key(key, revision))
            .collect()
    }

    fn write_delete_key(&mut self, key: Vec<u8>, revision: i64) -> Option<KeyValue> {
        self.sizes();
        let prev = self.kvs.remove(&key)?;
        self.move_to_lease(&key, prev.lease, 0);
        // etcd's tombstone: only the key and the deletion's revision.
        let tombstone = KeyValue {
            key,
            mod_revision: revision,
            ..KeyValue::default()
        };
        let event = Event {
            r#type: EventType::Delete as i32,
            kv: Some(tombstone),
            prev_kv: Some(prev.clone()),
        };
        self.sizes.live -= live_bytes(&prev);
        self.sizes.history += event_bytes(&event);
        self.history.push_back(event);
        Some(prev)
    }

    /// Keeps the leases' key sets in step with `KeyValue::lease`.
    fn move_to_lease(&mut self, key: &[u8], from: i64, to: i64) {
        if from == to {
            return;
        }
        if let Some(lease) = self.leases.get_mut(&from) {
            lease.keys.remove(key);
        }
        if let Some(lease) = self.leases.get_mut(&to) {
            lease.keys.insert(key.to_vec());
        }
    }

    /// etcd's `Grant`: TTL too large, id 0 (etcd's server picks an id for 0 before its lessor
    /// would refuse it, and its gRPC layer checks the TTL first), id taken; a short TTL is
    /// raised to the minimum. Does not change the revision.
    pub(super) fn lease_grant(
        &mut self,
        id: i64,
        ttl_seconds: i64,
    ) -> Result<LeaseGrantResponse, StoreError> {
        check::lease_ttl(ttl_seconds)?;
        if id == 0 {
            return Err(StoreError::LeaseNotFound);
        }
        if self.leases.contains_key(&id) {
            return Err(StoreError::LeaseExists);
        }
        let ttl_seconds = ttl_seconds.max(MIN_LEASE_TTL_SECONDS);
        let lease = Lease {
            ttl_seconds,
            keys: BTreeSet::new(),
        };
        self.leases.insert(id, lease);
        Ok(LeaseGrantResponse {
            header: None,
            id,
            ttl: ttl_seconds,
            error: String::new(),
        })
    }

    /// Removes the lease and deletes its keys in key order, all at one revision (none if it
    /// had no keys), as etcd's `Revoke`.
    pub(super) fn lease_revoke(&mut self, id: i64) -> Result<LeaseRevokeResponse, StoreError> {
        let lease = self.leases.remove(&id).ok_or(StoreError::LeaseNotFound)?;
        let revision = self.revision + 1;
        let mut deleted = false;
        for key in lease.keys {
            deleted |= self.write_delete_key(key, revision).is_some();
        }
        if deleted {
            self.revision = revision;
        }
        Ok(LeaseRevokeResponse { header: None })
    }

    /// etcd's Compact: at or below the compact revision is compacted already; above the current
    /// revision is a future revision. Does not change the revision.
    pub(super) fn compact(&mut self, revision: i64) -> Result<CompactionResponse, StoreError> {
        if revision <= self.compact_revision {
            return Err(StoreError::Compacted {
                compact_revision: self.compact_revision,
            });
        }
        if revision > self.revision {
            return Err(StoreError::FutureRevision);
        }
        self.compact_to(revision);
        Ok(CompactionResponse { header: None })
    }

    fn compact_to(&mut self, revision: i64) {
        self.sizes();
        self.compact_revision = revision;
        let first_kept = self
            .history
            .partition_point(|event| event_revision(event) < revision);
        let freed: u64 = self
            .history
            .drain(..first_kept)
            .map(|e| event_bytes(&e))
            .sum();
        self.sizes.history -= freed;
    }

    /// Keeps between `history_revisions` and twice that: compacting in halves keeps the cost
    /// of a compaction spread over many writes. Deterministic, so every replica compacts alike.
    pub(super) fn auto_compact(&mut self) {
        let keep = self.config.history_revisions.max(1);
        if self.revision - self.compact_revision > keep.saturating_mul(2) {
            self.compact_to(self.revision - keep);
        }
        // The byte bound (a big value written over and over): down to half of it, at a
        // revision's start, never past the current revision.
        if self.history_bytes > 0 && self.sizes().history > self.history_bytes {
            let target = self.history_bytes / 2;
            let mut left = self.sizes.history;
            let mut cut = self.revision;
            for event in &self.history {
                if left <= target {
                    cut = event_revision(event);
                    break;
                }
                left -= event_bytes(event);
            }
            if cut > self.compact_revision {
                self.compact_to(cut);
            }
        }
    }
}

/// A DeleteRange response; `header` is `None` at top level and the revision-only header etcd
/// gives inside a txn.
pub(super) fn delete_response(
    prev_kvs: Vec<KeyValue>,
    want_prev_kvs: bool,
    header: Option<crate::proto::etcdserverpb::ResponseHeader>,
) -> DeleteRangeResponse {
    DeleteRangeResponse {
        header,
        deleted: i64::try_from(prev_kvs.len()).unwrap_or(i64::MAX),
        prev_kvs: if want_prev_kvs { prev_kvs } else { Vec::new() },
    }
}
