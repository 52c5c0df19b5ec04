//! The etcd v3 gRPC services: KV, Lease, Watch, Cluster (MemberList) and Maintenance (Status).
//!
//! Writes go through the Raft log ([`Node::propose`]); reads are served from the applied store
//! after a read-index check (or at once when the client asked for a serializable read). Errors
//! carry etcd's gRPC codes and messages, so that etcd's clients recognise them.

use std::pin::Pin;
use std::sync::Arc;

use futures_util::Stream;
use prost::Message;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt as _;
use tonic::{Request, Response, Status, Streaming};

use crate::node::Node;
use crate::proto::etcdserverpb::cluster_server::{Cluster, ClusterServer};
use crate::proto::etcdserverpb::kv_server::{Kv, KvServer};
use crate::proto::etcdserverpb::lease_server::{Lease, LeaseServer};
use crate::proto::etcdserverpb::maintenance_server::{Maintenance, MaintenanceServer};
use crate::proto::etcdserverpb::watch_request::RequestUnion;
use crate::proto::etcdserverpb::watch_server::{Watch, WatchServer};
use crate::proto::etcdserverpb::*;
use crate::raft::{lock, Reply};
use crate::store::{Command, CommandResponse, StoreError};
use crate::watch::{self, stream_queue, StreamSink, WatcherId};

/// etcd's limit on one request (`--max-request-bytes` default).
pub const MAX_REQUEST_BYTES: usize = 1536 * 1024;
/// What gRPC accepts before a request is refused: the request limit plus etcd's allowance for
/// framing, so that an oversized request gets etcd's own "request is too large" answer.
const MAX_MESSAGE_BYTES: usize = MAX_REQUEST_BYTES + 512 * 1024;
/// What `Maintenance.Status` reports as the version: the etcd API this server speaks, with
/// baton's own version as build metadata (semver: it ranks equal to 3.4.0, where a pre-release
/// "-baton" would rank below it).
pub const VERSION: &str = concat!("3.4.0+baton.", env!("CARGO_PKG_VERSION"));

/// Serves every service on `listener` until `shutdown` completes.
pub async fn serve(
    node: Arc<Node>,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let service = Service { node };
    // tonic applies its TCP options only to sockets it accepts itself: without TCP_NODELAY,
    // a small response (a watch event, a txn's answer) can wait for a delayed ACK (~40 ms).
    let incoming = TcpListenerStream::new(listener).map(|accepted| {
        accepted.and_then(|stream| {
            stream.set_nodelay(true)?;
            Ok(stream)
        })
    });
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(service.node.config.keepalive_interval))
        .http2_keepalive_timeout(Some(service.node.config.keepalive_timeout))
        .layer(tower::util::MapResponseLayer::new(answer_as_grpc_go))
        .add_service(KvServer::new(service.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES))
        .add_service(LeaseServer::new(service.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES))
        .add_service(WatchServer::new(service.clone()).max_decoding_message_size(MAX_MESSAGE_BYTES))
        .add_service(ClusterServer::new(service.clone()))
        .add_service(MaintenanceServer::new(service))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

/// What an RPC outside the served subset is told (tonic's own answer has no message).
const UNIMPLEMENTED: &str = "baton server does not implement this RPC: it serves the part of \
    the etcd v3 API that leases, elections and locks use (KV, Watch, Lease, Cluster.MemberList, \
    Maintenance.Status)";

/// tonic's answers where etcd's server (gRPC-Go) answers otherwise, in the status of a call
/// refused before it reached a service:
/// - a bare `Unimplemented` (a method or service of etcd's API that is not served here:
///   defragment, alarms, auth...) gets a message that says so;
/// - a request larger than gRPC accepts gets gRPC-Go's `ResourceExhausted` and its message,
///   where tonic says `OutOfRange` (the code etcd uses for compacted revisions).
fn answer_as_grpc_go(
    mut response: http::Response<tonic::body::Body>,
) -> http::Response<tonic::body::Body> {
    let headers = response.headers_mut();
    let Some(status) = Status::from_header_map(headers) else {
        return response;
    };
    let answer = match status.code() {
        tonic::Code::Unimplemented if status.message().is_empty() => {
            Status::unimplemented(UNIMPLEMENTED)
        }
        tonic::Code::OutOfRange => match too_large_as_grpc_go(status.message()) {
            Some(message) => Status::resource_exhausted(message),
            None => return response,
        },
        _ => return response,
    };
    // Only the code and message headers change; an answer that cannot be a header stays
    // tonic's.
    let _ = answer.add_header(headers);
    response
}

