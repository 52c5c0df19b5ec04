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

/// The Raft log's file in a data directory.
const LOG_FILE: &str = "raft.redb";

/// Opens an existing Raft log in a child process first (`baton __open-log`): redb meets some
/// damage (a file cut short, say) with an assertion, which would abort this process with a
/// panic; the child's failure becomes one clear line and exit code 2 instead.
fn check_log(data: &std::path::Path) -> anyhow::Result<()> {
    let path = data.join(LOG_FILE);
    if !path.exists() {
        return Ok(());
    }
    let me = std::env::current_exe().context("finding the baton executable")?;
    let output = std::process::Command::new(me)
        .arg("__open-log")
        .arg(&path)
        .stdin(std::process::Stdio::null())
        .output()
        .context("checking the Raft log")?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    // The child's own one line, or redb's assertion (the line after "panicked at").
    let why = stderr
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .find(|l| !l.starts_with("baton: internal error") && !l.contains("panicked at"))
        .or_else(|| stderr.lines().find(|l| !l.trim().is_empty()))
        .unwrap_or("it could not be opened")
        .trim_start_matches("baton: error: ")
        .to_string();
    Err(UsageError(format!(
        "the Raft log {} cannot be opened ({why}); it is damaged: restore the data directory \
         from a backup, or move it away to start an empty server",
        path.display()
    ))
    .into())
}

/// `baton __open-log PATH`: opens the Raft log and exits 0, or prints why not and exits 2 (a
/// panic inside redb aborts, which the parent also reads as failure).
pub fn open_log(path: &std::path::Path) -> std::process::ExitCode {
    match baton_server::log_store::open_database(path) {
        Ok(_) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("baton: error: {error}");
            std::process::ExitCode::from(crate::EXIT_USAGE)
        }
    }
}

async fn serve(args: ServerArgs) -> anyhow::Result<()> {
    check_log(&args.data)?;
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
