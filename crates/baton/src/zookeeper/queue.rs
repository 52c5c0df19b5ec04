//! The candidate queue on ZooKeeper, for the backend-neutral driver.

use std::sync::{Arc, Mutex};

use baton_core::ElectionConfig;
use zookeeper_client as zk;

use super::fence::ZkFencer;
use super::lease::ZkLease;
use super::watch::ZkWatch;
use super::{
    ask, bounded, encode, kept_changing, mkdir_or_exists, node_name, protocol, request, sequence,
    stem, zk_error, ZkBackend, DELETE_TIMEOUT, RACE_RETRIES, REQUEST_TIMEOUT,
};
use crate::driver::{Located, Position, Queue, ReadPoint, TokenMemory};
use crate::election::{CandidateSpec, GuardContext};
use crate::error::{Error, Result};
use crate::stats::Stats;

const EPHEMERAL: zk::CreateOptions<'static> =
    zk::CreateMode::Ephemeral.with_acls(zk::Acls::anyone_all());
const EPHEMERAL_SEQUENTIAL: zk::CreateOptions<'static> =
    zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());

/// A candidate's entry: the folder and stem of its znode (the stem is the same for every
/// attempt of one candidacy under one session), and the full name of the incarnation once it is
/// known.
///
/// ZooKeeper names a sequential znode only when it creates it, while the driver names an entry
/// before creating it. So the incarnation is kept in a cell shared by every clone of the entry:
/// [`Queue::create`] sets it in the driver's own entry; the entry ahead of ours, found by
/// [`Queue::locate`], comes with it. Two entries are equal when folder and stem are (the driver
/// compares positions too where incarnations matter).
#[derive(Clone)]
pub(crate) struct ZkEntry {
    dir: Arc<str>,
    stem: Arc<str>,
    incarnation: Arc<Mutex<Option<Incarnation>>>,
}

/// One created znode of an entry.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Incarnation {
    /// The znode's name (stem and sequence number).
    name: String,
    czxid: u64,
}

impl ZkEntry {
    fn new(dir: Arc<str>, stem: &str) -> ZkEntry {
        ZkEntry {
            dir,
            stem: stem.into(),
            incarnation: Arc::default(),
        }
    }

    /// The entry of the znode `name` in `dir`, created at `czxid`.
    fn found(dir: &Arc<str>, name: &str, czxid: u64) -> ZkEntry {
        let entry = ZkEntry::new(dir.clone(), stem(name).unwrap_or(name));
        entry.set(name, czxid);
        entry
    }

    fn incarnation(&self) -> Option<Incarnation> {
        self.incarnation
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The incarnation created at `position`, if that is the one this entry knows.
    fn at(&self, position: u64) -> Option<Incarnation> {
        self.incarnation().filter(|known| known.czxid == position)
    }

    fn set(&self, name: &str, czxid: u64) {
        *self.incarnation.lock().unwrap_or_else(|e| e.into_inner()) = Some(Incarnation {
            name: name.to_string(),
            czxid,
        });
    }

    fn path(&self, name: &str) -> String {
        format!("{}/{name}", self.dir)
    }
}

impl PartialEq for ZkEntry {
    fn eq(&self, other: &ZkEntry) -> bool {
        self.dir == other.dir && self.stem == other.stem
    }
}

impl std::fmt::Debug for ZkEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZkEntry")
            .field("dir", &self.dir)
            .field("stem", &self.stem)
            .field("incarnation", &self.incarnation())
            .finish()
    }
}

/// One candidacy as ZooKeeper sees it.
pub(crate) struct ZkEntrant {
    election: String,
    id: String,
    serial: u64,
    /// `<chroot>/<election>/@candidates`.
    dir: Arc<str>,
    /// `<chroot>/<election>/@ids`.
    ids_dir: String,
    /// `<chroot>/<election>/@ids/<id>`: created with our entry, holding its stem.
    id_node: String,
    /// What our entry holds: the id and the leader value (see `encode`).
    value: Vec<u8>,
}

/// Who holds our id.
enum IdHolder {
    /// Our entry, created by an earlier attempt whose answer was lost: adopted, at this czxid.
    Us(u64),
    /// Nobody any more (the id entry was stale, and is removed): try again.
    Stale,
    /// Another live candidate, with this entry.
    Other(String),
}

const CREATE: &str = "create candidate entry";

