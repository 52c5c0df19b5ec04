//! `baton server`: the embedded coordination server (the etcd v3 API subset elections need).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::UsageError;

/// Flags of `baton server`.
#[derive(Debug, Args)]
pub struct ServerArgs {
    /// Where clients connect (IP:PORT; port 0 picks a free one, printed at start).
    #[arg(long, default_value = "127.0.0.1:2379")]
    listen: SocketAddr,
    /// Data directory: Raft log, snapshots and the member's identity (created if missing;
    /// one server per directory).
    #[arg(long)]
    data: PathBuf,
    /// Revisions of history kept for watches and reads at past revisions.
    #[arg(long, default_value_t = 10_000)]
    history: i64,
    /// Log entries between snapshots.
    #[arg(long, default_value_t = 10_000)]
    snapshot_every: u64,
}

/// Serves until SIGTERM or SIGINT; prints `{"listening":"IP:PORT"}` on stdout once clients can
/// connect. Runs on a runtime of its own with a thread per core: the CLI's other commands use
/// one thread.
pub fn main(args: ServerArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("baton-server")
        .build()
        .context("cannot start the runtime")?;
    runtime.block_on(serve(args))
}

async fn serve(args: ServerArgs) -> anyhow::Result<()> {
    let mut config = baton_server::ServerConfig::new(args.listen, args.data);
    config.history_revisions = args.history;
    config.snapshot_every = args.snapshot_every;
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot handle SIGTERM")?;
    let server = baton_server::start(config)
        .await
        .map_err(|error| match error {
            // Where to listen and where to keep data are the user's input.
            baton_server::ServerError::Listen(..)
            | baton_server::ServerError::Data(..)
            | baton_server::ServerError::Config(_) => {
                anyhow::Error::new(UsageError(error.to_string()))
            }
            other => anyhow::Error::new(other),
        })?;
    println!(
        "{}",
        serde_json::json!({ "listening": server.addr().to_string() })
    );
    crate::log::line(&format!(
        "baton server: serving the etcd v3 API on {} (member {:x})",
        server.addr(),
        server.member_id()
    ));
    tokio::select! {
        _ = terminate.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    server.shutdown().await.context("stopping")?;
    Ok(())
}
