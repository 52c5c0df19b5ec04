//! baton's own etcd v3 client: the few calls the backend makes, over the tonic clients that
//! `baton-etcd-proto` generates (no system `protoc` needed to build baton).
//!
//! Its shape follows the `etcd-client` crate, which the backend used before, so the backend reads
//! the same: `Client::get` with `GetOptions`, `Txn` of `Compare`s and `TxnOp`s, a watch stream
//! split into a request sender and a response stream, leases with a keeper and a keep-alive
//! stream. Only what the backend uses is here: no TLS, no authentication, no endpoint changes.
//!
//! [`Error`] keeps `etcd-client`'s variants and messages for the errors this client can produce,
//! so the backend's classification (transient or not, unreachable or not) and its error texts
//! stay as they were.

use std::time::Duration;

use baton_etcd_proto::etcdserverpb as pb;
use baton_etcd_proto::etcdserverpb::kv_client::KvClient;
use baton_etcd_proto::etcdserverpb::lease_client::LeaseClient;
use baton_etcd_proto::etcdserverpb::watch_client::WatchClient;
use baton_etcd_proto::mvccpb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::Streaming;
use tonic::transport::{Channel, Endpoint, Uri};

use super::endpoints::{Endpoints, NotReady};

/// Queued requests on one watch or keep-alive stream (as `etcd-client`).
const STREAM_QUEUE: usize = 100;

/// A failed call.
///
/// The variants, and their messages, are `etcd-client`'s for the same failures: the backend's
/// error texts and retry decisions do not depend on which client made the call.
#[derive(Debug)]
pub(crate) enum Error {
    /// Invalid arguments (no endpoints).
    InvalidArgs(String),
    /// An endpoint that is no URI.
    InvalidUri(String),
    /// The server, or the channel on the way to it, answered with a gRPC status; a refused or
    /// broken connection is one too (UNAVAILABLE, or UNKNOWN with the I/O error down its
    /// source chain).
    GRpcStatus(tonic::Status),
    /// A watch stream could not take a request, or ended before it began.
    Watch(String),
    /// A keep-alive stream could not take a request, or the lease is not found.
    LeaseKeepAlive(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::InvalidArgs(e) => write!(f, "invalid arguments: {e}"),
            Error::InvalidUri(e) => write!(f, "invalid uri: {e}"),
            Error::GRpcStatus(e) => write!(f, "grpc request error: {e}"),
            Error::Watch(e) => write!(f, "watch error: {e}"),
            Error::LeaseKeepAlive(e) => write!(f, "lease keep alive error: {e}"),
        }
    }
}

// No `source`: as `etcd-client`'s error, so that a chain printed from baton's `Error` reads the
// same. The backend looks inside a status itself (`root_cause`, `has_io_source`).
impl std::error::Error for Error {}

impl From<tonic::Status> for Error {
    fn from(status: tonic::Status) -> Error {
        Error::GRpcStatus(status)
    }
}

pub(crate) type Result<T> = std::result::Result<T, Error>;

/// How to reach the endpoints.
#[derive(Debug, Clone, Default)]
pub(crate) struct ConnectOptions {
    connect_timeout: Option<Duration>,
    /// HTTP/2 ping interval and the wait for its answer.
    keep_alive: Option<(Duration, Duration)>,
    keep_alive_while_idle: bool,
}

impl ConnectOptions {
    pub(crate) fn new() -> ConnectOptions {
        ConnectOptions::default()
    }

    /// Bound on establishing a connection to an endpoint.
    pub(crate) fn with_connect_timeout(mut self, timeout: Duration) -> ConnectOptions {
        self.connect_timeout = Some(timeout);
        self
    }

    /// HTTP/2 pings every `interval`; a connection whose ping goes unanswered for `timeout`
    /// is closed.
    pub(crate) fn with_keep_alive(mut self, interval: Duration, timeout: Duration) -> Self {
        self.keep_alive = Some((interval, timeout));
        self
    }

    /// Whether to ping while no stream is open.
    pub(crate) fn with_keep_alive_while_idle(mut self, enabled: bool) -> ConnectOptions {
        self.keep_alive_while_idle = enabled;
        self
    }
}

/// Where a pinned client's requests go: an endpoint, and how many of its checks had failed
/// when the pin was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pin {
    pub(crate) index: usize,
    failures: u64,
}

