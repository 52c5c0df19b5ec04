//! The conformance suite, and the etcd backend's own checks, against `baton server` started in
//! this test process: the same checks real etcd passes (crates/baton/tests/etcd.rs).

#[macro_use]
mod conformance;
mod etcd_support;
mod server_support;

use std::time::Duration;

use baton::{Backend, Election};
use conformance::*;
use server_support::BackgroundServer;

fn url() -> String {
    format!("etcd://{}/baton-test", server_support::shared())
}

struct ServerUnderTest;

/// A fresh server of the test's own (not the shared one), and a client of it.
async fn own_server() -> (BackgroundServer, etcd_client::Client) {
    let server = tokio::task::spawn_blocking(BackgroundServer::start)
        .await
        .unwrap();
    let client = etcd_client::Client::connect([server.endpoint()], None)
        .await
        .unwrap();
    (server, client)
}

impl conformance::BackendUnderTest for ServerUnderTest {
    type Rewindable = BackgroundServer;

    fn url(&self) -> String {
        url()
    }

    async fn delete_leader_entry(&self, election: &str) {
        etcd_support::delete_leader_key_at(server_support::shared(), election).await
    }

    async fn delete_all_entries(&self, election: &str) -> u64 {
        etcd_support::delete_all_keys_at(server_support::shared(), election).await
    }

    async fn rewindable(&self) -> BackgroundServer {
        let (server, mut client) = own_server().await;
        // Raise the revision well above what the fresh server will reach in a test.
        for i in 0..100 {
            client.put("/filler", i.to_string(), None).await.unwrap();
        }
        server
    }
}

impl conformance::Rewindable for BackgroundServer {
    fn url(&self) -> String {
        format!("etcd://{}/baton-test", self.endpoint())
    }

    async fn rewind(&mut self) {
        // Blocks this test's runtime for the restart; the server runs on a thread of its own.
        self.wipe()
    }
}

conformance_suite!(ServerUnderTest);

#[tokio::test]
async fn a_dead_endpoint_in_the_url_is_left_out() {
    etcd_support::check_a_dead_endpoint_is_left_out(server_support::shared()).await;
}

#[tokio::test]
async fn a_hung_member_in_the_url_ends_no_term() {
    etcd_support::check_a_hung_member_ends_no_term(server_support::shared()).await;
}

#[tokio::test]
async fn a_member_back_from_a_hang_is_used_again() {
    etcd_support::check_a_member_back_from_a_hang_is_used_again(server_support::shared()).await;
}

/// Two separate servers in one URL would hand out the same revisions, so the same token, to
/// two leaders: the URL is refused at connect, saying which endpoint is which cluster.
#[tokio::test]
async fn a_url_that_mixes_clusters_is_refused() {
    let (other, _client) = own_server().await;
    let shared = server_support::shared();
    let url = format!("etcd://{shared},{}/baton-test", other.endpoint());
    let error = Backend::connect(&url).await.unwrap_err();
    assert!(
        matches!(error, baton::Error::InvalidUrl { .. }),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains("different clusters")
            && message.contains(&format!("{shared} is cluster"))
            && message.contains(&format!("{} is cluster", other.endpoint())),
        "{message}"
    );
}

/// A member that was down at connect and comes back as another cluster (wiped, or another
/// server on its address) is never used: every read still sees the leader of the client's
/// own cluster, and a new connect with the same URL is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_comes_back_as_another_cluster_is_not_used() {
    let (first, _client) = own_server().await;
    let (mut second, _other) = own_server().await;
    second.stop();
    let url = format!(
        "etcd://{},{}/baton-test",
        first.endpoint(),
        second.endpoint()
    );
    let backend = Backend::connect(&url).await.unwrap();
    let election = Election::new(&backend, &unique("comeback"), config()).unwrap();
    let leadership = within(
        "campaign",
        Duration::from_secs(5),
        election.campaign("home"),
    )
    .await
    .unwrap();
    // The same address, a fresh data directory: another cluster.
    tokio::task::block_in_place(|| second.wipe());
    // The client checks a member that is down every 500 ms: give it several checks.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for read in 0..40 {
        let leader = election.leader().await.unwrap();
        assert_eq!(
            leader.map(|l| l.id),
            Some("home".to_string()),
            "read {read} went to the other cluster"
        );
    }
    let error = Backend::connect(&url).await.unwrap_err();
    assert!(error.to_string().contains("different clusters"), "{error}");
    leadership.resign().await;
}

