//! The candidate queue on etcd, for the backend-neutral driver.

use std::sync::Arc;

use super::client::{
    Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse,
};
use baton_core::ElectionConfig;

use super::fence::EtcdFencer;
use super::watch_hub::{DeletionWatch, QueueCheck};
use super::{hedged, hedged_txn, request, EtcdBackend, EtcdLease, DELETE_TIMEOUT, REQUEST_TIMEOUT};
use crate::driver::{
    EntryWatch, Fired, Located, Position, Queue, QueueLease, ReadPoint, TokenMemory,
};
use crate::election::{CandidateSpec, GuardContext};
use crate::error::{Error, Result};
use crate::lease_driver::LeaseHandle;
use crate::stats::Stats;
use crate::url::IDS_MARKER;

/// An etcd create revision as a queue position (revisions start at 1; a negative one would be a
/// protocol violation and sorts first, as position 0).
pub(super) fn position(create_revision: i64) -> Position {
    Position(u64::try_from(create_revision).unwrap_or(0))
}

/// A position as the etcd create revision it came from.
pub(super) fn revision(position: Position) -> i64 {
    i64::try_from(position.0).unwrap_or(i64::MAX)
}

/// The revision a response was served at.
fn read_point(header: Option<&super::client::ResponseHeader>) -> ReadPoint {
    ReadPoint(header.map_or(0, |h| u64::try_from(h.revision()).unwrap_or(0)))
}

/// The first revision a watch started after read point `after` must see.
fn start_after(after: ReadPoint) -> i64 {
    i64::try_from(after.0).unwrap_or(i64::MAX - 1) + 1
}

/// One candidacy as etcd sees it: where its entries live and what they hold.
pub(crate) struct EtcdEntrant {
    election: String,
    id: String,
    serial: u64,
    /// `<prefix>/<election>/@candidates/`: the scope of every query of this election.
    scope: String,
    /// `<prefix>/<election>/@ids/<id>`: created with our entry, bound to the same lease, so a
    /// second live candidate with our id is refused.
    id_key: Vec<u8>,
    /// What our entry holds: the id and the leader value (see `encode`).
    value: String,
    /// Where our entry stood when the create transaction made it (it reads the entry just
    /// ahead in the same transaction): the first `locate` of that entry is answered from here,
    /// saving a round trip per campaign.
    created: std::sync::Mutex<Option<(Position, Located<Vec<u8>>)>>,
}

/// What a create transaction found.
enum Created {
    /// Our entry exists with this create revision.
    Key(i64),
    /// Another entry holds our id.
    IdTakenBy(super::client::KeyValue),
}

impl QueueLease for EtcdLease {
    fn handle(&self) -> &LeaseHandle {
        &self.handle
    }
}

impl EntryWatch<Vec<u8>> for DeletionWatch {
    async fn fired(&mut self) -> Fired<Vec<u8>> {
        DeletionWatch::fired(self).await
    }
}

/// The queue on etcd: an entry is a key under the election's scope, its position the key's
/// create revision (etcd's revisions are global and strictly increasing, so queue order is
/// commit order), bound to the lease.
impl Queue for EtcdBackend {
    type Lease = EtcdLease;
    type Entry = Vec<u8>;
    type Entrant = EtcdEntrant;
    type Watch = DeletionWatch;

    fn stats(&self) -> &Stats {
        &self.stats
    }

    fn tokens(&self) -> &TokenMemory {
        &self.tokens
    }

    fn leases(&self) -> &crate::driver::LeasePool<Self::Lease> {
        &self.leases
    }

    fn entrant(&self, spec: &CandidateSpec, serial: u64) -> EtcdEntrant {
        EtcdEntrant {
            election: spec.election.clone(),
            id: spec.id.clone(),
            serial,
            scope: self.candidates_scope(&spec.election),
            id_key: format!(
                "{}/{}/{}/{}",
                self.prefix, spec.election, IDS_MARKER, spec.id
            )
            .into_bytes(),
            value: crate::election::entry_value(&spec.id, spec.value.as_deref()),
            created: std::sync::Mutex::new(None),
        }
    }

    async fn lease(&self, config: &ElectionConfig) -> Result<Arc<EtcdLease>> {
        EtcdBackend::lease(self, config).await
    }

    fn entry_name(&self, entrant: &EtcdEntrant, lease: &EtcdLease) -> Vec<u8> {
        format!("{}{:016x}-{}", entrant.scope, lease.id, entrant.serial).into_bytes()
    }

    async fn create(
        &self,
        entrant: &EtcdEntrant,
        entry: &Vec<u8>,
        lease: &EtcdLease,
    ) -> Result<Position> {
        // Twice at most: the second attempt follows the removal of a stale id entry.
        for _ in 0..2 {
            match self.create_once(entrant, entry, lease.id).await? {
                Created::Key(revision) => return Ok(position(revision)),
                Created::IdTakenBy(holder) => {
                    if !self.clear_stale_id_entry(entrant, &holder).await? {
                        return Err(Error::DuplicateId {
                            election: entrant.election.clone(),
                            id: entrant.id.clone(),
                            entry: String::from_utf8_lossy(holder.value()).into_owned(),
                        });
                    }
                }
            }
        }
        Err(Error::Backend {
            backend: "etcd",
            operation: "create candidate key",
            detail: "the candidate id entry keeps changing".into(),
            retryable: true,
            source: None,
        })
    }