/// A connection to an etcd cluster: one channel balanced over its endpoints, cheap to clone.
#[derive(Clone)]
pub(crate) struct Client {
    kv: KvClient<Channel>,
    watch: WatchClient<Channel>,
    lease: LeaseClient<Channel>,
    /// With several endpoints, which of them answer (requests go only to those).
    endpoints: Option<Endpoints>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

impl Client {
    /// A client for `endpoints` (`host:port`, or URLs with `http://`). Connecting to one
    /// endpoint is lazy: the first request connects, and an unreachable server shows there.
    /// Several endpoints are checked in the background (`endpoints.rs`), and requests go only
    /// to those that answer for the client's cluster; [`Client::ready`] waits for the first
    /// checks. Needs a tokio runtime.
    pub(crate) fn connect<E: AsRef<str>, S: AsRef<[E]>>(
        endpoints: S,
        options: Option<ConnectOptions>,
    ) -> Result<Client> {
        let options = options.unwrap_or_default();
        let names: Vec<String> = endpoints
            .as_ref()
            .iter()
            .map(|e| e.as_ref().to_string())
            .collect();
        let endpoints = names
            .iter()
            .map(|endpoint| build_endpoint(endpoint, &options))
            .collect::<Result<Vec<_>>>()?;
        let (channel, checked) = match endpoints.len() {
            0 => return Err(Error::InvalidArgs(String::from("empty endpoints"))),
            // Balanced even over one endpoint, as `etcd-client` does: a broken connection is
            // re-established in the background.
            1 => (Channel::balance_list(endpoints.into_iter()), None),
            n => {
                let (channel, changes) = Channel::balance_channel(n);
                let checked = Endpoints::start(names, endpoints, changes);
                (channel, Some(checked))
            }
        };
        Ok(Client {
            kv: KvClient::new(channel.clone()),
            watch: WatchClient::new(channel.clone()),
            lease: LeaseClient::new(channel),
            endpoints: checked,
        })
    }

    /// With several endpoints: waits (up to `limit`) until each was checked once; refuses
    /// when none answers or they answer for different clusters. Nothing to wait for with one.
    pub(crate) async fn ready(&self, limit: Duration) -> std::result::Result<(), NotReady> {
        match &self.endpoints {
            Some(endpoints) => endpoints.ready(limit).await,
            None => Ok(()),
        }
    }

    /// For a long-lived stream: a client whose requests all go to one endpoint that answers
    /// (another than `avoid`, if another does), and that endpoint's index. With one endpoint,
    /// or none answering, this client as it is and `None`.
    pub(crate) fn pinned(&self, avoid: Option<usize>) -> (Client, Option<Pin>) {
        let Some((index, channel)) = self.endpoints.as_ref().and_then(|e| e.pick(avoid)) else {
            return (self.clone(), None);
        };
        self.pinned_to(index, channel)
    }

    fn pinned_to(&self, index: usize, channel: Channel) -> (Client, Option<Pin>) {
        let failures = self.endpoints.as_ref().map_or(0, |e| e.failures(index));
        (self.on(channel), Some(Pin { index, failures }))
    }

    /// This client's requests sent over `channel` instead.
    fn on(&self, channel: Channel) -> Client {
        Client {
            kv: KvClient::new(channel.clone()),
            watch: WatchClient::new(channel.clone()),
            lease: LeaseClient::new(channel),
            endpoints: self.endpoints.clone(),
        }
    }

    /// [`Client::pinned`] for a stream that went silent on endpoint `avoid`: the first
    /// endpoint to answer a read now (each asked at once, `avoid` too, for up to `limit`; see
    /// [`Endpoints::fastest`]), else as [`Client::pinned`]. With no `avoid` (nothing went
    /// silent yet), as [`Client::pinned`].
    pub(crate) async fn pinned_elsewhere(
        &self,
        avoid: Option<usize>,
        limit: Duration,
    ) -> (Client, Option<Pin>) {
        if let (Some(endpoints), Some(_)) = (&self.endpoints, avoid) {
            if let Some((index, channel)) = endpoints.fastest(limit).await {
                return self.pinned_to(index, channel);
            }
        }
        self.pinned(avoid)
    }

    /// With several endpoints, a client whose requests go to the endpoint that answers a read
    /// first now (each asked at once, for up to `limit`; see [`Endpoints::fastest`]). `None`
    /// with one endpoint, or when none answers.
    pub(crate) async fn fastest(&self, limit: Duration) -> Option<Client> {
        let (_, channel) = self.endpoints.as_ref()?.fastest(limit).await?;
        Some(self.on(channel))
    }

