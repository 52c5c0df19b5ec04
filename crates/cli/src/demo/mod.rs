//! `baton demo`: the main job, end to end, on this host, in well under a minute.
//!
//! Five real `baton run` candidates (each a supervisor, its guard and the job) compete for one
//! election; the job writes to a fenced store every 150 ms with its token. The demo then does
//! to the leader what production does: kill -9 (failover once the lease runs out), SIGSTOP
//! beyond the TTL (a paused leader that wakes up late: its write is rejected by the fence, its
//! guard kills it, `--requeue` campaigns again) and SIGTERM (graceful handoff), shows it live,
//! checks that no stale write was ever accepted, and writes an HTML report with a timeline.
//!
//! By default it starts baton's embedded server (`baton server`) as the backend; `--backend`
//! uses an existing etcd, ZooKeeper or PostgreSQL instead.
//!
//! Whatever ends it (success, a step that times out, Ctrl-C, SIGTERM, SIGHUP), every process it
//! started is stopped and reaped and its temporary directory removed: the demo is a child
//! subreaper, so even the guard of a supervisor killed with kill -9 is re-parented to it.

mod procs;
mod report;
pub mod store;
mod view;

use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use tokio::sync::mpsc;

use crate::{containment, log, Exit, UsageError};
use procs::{Candidate, Server, TempDir};
use store::{Record, Store};

/// The election the candidates compete in on the demo's own server.
const ELECTION: &str = "demo";

/// The election of this run: [`ELECTION`] on the demo's own server; on a backend given with
/// `--backend`, which other demos may use at the same time, `demo-PID`, so that two demos never
/// count each other's candidates and writes as their own.
static RUN_ELECTION: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn election() -> &'static str {
    RUN_ELECTION.get().map_or(ELECTION, String::as_str)
}

/// The hidden subcommand each candidate runs as its job.
pub const WORKER: &str = "__demo-worker";

/// Flags of `baton demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Use this existing backend (etcd://, zk:// or postgres:// URL) instead of starting
    /// baton's embedded server.
    #[arg(long, env = "BATON_BACKEND")]
    backend: Option<String>,
    /// Lease TTL of the candidates: how long a killed leader blocks the election.
    #[arg(long, default_value = "2s", value_parser = duration)]
    ttl: Duration,
    /// Number of `baton run` candidates (3 to 9).
    #[arg(long, default_value_t = 5)]
    candidates: usize,
    /// Where to write the HTML report.
    #[arg(long, default_value = "baton-demo.html")]
    report: PathBuf,
}

/// Flags of the hidden `baton __demo-worker`.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// The fenced store's Unix socket.
    #[arg(long)]
    pub store: PathBuf,
}

fn duration(text: &str) -> Result<Duration, String> {
    baton::parse_duration(text).map_err(|error| error.to_string())
}

/// The fewest candidates that play every step: one is killed, one is paused (and comes back),
/// one is stopped with SIGTERM, and someone must take over after that.
const MIN_CANDIDATES: usize = 3;
/// Enough to make the point; more only crowds the view.
const MAX_CANDIDATES: usize = 9;
/// The TTL bounds that keep the demo short (every step waits about one TTL at most).
const MIN_TTL: Duration = Duration::from_secs(1);
const MAX_TTL: Duration = Duration::from_secs(10);

/// The stop signal received (SIGINT, SIGTERM or SIGHUP), 0 if none: set by a task, read by
/// every wait.
static STOP: AtomicI32 = AtomicI32::new(0);

fn stop_requested() -> Option<i32> {
    match STOP.load(Ordering::Relaxed) {
        0 => None,
        signal => Some(signal),
    }
}

/// The demo was stopped by a signal (it still cleans up, then exits 128+N).
#[derive(Debug)]
pub struct Interrupted(pub i32);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self.0 {
            libc::SIGINT => "SIGINT",
            libc::SIGHUP => "SIGHUP",
            _ => "SIGTERM",
        };
        write!(f, "stopped by {name}")
    }
}