/// gRPC-Go's words for tonic's "decoded message length too large"; `None` for any other
/// message.
fn too_large_as_grpc_go(tonic_message: &str) -> Option<String> {
    let rest = tonic_message
        .strip_prefix("Error, decoded message length too large: found ")?
        .strip_suffix(" bytes")?;
    let (found, limit) = rest.split_once(" bytes, the limit is: ")?;
    Some(format!(
        "grpc: received message larger than max ({found} vs. {limit})"
    ))
}

#[derive(Clone)]
struct Service {
    node: Arc<Node>,
}

/// etcd's gRPC status for a store rejection.
pub fn status(error: &StoreError) -> Status {
    use tonic::Code;
    let code = match error {
        StoreError::KeyNotProvided
        | StoreError::DuplicateKey
        | StoreError::TooManyOperations
        | StoreError::KeyNotFound
        | StoreError::ValueProvided
        | StoreError::LeaseProvided
        | StoreError::InvalidSortOption
        | StoreError::InvalidCompare
        | StoreError::TxnTooDeep => Code::InvalidArgument,
        StoreError::LeaseNotFound => Code::NotFound,
        StoreError::LeaseExists => Code::FailedPrecondition,
        StoreError::LeaseTtlTooLarge => Code::OutOfRange,
        StoreError::Compacted { .. } | StoreError::FutureRevision => Code::OutOfRange,
        StoreError::NoSpace => Code::ResourceExhausted,
    };
    Status::new(code, error.to_string())
}

fn too_large(command: &Command) -> Result<(), Status> {
    let size = match command {
        Command::Put(r) => r.encoded_len(),
        Command::DeleteRange(r) => r.encoded_len(),
        Command::Txn(r) => r.encoded_len(),
        _ => 0,
    };
    if size > MAX_REQUEST_BYTES {
        return Err(Status::invalid_argument("etcdserver: request is too large"));
    }
    Ok(())
}

impl Service {
    /// Proposes `command` and returns its response with a header at the revision it made.
    async fn write(&self, command: Command) -> Result<(CommandResponse, ResponseHeader), Status> {
        too_large(&command)?;
        // What is wrong whatever the state never takes a place in the log.
        {
            let mut core = lock(&self.node.core);
            core.store.precheck(&command).map_err(|e| status(&e))?;
            core.store
                .check_quota(&command, self.node.config.quota_bytes)
                .map_err(|e| status(&e))?;
        }
        let Reply { revision, result } = self.node.propose(command).await?;
        let response = result
            .ok_or_else(|| Status::internal("a command gave no result"))?
            .map_err(|e| status(&e))?;
        let header = lock(&self.node.core).header(revision);
        Ok((response, header))
    }
}

/// Proposes a command and answers with its response (of the given variant), headed.
macro_rules! respond {
    ($service:expr, $command:expr, $variant:ident) => {
        match $service.write($command).await? {
            (CommandResponse::$variant(mut response), header) => {
                response.header = Some(header);
                Ok(Response::new(response))
            }
            (other, _) => Err(unexpected(&other)),
        }
    };
}

fn unexpected(response: &CommandResponse) -> Status {
    Status::internal(format!(
        "a command gave an unexpected response: {response:?}"
    ))
}