    /// Resolves once the endpoint of `pin` (from [`Client::pinned`]) fails a check after
    /// the pin was made, with its name; never for `None`.
    pub(crate) async fn left(&self, pin: Option<Pin>) -> String {
        match (&self.endpoints, pin) {
            (Some(endpoints), Some(pin)) => {
                endpoints.left(pin.index, pin.failures).await;
                endpoints.name(pin.index)
            }
            _ => std::future::pending().await,
        }
    }

    /// Fails a request at once when no endpoint answers, rather than let it wait in the
    /// channel for one to come back.
    fn any_serving(&self) -> Result<()> {
        match self.endpoints.as_ref().and_then(Endpoints::none_serving) {
            Some(reason) => Err(Error::GRpcStatus(tonic::Status::unavailable(reason))),
            None => Ok(()),
        }
    }

    /// The keys `key` names (with `options`, a range).
    pub(crate) async fn get(
        &mut self,
        key: impl Into<Vec<u8>>,
        options: Option<GetOptions>,
    ) -> Result<GetResponse> {
        self.any_serving()?;
        let request = options.unwrap_or_default().request(key.into());
        let response = self.kv.range(request).await?.into_inner();
        Ok(GetResponse::from(response))
    }

    /// One transaction.
    pub(crate) async fn txn(&mut self, txn: Txn) -> Result<TxnResponse> {
        self.any_serving()?;
        let response = self.kv.txn(txn.request).await?.into_inner();
        Ok(TxnResponse::from(response))
    }

    /// Opens a watch stream with one watch on `key`; more go through its request sender.
    pub(crate) async fn watch(
        &mut self,
        key: impl Into<Vec<u8>>,
        options: Option<WatchOptions>,
    ) -> Result<WatchStream> {
        self.any_serving()?;
        let (sender, receiver) = mpsc::channel(STREAM_QUEUE);
        let mut sender = WatchRequestSender { sender };
        sender.watch(key, options).await?;
        let responses = self
            .watch
            .watch(ReceiverStream::new(receiver))
            .await?
            .into_inner();
        Ok(WatchStream {
            sender,
            responses: WatchResponseStream { responses },
        })
    }

    /// Grants a lease of `ttl` seconds (the server picks its id).
    pub(crate) async fn lease_grant(&mut self, ttl: i64) -> Result<LeaseGrantResponse> {
        self.any_serving()?;
        let request = pb::LeaseGrantRequest { ttl, id: 0 };
        let response = self.lease.lease_grant(request).await?.into_inner();
        Ok(LeaseGrantResponse(response))
    }

    /// Revokes lease `id` (its keys go with it).
    pub(crate) async fn lease_revoke(&mut self, id: i64) -> Result<()> {
        self.any_serving()?;
        let request = pb::LeaseRevokeRequest { id };
        self.lease.lease_revoke(request).await?;
        Ok(())
    }

    /// Opens a keep-alive stream for lease `id` and renews it once, waiting for the answer: the
    /// TTL it gives, or [`Error::LeaseKeepAlive`] if the server no longer knows the lease (TTL
    /// ≤ 0), as `etcd-client` reports it. Later renewals go through the keeper, their answers
    /// come on the stream.
    pub(crate) async fn lease_keep_alive(
        &mut self,
        id: i64,
    ) -> Result<(LeaseKeeper, LeaseKeepAliveStream, Duration)> {
        self.any_serving()?;
        let (sender, receiver) = mpsc::channel(STREAM_QUEUE);
        let mut keeper = LeaseKeeper { id, sender };
        keeper.keep_alive().await?;
        let mut responses = self
            .lease
            .lease_keep_alive(ReceiverStream::new(receiver))
            .await?
            .into_inner();
        match responses.message().await? {
            Some(response) if response.ttl <= 0 => {
                Err(Error::LeaseKeepAlive("lease not found".to_string()))
            }
            Some(response) => Ok((
                keeper,
                LeaseKeepAliveStream { responses },
                Duration::from_secs(response.ttl as u64),
            )),
            None => Err(Error::Watch("failed to create lease keeper".to_string())),
        }
    }
}

fn build_endpoint(endpoint: &str, options: &ConnectOptions) -> Result<Endpoint> {
    let url = if endpoint.starts_with("http://") {
        endpoint.to_string()
    } else {
        format!("http://{endpoint}")
    };
    let uri: Uri = url
        .parse()
        .map_err(|error: <Uri as std::str::FromStr>::Err| Error::InvalidUri(error.to_string()))?;
    let mut endpoint = Channel::builder(uri);
    if let Some((interval, timeout)) = options.keep_alive {
        endpoint = endpoint
            .keep_alive_while_idle(options.keep_alive_while_idle)
            .http2_keep_alive_interval(interval)
            .keep_alive_timeout(timeout);
    }
    if let Some(timeout) = options.connect_timeout {
        endpoint = endpoint.connect_timeout(timeout);
    }
    Ok(endpoint)
}

/// The end of the range of keys starting with `prefix` (etcd's convention: `\0` when every key
/// does, that is, when no key is greater than all keys with the prefix).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    for (i, byte) in prefix.iter().enumerate().rev() {
        if *byte < 0xff {
            let mut end = prefix[..=i].to_vec();
            end[i] = byte + 1;
            return end;
        }
    }
    vec![0]
}

