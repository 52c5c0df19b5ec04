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
        let server = tokio::task::spawn_blocking(BackgroundServer::start)
            .await
            .unwrap();
        // Raise the revision well above what the fresh server will reach in a test.
        let mut client = etcd_client::Client::connect([server.endpoint()], None)
            .await
            .unwrap();
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