/// The queue on ZooKeeper: an entry is an ephemeral sequential znode owned by the lease's
/// session; queue order is the sequence number and an entry's position its czxid.
impl Queue for ZkBackend {
    type Lease = ZkLease;
    type Entry = ZkEntry;
    type Entrant = ZkEntrant;
    type Watch = ZkWatch;

    fn stats(&self) -> &Stats {
        &self.stats
    }

    fn tokens(&self) -> &TokenMemory {
        &self.tokens
    }

    fn leases(&self) -> &crate::driver::LeasePool<Self::Lease> {
        &self.leases
    }

    fn entrant(&self, spec: &CandidateSpec, serial: u64) -> ZkEntrant {
        let ids_dir = self.ids_dir(&spec.election);
        ZkEntrant {
            election: spec.election.clone(),
            id: spec.id.clone(),
            serial,
            dir: self.candidates_dir(&spec.election).into(),
            id_node: format!("{ids_dir}/{}", node_name(&spec.id)),
            ids_dir,
            value: encode(&spec.id, spec.value.as_deref()),
        }
    }

    async fn lease(&self, config: &ElectionConfig) -> Result<Arc<ZkLease>> {
        ZkBackend::lease(self, config).await
    }

    fn entry_name(&self, entrant: &ZkEntrant, lease: &ZkLease) -> ZkEntry {
        // The session id names the lease, the serial the candidacy.
        let stem = format!("{:016x}-{}-", lease.session_id as u64, entrant.serial);
        ZkEntry::new(entrant.dir.clone(), &stem)
    }

    async fn create(
        &self,
        entrant: &ZkEntrant,
        entry: &ZkEntry,
        lease: &ZkLease,
    ) -> Result<Position> {
        // Created by the lease's session, so it is that session's ephemeral node.
        let client = lease.client()?;
        let entry_path = entry.path(&entry.stem);
        // A few rounds at most: after creating missing folders, or removing a stale id entry.
        for _ in 0..4 {
            let mut multi = client.new_multi_writer();
            multi
                .add_create(&entrant.id_node, entry.stem.as_bytes(), &EPHEMERAL)
                .map_err(|error| zk_error(CREATE, error))?;
            multi
                .add_create(&entry_path, &entrant.value, &EPHEMERAL_SEQUENTIAL)
                .map_err(|error| zk_error(CREATE, error))?;
            self.stats.request();
            match bounded(REQUEST_TIMEOUT, CREATE, multi.commit()).await? {
                Ok(results) => {
                    let Some(zk::MultiWriteResult::Create { path, stat }) =
                        results.into_iter().nth(1)
                    else {
                        return Err(protocol(CREATE, "the answer lacks the new entry"));
                    };
                    let czxid = if stat.is_invalid() {
                        // Some servers leave the stat of a create inside a multi empty.
                        match request(&self.stats, CREATE, client.check_stat(&path)).await? {
                            Some(stat) => stat.czxid,
                            None => return Err(kept_changing(CREATE, "the new entry vanished")),
                        }
                    } else {
                        stat.czxid
                    };
                    let name = path.rsplit('/').next().unwrap_or(&path);
                    let position = u64::try_from(czxid)
                        .map_err(|_| protocol(CREATE, "the new entry has a negative czxid"))?;
                    entry.set(name, position);
                    return Ok(Position(position));
                }
                Err(zk::MultiWriteError::OperationFailed {
                    source: zk::Error::NoNode,
                    ..
                }) => {
                    // The election's folders do not exist yet.
                    for dir in [&*entrant.dir, &*entrant.ids_dir] {
                        mkdir_or_exists(&self.stats, REQUEST_TIMEOUT, CREATE, &client, dir).await?;
                    }
                }
                Err(zk::MultiWriteError::OperationFailed {
                    index: 0,
                    source: zk::Error::NodeExists,
                }) => match self.id_holder(entrant, entry, &client).await? {
                    IdHolder::Us(position) => return Ok(Position(position)),
                    IdHolder::Stale => {}
                    IdHolder::Other(holder) => {
                        return Err(Error::DuplicateId {
                            election: entrant.election.clone(),
                            id: entrant.id.clone(),
                            entry: holder,
                        })
                    }
                },
                Err(
                    zk::MultiWriteError::OperationFailed { source, .. }
                    | zk::MultiWriteError::RequestFailed { source },
                ) => return Err(zk_error(CREATE, source)),
            }
        }
        Err(kept_changing(
            CREATE,
            "the candidate id entry keeps changing",
        ))
    }