#[tonic::async_trait]
impl Kv for Service {
    async fn range(
        &self,
        request: Request<RangeRequest>,
    ) -> Result<Response<RangeResponse>, Status> {
        let request = request.into_inner();
        if !request.serializable {
            self.node.linearizable().await?;
        }
        let core = lock(&self.node.core);
        let mut response = core.store.range(&request).map_err(|e| status(&e))?;
        response.header = Some(core.header(core.store.revision()));
        Ok(Response::new(response))
    }

    async fn put(&self, request: Request<PutRequest>) -> Result<Response<PutResponse>, Status> {
        respond!(self, Command::Put(request.into_inner()), Put)
    }

    async fn delete_range(
        &self,
        request: Request<DeleteRangeRequest>,
    ) -> Result<Response<DeleteRangeResponse>, Status> {
        respond!(
            self,
            Command::DeleteRange(request.into_inner()),
            DeleteRange
        )
    }

    async fn txn(&self, request: Request<TxnRequest>) -> Result<Response<TxnResponse>, Status> {
        let request = request.into_inner();
        // A txn that cannot write is a read, as in etcd: no place in the log (and no fsync),
        // only the linearizable-read wait that ranges have.
        if crate::store::txn_is_read_only(&request) {
            self.node.linearizable().await?;
            let core = lock(&self.node.core);
            if let Some(answer) = core.store.read_txn(&request) {
                let mut response = answer.map_err(|e| status(&e))?;
                // Only the txn's own header is the server's, as in etcd; the responses inside
                // carry the revision each op saw (from the store).
                response.header = Some(core.header(core.store.revision()));
                return Ok(Response::new(response));
            }
        }
        match self.write(Command::Txn(request)).await? {
            (CommandResponse::Txn(mut r), header) => {
                r.header = Some(header);
                Ok(Response::new(r))
            }
            (other, _) => Err(unexpected(&other)),
        }
    }

