//! `baton server`: the embedded coordination server (the etcd v3 API subset elections need).

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

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
    /// The most the live keys and values may take: a write that adds data beyond it is
    /// refused with etcd's "database space exceeded" (deletions pass, and free room at once);
    /// history is kept within a quarter of it. Bytes, or with KiB, MiB or GiB; at least 4MiB.
    #[arg(long, default_value = "512MiB", value_parser = bytes)]
    quota_bytes: u64,
    /// How long a client connection may be silent before the server pings it (etcd's
    /// --grpc-keepalive-interval).
    #[arg(long, default_value = "2h", value_parser = crate::run::duration)]
    grpc_keepalive_interval: Duration,
    /// How long an unanswered ping waits before the server closes the connection and drops
    /// its watches (etcd's --grpc-keepalive-timeout).
    #[arg(long, default_value = "20s", value_parser = crate::run::duration)]
    grpc_keepalive_timeout: Duration,
}

/// Serves until SIGTERM, SIGINT or SIGHUP; prints `{"listening":"IP:PORT"}` on stdout once clients can
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
/// panic; the child's failure becomes one clear line and exit code 2 instead. The child tells
/// a damaged log (exit code [`LOG_DAMAGED`], or a panic) from one that is fine but cannot be
/// opened here (in use by another server, a read-only file system): only the first gets the
/// advice to restore or move the directory, which would take revisions back.
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
    if output.status.code() == Some(i32::from(crate::EXIT_USAGE)) {
        return Err(UsageError(format!("the Raft log {why}")).into());
    }
    Err(UsageError(format!(
        "the Raft log {} cannot be opened ({why}); it is damaged: {}",
        path.display(),
        baton_server::log_store::DAMAGED_ADVICE
    ))
    .into())
}

/// `baton __open-log`'s exit code for a log that redb found damaged.
const LOG_DAMAGED: u8 = 3;

/// `baton __open-log PATH`: opens the Raft log and exits 0; or prints why not and exits
/// [`LOG_DAMAGED`] for a damaged file, 2 for any other reason (a panic inside redb aborts,
/// which the parent also reads as damage).
pub fn open_log(path: &std::path::Path) -> std::process::ExitCode {
    match baton_server::log_store::open_database(path) {
        Ok(_) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("baton: error: {error}");
            std::process::ExitCode::from(if error.kind() == std::io::ErrorKind::InvalidData {
                LOG_DAMAGED
            } else {
                crate::EXIT_USAGE
            })
        }
    }
}

async fn serve(args: ServerArgs) -> anyhow::Result<()> {
    check_log(&args.data)?;
    let mut config = baton_server::ServerConfig::new(args.listen, args.data);
    config.history_revisions = args.history;
    config.snapshot_every = args.snapshot_every;
    config.quota_bytes = args.quota_bytes;
    config.keepalive_interval = args.grpc_keepalive_interval;
    config.keepalive_timeout = args.grpc_keepalive_timeout;
    use tokio::signal::unix::{signal, SignalKind};
    let mut terminate = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    // A closed terminal or SSH session stops the server as SIGTERM does (cleanly), rather than
    // by the signal's default action.
    let mut hangup = signal(SignalKind::hangup()).context("cannot handle SIGHUP")?;
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
    // Scripts read this line; one that nobody reads (stdout closed or full) must not stop a
    // server that is otherwise fine.
    let ready = serde_json::json!({ "listening": server.addr().to_string() });
    let mut stdout = std::io::stdout().lock();
    if let Err(error) = writeln!(stdout, "{ready}").and_then(|()| stdout.flush()) {
        crate::log::line(&format!(
            "baton server: warning: cannot print the listening address on stdout: {error}"
        ));
    }
    drop(stdout);
    crate::log::line(&format!(
        "baton server: serving the etcd v3 API on {} (member {:x})",
        server.addr(),
        server.member_id()
    ));
    let failed = tokio::select! {
        _ = terminate.recv() => None,
        _ = hangup.recv() => None,
        _ = tokio::signal::ctrl_c() => None,
        error = server.failed() => Some(error),
    };
    if let Some(error) = failed {
        // Clients see the connection close and go to another endpoint or wait; a supervisor
        // (systemd, say) restarts the server once the cause is fixed.
        let _ = server.shutdown().await;
        anyhow::bail!(
            "{error}; it serves nothing until restarted: every acknowledged write is on disk, so \
             fix the cause (free disk space, say) and start it again on the same data directory"
        );
    }
    server.shutdown().await.context("stopping")?;
    Ok(())
}

/// A size in bytes: a whole number, optionally followed by KiB, MiB or GiB.
fn bytes(text: &str) -> Result<u64, String> {
    let not_a_size =
        || format!("{text:?} is not a size (a number of bytes, or with KiB, MiB or GiB)");
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let shift = match unit {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        _ => return Err(not_a_size()),
    };
    let number: u64 = number.parse().map_err(|_| not_a_size())?;
    number
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}