    async fn locate(
        &self,
        _entrant: &ZkEntrant,
        entry: &ZkEntry,
        position: Position,
    ) -> Result<Located<ZkEntry>> {
        const OP: &str = "find predecessor";
        let position = position.0;
        let Some(own) = entry.at(position) else {
            return Ok(Located::Gone);
        };
        let Some(own_sequence) = sequence(&own.name) else {
            return Err(protocol(OP, "our entry has no sequence number"));
        };
        let own_path = entry.path(&own.name);
        let client = self.main.client().await?;
        for _ in 0..RACE_RETRIES {
            // One atomic read (a multi read is served at one point of the server's history):
            // our entry, which must still be the incarnation created at `position`, and the
            // list of entries.
            let mut reader = client.new_multi_reader();
            reader
                .add_get_data(&own_path)
                .and_then(|()| reader.add_get_children(&entry.dir))
                .map_err(|error| zk_error(OP, error))?;
            let mut results = request(&self.stats, OP, reader.commit()).await?.into_iter();
            match results.next() {
                Some(zk::MultiReadResult::Data { stat, .. }) if stat.czxid as u64 == position => {}
                Some(
                    zk::MultiReadResult::Data { .. }
                    | zk::MultiReadResult::Error {
                        err: zk::Error::NoNode,
                    },
                ) => return Ok(Located::Gone),
                Some(zk::MultiReadResult::Error { err }) => return Err(zk_error(OP, err)),
                _ => return Err(protocol(OP, "unexpected answer to a read")),
            }
            let children = match results.next() {
                Some(zk::MultiReadResult::Children { children }) => children,
                Some(zk::MultiReadResult::Error { err }) => return Err(zk_error(OP, err)),
                _ => return Err(protocol(OP, "unexpected answer to a read")),
            };
            // The entry just ahead: the next-lower sequence number.
            let ahead = children
                .into_iter()
                .filter_map(|name| Some((sequence(&name)?, name)))
                .filter(|(sequence, _)| *sequence < own_sequence)
                .max();
            let Some((_, name)) = ahead else {
                return Ok(Located::Exists {
                    ahead: None,
                    at: ReadPoint(position),
                });
            };
            // Its position is read after the listing and trusted only if it still exists then:
            // its name is unique to that incarnation, so it existed all along.
            match request(&self.stats, OP, client.check_stat(&entry.path(&name))).await? {
                Some(stat) => {
                    let czxid = stat.czxid.max(0) as u64;
                    return Ok(Located::Exists {
                        ahead: Some((ZkEntry::found(&entry.dir, &name, czxid), Position(czxid))),
                        // ZooKeeper's watches need no read point (see `watch.rs`).
                        at: ReadPoint(position),
                    });
                }
                // Deleted since the listing: look again.
                None => continue,
            }
        }
        Err(kept_changing(OP, "the entries ahead keep changing"))
    }

    async fn confirm(&self, entry: &ZkEntry, position: Position) -> Result<Option<ReadPoint>> {
        let position = position.0;
        let Some(own) = entry.at(position) else {
            return Ok(None);
        };
        let client = self.main.client().await?;
        let stat = request(
            &self.stats,
            "get own entry",
            client.check_stat(&entry.path(&own.name)),
        )
        .await?;
        Ok(stat
            .filter(|stat| stat.czxid as u64 == position)
            .map(|_| ReadPoint(position)))
    }

    async fn watch_deletion(
        &self,
        entry: &ZkEntry,
        _position: Position,
        _after: ReadPoint,
    ) -> Result<ZkWatch> {
        let Some(known) = entry.incarnation() else {
            return Err(protocol("watch entry", "the entry has no znode yet"));
        };
        let client = self.main.client().await?;
        let path = entry.path(&known.name);
        ZkWatch::start(client, self.stats.clone(), entry.clone(), path, known.czxid).await
    }

    async fn delete(&self, entrant: &ZkEntrant, entry: &ZkEntry, position: Position) -> Result<()> {
        let position = position.0;
        // Only the incarnation created at `position`: its name is unique to it.
        let Some(own) = entry.at(position) else {
            return Ok(());
        };
        let path = entry.path(&own.name);
        bounded(
            DELETE_TIMEOUT,
            "delete candidate entry",
            self.delete_entry(entrant, &path, &entry.stem),
        )
        .await?
    }