    async fn locate(
        &self,
        entrant: &EtcdEntrant,
        entry: &Vec<u8>,
        own: Position,
    ) -> Result<Located<Vec<u8>>> {
        // Answered by the create itself: one read, in the transaction that made the entry, of
        // the entry and the one just ahead (a deletion since is caught by the watches, which
        // start from that revision).
        let created = entrant
            .created
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((position, located)) = created {
            if position == own {
                return Ok(located);
            }
        }
        let own_position = revision(own);
        // In one transaction: is our key still ours, and who is just ahead of it?
        let options = newest_first()
            .with_max_create_revision(own_position - 1)
            .with_limit(1);
        let txn = Txn::new()
            .when([Compare::create_revision(
                entry.clone(),
                CompareOp::Equal,
                own_position,
            )])
            .and_then([TxnOp::get(entrant.scope.clone(), Some(options))]);
        // A read (safe twice): hedged, as a candidate's watch that just moved off a hung member
        // looks again through the balanced channel, which may still send it there.
        let response = hedged_txn(
            &self.client,
            REQUEST_TIMEOUT,
            &self.stats,
            "find predecessor",
            txn,
        )
        .await?;
        if !response.succeeded() {
            return Ok(Located::Gone);
        }
        let at = read_point(response.header());
        let ahead = response.op_responses().iter().find_map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().map(|kv| ahead_of(entrant, kv)),
            _ => None,
        });
        Ok(Located::Exists { ahead, at })
    }

    async fn confirm(&self, entry: &Vec<u8>, own: Position) -> Result<Option<ReadPoint>> {
        let response = hedged(
            &self.client,
            REQUEST_TIMEOUT,
            &self.stats,
            "get own key",
            |mut client| {
                let entry = entry.clone();
                async move { client.get(entry, None).await }
            },
        )
        .await?;
        let at = read_point(response.header());
        let exists = response
            .kvs()
            .first()
            .is_some_and(|kv| position(kv.create_revision()) == own);
        Ok(exists.then_some(at))
    }

    async fn watch_deletion(
        &self,
        entry: &Vec<u8>,
        _position: Position,
        after: ReadPoint,
    ) -> Result<DeletionWatch> {
        self.hub
            .watch(entry.clone(), start_after(after), None)
            .await
    }

    async fn watch_predecessor(
        &self,
        entrant: &EtcdEntrant,
        own: &Vec<u8>,
        own_position: Position,
        entry: &Vec<u8>,
        _position: Position,
        after: ReadPoint,
    ) -> Result<DeletionWatch> {
        // baton server checks, with the deletion, whether ours is then first (the same check
        // as `locate`'s: our key with our create revision, nobody created before it in the
        // election); etcd ignores the check and the candidate reads as before.
        let check = QueueCheck {
            own_key: own.clone(),
            own_create_revision: revision(own_position),
            scope: entrant.scope.clone().into_bytes(),
        };
        self.hub
            .watch(entry.clone(), start_after(after), Some(check))
            .await
    }

    async fn delete(&self, entrant: &EtcdEntrant, entry: &Vec<u8>, own: Position) -> Result<()> {
        // Delete only the key we created, never a later one with the same name.
        let condition = Compare::create_revision(entry.clone(), CompareOp::Equal, revision(own));
        self.delete_own_key_if(entrant, entry, condition).await
    }

    async fn delete_if_on_lease(
        &self,
        entrant: &EtcdEntrant,
        entry: &Vec<u8>,
        lease: &EtcdLease,
    ) -> Result<()> {
        let condition = Compare::lease(entry.clone(), CompareOp::Equal, lease.id);
        self.delete_own_key_if(entrant, entry, condition).await
    }

    fn guard(&self, entry: &Vec<u8>, _position: Position) -> GuardContext {
        Arc::new(EtcdFencer {
            client: self.client.clone(),
            leader_key: entry.clone(),
        })
    }
}