/// `key` and the end of its range: the single key, or every key it prefixes.
fn key_range(key: Vec<u8>, prefix: bool) -> (Vec<u8>, Vec<u8>) {
    if !prefix {
        (key, Vec::new())
    } else if key.is_empty() {
        (vec![0], vec![0])
    } else {
        let end = prefix_end(&key);
        (key, end)
    }
}

/// What to sort a range by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SortTarget {
    Create,
}

/// Which way to sort a range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SortOrder {
    Ascend,
    Descend,
}

/// A range read's options.
#[derive(Debug, Clone, Default)]
pub(crate) struct GetOptions {
    request: pb::RangeRequest,
    prefix: bool,
}

impl GetOptions {
    pub(crate) fn new() -> GetOptions {
        GetOptions::default()
    }

    /// Every key starting with the key.
    pub(crate) fn with_prefix(mut self) -> GetOptions {
        self.prefix = true;
        self
    }

    pub(crate) fn with_sort(mut self, target: SortTarget, order: SortOrder) -> GetOptions {
        use pb::range_request::{SortOrder as Order, SortTarget as Target};
        self.request.sort_target = match target {
            SortTarget::Create => Target::Create,
        } as i32;
        self.request.sort_order = match order {
            SortOrder::Ascend => Order::Ascend,
            SortOrder::Descend => Order::Descend,
        } as i32;
        self
    }

    /// At most `limit` keys (0: no limit).
    pub(crate) fn with_limit(mut self, limit: i64) -> GetOptions {
        self.request.limit = limit;
        self
    }

    /// Keys without their values.
    pub(crate) fn with_keys_only(mut self) -> GetOptions {
        self.request.keys_only = true;
        self
    }

    /// Only the number of keys.
    pub(crate) fn with_count_only(mut self) -> GetOptions {
        self.request.count_only = true;
        self
    }

    /// Answered from the member's own store, without asking the Raft leader (a member that
    /// hangs still cannot answer; one in a leader election still can).
    pub(crate) fn with_serializable(mut self) -> GetOptions {
        self.request.serializable = true;
        self
    }

    /// Only keys created at or before `revision`.
    pub(crate) fn with_max_create_revision(mut self, revision: i64) -> GetOptions {
        self.request.max_create_revision = revision;
        self
    }

    fn request(self, key: Vec<u8>) -> pb::RangeRequest {
        let (key, range_end) = key_range(key, self.prefix);
        pb::RangeRequest {
            key,
            range_end,
            ..self.request
        }
    }
}

/// A put's options.
#[derive(Debug, Clone, Default)]
pub(crate) struct PutOptions {
    lease: i64,
}

impl PutOptions {
    pub(crate) fn new() -> PutOptions {
        PutOptions::default()
    }

    /// Binds the key to lease `id`.
    pub(crate) fn with_lease(mut self, id: i64) -> PutOptions {
        self.lease = id;
        self
    }
}

/// A delete's options (none yet: the single key).
#[derive(Debug, Clone, Default)]
pub(crate) struct DeleteOptions {}

/// A key's state in a response.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct KeyValue(mvccpb::KeyValue);

impl KeyValue {
    pub(crate) fn key(&self) -> &[u8] {
        &self.0.key
    }

