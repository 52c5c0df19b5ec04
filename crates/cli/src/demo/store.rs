//! The demo's fenced store, and the worker that writes to it.
//!
//! The store stands for any resource a leader's job writes to (a database, a bucket, a
//! downstream service): it admits a write only if its fencing token is at least the highest it
//! has seen ([`baton::Fence`], checked and recorded under one lock), and it records every write,
//! admitted or not, for the live view and the report. It listens on a Unix socket in the demo's
//! temporary directory, so nothing outside this host can reach it and it vanishes with the
//! directory.
//!
//! The protocol is one line per write, `ID TOKEN PID\n`, answered with `ok\n` or
//! `stale HIGHEST\n`.

use std::io::{BufRead, BufReader, Write as _};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::UnixListener;

/// One write as the store saw it.
#[derive(Debug, Clone)]
pub struct Record {
    /// When the store decided, since the demo started.
    pub at: Duration,
    /// The candidate id the writer claimed (its `BATON_ID`).
    pub id: String,
    /// The fencing token it wrote with (its `BATON_TOKEN`).
    pub token: u64,
    /// The writer's process id.
    pub pid: u32,
    /// Whether the fence admitted it.
    pub accepted: bool,
    /// The highest token the store had admitted before this write.
    pub highest: Option<u64>,
}

/// What the store has seen; shared by its connection tasks and the demo.
#[derive(Debug, Default)]
pub struct Log {
    fence: baton::Fence,
    /// Every write, in the order the store decided them.
    pub writes: Vec<Record>,
}

/// The running store.
pub struct Store {
    pub log: Arc<Mutex<Log>>,
    task: tokio::task::JoinHandle<()>,
}

impl Store {
    /// Listens on `path` (a Unix socket); `epoch` is the demo's time zero.
    pub fn start(path: &Path, epoch: Instant) -> anyhow::Result<Store> {
        let listener = UnixListener::bind(path)
            .with_context(|| format!("starting the fenced store on {}", path.display()))?;
        let log = Arc::new(Mutex::new(Log::default()));
        let shared = log.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve(stream, shared.clone(), epoch));
            }
        });
        Ok(Store { log, task })
    }

    /// A copy of the writes from index `from` on.
    pub fn writes_since(&self, from: usize) -> Vec<Record> {
        let log = lock(&self.log);
        log.writes
            .get(from..)
            .map(<[_]>::to_vec)
            .unwrap_or_default()
    }

    /// Stops accepting connections (open ones end when their workers die).
    pub fn stop(&self) {
        self.task.abort();
    }
}

/// The log, even if a task panicked while holding it (the data is append-only, so still whole).
fn lock(log: &Mutex<Log>) -> std::sync::MutexGuard<'_, Log> {
    log.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Longest request line the store reads; a longer one ends the connection.
const MAX_LINE: usize = 512;

async fn serve(stream: tokio::net::UnixStream, log: Arc<Mutex<Log>>, epoch: Instant) {
    let (read, mut write) = stream.into_split();
    let mut lines = tokio::io::BufReader::new(read);
    let mut line = String::new();
    loop {
        line.clear();
        match lines.read_line(&mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) if line.len() > MAX_LINE => return,
            Ok(_) => {}
        }
        let Some((id, token, pid)) = parse_request(&line) else {
            let _ = write.write_all(b"error expected ID TOKEN PID\n").await;
            continue;
        };
        // Check and record in one critical section: a check now and a write later would let a
        // stale writer slip in between (the point of the fence).
        let answer = {
            let mut log = lock(&log);
            let highest = log.fence.highest();
            let accepted = log.fence.admit(token).is_ok();
            log.writes.push(Record {
                at: epoch.elapsed(),
                id: id.to_string(),
                token,
                pid,
                accepted,
                highest,
            });
            if accepted {
                "ok\n".to_string()
            } else {
                format!("stale {}\n", highest.unwrap_or(0))
            }
        };
        if write.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
    }
}

fn parse_request(line: &str) -> Option<(&str, u64, u32)> {
    let mut words = line.split_whitespace();
    let id = words.next()?;
    let token = words.next()?.parse().ok()?;
    let pid = words.next()?.parse().ok()?;
    words.next().is_none().then_some((id, token, pid))
}

/// How often the worker writes.
const WRITE_EVERY: Duration = Duration::from_millis(150);

/// `baton __demo-worker --store PATH`: the job each demo candidate runs while it leads. It
/// writes to the store every 150 ms with the token `baton run` gave it, forever: it never
/// decides on its own that it is stale (a paused process cannot know it was paused), which is
/// exactly why the store fences.
pub fn worker(store: &Path) -> ExitCode {
    let id = std::env::var("BATON_ID").unwrap_or_default();
    let token: Option<u64> = std::env::var("BATON_TOKEN")
        .ok()
        .and_then(|t| t.parse().ok());
    let Some(token) = token.filter(|_| !id.is_empty()) else {
        eprintln!(
            "baton __demo-worker: BATON_ID and BATON_TOKEN must be set (run it under baton run)"
        );
        return ExitCode::from(crate::EXIT_USAGE);
    };
    let pid = std::process::id();
    let mut connection: Option<(UnixStream, BufReader<UnixStream>)> = None;
    loop {
        if connection.is_none() {
            connection = UnixStream::connect(store).ok().and_then(|stream| {
                let reader = BufReader::new(stream.try_clone().ok()?);
                Some((stream, reader))
            });
        }
        if let Some((stream, reader)) = connection.as_mut() {
            let mut answer = String::new();
            let sent = writeln!(stream, "{id} {token} {pid}")
                .and_then(|()| reader.read_line(&mut answer))
                .is_ok_and(|n| n > 0);
            if !sent {
                // The store went away (the demo is ending) or restarted: connect again.
                connection = None;
            } else if let Some(highest) = answer.trim().strip_prefix("stale ") {
                // Stderr goes to the demo's log of this candidate (shown in the report).
                eprintln!(
                    "{id}: the store rejected my write with token {token}: it has seen token {highest}"
                );
            }
        }
        std::thread::sleep(WRITE_EVERY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_strictly() {
        assert_eq!(parse_request("node-1 42 7\n"), Some(("node-1", 42, 7)));
        for bad in [
            "",
            "node-1",
            "node-1 x 7",
            "node-1 4 7 extra",
            "node-1 -4 7",
        ] {
            assert_eq!(parse_request(bad), None, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn the_store_rejects_a_token_below_the_highest_and_records_it() {
        let dir = std::env::temp_dir().join(format!("baton-store-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("store.sock");
        let _ = std::fs::remove_file(&path);
        let store = Store::start(&path, Instant::now()).unwrap();
        let stream = tokio::net::UnixStream::connect(&path).await.unwrap();
        let (read, mut write) = stream.into_split();
        let mut lines = tokio::io::BufReader::new(read).lines();
        for (request, answer) in [
            ("a 5 1\n", "ok"),
            ("b 7 2\n", "ok"),
            ("a 5 1\n", "stale 7"),
            ("b 7 2\n", "ok"),
        ] {
            write.write_all(request.as_bytes()).await.unwrap();
            assert_eq!(lines.next_line().await.unwrap().unwrap(), answer);
        }
        let writes = store.writes_since(0);
        let verdicts: Vec<(u64, bool)> = writes.iter().map(|w| (w.token, w.accepted)).collect();
        assert_eq!(verdicts, [(5, true), (7, true), (5, false), (7, true)]);
        assert_eq!(writes[2].highest, Some(7));
        store.stop();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