    async fn compact(
        &self,
        request: Request<CompactionRequest>,
    ) -> Result<Response<CompactionResponse>, Status> {
        let revision = request.into_inner().revision;
        respond!(self, Command::Compact { revision }, Compact)
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The largest TTL etcd grants (its `MaxLeaseTTL`).
const MAX_LEASE_TTL_SECONDS: i64 = 9_000_000_000;

#[tonic::async_trait]
impl Lease for Service {
    async fn lease_grant(
        &self,
        request: Request<LeaseGrantRequest>,
    ) -> Result<Response<LeaseGrantResponse>, Status> {
        let request = request.into_inner();
        if request.ttl > MAX_LEASE_TTL_SECONDS {
            return Err(Status::out_of_range("etcdserver: too large lease TTL"));
        }
        if request.id < 0 {
            return Err(Status::invalid_argument(
                "etcdserver: lease ID must be positive",
            ));
        }
        // The id is chosen here, before the log: applying must be deterministic.
        let id = if request.id == 0 {
            self.fresh_lease_id()
        } else {
            request.id
        };
        respond!(
            self,
            Command::LeaseGrant {
                id,
                ttl_seconds: request.ttl,
            },
            LeaseGrant
        )
    }

    async fn lease_revoke(
        &self,
        request: Request<LeaseRevokeRequest>,
    ) -> Result<Response<LeaseRevokeResponse>, Status> {
        let id = request.into_inner().id;
        respond!(self, Command::LeaseRevoke { id }, LeaseRevoke)
    }

    type LeaseKeepAliveStream = BoxStream<LeaseKeepAliveResponse>;

    async fn lease_keep_alive(
        &self,
        request: Request<Streaming<LeaseKeepAliveRequest>>,
    ) -> Result<Response<Self::LeaseKeepAliveStream>, Status> {
        let node = self.node.clone();
        let inbound = request.into_inner();
        let stream = futures_util::stream::unfold(inbound, move |mut inbound| {
            let node = node.clone();
            async move {
                let request = match inbound.message().await {
                    Ok(Some(request)) => request,
                    Ok(None) => return None,
                    Err(status) => return Some((Err(status), inbound)),
                };
                // Renewals are the leader's business and never go through the log; a lease
                // that ran out (or never was) gets TTL 0, as etcd answers.
                let ttl = node.leases.keep_alive(request.id).unwrap_or(0);
                let response = LeaseKeepAliveResponse {
                    header: Some(node.header()),
                    id: request.id,
                    ttl,
                };
                Some((Ok(response), inbound))
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn lease_time_to_live(
        &self,
        request: Request<LeaseTimeToLiveRequest>,
    ) -> Result<Response<LeaseTimeToLiveResponse>, Status> {
        let request = request.into_inner();
        self.node.linearizable().await?;
        let core = lock(&self.node.core);
        let header = Some(core.header(core.store.revision()));
        let (Some(lease), Some(remaining)) = (
            core.store.lease(request.id),
            self.node.leases.remaining(request.id),
        ) else {
            // etcd answers an unknown lease with TTL -1, not an error.
            return Ok(Response::new(LeaseTimeToLiveResponse {
                header,
                id: request.id,
                ttl: -1,
                ..LeaseTimeToLiveResponse::default()
            }));
        };
        Ok(Response::new(LeaseTimeToLiveResponse {
            header,
            id: request.id,
            // Whole seconds left, rounded down: a client never believes it has longer.
            ttl: i64::try_from(remaining.as_secs()).unwrap_or(i64::MAX),
            granted_ttl: lease.ttl_seconds,
            keys: if request.keys { lease.keys } else { Vec::new() },
        }))
    }

    async fn lease_leases(
        &self,
        _request: Request<LeaseLeasesRequest>,
    ) -> Result<Response<LeaseLeasesResponse>, Status> {
        self.node.linearizable().await?;
        let core = lock(&self.node.core);
        let leases = core
            .store
            .leases()
            .into_iter()
            .map(|(id, _)| LeaseStatus { id })
            .collect();
        Ok(Response::new(LeaseLeasesResponse {
            header: Some(core.header(core.store.revision())),
            leases,
        }))
    }
}

impl Service {
    fn fresh_lease_id(&self) -> i64 {
        let core = lock(&self.node.core);
        loop {
            // Positive and nonzero, like etcd's.
            let id = (rand::random::<u64>() >> 1) as i64;
            if id != 0 && core.store.lease(id).is_none() {
                return id;
            }
        }
    }
}

#[tonic::async_trait]
impl Watch for Service {
    type WatchStream = BoxStream<WatchResponse>;

    async fn watch(
        &self,
        request: Request<Streaming<WatchRequest>>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let stream = self.node.stream_id();
        let (sink, source) = stream_queue();
        let node = self.node.clone();
        let inbound = request.into_inner();
        let reader = tokio::spawn(read_watch_requests(node.clone(), stream, sink, inbound));
        let outgoing = futures_util::stream::unfold(
            (
                source,
                StreamGuard {
                    node,
                    stream,
                    reader,
                },
            ),
            |(mut source, guard)| async move {
                let response = source.next().await?;
                Some((Ok(response), (source, guard)))
            },
        );
        Ok(Response::new(Box::pin(outgoing)))
    }
}

/// Ends a watch stream's request reader and watchers when its response stream is dropped (the
/// client went away).
struct StreamGuard {
    node: Arc<Node>,
    stream: u64,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.reader.abort();
        lock(&self.node.core).watches.remove_stream(self.stream);
    }
}

async fn read_watch_requests(
    node: Arc<Node>,
    stream: u64,
    sink: StreamSink,
    mut inbound: Streaming<WatchRequest>,
) {
    // The next id this stream hands out; never reused on the stream, as etcd does, so a late
    // answer about a cancelled watch cannot be taken for a new one.
    let mut next_watch_id = 0;
    let mut progress = tokio::time::interval(node.config.progress_interval);
    progress.tick().await;
    // A client that closes its side of the stream (having sent all its requests) still gets
    // its events, as from etcd: the watches end when the response stream goes (StreamGuard).
    let mut requests_open = true;
    loop {
        tokio::select! {
            message = inbound.message(), if requests_open => match message {
                Ok(Some(WatchRequest { request_union: Some(request) })) => {
                    handle_watch_request(&node, stream, &sink, &mut next_watch_id, request);
                }
                Ok(Some(WatchRequest { request_union: None })) => {}
                Ok(None) => requests_open = false,
                Err(_) => break,
            },
            _ = progress.tick() => {
                let core = &mut *lock(&node.core);
                let header = core.header(core.store.revision());
                for watch_id in core.watches.take_idle_progress(stream) {
                    sink.send(WatchResponse { header: Some(header), watch_id, ..WatchResponse::default() });
                }
            }
        }
    }
    lock(&node.core).watches.remove_stream(stream);
}

fn handle_watch_request(
    node: &Node,
    stream: u64,
    sink: &StreamSink,
    next_watch_id: &mut i64,
    request: RequestUnion,
) {
    let mut core = lock(&node.core);
    let header = core.header(core.store.revision());
    match request {
        RequestUnion::CreateRequest(mut create) => {
            if create.key.is_empty() {
                // As in etcd: the empty key stands for the smallest key, "\0".
                create.key = vec![0];
            }
            // etcd's refusals of a watch: created and cancelled at once under watch id -1, so
            // that no watch of the stream can be taken for the cancelled one.
            let explicit = WatcherId {
                stream,
                watch: create.watch_id,
            };
            let refusal = if range_is_empty(&create.key, &create.range_end) {
                Some("mvcc: watcher range is empty")
            } else if create.watch_id != 0 && core.watches.contains(explicit) {
                Some("mvcc: duplicate watch ID provided on the WatchStream")
            } else {
                None
            };
            if let Some(reason) = refusal {
                sink.send(watch::refused(&header, reason));
                return;
            }
            let watch_id = if create.watch_id != 0 {
                create.watch_id
            } else {
                // etcd numbers a stream's watches from 0 up, skipping ids the client chose.
                while core.watches.contains(WatcherId {
                    stream,
                    watch: *next_watch_id,
                }) {
                    *next_watch_id += 1;
                }
                let id = *next_watch_id;
                *next_watch_id += 1;
                id
            };
            let id = WatcherId {
                stream,
                watch: watch_id,
            };
            sink.send(WatchResponse {
                header: Some(header),
                watch_id,
                created: true,
                ..WatchResponse::default()
            });
            // etcd's compact revision is -1 before the first compaction, and it cancels a watch
            // that starts below it; any other negative start (-1 before a compaction) finds no
            // history and watches from now on.
            let compact_revision = match core.store.compact_revision() {
                0 => -1,
                revision => revision,
            };
            if create.start_revision < 0 && create.start_revision < compact_revision {
                sink.send(watch::compacted(&header, watch_id, compact_revision));
                return;
            }
            let current = core.store.revision();
            let start_revision = if create.start_revision <= 0 {
                current + 1
            } else {
                create.start_revision
            };
            let watcher = watch::Watcher {
                key: create.key.clone(),
                range_end: create.range_end.clone(),
                start_revision,
                prev_kv: create.prev_kv,
                no_put: create
                    .filters
                    .contains(&(watch_create_request::FilterType::Noput as i32)),
                no_delete: create
                    .filters
                    .contains(&(watch_create_request::FilterType::Nodelete as i32)),
                progress_notify: create.progress_notify,
                sent_since_progress: false,
                sink: sink.clone(),
                queue_check: create.baton_queue_check.clone(),
            };
            if start_revision <= current {
                match core
                    .store
                    .events_since(&create.key, &create.range_end, start_revision)
                {
                    Ok(events) => {
                        let events = watcher.select(&events);
                        // The store is at the header's revision: the queue check holds there.
                        let first_at =
                            watcher.first_at(&core.store, &events, &mut Default::default());
                        send_history(sink, &header, watch_id, &events, first_at);
                    }
                    Err(StoreError::Compacted { compact_revision }) => {
                        sink.send(watch::compacted(&header, watch_id, compact_revision));
                        return;
                    }
                    Err(other) => {
                        sink.send(watch::cancelled(&header, watch_id, &other.to_string()));
                        return;
                    }
                }
            }
            core.watches.insert(id, watcher);
        }
        RequestUnion::CancelRequest(cancel) => {
            let id = WatcherId {
                stream,
                watch: cancel.watch_id,
            };
            if core.watches.remove(id) {
                sink.send(WatchResponse {
                    header: Some(header),
                    watch_id: cancel.watch_id,
                    canceled: true,
                    ..WatchResponse::default()
                });
            }
        }
        RequestUnion::ProgressRequest(_) => {
            // A stream-wide progress report: etcd marks it with watch id -1.
            sink.send(WatchResponse {
                header: Some(header),
                watch_id: -1,
                ..WatchResponse::default()
            });
        }
    }
}

/// Whether a watch's range holds no key: an end at or before its key (an empty end is one key,
/// "\0" every key from it on).
fn range_is_empty(key: &[u8], range_end: &[u8]) -> bool {
    !range_end.is_empty() && range_end != [0] && key >= range_end
}

/// Past events, one response per revision at most `HISTORY_BATCH` (1,000) events long.
fn send_history(
    sink: &StreamSink,
    header: &ResponseHeader,
    watch_id: i64,
    events: &[crate::proto::mvccpb::Event],
    first_at: i64,
) {
    const HISTORY_BATCH: usize = 1_000;
    let revision_of =
        |e: &crate::proto::mvccpb::Event| e.kv.as_ref().map_or(0, |kv| kv.mod_revision);
    let mut start = 0;
    while start < events.len() {
        // Whole revisions per response, unless one revision alone is larger than a batch.
        let mut end = (start + HISTORY_BATCH).min(events.len());
        if end < events.len() {
            let boundary = revision_of(&events[end]);
            let mut cut = end;
            while cut > start && revision_of(&events[cut - 1]) == boundary {
                cut -= 1;
            }
            if cut > start {
                end = cut;
            }
        }
        sink.send(WatchResponse {
            header: Some(*header),
            watch_id,
            // On the last response only: the client acts on it once it has every event.
            baton_first_at: if end == events.len() { first_at } else { 0 },
            events: events[start..end].to_vec(),
            ..WatchResponse::default()
        });
        start = end;
    }
}

#[tonic::async_trait]
impl Cluster for Service {
    async fn member_list(
        &self,
        _request: Request<MemberListRequest>,
    ) -> Result<Response<MemberListResponse>, Status> {
        let core = lock(&self.node.core);
        let members = core
            .membership
            .membership()
            .nodes()
            .map(|(id, node)| Member {
                id: *id,
                name: format!("baton-{id:x}"),
                peer_ur_ls: Vec::new(),
                client_ur_ls: vec![if *id == self.node.id {
                    self.node.client_url.clone()
                } else {
                    format!("http://{}", node.addr)
                }],
                is_learner: false,
            })
            .collect();
        Ok(Response::new(MemberListResponse {
            header: Some(core.header(core.store.revision())),
            members,
        }))
    }
}

#[tonic::async_trait]
impl Maintenance for Service {
    async fn status(
        &self,
        _request: Request<StatusRequest>,
    ) -> Result<Response<StatusResponse>, Status> {
        let metrics = self.node.raft.metrics().borrow().clone();
        let db_size = std::fs::metadata(self.node.config.data_dir.join("raft.redb"))
            .map(|m| i64::try_from(m.len()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        let header = self.node.header();
        Ok(Response::new(StatusResponse {
            header: Some(header),
            version: VERSION.to_string(),
            db_size,
            leader: metrics.current_leader.unwrap_or(0),
            raft_index: metrics.last_log_index.unwrap_or(0),
            raft_term: metrics.current_term,
            raft_applied_index: metrics.last_applied.map_or(0, |id| id.index),
            errors: Vec::new(),
            db_size_in_use: db_size,
            is_learner: false,
        }))
    }
}