    async fn delete_if_on_lease(
        &self,
        entrant: &ZkEntrant,
        entry: &ZkEntry,
        _lease: &ZkLease,
    ) -> Result<()> {
        const OP: &str = "delete candidate entry";
        // The stem names the lease's session: an entry with it is bound to that lease.
        bounded(DELETE_TIMEOUT, OP, async {
            let client = self.main.client().await?;
            let children = match ask(
                &self.stats,
                REQUEST_TIMEOUT,
                OP,
                client.list_children(&entry.dir),
            )
            .await?
            {
                Ok(children) => children,
                Err(zk::Error::NoNode) => return Ok(()),
                Err(error) => return Err(zk_error(OP, error)),
            };
            for name in children
                .iter()
                .filter(|name| stem(name) == Some(&*entry.stem) && sequence(name).is_some())
            {
                self.delete_entry(entrant, &entry.path(name), &entry.stem)
                    .await?;
            }
            Ok(())
        })
        .await?
    }

    fn guard(&self, entry: &ZkEntry, position: Position) -> GuardContext {
        let position = position.0;
        Arc::new(ZkFencer {
            main: self.main.clone(),
            stats: self.stats.clone(),
            chroot: self.chroot.clone(),
            leader: entry
                .at(position)
                .map(|own| entry.path(&own.name))
                .unwrap_or_default(),
        })
    }
}

impl ZkBackend {
    /// Who holds our id, from one atomic read of the id entry and the list of entries (the id
    /// entry holds its entry's stem, and the two are created and deleted together).
    async fn id_holder(
        &self,
        entrant: &ZkEntrant,
        entry: &ZkEntry,
        client: &zk::Client,
    ) -> Result<IdHolder> {
        const OP: &str = "find id holder";
        let mut reader = client.new_multi_reader();
        reader
            .add_get_data(&entrant.id_node)
            .and_then(|()| reader.add_get_children(&entrant.dir))
            .map_err(|error| zk_error(OP, error))?;
        let mut results = request(&self.stats, OP, reader.commit()).await?.into_iter();
        let (holder, version) = match results.next() {
            Some(zk::MultiReadResult::Data { data, stat }) => (data, stat.version),
            // Gone meanwhile: try again.
            Some(zk::MultiReadResult::Error {
                err: zk::Error::NoNode,
            }) => return Ok(IdHolder::Stale),
            Some(zk::MultiReadResult::Error { err }) => return Err(zk_error(OP, err)),
            _ => return Err(protocol(OP, "unexpected answer to a read")),
        };
        let children = match results.next() {
            Some(zk::MultiReadResult::Children { children }) => children,
            Some(zk::MultiReadResult::Error {
                err: zk::Error::NoNode,
            }) => Vec::new(),
            Some(zk::MultiReadResult::Error { err }) => return Err(zk_error(OP, err)),
            _ => return Err(protocol(OP, "unexpected answer to a read")),
        };
        let holder = String::from_utf8_lossy(&holder).into_owned();
        let holder_entry = children
            .into_iter()
            .filter(|name| stem(name) == Some(holder.as_str()))
            .filter_map(|name| Some((sequence(&name)?, name)))
            .max()
            .map(|(_, name)| name);
        match holder_entry {
            Some(name) if holder == *entry.stem => {
                // Ours: an earlier attempt whose answer was lost created both (in one multi).
                let path = entry.path(&name);
                let stat = request(&self.stats, OP, client.check_stat(&path)).await?;
                if let Some(stat) = stat.filter(|s| s.ephemeral_owner == client.session_id().0) {
                    let position = stat.czxid.max(0) as u64;
                    entry.set(&name, position);
                    return Ok(IdHolder::Us(position));
                }
            }
            Some(name) => return Ok(IdHolder::Other(name)),
            None => {}
        }
        // An id entry whose entry is gone (deleted behind baton's back) is stale: remove it,
        // unless it changed meanwhile.
        match ask(
            &self.stats,
            REQUEST_TIMEOUT,
            "clear stale id entry",
            client.delete(&entrant.id_node, Some(version)),
        )
        .await?
        {
            Ok(()) | Err(zk::Error::NoNode | zk::Error::BadVersion) => Ok(IdHolder::Stale),
            Err(error) => Err(zk_error("clear stale id entry", error)),
        }
    }

