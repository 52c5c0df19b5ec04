//! The conformance suite, and the etcd backend's own checks, against `baton server` started in
//! this test process: the same checks real etcd passes (crates/baton/tests/etcd.rs).

#[macro_use]
mod conformance;
mod etcd_support;
mod server_support;

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