impl std::error::Error for Interrupted {}

/// A candidate as the view and the report show it.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: String,
    pub pid: i32,
    pub fate: Fate,
    /// How its `baton run` exited, once it has.
    pub exit: Option<String>,
    /// Its log (stdout and stderr of `baton run` and its worker), read at the end.
    pub log: String,
}

/// What the demo did to a candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Nothing (yet): waiting or leading, as the backend says.
    Running,
    /// Its supervisor got kill -9.
    Killed,
    /// Supervisor, guard and worker are stopped (SIGSTOP).
    Paused,
    /// Its supervisor got SIGTERM (or the demo is ending).
    Stopping,
    /// Its `baton run` exited after a stop.
    Stopped,
}

/// A leadership as the backend showed it (through the library's observer).
#[derive(Debug, Clone)]
pub struct Term {
    pub id: String,
    pub token: u64,
    pub start: Duration,
    pub end: Option<Duration>,
}

/// What the demo did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    Kill9,
    /// SIGSTOP of supervisor, guard and worker.
    Stop,
    /// SIGCONT of the worker alone.
    ContWorker,
    /// SIGCONT of the guard and supervisor.
    ContRest,
    Term,
}

#[derive(Debug, Clone)]
pub struct Fault {
    pub at: Duration,
    pub id: String,
    pub kind: FaultKind,
}

/// One line of the event log.
#[derive(Debug, Clone)]
pub struct Event {
    pub at: Duration,
    pub text: String,
    /// Shown prominently (the fence rejecting a late write, a measured time).
    pub loud: bool,
}

/// Everything the demo has seen: what the view draws and the report is made of.
#[derive(Debug)]
pub struct Timeline {
    pub epoch: Instant,
    pub backend: String,
    pub ttl: Duration,
    pub step: String,
    pub rows: Vec<Row>,
    pub leader: Option<baton::LeaderInfo>,
    /// Why the backend cannot be seen, while the demo's observer says so.
    pub unavailable: Option<String>,
    pub terms: Vec<Term>,
    pub faults: Vec<Fault>,
    pub writes: Vec<Record>,
    pub events: Vec<Event>,
    /// kill -9 → the successor's first accepted write.
    pub failover: Option<Duration>,
    /// SIGTERM → the successor's first accepted write.
    pub handoff: Option<Duration>,
    /// The paused leader's late write, rejected by the fence.
    pub late_write: Option<Record>,
    /// When the demo ended.
    pub end: Option<Duration>,
}

impl Timeline {
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn event(&mut self, text: String) {
        let at = self.now();
        self.events.push(Event {
            at,
            text,
            loud: false,
        });
    }

    fn loud(&mut self, text: String) {
        let at = self.now();
        self.events.push(Event {
            at,
            text,
            loud: true,
        });
    }

    fn fault(&mut self, id: &str, kind: FaultKind) -> Duration {
        let at = self.now();
        self.faults.push(Fault {
            at,
            id: id.to_string(),
            kind,
        });
        at
    }

    fn row(&self, id: &str) -> usize {
        self.rows.iter().position(|r| r.id == id).unwrap_or(0)
    }

    /// The candidate whose job holds the highest token the store admitted, and that token:
    /// the leader as the protected resource sees it.
    fn writer(&self) -> Option<(String, u64)> {
        self.writes
            .iter()
            .rev()
            .find(|w| w.accepted)
            .map(|w| (w.id.clone(), w.token))
    }

    /// The first accepted write at or after `since` with a token above `token`.
    fn successor(&self, since: Duration, token: u64) -> Option<Record> {
        self.writes
            .iter()
            .find(|w| w.accepted && w.at >= since && w.token > token)
            .cloned()
    }
}