    pub(crate) fn value(&self) -> &[u8] {
        &self.0.value
    }

    /// The revision of the key's last creation.
    pub(crate) fn create_revision(&self) -> i64 {
        self.0.create_revision
    }

    /// The revision of the key's last modification.
    pub(crate) fn mod_revision(&self) -> i64 {
        self.0.mod_revision
    }

    /// The lease the key is bound to (0: none).
    pub(crate) fn lease(&self) -> i64 {
        self.0.lease
    }
}

/// The header of every response.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ResponseHeader(pb::ResponseHeader);

impl ResponseHeader {
    /// The store's revision when the request was served.
    pub(crate) fn revision(&self) -> i64 {
        self.0.revision
    }
}

/// A range read's answer.
#[derive(Debug, Clone)]
pub(crate) struct GetResponse {
    header: Option<ResponseHeader>,
    kvs: Vec<KeyValue>,
}

impl GetResponse {
    pub(crate) fn header(&self) -> Option<&ResponseHeader> {
        self.header.as_ref()
    }

    pub(crate) fn kvs(&self) -> &[KeyValue] {
        &self.kvs
    }
}

impl From<pb::RangeResponse> for GetResponse {
    fn from(response: pb::RangeResponse) -> GetResponse {
        GetResponse {
            header: response.header.map(ResponseHeader),
            kvs: response.kvs.into_iter().map(KeyValue).collect(),
        }
    }
}

/// How a [`Compare`] compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CompareOp {
    Equal,
}

/// One condition of a transaction.
#[derive(Debug, Clone)]
pub(crate) struct Compare(pb::Compare);

impl Compare {
    fn new(
        key: impl Into<Vec<u8>>,
        op: CompareOp,
        target: pb::compare::CompareTarget,
        value: pb::compare::TargetUnion,
    ) -> Compare {
        let result = match op {
            CompareOp::Equal => pb::compare::CompareResult::Equal,
        };
        Compare(pb::Compare {
            result: result as i32,
            target: target as i32,
            key: key.into(),
            target_union: Some(value),
            range_end: Vec::new(),
        })
    }

    /// On the key's create revision (0: the key does not exist).
    pub(crate) fn create_revision(key: impl Into<Vec<u8>>, op: CompareOp, revision: i64) -> Self {
        use pb::compare::{CompareTarget, TargetUnion};
        Compare::new(
            key,
            op,
            CompareTarget::Create,
            TargetUnion::CreateRevision(revision),
        )
    }

    /// On the key's mod revision.
    pub(crate) fn mod_revision(key: impl Into<Vec<u8>>, op: CompareOp, revision: i64) -> Self {
        use pb::compare::{CompareTarget, TargetUnion};
        Compare::new(
            key,
            op,
            CompareTarget::Mod,
            TargetUnion::ModRevision(revision),
        )
    }

    /// On the key's value (false for an absent key).
    pub(crate) fn value(
        key: impl Into<Vec<u8>>,
        op: CompareOp,
        value: impl Into<Vec<u8>>,
    ) -> Compare {
        use pb::compare::{CompareTarget, TargetUnion};
        Compare::new(
            key,
            op,
            CompareTarget::Value,
            TargetUnion::Value(value.into()),
        )
    }

    /// On the key's lease (0: none).
    pub(crate) fn lease(key: impl Into<Vec<u8>>, op: CompareOp, lease: i64) -> Compare {
        use pb::compare::{CompareTarget, TargetUnion};
        Compare::new(key, op, CompareTarget::Lease, TargetUnion::Lease(lease))
    }
}

/// One operation of a transaction.
#[derive(Debug, Clone)]
pub(crate) struct TxnOp(pb::request_op::Request);

impl TxnOp {
    pub(crate) fn put(
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        options: Option<PutOptions>,
    ) -> TxnOp {
        let options = options.unwrap_or_default();
        TxnOp(pb::request_op::Request::RequestPut(pb::PutRequest {
            key: key.into(),
            value: value.into(),
            lease: options.lease,
            ..pb::PutRequest::default()
        }))
    }

    pub(crate) fn get(key: impl Into<Vec<u8>>, options: Option<GetOptions>) -> TxnOp {
        let request = options.unwrap_or_default().request(key.into());
        TxnOp(pb::request_op::Request::RequestRange(request))
    }