/// Watch progress notifications, as etcd sends them: a watch created with `progress_notify`
/// that has had no event for an interval gets an empty response carrying its watch id and
/// the current revision (so its client knows it is up to date); a watch that asked for none,
/// or that just had an event, gets nothing.
#[tokio::test]
async fn an_idle_watch_that_asked_for_progress_hears_the_current_revision() {
    use etcd_client::WatchOptions;
    let server = tokio::task::spawn_blocking(|| {
        BackgroundServer::start_with(|config| {
            config.progress_interval = Duration::from_millis(300);
        })
    })
    .await
    .unwrap();
    let mut client = etcd_client::Client::connect([server.endpoint()], None)
        .await
        .unwrap();
    let mut quiet = client
        .watch(
            "/progress/quiet",
            Some(WatchOptions::new().with_progress_notify()),
        )
        .await
        .unwrap();
    let created = quiet.message().await.unwrap().unwrap();
    assert!(created.created());
    let quiet_id = created.watch_id();
    let mut plain = client.watch("/progress/plain", None).await.unwrap();
    let revision = client
        .put("/progress/other", "x", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    // Progress notifications: no events, the watch's id, and (once the put is in: a slow host
    // may see one tick before it) the current revision.
    tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            let note = quiet.message().await.unwrap().unwrap();
            assert!(note.events().is_empty(), "{note:?}");
            assert_eq!(note.watch_id(), quiet_id);
            let at = note.header().unwrap().revision();
            assert!(at <= revision, "{note:?}");
            if at == revision {
                return;
            }
        }
    })
    .await
    .expect("no progress notification at the current revision within 3 s");
    // The watch that asked for none hears nothing but its creation.
    let created = plain.message().await.unwrap().unwrap();
    assert!(created.created());
    let nothing = tokio::time::timeout(Duration::from_secs(1), plain.message()).await;
    assert!(nothing.is_err(), "{nothing:?}");
    drop(server);
}

#[tokio::test]
async fn nested_prefixes_are_independent() {
    check_nested_prefixes_are_independent(&url()).await;
}

/// A txn that writes on no branch is a read, as in etcd: answered at the current revision
/// without a place in the Raft log (no fsync on a waiter's find-predecessor); a txn that may
/// write still goes through the log, even when the branch it takes only reads.
#[tokio::test]
async fn read_only_txns_take_no_place_in_the_log() {
    use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp, TxnOpResponse};
    let (_server, mut client) = own_server().await;
    client.put("/ro/a", "1", None).await.unwrap();
    let put = client.put("/ro/b", "2", None).await.unwrap();
    let revision = put.header().unwrap().revision();
    let log_index = |status: etcd_client::StatusResponse| status.raft_index();
    let before = log_index(client.status().await.unwrap());
    let read = Txn::new()
        .when([Compare::value("/ro/a", CompareOp::Equal, "1")])
        .and_then([
            TxnOp::get("/ro/", Some(GetOptions::new().with_prefix())),
            TxnOp::txn(Txn::new().and_then([TxnOp::get("/ro/b", None)])),
        ])
        .or_else([TxnOp::get("/ro/missing", None)]);
    let answer = client.txn(read).await.unwrap();
    assert!(answer.succeeded());
    assert_eq!(answer.header().unwrap().revision(), revision);
    let TxnOpResponse::Get(all) = &answer.op_responses()[0] else {
        panic!("expected a range response, got {:?}", answer.op_responses());
    };
    assert_eq!(all.kvs().len(), 2);
    assert_eq!(all.header().unwrap().revision(), revision);
    assert_eq!(
        log_index(client.status().await.unwrap()),
        before,
        "a read-only txn was written to the log"
    );
    // The failure branch writes: the txn goes through the log, though it only reads.
    let may_write = Txn::new()
        .when([Compare::value("/ro/a", CompareOp::Equal, "1")])
        .and_then([TxnOp::get("/ro/a", None)])
        .or_else([TxnOp::put("/ro/c", "3", None)]);
    let answer = client.txn(may_write).await.unwrap();
    assert!(answer.succeeded());
    assert_eq!(answer.header().unwrap().revision(), revision);
    assert_eq!(log_index(client.status().await.unwrap()), before + 1);
    // A compacted revision inside a read-only txn is the same error as for a range.
    client.put("/ro/a", "4", None).await.unwrap();
    client.compact(revision + 1, None).await.unwrap();
    let old = Txn::new().and_then([TxnOp::get(
        "/ro/a",
        Some(GetOptions::new().with_revision(revision)),
    )]);
    let error = client.txn(old).await.unwrap_err().to_string();
    assert!(error.contains("compacted"), "{error}");
}