/// The processes and connections of a running demo.
struct Demo {
    t: Timeline,
    view: view::View,
    candidates: Vec<Candidate>,
    server: Option<Server>,
    store: Option<Store>,
    observed: Option<mpsc::UnboundedReceiver<baton::Observed>>,
    backend: Option<baton::Backend>,
    /// How many of the store's records the timeline has.
    synced: usize,
}

/// The pause between steps, so that each new leader is seen working.
const BREATHE: Duration = Duration::from_millis(1000);

pub async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    if !(MIN_CANDIDATES..=MAX_CANDIDATES).contains(&args.candidates) {
        return Err(UsageError(format!(
            "--candidates {}: the demo needs {MIN_CANDIDATES} to {MAX_CANDIDATES}",
            args.candidates
        ))
        .into());
    }
    if !(MIN_TTL..=MAX_TTL).contains(&args.ttl) || args.ttl.subsec_nanos() != 0 {
        return Err(UsageError(format!(
            "--ttl {}: the demo takes whole seconds from {} to {}",
            baton::format_duration(args.ttl),
            baton::format_duration(MIN_TTL),
            baton::format_duration(MAX_TTL)
        ))
        .into());
    }
    if args.report.as_os_str().is_empty() || args.report.is_dir() {
        return Err(UsageError(format!("--report {:?}: expected a file path", args.report)).into());
    }
    // Told now, not after the whole demo has run.
    let parent = args.report.parent().filter(|p| !p.as_os_str().is_empty());
    if parent.is_some_and(|p| !p.is_dir()) {
        return Err(UsageError(format!(
            "--report {}: its directory does not exist",
            args.report.display()
        ))
        .into());
    }
    if let Err(error) = check_writable(&args.report) {
        return Err(UsageError(format!(
            "--report {}: cannot write it: {error}",
            args.report.display()
        ))
        .into());
    }
    if let Some(url) = &args.backend {
        // Bad URLs are bad input, told before anything starts.
        match baton::BackendUrl::parse(url) {
            Err(error) => return Err(UsageError(error.to_string()).into()),
            Ok(baton::BackendUrl::Memory { .. }) => {
                return Err(UsageError(format!(
                    "--backend {url}: memory:// lives inside one process; the candidates are \
                     processes of their own and need a shared backend such as etcd://"
                ))
                .into())
            }
            Ok(_) => {}
        }
    }
    listen_for_stop()?;
    // Orphans (the guard of a supervisor killed with kill -9) come to us, not to PID 1, so the
    // demo can reap them and kill whatever is left at the end.
    containment::become_subreaper().context("becoming a child subreaper")?;
    let dir = TempDir::create()?;
    let epoch = Instant::now();
    let mut demo = Demo {
        t: Timeline {
            epoch,
            backend: String::new(),
            ttl: args.ttl,
            step: "starting".into(),
            rows: Vec::new(),
            leader: None,
            unavailable: None,
            terms: Vec::new(),
            faults: Vec::new(),
            writes: Vec::new(),
            events: Vec::new(),
            failover: None,
            handoff: None,
            late_write: None,
            end: None,
        },
        view: view::View::new(),
        candidates: Vec::new(),
        server: None,
        store: None,
        observed: None,
        backend: None,
        synced: 0,
    };
    let played = demo.play(&args, &dir).await;
    demo.t.step = "stopping every candidate".into();
    demo.cleanup().await;
    demo.t.end = Some(demo.t.now());
    demo.view.finish(&demo.t);
    for (row, candidate) in demo.t.rows.iter_mut().zip(&demo.candidates) {
        row.log = std::fs::read_to_string(&candidate.log).unwrap_or_default();
    }
    let server_log = demo
        .server
        .as_ref()
        .and_then(|s| std::fs::read_to_string(&s.log).ok());
    drop(dir);
    let summary = report::Summary::of(&demo.t);
    // A failed demo still gets its report when it got as far as starting candidates: their
    // logs are the only record of what went wrong (the temporary directory is gone).
    let failure = played.as_ref().err().map(crate::one_line);
    let wrote = if demo.t.rows.is_empty() {
        None
    } else {
        let page = report::html(&demo.t, &summary, failure.as_deref(), server_log.as_deref());
        Some(
            std::fs::write(&args.report, page)
                .with_context(|| format!("writing the report to {}", args.report.display())),
        )
    };
    match played {
        Ok(()) => {
            view::print(&summary.text());
            wrote.unwrap_or_else(|| Ok(()))?;
            // Absolute, so that it can be opened from wherever the output is read.
            let shown = std::path::absolute(&args.report).unwrap_or_else(|_| args.report.clone());
            view::print(&format!("report: {}\n", shown.display()));
            if summary.stale_accepted > 0 {
                anyhow::bail!(
                    "{} stale writes were accepted: the fence did not hold",
                    summary.stale_accepted
                );
            }
            Ok(())
        }
        Err(error) => {
            let report = match wrote {
                Some(Ok(())) => format!("; the report so far is in {}", args.report.display()),
                _ => String::new(),
            };
            if let Some(Interrupted(signal)) = error.downcast_ref::<Interrupted>() {
                log::line(&format!(
                    "baton: demo: {}; every process it started is stopped{report}",
                    Interrupted(*signal)
                ));
                return Err(Exit(128 + *signal as u8).into());
            }
            // One line: the failure, then where its report is.
            log::line(&format!(
                "baton: error: {}{report}",
                crate::one_line(&error)
            ));
            Err(Exit(crate::exit_status_of(&error)).into())
        }
    }
}