    pub(crate) fn delete(key: impl Into<Vec<u8>>, _options: Option<DeleteOptions>) -> TxnOp {
        TxnOp(pb::request_op::Request::RequestDeleteRange(
            pb::DeleteRangeRequest {
                key: key.into(),
                ..pb::DeleteRangeRequest::default()
            },
        ))
    }

    /// A transaction nested in this one.
    pub(crate) fn txn(txn: Txn) -> TxnOp {
        TxnOp(pb::request_op::Request::RequestTxn(txn.request))
    }
}

fn ops(ops: impl IntoIterator<Item = TxnOp>) -> Vec<pb::RequestOp> {
    ops.into_iter()
        .map(|op| pb::RequestOp {
            request: Some(op.0),
        })
        .collect()
}

/// A transaction: if every compare holds, the `and_then` operations, else the `or_else` ones.
#[derive(Debug, Clone, Default)]
pub(crate) struct Txn {
    request: pb::TxnRequest,
}

impl Txn {
    pub(crate) fn new() -> Txn {
        Txn::default()
    }

    pub(crate) fn when(mut self, compares: impl IntoIterator<Item = Compare>) -> Txn {
        self.request.compare = compares.into_iter().map(|compare| compare.0).collect();
        self
    }

    pub(crate) fn and_then(mut self, operations: impl IntoIterator<Item = TxnOp>) -> Txn {
        self.request.success = ops(operations);
        self
    }

    pub(crate) fn or_else(mut self, operations: impl IntoIterator<Item = TxnOp>) -> Txn {
        self.request.failure = ops(operations);
        self
    }
}

/// The answer to one operation of a transaction.
#[derive(Debug, Clone)]
pub(crate) enum TxnOpResponse {
    Put,
    Get(GetResponse),
    Delete,
    Txn(TxnResponse),
}

/// A transaction's answer.
#[derive(Debug, Clone)]
pub(crate) struct TxnResponse {
    header: Option<ResponseHeader>,
    succeeded: bool,
    responses: Vec<TxnOpResponse>,
}

impl TxnResponse {
    pub(crate) fn header(&self) -> Option<&ResponseHeader> {
        self.header.as_ref()
    }

    /// Whether every compare held (the `and_then` branch ran).
    pub(crate) fn succeeded(&self) -> bool {
        self.succeeded
    }

    /// The answers of the branch that ran, in order.
    pub(crate) fn op_responses(&self) -> &[TxnOpResponse] {
        &self.responses
    }
}

impl From<pb::TxnResponse> for TxnResponse {
    fn from(response: pb::TxnResponse) -> TxnResponse {
        use pb::response_op::Response;
        TxnResponse {
            header: response.header.map(ResponseHeader),
            succeeded: response.succeeded,
            responses: response
                .responses
                .into_iter()
                // An empty answer (no known operation) is left out, where `etcd-client`
                // panicked.
                .filter_map(|op| op.response)
                .map(|op| match op {
                    Response::ResponsePut(_) => TxnOpResponse::Put,
                    Response::ResponseRange(get) => TxnOpResponse::Get(get.into()),
                    Response::ResponseDeleteRange(_) => TxnOpResponse::Delete,
                    Response::ResponseTxn(txn) => TxnOpResponse::Txn(txn.into()),
                })
                .collect(),
        }
    }
}

/// Events a watch leaves out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WatchFilterType {
    /// No puts.
    NoPut,
}

/// A watch's options.
#[derive(Debug, Clone, Default)]
pub(crate) struct WatchOptions {
    request: pb::WatchCreateRequest,
    prefix: bool,
}

impl WatchOptions {
    pub(crate) fn new() -> WatchOptions {
        WatchOptions::default()
    }

    /// Every key starting with the key.
    pub(crate) fn with_prefix(mut self) -> WatchOptions {
        self.prefix = true;
        self
    }

    /// Events carry the key's previous state.
    pub(crate) fn with_prev_key(mut self) -> WatchOptions {
        self.request.prev_kv = true;
        self
    }

    /// Events from `revision` on (history included).
    pub(crate) fn with_start_revision(mut self, revision: i64) -> WatchOptions {
        self.request.start_revision = revision;
        self
    }

    /// The watch's id, chosen by the client (0: the server picks one).
    pub(crate) fn with_watch_id(mut self, id: i64) -> WatchOptions {
        self.request.watch_id = id;
        self
    }

