//! etcd-specific helpers shared by the test binaries that run against the real etcd.
// Each test binary uses a different subset.
#![allow(dead_code)]

/// The etcd under test. Missing is a loud failure, never a skip.
pub fn etcd() -> String {
    std::env::var("BATON_TEST_ETCD").expect(
        "BATON_TEST_ETCD is not set: run the tests with scripts/test, which starts a private etcd",
    )
}

pub fn url() -> String {
    format!("etcd://{}/baton-test", etcd())
}

/// Deletes the leader's key of `election` behind the library's back, as an operator would.
pub async fn delete_leader_key(election: &str) {
    delete_leader_key_at(&etcd(), election).await
}

/// [`delete_leader_key`] on the etcd API server at `endpoint`.
pub async fn delete_leader_key_at(endpoint: &str, election: &str) {
    let mut client = etcd_client::Client::connect([endpoint], None)
        .await
        .unwrap();
    let prefix = format!("/baton-test/{election}/@candidates/");
    let options = etcd_client::GetOptions::new()
        .with_prefix()
        .with_sort(
            etcd_client::SortTarget::Create,
            etcd_client::SortOrder::Ascend,
        )
        .with_limit(1);
    let response = client.get(prefix, Some(options)).await.unwrap();
    let key = response.kvs()[0].key().to_vec();
    client.delete(key, None).await.unwrap();
}

/// Deletes every candidate key of `election` in one revision (one `DeleteRange`), as
/// `etcdctl del --prefix` would, on the etcd API server at `endpoint`; returns that revision.
pub async fn delete_all_keys_at(endpoint: &str, election: &str) -> u64 {
    let mut client = etcd_client::Client::connect([endpoint], None)
        .await
        .unwrap();
    let prefix = format!("/baton-test/{election}/@candidates/");
    let options = etcd_client::DeleteOptions::new().with_prefix();
    let response = client.delete(prefix, Some(options)).await.unwrap();
    assert_eq!(response.deleted(), 2, "the leader's key and the waiter's");
    response.header().unwrap().revision() as u64
}