/// A read-only txn answered without the log still sees every write acknowledged before it was
/// sent, from any connection (the find-predecessor after a deletion relies on it).
#[tokio::test]
async fn a_read_only_txn_sees_the_write_acknowledged_before_it() {
    use etcd_client::{Txn, TxnOp, TxnOpResponse};
    let (server, mut writer) = own_server().await;
    let mut reader = etcd_client::Client::connect([server.endpoint()], None)
        .await
        .unwrap();
    for i in 0..200 {
        let put = writer.put("/fresh", i.to_string(), None).await.unwrap();
        let written = put.header().unwrap().revision();
        let answer = reader
            .txn(Txn::new().and_then([TxnOp::get("/fresh", None)]))
            .await
            .unwrap();
        assert!(answer.header().unwrap().revision() >= written);
        let TxnOpResponse::Get(get) = &answer.op_responses()[0] else {
            panic!("expected a range response");
        };
        assert_eq!(
            get.kvs()[0].value_str().unwrap(),
            i.to_string(),
            "round {i}"
        );
    }
}

/// A waiter leads on its predecessor's deletion event alone: baton server's queue check says,
/// with the event, that its entry is first, so it makes no read (etcd: one, see etcd.rs).
#[tokio::test]
async fn the_successor_leads_without_a_read() {
    let requests = etcd_support::requests_from_resign_to_successor(&url()).await;
    assert_eq!(
        requests, 0,
        "requests from the resign to the successor's lead"
    );
}

/// baton server restarted (same data directory) while a waiter waits behind the leader: the
/// waiter's checked watch breaks, it finds its place again, and the leader's resign after the
/// restart hands over once, to it, with a higher token; it never leads beside the leader.
#[tokio::test]
async fn a_waiter_takes_over_after_a_server_restart() {
    use std::time::Duration;
    let (server, _client) = own_server().await;
    let url = format!("etcd://{}/baton-test", server.endpoint());
    let mut server = Some(server);
    // A 5 s TTL: the restart (up to 0.5 s of shutdown grace, then the start) and both clients'
    // reconnections fit in it with room to spare on a busy machine.
    let config = conformance::config().with_ttl(Duration::from_secs(5));
    check_waiter_takes_over_on_resign_after(&url, config, async |a_lead, b_backend| {
        let watched = b_backend.stats().predecessor_watches;
        let restarting = server.take().unwrap();
        let restarted = tokio::task::spawn_blocking(move || {
            let mut restarting = restarting;
            restarting.restart();
            restarting
        })
        .await
        .unwrap();
        server = Some(restarted);
        // The waiter's watch broke with the restart: it finds its place and watches again.
        settled(std::slice::from_ref(b_backend), watched as usize + 1).await;
        assert!(a_lead.is_leading(), "a restart shorter than the TTL");
    })
    .await;
    drop(server);
}