    pub(crate) fn with_filters(
        mut self,
        filters: impl IntoIterator<Item = WatchFilterType>,
    ) -> WatchOptions {
        use pb::watch_create_request::FilterType;
        self.request.filters = filters
            .into_iter()
            .map(|filter| match filter {
                WatchFilterType::NoPut => FilterType::Noput as i32,
            })
            .collect();
        self
    }

    /// baton server's queue check (etcd ignores it): with the watched key's deletion, the
    /// server says whether `own_key`, created at `own_create_revision`, is then the oldest key
    /// under `scope` (see [`WatchResponse::first_at`]).
    pub(crate) fn with_queue_check(
        mut self,
        own_key: Vec<u8>,
        own_create_revision: i64,
        scope: Vec<u8>,
    ) -> WatchOptions {
        let scope_range_end = prefix_end(&scope);
        self.request.baton_queue_check = Some(pb::QueueCheck {
            own_key,
            own_create_revision,
            scope_key: scope,
            scope_range_end,
        });
        self
    }

    fn request(self, key: Vec<u8>) -> pb::WatchRequest {
        let (key, range_end) = key_range(key, self.prefix);
        let create = pb::WatchCreateRequest {
            key,
            range_end,
            ..self.request
        };
        pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CreateRequest(create)),
        }
    }
}

/// An open watch stream: send more requests on it, read its responses.
pub(crate) struct WatchStream {
    sender: WatchRequestSender,
    responses: WatchResponseStream,
}

impl WatchStream {
    /// The next response; `None` once the server ended the stream.
    pub(crate) async fn message(&mut self) -> Result<Option<WatchResponse>> {
        self.responses.message().await
    }

    /// The request side and the response side, to be used apart.
    pub(crate) fn split(self) -> (WatchRequestSender, WatchResponseStream) {
        (self.sender, self.responses)
    }
}

/// The request side of a watch stream.
pub(crate) struct WatchRequestSender {
    sender: mpsc::Sender<pb::WatchRequest>,
}

impl WatchRequestSender {
    async fn send(&mut self, request: pb::WatchRequest) -> Result<()> {
        self.sender
            .send(request)
            .await
            .map_err(|error| Error::Watch(error.to_string()))
    }

    /// Adds a watch on `key` to the stream.
    pub(crate) async fn watch(
        &mut self,
        key: impl Into<Vec<u8>>,
        options: Option<WatchOptions>,
    ) -> Result<()> {
        let request = options.unwrap_or_default().request(key.into());
        self.send(request).await
    }

    /// Cancels watch `id` at the server.
    pub(crate) async fn cancel(&mut self, id: i64) -> Result<()> {
        let cancel = pb::WatchCancelRequest { watch_id: id };
        self.send(pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CancelRequest(cancel)),
        })
        .await
    }
}

/// The response side of a watch stream.
pub(crate) struct WatchResponseStream {
    responses: Streaming<pb::WatchResponse>,
}

impl WatchResponseStream {
    /// The next response; `None` once the server ended the stream.
    pub(crate) async fn message(&mut self) -> Result<Option<WatchResponse>> {
        Ok(self.responses.message().await?.map(WatchResponse::from))
    }
}

/// What happened to a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventType {
    Put,
    Delete,
}

/// One change of one key.
#[derive(Debug, Clone)]
pub(crate) struct Event {
    event_type: EventType,
    kv: Option<KeyValue>,
    prev_kv: Option<KeyValue>,
}

impl Event {
    pub(crate) fn event_type(&self) -> EventType {
        self.event_type
    }

    /// After a put, the key; after a delete, the key with the deletion's revision.
    pub(crate) fn kv(&self) -> Option<&KeyValue> {
        self.kv.as_ref()
    }

    /// The key before the event, if the watch asked for it.
    pub(crate) fn prev_kv(&self) -> Option<&KeyValue> {
        self.prev_kv.as_ref()
    }
}

impl From<mvccpb::Event> for Event {
    fn from(event: mvccpb::Event) -> Event {
        // etcd knows two event types; an unknown number (which `etcd-client` panicked on) is
        // taken for a put, which never fires a deletion watch.
        let event_type = if event.r#type == mvccpb::event::EventType::Delete as i32 {
            EventType::Delete
        } else {
            EventType::Put
        };
        Event {
            event_type,
            kv: event.kv.map(KeyValue),
            prev_kv: event.prev_kv.map(KeyValue),
        }
    }
}

