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

/// The requests the next in line makes from its predecessor's resign until it leads: on baton
/// server none (the deletion's watch event says, by baton's queue check, that it is first),
/// on etcd one (its find-predecessor read).
pub async fn requests_from_resign_to_successor(url: &str) -> u64 {
    use baton::{Backend, Election, ElectionConfig};
    use std::time::Duration;
    let config = ElectionConfig::default().with_ttl(Duration::from_secs(10));
    let name = format!(
        "successor-requests-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let leader_backend = Backend::connect(url).await.unwrap();
    let waiter_backend = Backend::connect(url).await.unwrap();
    let leader = Election::new(&leader_backend, &name, config.clone())
        .unwrap()
        .campaign("leader")
        .await
        .unwrap();
    let mut waiter = Election::new(&waiter_backend, &name, config)
        .unwrap()
        .candidacy("waiter")
        .unwrap();
    let observer = Election::new(&leader_backend, &name, ElectionConfig::default()).unwrap();
    while observer.participants().await.unwrap().len() < 2 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Its watches are in place once it queued; let them settle.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = waiter_backend.stats().requests;
    let leader_token = leader.token();
    leader.resign().await;
    let successor = tokio::time::timeout(Duration::from_secs(5), waiter.next())
        .await
        .expect("the waiter did not lead within 5 s")
        .unwrap();
    let requests = waiter_backend.stats().requests - before;
    assert!(successor.token() > leader_token);
    successor.resign().await;
    requests
}

/// A raw watch stream on the etcd API server at `endpoint` (the generated client, which can
/// send baton's `QueueCheck` extension), for checks below the library; `first` goes out
/// before the call is answered (etcd answers a watch call only with its first response).
pub async fn raw_watch(
    endpoint: &str,
    first: baton_etcd_proto::etcdserverpb::WatchRequest,
) -> (
    tokio::sync::mpsc::Sender<baton_etcd_proto::etcdserverpb::WatchRequest>,
    tonic::Streaming<baton_etcd_proto::etcdserverpb::WatchResponse>,
) {
    use baton_etcd_proto::etcdserverpb::watch_client::WatchClient;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{endpoint}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = WatchClient::new(channel);
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tx.send(first).await.unwrap();
    let responses = client
        .watch(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, responses)
}

/// A deletion watch on `key` from `start_revision`, with baton's queue check for `own_key`
/// (created at `own_create_revision`) under `scope`.
pub fn checked_watch(
    watch_id: i64,
    key: &str,
    start_revision: i64,
    own_key: &str,
    own_create_revision: i64,
    scope: &str,
) -> baton_etcd_proto::etcdserverpb::WatchRequest {
    use baton_etcd_proto::etcdserverpb::{
        watch_create_request::FilterType, watch_request::RequestUnion, QueueCheck,
        WatchCreateRequest, WatchRequest,
    };
    let mut scope_range_end = scope.as_bytes().to_vec();
    *scope_range_end.last_mut().unwrap() += 1;
    WatchRequest {
        request_union: Some(RequestUnion::CreateRequest(WatchCreateRequest {
            key: key.as_bytes().to_vec(),
            start_revision,
            filters: vec![FilterType::Noput as i32],
            prev_kv: true,
            watch_id,
            baton_queue_check: Some(QueueCheck {
                own_key: own_key.as_bytes().to_vec(),
                own_create_revision,
                scope_key: scope.as_bytes().to_vec(),
                scope_range_end,
            }),
            ..WatchCreateRequest::default()
        })),
    }
}

/// The next response of `watch_id` (0: of any watch) on the stream that carries events
/// (skipping the `created` answers).
pub async fn next_events(
    responses: &mut tonic::Streaming<baton_etcd_proto::etcdserverpb::WatchResponse>,
    watch_id: i64,
) -> baton_etcd_proto::etcdserverpb::WatchResponse {
    loop {
        let response = tokio::time::timeout(std::time::Duration::from_secs(5), responses.message())
            .await
            .expect("no watch response within 5 s")
            .unwrap()
            .expect("the watch stream ended");
        assert!(!response.canceled, "watch cancelled: {response:?}");
        if (watch_id == 0 || response.watch_id == watch_id) && !response.events.is_empty() {
            return response;
        }
    }
}