/// The queue check on a deletion watch: `baton_first_at` is the revision at which the own
/// entry is first, and 0 whenever it is not: another entry still ahead, the own entry gone in
/// the same revision, a different incarnation of it. A deletion already in the history gets
/// the check at the current revision.
#[tokio::test]
async fn a_queue_checked_watch_says_when_the_own_entry_is_first() {
    use etcd_support::{checked_watch, next_events, raw_watch};
    let (server, mut client) = own_server().await;
    let endpoint = server.endpoint();
    let revision = |r: Option<&etcd_client::ResponseHeader>| r.unwrap().revision();
    client.put("/q/a", "", None).await.unwrap();
    let b = revision(client.put("/q/b", "", None).await.unwrap().header());
    let c = revision(client.put("/q/c", "", None).await.unwrap().header());
    // c waits behind b, but a is still ahead of both.
    let (watches, mut responses) =
        raw_watch(&endpoint, checked_watch(1, "/q/b", c + 1, "/q/c", c, "/q/")).await;
    // A check for an incarnation of c that is not the live one never holds.
    watches
        .send(checked_watch(2, "/q/a", c + 1, "/q/c", c + 100, "/q/"))
        .await
        .unwrap();
    // b's own check, behind a.
    watches
        .send(checked_watch(3, "/q/a", c + 1, "/q/b", b, "/q/"))
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    client.delete("/q/b", None).await.unwrap();
    let response = next_events(&mut responses, 1).await;
    assert_eq!(response.baton_first_at, 0, "a is still ahead of c");
    let deleted_a = revision(client.delete("/q/a", None).await.unwrap().header());
    let seen = first_at_of_two(&mut responses).await;
    assert_eq!(seen[&2], 0, "another incarnation of the own entry");
    assert_eq!(seen[&3], 0, "b was deleted before a");
    // c is first now: a watch that replays a's deletion from the history says so, at the
    // current revision.
    watches
        .send(checked_watch(4, "/q/a", deleted_a, "/q/c", c, "/q/"))
        .await
        .unwrap();
    let response = next_events(&mut responses, 4).await;
    assert_eq!(response.baton_first_at, deleted_a);

    // The own entry deleted in the same revision as the one ahead: not first.
    client.put("/x/a", "", None).await.unwrap();
    let y = revision(client.put("/x/b", "", None).await.unwrap().header());
    let z = revision(client.put("/x/c", "", None).await.unwrap().header());
    watches
        .send(checked_watch(5, "/x/a", z + 1, "/x/b", y, "/x/"))
        .await
        .unwrap();
    watches
        .send(checked_watch(6, "/x/a", z + 1, "/x/c", z, "/x/"))
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let both = etcd_client::Txn::new().and_then([
        etcd_client::TxnOp::delete("/x/a", None),
        etcd_client::TxnOp::delete("/x/b", None),
    ]);
    let deleted = revision(client.txn(both).await.unwrap().header());
    let seen = first_at_of_two(&mut responses).await;
    assert_eq!(seen[&5], 0, "its own entry went in the same revision");
    assert_eq!(
        seen[&6], deleted,
        "c is first once a and b are gone together"
    );
}

/// `baton_first_at` of the next two watches' event responses, by watch id.
async fn first_at_of_two(
    responses: &mut tonic::Streaming<baton_etcd_proto::etcdserverpb::WatchResponse>,
) -> std::collections::HashMap<i64, i64> {
    let mut seen = std::collections::HashMap::new();
    while seen.len() < 2 {
        let response = etcd_support::next_events(responses, 0).await;
        seen.insert(response.watch_id, response.baton_first_at);
    }
    seen
}

/// Answers clients can tell apart from etcd's (refused watches, a negative start revision, a
/// half-closed watch stream, headers inside a txn), checked as on etcd (tests/etcd.rs).
#[tokio::test]
async fn answers_as_etcd() {
    etcd_support::check_answers_as_etcd(server_support::shared()).await;
}

/// A start revision of -1 on a server that never compacted: etcd 3.4 (its compact revision
/// is -1 then) finds no history below it and watches from now on; -2 is cancelled as
/// compacted, at -1.
#[tokio::test]
async fn a_start_revision_of_minus_one_watches_from_now_before_any_compaction() {
    use etcd_support::{next_response, raw_watch, watch_create};
    let (server, mut client) = own_server().await;
    client.put("/m/before", "", None).await.unwrap();
    let (watches, mut responses) =
        raw_watch(&server.endpoint(), watch_create(1, "/m/", "/m0", -1)).await;
    let created = next_response(&mut responses).await;
    assert!(created.created && !created.canceled, "{created:?}");
    watches
        .send(watch_create(2, "/m/", "/m0", -2))
        .await
        .unwrap();
    let created = next_response(&mut responses).await;
    assert_eq!(
        (created.watch_id, created.created),
        (2, true),
        "{created:?}"
    );
    let cancelled = next_response(&mut responses).await;
    assert_eq!(
        (
            cancelled.watch_id,
            cancelled.canceled,
            cancelled.compact_revision
        ),
        (2, true, -1),
        "{cancelled:?}"
    );
    client.put("/m/after", "", None).await.unwrap();
    let event = next_response(&mut responses).await;
    assert_eq!(event.watch_id, 1, "{event:?}");
    let keys: Vec<_> = event
        .events
        .iter()
        .map(|e| e.kv.clone().unwrap().key)
        .collect();
    assert_eq!(
        keys,
        [b"/m/after".to_vec()],
        "no history, only what came after"
    );
}

#[tokio::test]
async fn a_resign_into_a_fresh_hang_is_heard() {
    etcd_support::check_a_resign_into_a_fresh_hang_is_heard(server_support::shared()).await;
}