/// One message of a watch stream: events of one watch, or news of the watch itself.
#[derive(Debug, Clone)]
pub(crate) struct WatchResponse {
    watch_id: i64,
    canceled: bool,
    events: Vec<Event>,
    first_at: i64,
}

impl WatchResponse {
    pub(crate) fn watch_id(&self) -> i64 {
        self.watch_id
    }

    /// The server ended this watch (its history was compacted, say).
    pub(crate) fn canceled(&self) -> bool {
        self.canceled
    }

    pub(crate) fn events(&self) -> &[Event] {
        &self.events
    }

    /// The revision at which baton server found the watch's queue check to hold (after the
    /// deletion in this response, the client's own entry is first); `None` from etcd, which
    /// knows no such check, and whenever it did not hold.
    pub(crate) fn first_at(&self) -> Option<i64> {
        (self.first_at > 0).then_some(self.first_at)
    }
}

impl From<pb::WatchResponse> for WatchResponse {
    fn from(response: pb::WatchResponse) -> WatchResponse {
        WatchResponse {
            watch_id: response.watch_id,
            canceled: response.canceled,
            events: response.events.into_iter().map(Event::from).collect(),
            first_at: response.baton_first_at,
        }
    }
}

/// A lease grant's answer.
#[derive(Debug, Clone)]
pub(crate) struct LeaseGrantResponse(pb::LeaseGrantResponse);

impl LeaseGrantResponse {
    /// The lease's id.
    pub(crate) fn id(&self) -> i64 {
        self.0.id
    }

    /// The granted TTL in seconds.
    pub(crate) fn ttl(&self) -> i64 {
        self.0.ttl
    }
}

/// Sends renewals of one lease on its keep-alive stream.
pub(crate) struct LeaseKeeper {
    id: i64,
    sender: mpsc::Sender<pb::LeaseKeepAliveRequest>,
}

impl LeaseKeeper {
    /// Sends one renewal; its answer comes on the [`LeaseKeepAliveStream`].
    pub(crate) async fn keep_alive(&mut self) -> Result<()> {
        self.sender
            .send(pb::LeaseKeepAliveRequest { id: self.id })
            .await
            .map_err(|error| Error::LeaseKeepAlive(error.to_string()))
    }
}

/// The answers to a lease's renewals.
pub(crate) struct LeaseKeepAliveStream {
    responses: Streaming<pb::LeaseKeepAliveResponse>,
}

impl LeaseKeepAliveStream {
    /// The next answer; `None` once the server ended the stream.
    pub(crate) async fn message(&mut self) -> Result<Option<LeaseKeepAliveResponse>> {
        Ok(self.responses.message().await?.map(LeaseKeepAliveResponse))
    }
}

/// A renewal's answer.
#[derive(Debug, Clone)]
pub(crate) struct LeaseKeepAliveResponse(pb::LeaseKeepAliveResponse);

impl LeaseKeepAliveResponse {
    /// The renewed TTL in seconds; 0 or less when the lease does not exist (any more).
    pub(crate) fn ttl(&self) -> i64 {
        self.0.ttl
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ranges_follow_etcd() {
        assert_eq!(key_range(b"a/b".to_vec(), false), (b"a/b".to_vec(), vec![]));
        assert_eq!(
            key_range(b"a/".to_vec(), true),
            (b"a/".to_vec(), b"a0".to_vec())
        );
        assert_eq!(
            key_range(vec![b'a', 0xff], true),
            (vec![b'a', 0xff], vec![b'b'])
        );
        assert_eq!(
            key_range(vec![0xff, 0xff], true),
            (vec![0xff, 0xff], vec![0])
        );
        assert_eq!(key_range(Vec::new(), true), (vec![0], vec![0]));
    }

    #[test]
    fn errors_read_as_before() {
        let status = Error::GRpcStatus(tonic::Status::new(tonic::Code::Unavailable, "down"));
        assert!(
            status.to_string().starts_with("grpc request error: "),
            "{status}"
        );
        assert_eq!(
            Error::LeaseKeepAlive("lease not found".into()).to_string(),
            "lease keep alive error: lease not found"
        );
        assert!(Client::connect(Vec::<String>::new(), None).is_err());
        assert!(matches!(
            Client::connect(["bad host:1"], None),
            Err(Error::InvalidUri(_))
        ));
    }
}