    /// Deletes the entry at `path`, and with it our id entry if it is ours (it holds `stem`).
    async fn delete_entry(&self, entrant: &ZkEntrant, path: &str, stem: &str) -> Result<()> {
        const OP: &str = "delete candidate entry";
        let client = self.main.client().await?;
        // Our entry first, alone: its deletion is what wakes the next candidate, so nothing
        // else may stand before it on the handoff's path.
        match ask(&self.stats, REQUEST_TIMEOUT, OP, client.delete(path, None)).await? {
            Ok(()) | Err(zk::Error::NoNode) => {}
            Err(error) => return Err(zk_error(OP, error)),
        }
        // Then our id entry, if it is still ours (it names our stem). Should this fail, the id
        // entry goes with our session, and a later candidate with the id finds it stale (its
        // entry is gone) and removes it.
        let version = match ask(
            &self.stats,
            REQUEST_TIMEOUT,
            OP,
            client.get_data(&entrant.id_node),
        )
        .await
        {
            Ok(Ok((holder, stat))) if holder == stem.as_bytes() => stat.version,
            _ => return Ok(()),
        };
        let _ = ask(
            &self.stats,
            REQUEST_TIMEOUT,
            OP,
            client.delete(&entrant.id_node, Some(version)),
        )
        .await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The queue's own paths against the real ZooKeeper that `scripts/test` starts (the
    //! conformance suite in `tests/zookeeper.rs` covers the rest through the public API).
    use super::*;
    use crate::backend::Connection;
    use std::time::Duration;

    /// The ZooKeeper under test. Missing is a loud failure, never a skip.
    fn zookeeper() -> Vec<String> {
        vec![std::env::var("BATON_TEST_ZK").expect(
            "BATON_TEST_ZK is not set: run the tests with scripts/test, which starts a private \
             ZooKeeper",
        )]
    }

    fn spec(election: &str) -> CandidateSpec {
        CandidateSpec {
            election: election.to_string(),
            id: "a".into(),
            value: Some("v".into()),
            config: ElectionConfig::default().with_ttl(Duration::from_secs(2)),
        }
    }

    /// Creating is safe to repeat: a create whose answer was lost is retried with the same
    /// name, and the retry adopts the entry the first attempt made (one entry, same position)
    /// instead of making a second one. Another candidacy with the id is refused until the
    /// entry is deleted with its id entry.
    #[tokio::test]
    async fn a_repeated_create_adopts_the_entry() {
        let backend = ZkBackend::connect(zookeeper(), "/baton-unit".into())
            .await
            .unwrap();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let spec = spec(&format!("adopt-{}-{nanos}", std::process::id()));
        let entrant = backend.entrant(&spec, 7);
        let lease = Queue::lease(&backend, &spec.config).await.unwrap();
        let entry = backend.entry_name(&entrant, &lease);
        let first = backend.create(&entrant, &entry, &lease).await.unwrap();
        // The same create again, as after a lost answer: adopted, not duplicated.
        let again = backend.entry_name(&entrant, &lease);
        assert_eq!(again, entry);
        let second = backend.create(&entrant, &again, &lease).await.unwrap();
        assert_eq!(second, first);
        assert_eq!(again.incarnation(), entry.incarnation());
        let participants = backend.participants(&spec.election).await.unwrap();
        assert_eq!(participants.len(), 1, "{participants:?}");
        assert_eq!(participants[0].token, first.token());
        assert_eq!(participants[0].value.as_deref(), Some("v"));
        // Another candidacy with the same id, even under the same session, is refused.
        let other = backend.entrant(&spec, 8);
        let other_entry = backend.entry_name(&other, &lease);
        assert!(matches!(
            backend.create(&other, &other_entry, &lease).await,
            Err(Error::DuplicateId { .. })
        ));
        // Giving up on an uncertain create deletes the entry and its id entry.
        backend
            .delete_if_on_lease(&entrant, &again, &lease)
            .await
            .unwrap();
        assert!(backend
            .participants(&spec.election)
            .await
            .unwrap()
            .is_empty());
        let third = backend.create(&other, &other_entry, &lease).await.unwrap();
        assert!(third > first);
        // Our own entry is deleted only at its own position.
        backend.delete(&other, &other_entry, first).await.unwrap();
        assert_eq!(backend.participants(&spec.election).await.unwrap().len(), 1);
        backend.delete(&other, &other_entry, third).await.unwrap();
        assert!(backend
            .participants(&spec.election)
            .await
            .unwrap()
            .is_empty());
        Connection::close(&backend).await;
    }
}
