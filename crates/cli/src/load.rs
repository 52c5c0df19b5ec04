//! `baton bench load`: a small load generator for servers speaking the etcd v3 API, so that
//! `baton server` and etcd are measured by the same client in the same run.
//!
//! Each client has a connection (HTTP/2) of its own, as separate processes would, and runs
//! its requests one after another; the figures are completed operations per second over the
//! window and the latency percentiles of one operation.

use std::time::{Duration, Instant};

use anyhow::Context;
use baton_server::proto::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use baton_server::proto::etcdserverpb::kv_client::KvClient;
use baton_server::proto::etcdserverpb::lease_client::LeaseClient;
use baton_server::proto::etcdserverpb::request_op::Request as Op;
use baton_server::proto::etcdserverpb::{
    Compare, DeleteRangeRequest, LeaseGrantRequest, LeaseKeepAliveRequest, PutRequest, RequestOp,
    TxnRequest,
};
use clap::{Args, ValueEnum};
use serde::Serialize;
use tonic::transport::Channel;

/// Flags of `baton bench load`.
#[derive(Debug, Args)]
pub struct LoadArgs {
    /// The server, IP:PORT (etcd or `baton server`).
    #[arg(long)]
    endpoint: String,
    /// What each client does in a loop.
    #[arg(long, value_enum)]
    op: LoadOp,
    /// Concurrent clients, each on a connection of its own.
    #[arg(long, default_value_t = 1)]
    clients: usize,
    /// How long to measure.
    #[arg(long, default_value = "5s", value_parser = crate::run::duration)]
    window: Duration,
    /// For `--op leases`: how many leases to grant (then the server's memory is read by the
    /// caller); for `--op expiry`: how many leases to time.
    #[arg(long, default_value_t = 100_000)]
    count: usize,
}

/// The operations.
#[derive(Debug, Clone, Copy, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
enum LoadOp {
    /// A Txn that creates a fresh key if absent (how a candidate enters the queue).
    Create,
    /// Create-if-absent, then delete the key: one campaign → resign cycle.
    Cycle,
    /// Keep-alives of one lease per client on its stream, one at a time.
    Keepalive,
    /// Grant `--count` leases (TTL 1 h) as fast as the clients can, then stop.
    Leases,
    /// How late leases expire: each client, `--count` times, grants a 1 s lease, attaches a
    /// key, watches it and times the deletion from the grant's answer; the figures are the
    /// time past the TTL.
    Expiry,
}

/// One line of JSON per run.
#[derive(Debug, Serialize)]
struct LoadReport<'a> {
    endpoint: &'a str,
    op: LoadOp,
    clients: usize,
    operations: u64,
    seconds: f64,
    ops_per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
}

/// Runs the load on a runtime with a thread per core (the CLI's own runtime has one thread).
pub async fn bench(args: LoadArgs) -> anyhow::Result<()> {
    if args.clients == 0 {
        return Err(crate::UsageError("--clients must be at least 1".into()).into());
    }
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("cannot start the runtime")?;
        runtime.block_on(run(args))
    })
    .await
    .context("the load generator stopped")?
}

