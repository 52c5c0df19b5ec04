//! The demo's processes: the embedded server, the candidates, and what it needs to find, signal
//! and clean up after them. Everything here acts only on processes the demo started (or their
//! descendants, found through `/proc`), never on processes found by name.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use std::io::Write as _;

use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};

use super::stop_requested;

/// The demo's temporary directory (server data, the store's socket, the candidates' logs),
/// removed when dropped, however the demo ends.
pub struct TempDir {
    pub path: PathBuf,
}

/// Longest path the store's socket may have (a Unix socket address holds 108 bytes).
const MAX_SOCKET_PATH: usize = 100;

impl TempDir {
    pub fn create() -> anyhow::Result<TempDir> {
        let mut base = std::env::temp_dir();
        // The store's socket lives in here: a TMPDIR too long for a socket address falls back
        // to /tmp rather than failing the demo.
        if base.join("baton-demo.XXXXXX/store.sock").as_os_str().len() > MAX_SOCKET_PATH {
            base = PathBuf::from("/tmp");
        }
        let template = base.join("baton-demo.XXXXXX");
        let mut bytes = std::ffi::CString::new(template.as_os_str().as_encoded_bytes())
            .context("the temporary directory's path")?
            .into_bytes_with_nul();
        // SAFETY: mkdtemp rewrites the XXXXXX of the NUL-terminated buffer we own in place.
        let made = unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) };
        if made.is_null() {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("creating a temporary directory in {}", base.display()));
        }
        bytes.pop();
        let path = PathBuf::from(String::from_utf8_lossy(&bytes).into_owned());
        Ok(TempDir { path })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Makes the child get SIGTERM when the demo dies, even by SIGKILL: candidates then resign and
/// the server stops, instead of running on with nobody to clean up after them.
fn die_with_demo(command: &mut Command) {
    // SAFETY: getpid has no preconditions.
    let demo = unsafe { libc::getpid() };
    // SAFETY: between fork and exec we only call prctl, getppid and raise, which are
    // async-signal-safe.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The demo may have died before prctl: then no signal would ever come.
            if libc::getppid() != demo {
                libc::raise(libc::SIGTERM);
            }
            Ok(())
        });
    }
}

/// The baton executable this demo runs as: the candidates and the server are this same binary.
pub fn baton_exe() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("finding the baton executable")
}

/// One candidate: a real `baton run` process.
pub struct Candidate {
    pub child: Option<Child>,
    pub pid: i32,
    pub log: PathBuf,
}

impl Candidate {
    /// Starts `baton run … --requeue -- baton __demo-worker --store STORE`; its stdout and
    /// stderr (its notes, its worker's complaints) go to `log`, never to the live view.
    pub fn spawn(
        backend: &str,
        id: &str,
        ttl: Duration,
        store: &Path,
        log: PathBuf,
    ) -> anyhow::Result<Candidate> {
        let exe = baton_exe()?;
        let out =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone().context("opening the candidate's log")?;
        let mut command = Command::new(&exe);
        command
            .arg("run")
            .args(["--backend", backend, "--election", super::election()])
            .args(["--id", id, "--ttl", &baton::format_duration(ttl)])
            .args(["--requeue", "--grace", "1s", "--"])
            .arg(&exe)
            .arg(super::WORKER)
            .arg("--store")
            .arg(store)
            .env_remove("BATON_BACKEND")
            .env_remove("BATON_ELECTION")
            .env_remove("BATON_ID")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            // A process group of its own: Ctrl-C in the terminal reaches the demo only, which
            // then stops the candidates in order (resigning), not all at once behind its back.
            .process_group(0)
            // A safety net: a candidate whose handle is dropped without a wait is killed.
            .kill_on_drop(true);
        die_with_demo(&mut command);
        let child = command
            .spawn()
            .with_context(|| format!("starting candidate {id}"))?;
        let pid = child.id().map_or(-1, |pid| pid as i32);
        Ok(Candidate {
            child: Some(child),
            pid,
            log,
        })
    }