impl EtcdBackend {
    /// One create transaction: our entry and our id entry, both bound to the lease, only if
    /// neither exists.
    async fn create_once(&self, entrant: &EtcdEntrant, key: &[u8], lease: i64) -> Result<Created> {
        let leased = || Some(PutOptions::new().with_lease(lease));
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.to_vec(), CompareOp::Equal, 0),
                Compare::create_revision(entrant.id_key.clone(), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(key.to_vec(), entrant.value.clone(), leased()),
                TxnOp::put(entrant.id_key.clone(), key.to_vec(), leased()),
                // After the puts, in the same revision: ours is the newest entry, and the one
                // before it is the entry just ahead of us.
                TxnOp::get(entrant.scope.clone(), Some(newest_first().with_limit(2))),
            ])
            .or_else([
                TxnOp::get(key.to_vec(), None),
                TxnOp::get(entrant.id_key.clone(), None),
            ]);
        let mut client = self.client.clone();
        let response = request(&self.stats, "create candidate key", client.txn(txn)).await?;
        *entrant.created.lock().unwrap_or_else(|e| e.into_inner()) = None;
        if response.succeeded() {
            let created = response.header().map_or(0, |h| h.revision());
            let range = response.op_responses().iter().find_map(|op| match op {
                TxnOpResponse::Get(get) => Some(get.kvs()),
                _ => None,
            });
            // Only if the read is what it must be: our key first, with this revision.
            if let Some([ours, rest @ ..]) = range {
                if ours.key() == key && ours.create_revision() == created {
                    let ahead = rest.first().map(|kv| ahead_of(entrant, kv));
                    let located = Located::Exists {
                        ahead,
                        at: read_point(response.header()),
                    };
                    *entrant.created.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some((position(created), located));
                }
            }
            return Ok(Created::Key(created));
        }
        // Our key exists: an earlier attempt of ours whose answer was lost (it created the id
        // entry too). Adopt it only if it is bound to our lease. Else the id is taken.
        let mut gets = response.op_responses().iter().map(|op| match op {
            TxnOpResponse::Get(get) => get.kvs().first().cloned(),
            _ => None,
        });
        let (own, id_entry) = (gets.next().flatten(), gets.next().flatten());
        if let Some(kv) = own.filter(|kv| kv.lease() == lease) {
            return Ok(Created::Key(kv.create_revision()));
        }
        // Another candidate's, or a stale one of ours whose entry was deleted behind our back.
        if let Some(holder) = id_entry {
            return Ok(Created::IdTakenBy(holder));
        }
        Err(Error::Backend {
            backend: "etcd",
            operation: "create candidate key",
            detail: "the key exists with another lease".into(),
            retryable: true,
            source: None,
        })
    }

    /// An id entry whose candidate entry is gone (deleted behind baton's back, say) is stale:
    /// removes it, unless it changed meanwhile. Returns whether it was stale.
    async fn clear_stale_id_entry(
        &self,
        entrant: &EtcdEntrant,
        holder: &super::client::KeyValue,
    ) -> Result<bool> {
        let txn = Txn::new()
            .when([
                Compare::create_revision(holder.value().to_vec(), CompareOp::Equal, 0),
                Compare::mod_revision(
                    entrant.id_key.clone(),
                    CompareOp::Equal,
                    holder.mod_revision(),
                ),
            ])
            .and_then([TxnOp::delete(entrant.id_key.clone(), None)]);
        let mut client = self.client.clone();
        let response = request(&self.stats, "clear stale id entry", client.txn(txn)).await?;
        Ok(response.succeeded())
    }

    /// Deletes our key in one transaction guarded by `condition`, within the delete bound.
    async fn delete_own_key_if(
        &self,
        entrant: &EtcdEntrant,
        key: &[u8],
        condition: Compare,
    ) -> Result<()> {
        // The id entry goes with our key, but only if it is ours (it names our key).
        let id_entry = Txn::new()
            .when([Compare::value(
                entrant.id_key.clone(),
                CompareOp::Equal,
                key.to_vec(),
            )])
            .and_then([TxnOp::delete(entrant.id_key.clone(), None)]);
        let txn = Txn::new()
            .when([condition])
            .and_then([TxnOp::delete(key.to_vec(), None), TxnOp::txn(id_entry)]);
        // Sent again elsewhere if its member hangs: a lost resign leaves the successor
        // waiting out the TTL, and the guard makes a second delete do nothing.
        hedged_txn(
            &self.client,
            DELETE_TIMEOUT,
            &self.stats,
            "delete candidate key",
            txn,
        )
        .await?;
        Ok(())
    }
}

/// The entry just ahead of ours, as the queue sees it. Every baton entry is bound to a lease:
/// one without is someone else's key under the election (an `etcdctl put`, say), which no
/// lease ever removes, so we would wait behind it for good. Said as a warning each time a
/// candidate finds it ahead, with the key to delete.
fn ahead_of(entrant: &EtcdEntrant, kv: &super::client::KeyValue) -> (Vec<u8>, Position) {
    if kv.lease() == 0 {
        tracing::warn!(
            election = %entrant.election,
            // Quoted and escaped: a key may hold a newline, and this is one line.
            key = ?String::from_utf8_lossy(kv.key()),
            "a key with no lease is ahead in the election: not a baton candidate, it blocks the election until it is deleted"
        );
    }
    (kv.key().to_vec(), position(kv.create_revision()))
}

/// The entries of an election, keys only, newest (queue's last) first.
fn newest_first() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_keys_only()
        .with_sort(SortTarget::Create, SortOrder::Descend)
}