async fn run(args: LoadArgs) -> anyhow::Result<()> {
    let url = format!("http://{}", args.endpoint);
    let mut channels = Vec::new();
    for _ in 0..args.clients {
        let channel = Channel::from_shared(url.clone())
            .map_err(|e| crate::UsageError(format!("invalid endpoint {:?}: {e}", args.endpoint)))?
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(3))
            .connect()
            .await
            .with_context(|| format!("cannot reach {}", args.endpoint))?;
        channels.push(channel);
    }
    let started = Instant::now();
    let deadline = started + args.window;
    let per_client = args.count.div_ceil(args.clients);
    let workers: Vec<_> = channels
        .into_iter()
        .enumerate()
        .map(|(client, channel)| {
            let op = args.op;
            tokio::spawn(async move {
                match op {
                    LoadOp::Create | LoadOp::Cycle => kv_loop(channel, client, op, deadline).await,
                    LoadOp::Keepalive => keepalive_loop(channel, deadline).await,
                    LoadOp::Leases => grant_loop(channel, per_client).await,
                    LoadOp::Expiry => expiry_loop(channel, client, per_client).await,
                }
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for worker in workers {
        latencies.extend(worker.await.context("a client stopped")??);
    }
    let seconds = started.elapsed().as_secs_f64();
    latencies.sort_unstable();
    let percentile = |p: f64| -> f64 {
        if latencies.is_empty() {
            return 0.0;
        }
        let index = ((latencies.len() as f64 - 1.0) * p).round() as usize;
        latencies[index].as_secs_f64() * 1000.0
    };
    let report = LoadReport {
        endpoint: &args.endpoint,
        op: args.op,
        clients: args.clients,
        operations: latencies.len() as u64,
        seconds,
        ops_per_second: latencies.len() as f64 / seconds,
        p50_ms: percentile(0.5),
        p99_ms: percentile(0.99),
    };
    crate::print_out(&serde_json::to_string(&report)?)?;
    Ok(())
}

fn create_if_absent(key: Vec<u8>) -> TxnRequest {
    TxnRequest {
        compare: vec![Compare {
            result: CompareResult::Equal as i32,
            target: CompareTarget::Create as i32,
            key: key.clone(),
            target_union: Some(TargetUnion::CreateRevision(0)),
            range_end: Vec::new(),
        }],
        success: vec![RequestOp {
            request: Some(Op::RequestPut(PutRequest {
                key,
                value: b"candidate".to_vec(),
                ..PutRequest::default()
            })),
        }],
        failure: Vec::new(),
    }
}

async fn kv_loop(
    channel: Channel,
    client: usize,
    op: LoadOp,
    deadline: Instant,
) -> anyhow::Result<Vec<Duration>> {
    let mut kv = KvClient::new(channel);
    let mut latencies = Vec::new();
    let run = std::process::id();
    for i in 0u64.. {
        if Instant::now() >= deadline {
            break;
        }
        let key = format!("/baton-bench-load/{run}/{client}/{i}").into_bytes();
        let start = Instant::now();
        let created = kv.txn(create_if_absent(key.clone())).await?.into_inner();
        anyhow::ensure!(created.succeeded, "a fresh key already existed");
        if matches!(op, LoadOp::Cycle) {
            kv.delete_range(DeleteRangeRequest {
                key,
                ..DeleteRangeRequest::default()
            })
            .await?;
        }
        latencies.push(start.elapsed());
    }
    Ok(latencies)
}

async fn keepalive_loop(channel: Channel, deadline: Instant) -> anyhow::Result<Vec<Duration>> {
    let mut lease = LeaseClient::new(channel);
    let id = lease
        .lease_grant(LeaseGrantRequest { ttl: 60, id: 0 })
        .await?
        .into_inner()
        .id;
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    // The first request goes in before the call: a gRPC server may hold its response headers
    // (which the call waits for) until it has something to answer, as etcd does.
    let mut start = Instant::now();
    tx.send(LeaseKeepAliveRequest { id }).await?;
    let mut responses = lease
        .lease_keep_alive(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    let mut latencies = Vec::new();
    let mut first = true;
    while Instant::now() < deadline {
        if !first {
            start = Instant::now();
            tx.send(LeaseKeepAliveRequest { id }).await?;
        }
        first = false;
        let response = responses
            .message()
            .await?
            .context("the keep-alive stream ended")?;
        anyhow::ensure!(response.ttl > 0, "the lease expired");
        latencies.push(start.elapsed());
    }
    Ok(latencies)
}

async fn grant_loop(channel: Channel, count: usize) -> anyhow::Result<Vec<Duration>> {
    let mut lease = LeaseClient::new(channel);
    let mut latencies = Vec::with_capacity(count);
    for _ in 0..count {
        let start = Instant::now();
        lease
            .lease_grant(LeaseGrantRequest { ttl: 3600, id: 0 })
            .await?;
        latencies.push(start.elapsed());
    }
    Ok(latencies)
}

async fn expiry_loop(
    channel: Channel,
    client: usize,
    count: usize,
) -> anyhow::Result<Vec<Duration>> {
    use baton_server::proto::etcdserverpb::watch_client::WatchClient;
    use baton_server::proto::etcdserverpb::watch_request::RequestUnion;
    use baton_server::proto::etcdserverpb::{WatchCreateRequest, WatchRequest};
    const TTL: Duration = Duration::from_secs(1);
    let mut lease = LeaseClient::new(channel.clone());
    let mut kv = KvClient::new(channel.clone());
    let mut watch = WatchClient::new(channel);
    let mut late = Vec::with_capacity(count);
    for i in 0..count {
        let key = format!("/baton-bench-expiry/{}/{client}/{i}", std::process::id()).into_bytes();
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tx.send(WatchRequest {
            request_union: Some(RequestUnion::CreateRequest(WatchCreateRequest {
                key: key.clone(),
                ..WatchCreateRequest::default()
            })),
        })
        .await?;
        let mut events = watch
            .watch(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        let created = events.message().await?.context("the watch ended")?;
        anyhow::ensure!(created.created, "the watch was not created");
        let id = lease
            .lease_grant(LeaseGrantRequest { ttl: 1, id: 0 })
            .await?
            .into_inner()
            .id;
        // The server's TTL starts when it granted; the answer arrives after that, so this
        // measures at most how late the expiry is.
        let granted = Instant::now();
        kv.put(PutRequest {
            key,
            value: b"x".to_vec(),
            lease: id,
            ..PutRequest::default()
        })
        .await?;
        loop {
            let response = events.message().await?.context("the watch ended")?;
            // The put is seen first; the lease's end is the deletion.
            let deleted = baton_server::proto::mvccpb::event::EventType::Delete as i32;
            if response.events.iter().any(|event| event.r#type == deleted) {
                break;
            }
        }
        let lived = granted.elapsed();
        // The answer left the server after its TTL started, so a lease that lived a little
        // less than the TTL here may still be on time; clearly less is an early expiry.
        anyhow::ensure!(
            lived + Duration::from_millis(5) >= TTL,
            "a 1 s lease expired after {lived:?}: early"
        );
        late.push(lived.saturating_sub(TTL));
        drop(tx);
    }
    Ok(late)
}