    /// The exit status if it has exited (reaped here, so the PID is not signalled after).
    pub fn exited(&mut self) -> Option<String> {
        reap(&mut self.child)
    }

    /// Sends `signal` to the `baton run` process if it has not been reaped yet.
    pub fn signal(&self, signal: libc::c_int) {
        if self.child.is_some() {
            // SAFETY: kill has no memory-safety preconditions; the PID is our unreaped child,
            // so it cannot have been reused.
            unsafe { libc::kill(self.pid, signal) };
        }
    }

    /// The last non-empty line of its log, for error messages.
    pub fn last_words(&self) -> String {
        last_line(&self.log)
    }
}

fn last_line(path: &Path) -> String {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| {
            text.lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map(str::to_string)
        })
        .unwrap_or_default()
}

/// An exit status as the report shows it.
pub fn describe(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => "unknown status".into(),
    }
}

/// The `baton run` supervisor's guard and worker (the leader's command), found in `/proc`.
#[derive(Debug, Clone, Copy)]
pub struct Term {
    pub guard: i32,
    pub worker: i32,
}

/// Finds the running worker under `supervisor` and the guard that started it. The worker is
/// the process whose first argument is the hidden worker subcommand (the guard's own command
/// line also mentions it, but as a later argument).
pub fn find_term(supervisor: i32) -> Option<Term> {
    let tree = crate::containment::descendants(supervisor);
    let worker = tree
        .iter()
        .find(|p| p.live && argument(p.pid, 1).as_deref() == Some(super::WORKER))?;
    (argument(worker.parent, 1).as_deref() == Some("__guard")).then_some(Term {
        guard: worker.parent,
        worker: worker.pid,
    })
}

/// Argument `index` of a process's command line.
fn argument(pid: i32, index: usize) -> Option<String> {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let arg = cmdline.split(|&b| b == 0).nth(index)?;
    Some(String::from_utf8_lossy(arg).into_owned())
}

/// Whether a process exists and is not a zombie.
pub fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat.rsplit(')').next().unwrap_or("").trim_start();
        !state.starts_with('Z') && !state.starts_with('X')
    })
}

/// Sends `signal` to a descendant of the demo found in `/proc` (a guard or a worker) only if
/// it is still the process we found: alive and with the same parent.
pub fn signal_descendant(pid: i32, parent: i32, signal: libc::c_int) {
    let me = std::process::id() as i32;
    let ours = crate::containment::descendants(me)
        .iter()
        .any(|p| p.pid == pid && p.parent == parent);
    if ours {
        // SAFETY: kill has no memory-safety preconditions; the PID was just seen as ours.
        unsafe { libc::kill(pid, signal) };
    }
}

/// Kills and reaps every process left under the demo that is not one of `known` (those have
/// handles that reap them): orphans re-parented to the demo (it is a child subreaper), such as
/// the guard of a supervisor killed with kill -9. Returns how many were still alive.
pub fn kill_orphans(known: &[i32]) -> usize {
    let me = std::process::id() as i32;
    let tree = crate::containment::descendants(me);
    let strays: Vec<_> = tree
        .iter()
        .filter(|p| !known.contains(&p.pid))
        .copied()
        .collect();
    let live = crate::containment::signal_all(&strays, libc::SIGKILL, None);
    reap_orphans(known);
    live
}

/// Reaps orphans re-parented to the demo that have exited (never a child with a handle).
pub fn reap_orphans(known: &[i32]) {
    let me = std::process::id() as i32;
    let tree = crate::containment::descendants(me);
    crate::containment::reap(
        tree.iter()
            .filter(|p| p.parent == me && !p.live && !known.contains(&p.pid))
            .map(|p| p.pid),
    );
}

/// How long the embedded server gets to say it is listening.
pub const SERVER_READY: Duration = Duration::from_secs(10);