/// Records SIGINT, SIGTERM and SIGHUP (a closed terminal or SSH session) for the waits to act
/// on (the demo then cleans up, rather than dying with its candidates still running and its
/// directory left behind).
fn listen_for_stop() -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let mut hup = signal(SignalKind::hangup()).context("installing a SIGHUP handler")?;
    tokio::spawn(async move {
        let got = tokio::select! {
            _ = int.recv() => libc::SIGINT,
            _ = term.recv() => libc::SIGTERM,
            _ = hup.recv() => libc::SIGHUP,
        };
        STOP.store(got, Ordering::Relaxed);
    });
    Ok(())
}

impl Demo {
    async fn play(&mut self, args: &DemoArgs, dir: &TempDir) -> anyhow::Result<()> {
        // The backend.
        let url = match &args.backend {
            Some(url) => {
                let _ = RUN_ELECTION.set(format!("{ELECTION}-{}", std::process::id()));
                self.t.event(format!(
                    "backend: {url} (given with --backend), election {}",
                    election()
                ));
                url.clone()
            }
            None => {
                self.step("starting baton's embedded server");
                let data = dir.path.join("server");
                std::fs::create_dir_all(&data).context("creating the server's data directory")?;
                let server = Server::start(&data, dir.path.join("server.log")).await?;
                let url = format!("etcd://{}/{ELECTION}", server.address);
                self.t.event(format!(
                    "embedded server (pid {}) listening on {}",
                    server.pid, server.address
                ));
                self.server = Some(server);
                url
            }
        };
        self.t.backend = url.clone();
        // The demo's own view of the election, through the library.
        let config = baton::ElectionConfig::default().with_ttl(args.ttl);
        let (backend, election) = crate::open_election(&url, election(), config)
            .await
            .with_context(|| format!("connecting to {url}"))?;
        self.backend = Some(backend);
        let mut observer = election.observe().await.context("observing the election")?;
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(observed) = observer.next().await {
                if tx.send(observed).is_err() {
                    return;
                }
            }
        });
        self.observed = Some(rx);
        // The fenced store.
        let socket = dir.path.join("store.sock");
        self.store = Some(Store::start(&socket, self.t.epoch)?);
        self.t.event(
            "fenced store listening (admits a write only if its token ≥ the highest seen)".into(),
        );

        // (a) Candidates, and the first leader.
        self.step(&format!(
            "step 1/4: {} candidates campaign; the first leader starts its job",
            args.candidates
        ));
        for n in 1..=args.candidates {
            let id = format!("node-{n}");
            let log = dir.path.join(format!("{id}.log"));
            let candidate = Candidate::spawn(&url, &id, args.ttl, &socket, log)?;
            self.t.event(format!(
                "{id}: baton run started (pid {}), campaigning",
                candidate.pid
            ));
            self.t.rows.push(Row {
                id,
                pid: candidate.pid,
                fate: Fate::Running,
                exit: None,
                log: String::new(),
            });
            self.candidates.push(candidate);
        }
        let first = self
            .wait_for(
                "the first leader's first accepted write",
                Duration::from_secs(15),
                |t| t.writer(),
            )
            .await?;
        self.t.loud(format!(
            "{} leads: its job writes with token {}",
            first.0, first.1
        ));
        self.breathe().await?;

        // (b) kill -9 of the leader's supervisor.
        self.step("step 2/4: kill -9 the leader's baton run (failover after the TTL)");
        let (victim, token) = self.leader().await?;
        let index = self.t.row(&victim);
        self.candidates[index].signal(libc::SIGKILL);
        self.t.rows[index].fate = Fate::Killed;
        let killed = self.t.fault(&victim, FaultKind::Kill9);
        self.t.loud(format!(
            "kill -9 {victim}'s baton run (pid {}): its guard kills the job at once; the lease runs out after {}",
            self.t.rows[index].pid,
            baton::format_duration(args.ttl)
        ));
        let limit = args.ttl * 3 + Duration::from_secs(5);
        let next = self
            .wait_for(
                "a successor's first accepted write after kill -9",
                limit,
                |t| t.successor(killed, token),
            )
            .await?;
        let failover = next.at.saturating_sub(killed);
        self.t.failover = Some(failover);
        self.t.loud(format!(
            "failover: {} writes with token {}, {} ms after kill -9 (TTL {})",
            next.id,
            next.token,
            failover.as_millis(),
            baton::format_duration(args.ttl)
        ));
        self.breathe().await?;

        // (c) SIGSTOP beyond the TTL: a paused leader that wakes up late.
        self.step("step 3/4: SIGSTOP the leader beyond the TTL, then wake its job first");
        let (victim, token) = self.leader().await?;
        let index = self.t.row(&victim);
        let supervisor = self.t.rows[index].pid;
        let term = procs::find_term(supervisor)
            .with_context(|| format!("finding {victim}'s guard and job in /proc"))?;
        procs::signal_descendant(term.worker, term.guard, libc::SIGSTOP);
        procs::signal_descendant(term.guard, supervisor, libc::SIGSTOP);
        self.candidates[index].signal(libc::SIGSTOP);
        self.t.rows[index].fate = Fate::Paused;
        let stopped = self.t.fault(&victim, FaultKind::Stop);
        self.t.loud(format!(
            "SIGSTOP {victim}: job (pid {}), guard (pid {}) and baton run (pid {}) frozen; it still believes it leads with token {token}",
            term.worker, term.guard, supervisor
        ));
        let next = self
            .wait_for(
                "another candidate to lead and write while one is paused",
                limit,
                |t| t.successor(stopped, token),
            )
            .await?;
        self.t.event(format!(
            "{} leads and writes with token {} while {victim} is frozen",
            next.id, next.token
        ));
        let worker = term.worker as u32;
        procs::signal_descendant(term.worker, term.guard, libc::SIGCONT);
        let woke = self.t.fault(&victim, FaultKind::ContWorker);
        self.t.event(format!(
            "SIGCONT {victim}'s job only: it wakes up late and writes with its old token {token}"
        ));
        let late = self
            .wait_for("the paused job's late write", Duration::from_secs(5), |t| {
                t.writes
                    .iter()
                    .find(|w| w.pid == worker && w.at >= woke && w.token == token)
                    .cloned()
            })
            .await?;
        if late.accepted {
            anyhow::bail!(
                "the fence accepted {victim}'s late write with token {token} (highest seen {:?})",
                late.highest
            );
        }
        self.t.loud(format!(
            "REJECTED BY THE FENCE: {victim}'s late write with token {token} (the store has seen token {})",
            late.highest.unwrap_or(0)
        ));
        self.t.late_write = Some(late);
        procs::signal_descendant(term.guard, supervisor, libc::SIGCONT);
        self.candidates[index].signal(libc::SIGCONT);
        self.t.rows[index].fate = Fate::Running;
        self.t.fault(&victim, FaultKind::ContRest);
        self.t.event(format!(
            "SIGCONT {victim}'s guard and baton run: the deadline has passed, so the guard kills the stale job"
        ));
        let worker = term.worker;
        self.wait_for(
            "the stale job to be killed by its guard",
            Duration::from_secs(5),
            |_| (!procs::alive(worker)).then_some(()),
        )
        .await?;
        self.t.event(format!(
            "{victim}'s stale job is gone; with --requeue it campaigns again"
        ));
        self.breathe().await?;

        // (d) SIGTERM: graceful handoff.
        self.step("step 4/4: SIGTERM the leader's baton run (graceful handoff)");
        let (victim, token) = self.leader().await?;
        let index = self.t.row(&victim);
        self.candidates[index].signal(libc::SIGTERM);
        self.t.rows[index].fate = Fate::Stopping;
        let termed = self.t.fault(&victim, FaultKind::Term);
        self.t.loud(format!(
            "SIGTERM {victim}'s baton run (pid {}): it stops its job and resigns",
            self.t.rows[index].pid
        ));
        let next = self
            .wait_for(
                "a successor's first accepted write after SIGTERM",
                limit,
                |t| t.successor(termed, token),
            )
            .await?;
        let handoff = next.at.saturating_sub(termed);
        self.t.handoff = Some(handoff);
        self.t.loud(format!(
            "handoff: {} writes with token {}, {} ms after SIGTERM",
            next.id,
            next.token,
            handoff.as_millis()
        ));
        self.wait_for(
            "the SIGTERMed baton run to exit",
            Duration::from_secs(5),
            |t| (t.rows[index].fate == Fate::Stopped).then_some(()),
        )
        .await?;
        self.breathe().await?;
        Ok(())
    }

    fn step(&mut self, step: &str) {
        self.t.step = step.to_string();
        self.t.event(format!("— {step}"));
    }

    /// The current leader: the candidate whose job holds the highest token the store admitted,
    /// once the backend (through the observer) names the same candidate and token. Both views
    /// must agree before the demo acts on one of them.
    async fn leader(&mut self) -> anyhow::Result<(String, u64)> {
        self.wait_for(
            "the store and the backend to agree on the leader",
            Duration::from_secs(5),
            |t| {
                let (id, token) = t.writer()?;
                let leader = t.leader.as_ref()?;
                (leader.id == id && leader.token == token).then_some((id, token))
            },
        )
        .await
    }

    /// Lets the demo run for [`BREATHE`] (refreshing the view, watching for trouble).
    async fn breathe(&mut self) -> anyhow::Result<()> {
        let until = Instant::now() + BREATHE;
        self.wait_for("a pause", BREATHE * 2, |_| {
            (Instant::now() >= until).then_some(())
        })
        .await
    }

    /// Polls until `check` answers (refreshing the view, noticing exits and stop signals);
    /// a clear error after `limit`.
    async fn wait_for<T>(
        &mut self,
        what: &str,
        limit: Duration,
        mut check: impl FnMut(&Timeline) -> Option<T>,
    ) -> anyhow::Result<T> {
        let give_up = Instant::now() + limit;
        loop {
            self.tick()?;
            if let Some(value) = check(&self.t) {
                return Ok(value);
            }
            if Instant::now() >= give_up {
                // The likeliest cause first, when the demo's own observer has it.
                let cause = match &self.t.unavailable {
                    Some(reason) => format!(" (the backend cannot be reached: {reason})"),
                    None => String::new(),
                };
                anyhow::bail!(
                    "{} ({}): not within {}{cause}",
                    what,
                    self.t.step,
                    baton::format_duration(limit)
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Brings the timeline up to date and redraws; fails on a stop signal or on a process
    /// that exited when it should not have.
    fn tick(&mut self) -> anyhow::Result<()> {
        if let Some(signal) = stop_requested() {
            return Err(Interrupted(signal).into());
        }
        let now = self.t.now();
        if let Some(rx) = self.observed.as_mut() {
            let mut seen = Vec::new();
            while let Ok(observed) = rx.try_recv() {
                seen.push(observed);
            }
            for observed in seen {
                self.observe(observed, now);
            }
        }
        if let Some(store) = &self.store {
            let new = store.writes_since(self.synced);
            self.synced += new.len();
            for write in new {
                self.record(write);
            }
        }
        for (index, candidate) in self.candidates.iter_mut().enumerate() {
            if let Some(status) = candidate.exited() {
                let row = &mut self.t.rows[index];
                row.exit = Some(status.clone());
                let expected = matches!(row.fate, Fate::Killed | Fate::Stopping | Fate::Stopped);
                if row.fate == Fate::Stopping {
                    row.fate = Fate::Stopped;
                }
                let id = row.id.clone();
                if !expected {
                    // Its last line explains the exit only when it is the error it exited with
                    // (not when it was killed, say, mid-way through its progress lines).
                    let words = candidate.last_words();
                    let why = if words.contains("error:") {
                        format!(": {words}")
                    } else {
                        String::new()
                    };
                    anyhow::bail!("{id}'s baton run exited unexpectedly ({status}){why}");
                }
                self.t.event(format!("{id}: baton run exited ({status})"));
            }
        }
        if let Some(server) = self.server.as_mut() {
            if let Some(status) = server.exited() {
                anyhow::bail!("baton's embedded server exited unexpectedly ({status})");
            }
        }
        procs::reap_orphans(&self.known_pids());
        self.view.draw(&self.t);
        Ok(())
    }

    fn observe(&mut self, observed: baton::Observed, now: Duration) {
        match observed {
            baton::Observed::Leader(leader) => {
                self.t.unavailable = None;
                let same = |a: &Option<baton::LeaderInfo>, b: &Option<baton::LeaderInfo>| {
                    a.as_ref().map(|l| l.token) == b.as_ref().map(|l| l.token)
                };
                if same(&self.t.leader, &leader) {
                    return;
                }
                if let Some(term) = self.t.terms.last_mut().filter(|t| t.end.is_none()) {
                    term.end = Some(now);
                }
                match &leader {
                    Some(info) => {
                        self.t.terms.push(Term {
                            id: info.id.clone(),
                            token: info.token,
                            start: now,
                            end: None,
                        });
                        self.t.event(format!(
                            "backend: {} leads with token {}",
                            info.id, info.token
                        ));
                    }
                    None => self.t.event("backend: no leader".into()),
                }
                self.t.leader = leader;
            }
            baton::Observed::Unavailable { reason } => {
                self.t.event(format!("backend cannot be seen: {reason}"));
                self.t.unavailable = Some(reason);
            }
        }
    }

    fn record(&mut self, write: Record) {
        if write.accepted {
            let first = !self
                .t
                .writes
                .iter()
                .any(|w| w.accepted && w.token == write.token);
            if first {
                self.t.event(format!(
                    "store: first write of {} with token {} accepted",
                    write.id, write.token
                ));
            }
        } else {
            self.t.loud(format!(
                "store: REJECTED {}'s write (job pid {}) with token {} (it has seen token {})",
                write.id,
                write.pid,
                write.token,
                write.highest.unwrap_or(0)
            ));
        }
        self.t.writes.push(write);
    }

    /// The PIDs that have handles (reaped through them, never by the orphan sweep).
    fn known_pids(&self) -> Vec<i32> {
        let mut known: Vec<i32> = self
            .candidates
            .iter()
            .filter(|c| c.child.is_some())
            .map(|c| c.pid)
            .collect();
        if let Some(server) = self.server.as_ref().filter(|s| s.child.is_some()) {
            known.push(server.pid);
        }
        known
    }

    /// Stops everything the demo started, whatever state it is in: wakes paused processes,
    /// SIGTERMs the candidates (they stop their jobs and resign), SIGKILLs what is left after
    /// a few seconds, closes the demo's own connection, stops the server last (the candidates
    /// resign through it), then kills and reaps any orphan.
    async fn cleanup(&mut self) {
        let me = std::process::id() as i32;
        // A process stopped mid-demo cannot act on SIGTERM until it runs again.
        containment::signal_tree(me, libc::SIGCONT, None);
        if self.candidates.iter().any(|c| c.child.is_some()) {
            self.t.event("— SIGTERM every remaining candidate".into());
        }
        for (index, candidate) in self.candidates.iter().enumerate() {
            if candidate.child.is_some() {
                candidate.signal(libc::SIGTERM);
                if self.t.rows[index].fate != Fate::Killed {
                    self.t.rows[index].fate = Fate::Stopping;
                }
            }
        }
        let give_up = Instant::now() + CANDIDATES_STOP;
        while self.candidates.iter().any(|c| c.child.is_some()) && Instant::now() < give_up {
            for (index, candidate) in self.candidates.iter_mut().enumerate() {
                if let Some(status) = candidate.exited() {
                    let row = &mut self.t.rows[index];
                    row.exit = Some(status.clone());
                    if row.fate == Fate::Stopping {
                        row.fate = Fate::Stopped;
                    }
                    let id = row.id.clone();
                    self.t.event(format!("{id}: baton run exited ({status})"));
                }
            }
            self.view.draw(&self.t);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for (index, candidate) in self.candidates.iter_mut().enumerate() {
            if let Some(mut child) = candidate.child.take() {
                let _ = child.kill().await;
                self.t.rows[index].exit = Some("killed by the demo after 3s".into());
                self.t.rows[index].fate = Fate::Stopped;
            }
        }
        if let Some(store) = self.store.take() {
            // The last writes, as the jobs stopped.
            let new = store.writes_since(self.synced);
            self.synced += new.len();
            for write in new {
                self.record(write);
            }
            store.stop();
        }
        if let Some(rx) = self.observed.as_mut() {
            rx.close();
        }
        if let Some(backend) = self.backend.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), backend.close()).await;
        }
        if let Some(server) = self.server.as_mut() {
            server.stop().await;
        }
        // Orphans (a killed supervisor's guard, anything a job left): SIGKILL and reap until
        // none is left.
        let give_up = Instant::now() + Duration::from_secs(3);
        loop {
            let known = self.known_pids();
            let live = procs::kill_orphans(&known);
            if containment::descendants(me).is_empty() || Instant::now() >= give_up {
                if live > 0 {
                    log::line("baton: demo: warning: some processes survived SIGKILL");
                }
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// How long the candidates get to stop their jobs and resign at the end before SIGKILL.
const CANDIDATES_STOP: Duration = Duration::from_secs(3);

/// Whether `path` can be written, found by opening it for appending (an existing file is left
/// as it is; one this made is removed again).
fn check_writable(path: &std::path::Path) -> std::io::Result<()> {
    let existed = path.exists();
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)?;
    if !existed {
        std::fs::remove_file(path)?;
    }
    Ok(())
}