/// baton's embedded server, `baton server --listen 127.0.0.1:0 --data DIR`.
pub struct Server {
    pub child: Option<Child>,
    pub pid: i32,
    /// Where it listens.
    pub address: String,
    pub log: PathBuf,
}

/// What the server prints once it serves: `{"listening":"127.0.0.1:PORT"}`.
#[derive(serde::Deserialize)]
struct Ready {
    listening: std::net::SocketAddr,
}

const NO_SERVER_HINT: &str =
    "pass --backend URL to use an existing etcd, ZooKeeper or PostgreSQL instead";

impl Server {
    /// Starts the server with its data in `data` and waits (at most [`SERVER_READY`], and
    /// never past a stop signal) for its ready line. Its stderr, and anything it prints after
    /// the ready line, go to `log`.
    pub async fn start(data: &Path, log: PathBuf) -> anyhow::Result<Server> {
        let mut command = Command::new(baton_exe()?);
        command
            .arg("server")
            .args(["--listen", "127.0.0.1:0", "--data"])
            .arg(data);
        Server::launch(command, log, SERVER_READY).await
    }

    /// [`Server::start`] with any command (the tests' stand-ins) and limit.
    async fn launch(
        mut command: Command,
        log: PathBuf,
        ready_within: Duration,
    ) -> anyhow::Result<Server> {
        let err =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            // Its own process group: Ctrl-C reaches the demo, which stops the candidates
            // (they resign through the server) before it stops the server.
            .process_group(0)
            .kill_on_drop(true);
        die_with_demo(&mut command);
        let mut child = command
            .spawn()
            .context("starting baton's embedded server")?;
        let pid = child.id().map_or(-1, |pid| pid as i32);
        let stdout = child.stdout.take().context("the server's stdout")?;
        // Read on a task of its own, which then keeps draining stdout into the log so that a
        // chatty server never blocks on a full pipe; the ready line comes back on a channel
        // (reading here directly could not be interrupted by Ctrl-C without losing data).
        let (ready_tx, mut ready_rx) = tokio::sync::oneshot::channel::<String>();
        let drain_log = log.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stdout).lines();
            let first = lines.next_line().await.ok().flatten();
            let Some(first) = first else { return };
            let _ = ready_tx.send(first);
            let Ok(mut file) = std::fs::OpenOptions::new().append(true).open(&drain_log) else {
                return;
            };
            // A short write to a local file: not worth a blocking thread.
            while let Ok(Some(line)) = lines.next_line().await {
                let _ = writeln!(file, "{line}");
            }
        });
        let mut server = Server {
            child: Some(child),
            pid,
            address: String::new(),
            log,
        };
        let give_up = Instant::now() + ready_within;
        let line = loop {
            match ready_rx.try_recv() {
                Ok(line) => break line,
                Err(tokio::sync::oneshot::error::TryRecvError::Closed) => {
                    // stdout closed without a line: it exited (or closed stdout and is about
                    // to). Give it a moment to exit so the status can be told.
                    let status = match server.child.as_mut() {
                        Some(child) => tokio::time::timeout(Duration::from_secs(1), child.wait())
                            .await
                            .ok()
                            .and_then(Result::ok)
                            .map(describe)
                            .unwrap_or_else(|| "closed its stdout".into()),
                        None => "gone".into(),
                    };
                    let said = last_line(&server.log);
                    let said = if said.is_empty() {
                        String::new()
                    } else {
                        format!(": {said}")
                    };
                    server.stop().await;
                    anyhow::bail!(
                        "baton's embedded server stopped before it was ready ({status}){said}; {NO_SERVER_HINT}"
                    );
                }
                Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {}
            }
            if let Some(signal) = stop_requested() {
                server.stop().await;
                return Err(super::Interrupted(signal).into());
            }
            if Instant::now() >= give_up {
                server.stop().await;
                anyhow::bail!(
                    "baton's embedded server did not say it was listening within {}; {NO_SERVER_HINT}",
                    baton::format_duration(ready_within)
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        match serde_json::from_str::<Ready>(&line) {
            Ok(ready) => {
                server.address = ready.listening.to_string();
                Ok(server)
            }
            Err(_) => {
                server.stop().await;
                anyhow::bail!(
                    "baton's embedded server printed {line:?}, not {{\"listening\":\"IP:PORT\"}}; {NO_SERVER_HINT}"
                )
            }
        }
    }

    /// The server's exit status if it has exited.
    pub fn exited(&mut self) -> Option<String> {
        reap(&mut self.child)
    }

    /// SIGTERM, then SIGKILL if it has not exited within [`SERVER_STOP`]; reaped either way.
    pub async fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // SAFETY: kill has no memory-safety preconditions; the PID is our unreaped child.
        unsafe { libc::kill(self.pid, libc::SIGTERM) };
        if tokio::time::timeout(SERVER_STOP, child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }
}

/// How long the server gets to stop after SIGTERM before SIGKILL.
const SERVER_STOP: Duration = Duration::from_secs(3);

/// The exit status of `child` if it has exited; it is then reaped and dropped, so its PID is
/// never signalled after.
fn reap(child: &mut Option<Child>) -> Option<String> {
    let status = match child.as_mut()?.try_wait() {
        Ok(Some(status)) => describe(status),
        Ok(None) => return None,
        Err(error) => format!("unknown status ({error})"),
    };
    *child = None;
    Some(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for `baton server` (a shell script: `exec` its last command, so that
    /// SIGTERM reaches it); also returns the directory of its log.
    async fn fake(script: &str, ready_within: Duration) -> (anyhow::Result<Server>, TempDir) {
        let dir = TempDir::create().unwrap();
        let mut command = Command::new("sh");
        command.args(["-c", script]);
        let result = Server::launch(command, dir.path.join("server.log"), ready_within).await;
        (result, dir)
    }

    #[tokio::test]
    async fn a_ready_server_is_used_and_stopped_with_sigterm() {
        let (server, dir) = fake(
            r#"trap 'echo bye >&2; exit 0' TERM; echo '{"listening":"127.0.0.1:4321"}'; echo more; while :; do sleep 0.05; done"#,
            Duration::from_secs(5),
        )
        .await;
        let mut server = server.unwrap();
        assert_eq!(server.address, "127.0.0.1:4321");
        let pid = server.pid;
        server.stop().await;
        assert!(!alive(pid));
        assert!(server.exited().is_none(), "reaped by stop");
        let text = std::fs::read_to_string(dir.path.join("server.log")).unwrap();
        assert!(text.contains("bye"), "{text}");
    }

    #[tokio::test]
    async fn a_server_that_exits_early_is_one_clear_line() {
        let (server, _dir) = fake(
            "echo 'baton: error: unrecognized subcommand' >&2; exit 2",
            Duration::from_secs(5),
        )
        .await;
        let error = server.err().unwrap().to_string();
        assert!(
            error.contains("stopped before it was ready (exit 2): baton: error: unrecognized subcommand; pass --backend"),
            "{error}"
        );
        assert!(!error.contains('\n'));
    }

    #[tokio::test]
    async fn a_silent_server_times_out_and_is_killed() {
        let (server, _dir) = fake("exec sleep 30", Duration::from_millis(300)).await;
        let error = server.err().unwrap().to_string();
        assert!(
            error.contains("did not say it was listening within 300ms"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_wrong_ready_line_is_refused() {
        let (server, _dir) = fake("echo listening; exec sleep 30", Duration::from_secs(5)).await;
        let error = server.err().unwrap().to_string();
        assert!(
            error.contains(r#"printed "listening", not {"listening":"IP:PORT"}"#),
            "{error}"
        );
    }
}
