//! `baton run`: the supervisor.
//!
//! It campaigns; while leader it runs CMD (through the guard, inside a containment CMD cannot
//! leave: see [`crate::containment`]) with `BATON_ELECTION`, `BATON_ID` and `BATON_TOKEN`; when
//! leadership ends it stops everything CMD started no later than the local deadline; when CMD
//! and everything it started have exited it resigns and exits with CMD's code.
//!
//! The runtime thread never blocks on anything but the backend: notes go through
//! [`crate::log`], the guard's control pipe is non-blocking (deadlines coalesce), and a guard
//! that stops reading it is treated as failed.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use baton::{parse_duration, ElectionConfig, Leadership, LossReason};
use clap::Args;
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::time::Instant;

use crate::containment::{self, Cage, Mode, PidNamespace, CAGE_ENV};
use crate::{guard, log, open_election, serve, Exit, UsageError, EXIT_LOST};

/// Flags of `baton run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Backend URL: etcd://127.0.0.1:2379/baton, zk://127.0.0.1:2181/baton or
    /// postgres://user:password@127.0.0.1:5432/db?schema=baton.
    #[arg(long, env = "BATON_BACKEND")]
    backend: String,
    /// Election name: one leader per name.
    #[arg(long, env = "BATON_ELECTION")]
    election: String,
    /// This candidate's id, shown by `baton leader` [default: HOSTNAME-PID].
    #[arg(long, env = "BATON_ID")]
    id: Option<String>,
    /// A value published with this candidate (say, the address it serves on), shown by
    /// `baton leader` and `baton observe`.
    #[arg(long, env = "BATON_VALUE")]
    value: Option<String>,
    /// Lease TTL: how long a crashed leader blocks the election.
    #[arg(long, default_value = "10s", value_parser = duration)]
    ttl: Duration,
    /// How long CMD may take to exit after SIGTERM before SIGKILL (never past the local
    /// deadline).
    #[arg(long, default_value = "5s", value_parser = duration)]
    grace: Duration,
    /// After losing leadership, campaign again (and run CMD again when re-elected) instead of
    /// exiting with code 3.
    #[arg(long)]
    requeue: bool,
    /// Time between lease renewals [default: a third of the TTL].
    #[arg(long, value_parser = duration)]
    renew_interval: Option<Duration>,
    /// Assumed bound on clock-rate difference to the server, in parts per million.
    #[arg(long, default_value_t = 10_000)]
    max_drift_ppm: u32,
    /// Extra time taken off the local deadline to cover stopping CMD.
    #[arg(long, default_value = "100ms", value_parser = duration)]
    safety_margin: Duration,
    /// What holds CMD and everything it starts: auto picks the strongest the host allows.
    #[arg(long, env = "BATON_CONTAINMENT", value_enum, default_value_t = Mode::Auto)]
    containment: Mode,
    /// Run CMD in a PID namespace of its own (needs root or CAP_SYS_ADMIN): then every process
    /// of CMD dies even when `baton run` and its guard are killed together (`killall -9
    /// baton`). CMD sees namespace PIDs: its own is 2, and a pidfile it writes holds PIDs the
    /// host does not know.
    #[arg(long, env = "BATON_PID_NAMESPACE", value_enum, default_value_t = PidNamespace::Off)]
    pid_namespace: PidNamespace,
    /// Serve /metrics (Prometheus), /healthz and /leader over HTTP on this IP:PORT (port 0:
    /// any free port; the address is printed on stderr) [default: off].
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// The command to run while leader.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

pub fn duration(text: &str) -> Result<Duration, String> {
    parse_duration(text).map_err(|error| error.to_string())
}

pub(crate) fn default_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    format!("{host}-{}", std::process::id())
}

fn note(election: &str, message: std::fmt::Arguments<'_>) {
    log::line(&format!("baton: {election}: {message}"));
}

/// A guard that has not reported for this long while its control pipe holds unread data is
/// stalled (stopped, or wedged): the command's containment is killed. The guard reads every
/// message at once, so this is far beyond any scheduling delay.
const GUARD_STALL: Duration = Duration::from_secs(1);

/// The least time `kill_all` waits for a SIGKILLed containment to be gone.
const MIN_KILL_WAIT: Duration = Duration::from_secs(1);

/// Signals that matter to the supervisor.
pub(crate) struct Signals {
    term: Signal,
    /// `None` when we were started with SIGINT ignored (a script's background job): it stays
    /// ignored, for us and for CMD.
    int: Option<Signal>,
    /// A closed terminal or SSH session: stop and resign like SIGTERM, rather than die and make
    /// the successor wait out the TTL. `None` under `nohup` (started with SIGHUP ignored): the
    /// job outlives the terminal, as `nohup` asks.
    hup: Option<Signal>,
}

/// Signals meant for the job, or stray, whose default would end the supervisor without
/// resigning (the successor would wait out the TTL): `pkill -USR1 -f JOB` to reopen logs, or
/// `pkill -QUIT -f JOB` for a JVM's thread dump, also match `baton run`'s command line. They
/// are ignored, as the guard ignores them. The realtime signals are added in
/// [`Signals::install`].
pub(crate) const STRAY: [libc::c_int; 9] = [
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGQUIT,
    libc::SIGALRM,
    libc::SIGVTALRM,
    libc::SIGPROF,
    libc::SIGIO,
    libc::SIGPWR,
    libc::SIGSTKFLT,
];

impl Signals {
    pub(crate) fn install() -> anyhow::Result<Signals> {
        // Before anything replaces them: what our caller ignored, CMD ignores too.
        guard::note_inherited_ignores();
        // We wait for our children: with SIGCHLD ignored the kernel would reap them behind our
        // back (CMD still gets it ignored, through the guard).
        // SAFETY: signal with SIG_DFL has no preconditions.
        unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) };
        guard::ignore_signals(STRAY.into_iter().chain(libc::SIGRTMIN()..=libc::SIGRTMAX()));
        let unless_ignored = |number: libc::c_int, kind: SignalKind, name: &str| {
            if guard::inherited_ignore(number) {
                return Ok(None);
            }
            signal(kind)
                .map(Some)
                .with_context(|| format!("installing a {name} handler"))
        };
        Ok(Signals {
            // Always: it is how a supervisor (systemd, Kubernetes, a script) stops the job.
            term: signal(SignalKind::terminate()).context("installing a SIGTERM handler")?,
            int: unless_ignored(libc::SIGINT, SignalKind::interrupt(), "SIGINT")?,
            hup: unless_ignored(libc::SIGHUP, SignalKind::hangup(), "SIGHUP")?,
        })
    }

    /// Waits for SIGTERM, SIGINT or SIGHUP; returns the signal number.
    pub(crate) async fn stop(&mut self) -> i32 {
        async fn maybe(signal: &mut Option<Signal>) {
            match signal {
                Some(signal) => {
                    signal.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            _ = self.term.recv() => libc::SIGTERM,
            () = maybe(&mut self.int) => libc::SIGINT,
            () = maybe(&mut self.hup) => libc::SIGHUP,
        }
    }

    /// Sleeps for `pause` before trying again; a stop signal meanwhile ends the command with
    /// 128+N (there is nothing to resign: the candidacy it waits to retry has ended).
    pub(crate) async fn pause(&mut self, pause: Duration) -> anyhow::Result<()> {
        tokio::select! {
            () = tokio::time::sleep(pause) => Ok(()),
            signal = self.stop() => Err(Exit(128 + signal as u8).into()),
        }
    }
}

/// Why a term of office ended other than by CMD's exit or a stop signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// The library reported the loss.
    Leadership(LossReason),
    /// The guard's dead-man switch fired: it heard of no newer deadline in time.
    DeadMan,
    /// The guard died (it was killed): containment can no longer be vouched for.
    GuardDied(u8),
    /// The guard stopped reading its control pipe (stopped or wedged).
    GuardStalled,
}

impl Ending {
    /// Whether a rival may already be acting, or containment is in doubt: no grace at all.
    fn immediate(self) -> bool {
        !matches!(
            self,
            Ending::Leadership(LossReason::LeaseExpired | LossReason::BackendFailed)
        )
    }
}

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ending::Leadership(reason) => write!(f, "{reason}"),
            Ending::DeadMan => f.write_str("the guard's local deadline passed without renewal"),
            Ending::GuardDied(code) => write!(f, "the command's guard died (status {code})"),
            Ending::GuardStalled => f.write_str("the command's guard stopped responding"),
        }
    }
}

/// Waiting for our id to come free. It may be taken by an entry of our own making: one an
/// earlier campaign left behind (a place lost while the backend was away: a restarted server
/// gives every lease its full TTL again), or one of an earlier run with the same id (a crash
/// and a restart under systemd, a container restarted with the same hostname and PID). That
/// lives on until its lease expires at the backend, about a TTL later (etcd adds its election
/// timeout, ZooKeeper rounds up to its tick). A fresh process cannot tell it from another live
/// candidate with our id, so it waits, up to two TTLs and ten seconds from the first refusal
/// since the backend was last reachable, and only then takes it for a rival (exit 2).
pub(crate) struct IdWait {
    bound: Duration,
    since: Option<Instant>,
    refusals: u32,
}

impl IdWait {
    pub(crate) fn new(ttl: Duration) -> IdWait {
        IdWait {
            bound: ttl * 2 + Duration::from_secs(10),
            since: None,
            refusals: 0,
        }
    }

    /// Counts a refusal of our id; whether to go on waiting for it.
    pub(crate) fn refused(&mut self) -> bool {
        self.refusals += 1;
        self.since.get_or_insert_with(Instant::now).elapsed() < self.bound
    }

    /// Refusals since the wait began (1 for the first).
    pub(crate) fn refusals(&self) -> u32 {
        self.refusals
    }

    /// The backend was away, or the id was had: a later refusal starts a new wait.
    pub(crate) fn reset(&mut self) {
        self.since = None;
        self.refusals = 0;
    }

    /// How long a wait lasts, for messages.
    pub(crate) fn bound(&self) -> String {
        baton::format_duration(self.bound)
    }
}

/// How a term of office ended.
enum Outcome {
    ChildExited(u8),
    Lost(Ending),
    Stopped(i32),
}

/// Removes the cgroup when `baton run` ends (the guard removes it instead if we are killed).
pub(crate) struct CageGuard(pub(crate) Arc<Cage>);

impl Drop for CageGuard {
    fn drop(&mut self) {
        self.0.remove();
    }
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let mut config = ElectionConfig::default()
        .with_ttl(args.ttl)
        .with_requeue(args.requeue)
        .with_max_drift_ppm(args.max_drift_ppm)
        .with_safety_margin(args.safety_margin);
    if let Some(interval) = args.renew_interval {
        config = config.with_renew_interval(interval);
    }
    let id = args.id.clone().unwrap_or_else(default_id);
    let name = args.election.clone();
    crate::program::check(&args.command[0])?;
    // Signals first: a SIGTERM during the campaign must resign, not kill us mid-way.
    let mut signals = Signals::install()?;
    let mut cont =
        signal(SignalKind::from_raw(libc::SIGCONT)).context("installing a SIGCONT handler")?;
    // Bound before anything else: an address in use is bad input, reported at once.
    let endpoint = match args.metrics {
        Some(address) => Some(serve::bind(address).await?),
        None => None,
    };
    let (_backend, election) = open_election(&args.backend, &name, config).await?;
    // Orphans of the guard (should it die) come to us, not to PID 1: we can still kill them.
    containment::become_subreaper().context("becoming a child subreaper")?;
    let mut cage = Cage::create(args.containment).map_err(|why| {
        UsageError(format!(
            "--containment {}: {why}",
            clap::ValueEnum::to_possible_value(&args.containment)
                .map(|v| v.get_name().to_string())
                .unwrap_or_default()
        ))
    })?;
    if let Err(why) = cage.use_pid_namespace(args.pid_namespace) {
        // Refused: the cgroup just made goes too.
        cage.remove();
        return Err(UsageError(format!("--pid-namespace on: {why}")).into());
    }
    let cage = Arc::new(cage);
    let _cage_dir = CageGuard(cage.clone());
    let terms = serve::Terms::new(&name);
    if let Some(endpoint) = endpoint {
        let address = endpoint
            .local_addr()
            .context("reading the --metrics address")?;
        endpoint.spawn(election.clone(), terms.clone());
        note(
            &name,
            format_args!("serving /metrics, /healthz and /leader on http://{address}"),
        );
    }
    let mut options = baton::CandidateOptions::default();
    if let Some(value) = &args.value {
        options = options.with_value(value.clone());
    }
    let mut candidacy = election.candidacy_with(&id, options.clone())?;
    note(
        &name,
        format_args!("campaigning as {id:?}; containment: {}", cage.describe()),
    );
    let mut id_wait = IdWait::new(args.ttl);
    loop {
        // Start the guard while campaigning, so that winning only costs starting CMD.
        let standby = Standby::spawn(&args.command, &name, &id, &cage)?;
        let next = tokio::select! {
            next = candidacy.next() => next,
            signal = signals.stop() => {
                candidacy.resign().await;
                standby.cancel().await;
                return Err(Exit(128 + signal as u8).into());
            }
        };
        let leadership = match next {
            Ok(leadership) => leadership,
            // A waiter that never led lost its place in the queue (its lease expired while
            // the backend was stopped or unreachable): it has nothing to stop, so it queues up
            // again rather than leave the job without a candidate.
            Err(baton::Error::CampaignLost(reason)) => {
                note(
                    &name,
                    format_args!("lost its place in the queue ({reason}); campaigning again"),
                );
                standby.cancel().await;
                candidacy = election.candidacy_with(&id, options.clone())?;
                id_wait.reset();
                continue;
            }
            // Our id is taken, perhaps by an entry of our own that expires: see `IdWait`.
            Err(error @ baton::Error::DuplicateId { .. }) => {
                standby.cancel().await;
                if !id_wait.refused() {
                    return Err(anyhow::Error::new(error).context(format!(
                        "campaigning (the id was still in use after {}: another live \
                         candidate has it)",
                        id_wait.bound()
                    )));
                }
                // Once, then every 5 s: not a line a second for a long TTL.
                if id_wait.refusals() % 5 == 1 {
                    note(
                        &name,
                        format_args!(
                            "{error}: an entry of ours (left by an earlier run or campaign) \
                             lasts until the backend expires it, another live candidate's does \
                             not; waiting up to {} for the id, trying again every 1s",
                            id_wait.bound()
                        ),
                    );
                }
                signals.pause(Duration::from_secs(1)).await?;
                candidacy = election.candidacy_with(&id, options.clone())?;
                continue;
            }
            // The backend went away while we waited: wait for it, as a queued candidate.
            Err(error) if error.is_retryable() => {
                note(
                    &name,
                    format_args!("campaign failed ({error}); trying again in 1s"),
                );
                standby.cancel().await;
                signals.pause(Duration::from_secs(1)).await?;
                candidacy = election.candidacy_with(&id, options.clone())?;
                // The backend was away again: a restarted one gives our old entry another
                // full TTL, so the wait for it starts over once it is back.
                id_wait.reset();
                continue;
            }
            Err(error) => {
                standby.cancel().await;
                return Err(anyhow::Error::new(error).context("campaigning"));
            }
        };
        id_wait.reset();
        let token = leadership.token();
        if !leadership.is_leading() {
            // Won, but the local deadline has already passed (a pause between the election
            // and now): starting the command would be acting without a lease.
            note(
                &name,
                format_args!("elected with token {token} after the lease ran out; not starting"),
            );
            drop(leadership);
            standby.cancel().await;
            if !args.requeue {
                candidacy.resign().await;
                return Err(Exit(EXIT_LOST).into());
            }
            continue;
        }
        let deadline = leadership.deadline().unwrap_or_else(Instant::now);
        // A standby guard that died while we campaigned (a stray kill -9, the OOM killer) is
        // replaced now, at the cost of its start-up: that is no reason to give up the term.
        let started = standby.start(token, deadline).or_else(|_| {
            note(
                &name,
                format_args!("the command's standby guard had died; starting another"),
            );
            Standby::spawn(&args.command, &name, &id, &cage)?.start(token, deadline)
        });
        let mut child = match started {
            Ok(child) => child,
            Err(error) => {
                candidacy.resign().await;
                return Err(error);
            }
        };
        let term = terms.begin(&leadership);
        // Logged after the start: the command need not wait for stderr.
        note(
            &name,
            format_args!("elected with token {token}; command started"),
        );
        match supervise(&mut child, &leadership, &mut signals, &mut cont, &name).await {
            Outcome::ChildExited(code) => {
                // CMD and everything it started are gone (the guard vouches for it, or we make
                // sure) before we resign.
                child.kill_all(args.grace).await;
                drop(term);
                // Resign the whole candidacy in one step (with --requeue, resigning only the
                // term would campaign again).
                candidacy.resign().await;
                // What is left (the lease's revoke, the log, the exit) yields to the successor.
                containment::step_aside();
                drop(leadership);
                note(
                    &name,
                    format_args!("command exited with code {code}; resigned"),
                );
                return if code == 0 {
                    Ok(())
                } else {
                    Err(Exit(code).into())
                };
            }
            Outcome::Stopped(signal) => {
                stop_child(&mut child, &leadership, args.grace, false).await;
                drop(term);
                note(
                    &name,
                    format_args!("stopped on signal {signal}; command stopped, resigning"),
                );
                candidacy.resign().await;
                containment::step_aside();
                drop(leadership);
                return Err(Exit(128 + signal as u8).into());
            }
            Outcome::Lost(ending) => {
                if !args.requeue {
                    // Unhealthy from here to the exit, never `ok` in between.
                    terms.exiting(format!("leadership lost ({ending}); exiting"));
                }
                // Stop first, log after: a blocked stderr must not delay the kill.
                stop_child(&mut child, &leadership, args.grace, ending.immediate()).await;
                drop(term);
                note(
                    &name,
                    format_args!("leadership lost ({ending}); command stopped"),
                );
                drop(leadership);
                if !args.requeue {
                    candidacy.resign().await;
                    return Err(Exit(EXIT_LOST).into());
                }
                // Dropping the term's leadership above ended it (a loss the library did not see
                // itself, such as the guard's, steps down); the candidacy campaigns again.
                note(&name, format_args!("campaigning again"));
            }
        }
    }
}

async fn supervise(
    child: &mut Running,
    leadership: &Leadership,
    signals: &mut Signals,
    cont: &mut Signal,
    election: &str,
) -> Outcome {
    // Renewals move the deadline every third of the TTL; passing it on within 50 ms keeps the
    // guard's copy close behind (it is never later than ours). The same tick notices a host
    // resumed from suspend (the deadline is on `CLOCK_BOOTTIME`) and a stalled guard.
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            biased;
            // After a pause (SIGSTOP/SIGCONT of us or the whole host) look at the deadline
            // first thing, before anything else gets to run.
            _ = cont.recv() => {
                if !leadership.is_leading() {
                    return Outcome::Lost(Ending::Leadership(LossReason::LeaseExpired));
                }
            }
            reason = leadership.lost() => return Outcome::Lost(Ending::Leadership(reason)),
            event = child.event() => match event {
                GuardEvent::Exited(code) => return Outcome::ChildExited(code),
                GuardEvent::Left(code) => note(
                    election,
                    format_args!(
                        "command exited with code {code} but processes it started still run; \
                         the term lasts until they exit"
                    ),
                ),
                GuardEvent::Expired => return Outcome::Lost(Ending::DeadMan),
                GuardEvent::Died(code) => return Outcome::Lost(Ending::GuardDied(code)),
            },
            _ = tick.tick() => {
                if !leadership.is_leading() {
                    return Outcome::Lost(Ending::Leadership(LossReason::LeaseExpired));
                }
                child.extend_deadline(leadership.deadline());
                if child.stalled() {
                    return Outcome::Lost(Ending::GuardStalled);
                }
            }
            signal = signals.stop() => return Outcome::Stopped(signal),
        }
    }
}

/// What the guard reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GuardEvent {
    /// CMD exited with this code and nothing it started is left.
    Exited(u8),
    /// CMD exited with this code; processes it started still run.
    Left(u8),
    /// The guard's dead-man switch killed everything.
    Expired,
    /// The guard died without a report, with this status.
    Died(u8),
}

/// A guard started ahead of time, waiting for its token on the control pipe.
pub(crate) struct Standby {
    child: Child,
    control: OwnedFd,
    status: Option<pipe::Receiver>,
    cage: Arc<Cage>,
}

/// The running guard and CMD.
pub(crate) struct Running {
    child: Child,
    /// The guard's pid.
    guard: i32,
    cage: Arc<Cage>,
    /// The guard's control pipe (non-blocking): each new local deadline goes here.
    control: OwnedFd,
    sent_deadline: Instant,
    /// A deadline the pipe had no room for; only the latest matters.
    pending: Option<u64>,
    /// Since when the control pipe has held data the guard has not read.
    unread_since: Option<Instant>,
    /// The guard's reports.
    status: Option<pipe::Receiver>,
    buffer: Vec<u8>,
    /// A final report (exit, expired, death), returned again on every later call.
    last: Option<GuardEvent>,
}

impl Running {
    /// The guard's next report; a final one is returned again on every later call. Cancel-safe.
    pub(crate) async fn event(&mut self) -> GuardEvent {
        if let Some(event) = self.last {
            return event;
        }
        loop {
            if let Some(event) = self.parse_line() {
                if !matches!(event, GuardEvent::Left(_)) {
                    self.last = Some(event);
                }
                return event;
            }
            let Some(status) = self.status.as_mut() else {
                break;
            };
            let mut chunk = [0u8; 64];
            match status.read(&mut chunk).await {
                Ok(0) | Err(_) => self.status = None,
                Ok(n) => {
                    self.buffer.extend_from_slice(&chunk[..n]);
                    if self.buffer.len() > 1024 {
                        self.status = None;
                    }
                }
            }
        }
        // The pipe closed without a final report: the guard died.
        let code = guard::exit_code(self.child.wait().await) as u8;
        let event = GuardEvent::Died(code);
        self.last = Some(event);
        event
    }

    /// Resolves once the guard reports an end (`left` is not one: its leftovers still run).
    pub(crate) async fn all_exited(&mut self) {
        while let GuardEvent::Left(_) = self.event().await {}
    }

    fn parse_line(&mut self) -> Option<GuardEvent> {
        let end = self.buffer.iter().position(|&b| b == b'\n')?;
        let line: Vec<u8> = self.buffer.drain(..=end).collect();
        let line = String::from_utf8_lossy(&line);
        let mut words = line.split_whitespace();
        let code = |word: Option<&str>| word.and_then(|w| w.parse::<i32>().ok()).unwrap_or(1) as u8;
        match words.next() {
            Some("exit") => Some(GuardEvent::Exited(code(words.next()))),
            Some("left") => Some(GuardEvent::Left(code(words.next()))),
            Some("expired") => Some(GuardEvent::Expired),
            _ => None,
        }
    }

    /// Stops the containment: SIGTERM to every process of it, then, once everything exited,
    /// `kill_at` came or `cut_short` resolved, SIGKILL to whatever is left (see
    /// [`Running::kill_all`], which `grace` bounds). A `kill_at` already past kills at once.
    pub(crate) async fn stop(
        &mut self,
        kill_at: Instant,
        grace: Duration,
        cut_short: impl std::future::Future<Output = ()>,
    ) {
        if kill_at > Instant::now() {
            self.terminate();
            tokio::select! {
                _ = self.all_exited() => {}
                _ = tokio::time::sleep_until(kill_at) => {}
                _ = cut_short => {}
            }
        }
        // Whatever is left, CMD's descendants and the guard included, dies now.
        self.kill_all(grace).await;
    }

    /// Sends SIGTERM, then SIGCONT, once to every process of the containment except the guard
    /// (which ignores stop signals): the cgroup's members and every descendant, including
    /// orphans that were re-parented to us. (A process found both ways gets them once: a
    /// SIGTERM handler that ran twice could do its cleanup twice.) SIGCONT, as systemd sends
    /// it: a stopped process (`kill -STOP`, Ctrl-Z in a terminal it reads) runs its handler at
    /// once, rather than sit out the grace and be killed without cleaning up.
    fn terminate(&self) {
        let sent = self.cage.signal_members(libc::SIGTERM);
        let rest: Vec<containment::Process> = containment::descendants(std::process::id() as i32)
            .into_iter()
            .filter(|p| !sent.iter().any(|s| containment::same_process(s, p)))
            .collect();
        containment::signal_all(&rest, libc::SIGTERM, Some(self.guard));
        containment::signal_all(&sent, libc::SIGCONT, Some(self.guard));
        containment::signal_all(&rest, libc::SIGCONT, Some(self.guard));
    }

    /// Tells the guard about a later local deadline, without ever blocking: if the pipe is
    /// full the newest deadline waits for the next call.
    pub(crate) fn extend_deadline(&mut self, deadline: Option<Instant>) {
        if let Some(deadline) = deadline.filter(|&d| d > self.sent_deadline) {
            self.pending = Some(guard_clock(deadline));
            self.sent_deadline = deadline;
        }
        if let Some(nanos) = self.pending {
            let line = format!("{nanos}\n");
            // SAFETY: write from a buffer we own to our non-blocking descriptor. Lines are far
            // below PIPE_BUF, so a write is all or nothing.
            let written =
                unsafe { libc::write(self.control.as_raw_fd(), line.as_ptr().cast(), line.len()) };
            if written == line.len() as isize {
                self.pending = None;
            }
        }
    }

    /// Whether the guard has left data unread on its control pipe for longer than
    /// [`GUARD_STALL`].
    pub(crate) fn stalled(&mut self) -> bool {
        if unread_bytes(self.control.as_raw_fd()) == 0 && self.pending.is_none() {
            self.unread_since = None;
            return false;
        }
        let since = *self.unread_since.get_or_insert_with(Instant::now);
        since.elapsed() > GUARD_STALL
    }

    /// SIGKILLs the whole containment and waits until nothing of it can run any more: the
    /// guard reaped, no live descendant, the cgroup empty. A process stuck in uninterruptible
    /// I/O (say, on NFS) may still complete a write it had started, so resigning waits for it,
    /// up to `limit`, after which we resign anyway rather than block the election forever.
    pub(crate) async fn kill_all(&mut self, limit: Duration) {
        let me = std::process::id() as i32;
        // Even with --grace 0, give a killed process a moment to finish dying.
        let give_up = Instant::now() + limit.max(MIN_KILL_WAIT);
        // The guard, a subreaper, is the one that can tell for sure that nothing is left (it
        // has no child at all): ask it to kill everything and exit. Only if it does not do so
        // in time (stopped, wedged, dead) do we kill it as well and walk the tree ourselves.
        // A guard that reported the end (`exit`, `expired`) has already seen its last child go,
        // and found the cgroup empty.
        let vouched = matches!(self.last, Some(GuardEvent::Exited(_) | GuardEvent::Expired));
        if vouched
            && containment::children_of(me)
                .iter()
                .all(|&pid| pid == self.guard)
        {
            // Nothing of CMD is under the guard, and nothing else under us (orphans of an
            // earlier term's guard would be): a walk would find nothing and only lengthen the
            // handoff. The guard itself is exiting; it is reaped afterwards.
            return;
        }
        let asked = vouched || self.write_control("kill\n");
        let trust_until = Instant::now() + GUARD_KILL_WAIT;
        let mut clean_walks = 0;
        loop {
            let trusted = vouched || (asked && Instant::now() < trust_until);
            self.cage.kill();
            let skip = trusted.then_some(self.guard);
            // One walk of the tree per round: signal what lives, reap our orphans (the guard
            // is tokio's to reap).
            let tree = containment::descendants(me);
            let live = containment::signal_all(&tree, libc::SIGKILL, skip);
            containment::reap(
                tree.iter()
                    .filter(|p| p.parent == me && !p.live && p.pid != self.guard)
                    .map(|p| p.pid),
            );
            let guard_gone = matches!(self.child.try_wait(), Ok(Some(_)));
            // A walk of /proc is not atomic: a process forking and exiting in a chain can be
            // missed by one walk. Without the guard's word, several clean walks in a row.
            clean_walks = if live == 0 { clean_walks + 1 } else { 0 };
            let enough = if trusted { 1 } else { CLEAN_WALKS };
            // A guard that vouched for the end has nothing of CMD left under it: waiting for
            // its own exit would only delay the resign (it is reaped afterwards).
            if (guard_gone || vouched) && clean_walks >= enough && self.cage.is_empty() {
                return;
            }
            if Instant::now() >= give_up {
                log::line(&format!(
                    "baton: warning: processes of the command survived SIGKILL for {}; resigning anyway",
                    baton::format_duration(limit.max(MIN_KILL_WAIT))
                ));
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Writes a control line without blocking; returns whether it went out whole.
    fn write_control(&self, line: &str) -> bool {
        // SAFETY: write from a buffer we own to our non-blocking descriptor; lines are far
        // below PIPE_BUF, so a write is all or nothing.
        let written =
            unsafe { libc::write(self.control.as_raw_fd(), line.as_ptr().cast(), line.len()) };
        written == line.len() as isize
    }
}

/// How long `kill_all` waits for the guard to kill the containment and exit before doing it
/// without the guard.
const GUARD_KILL_WAIT: Duration = Duration::from_millis(500);

/// How long a standby guard gets to end its launcher and exit when it gets no term.
const STANDBY_CANCEL: Duration = Duration::from_secs(1);

/// Clean walks in a row that `kill_all` needs when the guard cannot vouch for the tree.
const CLEAN_WALKS: u32 = 20;

impl Drop for Running {
    /// However this value goes away (an early return, a panic that unwinds), nothing of the
    /// command outlives it.
    fn drop(&mut self) {
        self.cage.kill();
        containment::signal_tree(std::process::id() as i32, libc::SIGKILL, None);
    }
}

impl Standby {
    /// Starts the guard for `command`; it waits until [`Standby::start`].
    pub(crate) fn spawn(
        command: &[OsString],
        election: &str,
        id: &str,
        cage: &Arc<Cage>,
    ) -> anyhow::Result<Standby> {
        let me = std::env::current_exe().context("finding the baton executable")?;
        // Non-blocking: a guard that stops reading must never block this thread.
        let (read_end, write_end) =
            guard::pipe(libc::O_NONBLOCK).context("creating the guard's control pipe")?;
        let read_fd = read_end.as_raw_fd();
        // Non-blocking for tokio's reader; the guard's short writes never block either.
        let (status_read, status_write) =
            guard::pipe(libc::O_NONBLOCK).context("creating the guard's status pipe")?;
        let status_fd = status_write.as_raw_fd();
        let mut guard = Command::new(me);
        guard
            .arg("__guard")
            .arg("--")
            .args(command)
            .env("BATON_ELECTION", election)
            .env("BATON_ID", id)
            .env("BATON_SUPERVISOR_PID", std::process::id().to_string())
            .env(CAGE_ENV, cage.to_env())
            .env(guard::KEEP_IGNORED_ENV, guard::kept_ignored())
            // The guard and CMD stay in our process group: started from a terminal they are
            // in its foreground group too, so a command that reads the terminal is not stopped
            // by SIGTTIN (containment does not rely on process groups).
            .kill_on_drop(true);
        // SAFETY: between fork and exec we only call dup2, which is async-signal-safe. dup2
        // leaves the new descriptor without close-on-exec, so the guard inherits it as fd 3.
        unsafe {
            guard.pre_exec(move || {
                if libc::dup2(read_fd, guard::CONTROL_FD) < 0
                    || libc::dup2(status_fd, guard::STATUS_FD) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = guard.spawn().context("starting the command's guard")?;
        drop(read_end);
        drop(status_write);
        // Without the status pipe the guard's own exit still tells us; it is only slower.
        let status = pipe::Receiver::from_owned_fd(status_read).ok();
        Ok(Standby {
            child,
            control: write_end,
            status,
            cage: cage.clone(),
        })
    }

    /// Ends a guard that gets no term. Its control pipe closing tells it so: it ends its
    /// launcher, waits for it and exits, leaving the cgroup empty and no orphan to us (killing
    /// it instead would orphan the launcher to us, where it stays a zombie and keeps the cgroup
    /// from being removed). A guard that does not exit in time is killed, and what it leaves
    /// orphaned to us is killed and reaped here.
    pub(crate) async fn cancel(self) {
        let Standby {
            mut child,
            control,
            cage,
            ..
        } = self;
        drop(control);
        if tokio::time::timeout(STANDBY_CANCEL, child.wait())
            .await
            .is_ok()
        {
            return;
        }
        let _ = child.kill().await;
        // The guard is reaped: anything still under us is its launcher (dying of its
        // parent-death signal) or what that started. No other child of ours exists while a
        // standby is being cancelled.
        let me = std::process::id() as i32;
        let give_up = Instant::now() + STANDBY_CANCEL;
        loop {
            cage.kill();
            let tree = containment::descendants(me);
            containment::signal_all(&tree, libc::SIGKILL, None);
            containment::reap(
                tree.iter()
                    .filter(|p| p.parent == me && !p.live)
                    .map(|p| p.pid),
            );
            if tree.is_empty() || Instant::now() >= give_up {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Hands the guard its token and the local deadline: it starts CMD at once.
    pub(crate) fn start(self, token: u64, deadline: Instant) -> anyhow::Result<Running> {
        let line = format!("{token} {}\n", guard_clock(deadline));
        // SAFETY: write from a buffer we own; the pipe is new and empty, so it has room.
        let written =
            unsafe { libc::write(self.control.as_raw_fd(), line.as_ptr().cast(), line.len()) };
        if written != line.len() as isize {
            return Err(std::io::Error::last_os_error())
                .context("starting the command (its guard is gone)");
        }
        let guard = self.child.id().map_or(-1, |pid| pid as i32);
        Ok(Running {
            child: self.child,
            guard,
            cage: self.cage,
            control: self.control,
            sent_deadline: deadline,
            pending: None,
            unread_since: None,
            status: self.status,
            buffer: Vec::new(),
            last: None,
        })
    }
}

/// The bytes written to a pipe and not yet read by the process at its other end.
pub(crate) fn unread_bytes(fd: std::os::fd::RawFd) -> usize {
    let mut unread: libc::c_int = 0;
    // SAFETY: FIONREAD writes an int we own; on a pipe it counts unread bytes.
    unsafe { libc::ioctl(fd, libc::FIONREAD, &mut unread) };
    usize::try_from(unread).unwrap_or(0)
}

/// A tokio deadline as `CLOCK_BOOTTIME` nanoseconds, the guard's clock.
pub(crate) fn guard_clock(deadline: Instant) -> u64 {
    // Read the guard's clock first: time passing between the two reads then moves the result
    // earlier (safe), never later.
    let nanos = guard::clock_nanos();
    let now = Instant::now();
    if deadline > now {
        nanos.saturating_add(u64::try_from((deadline - now).as_nanos()).unwrap_or(u64::MAX))
    } else {
        nanos.saturating_sub(u64::try_from((now - deadline).as_nanos()).unwrap_or(u64::MAX))
    }
}

/// Stops the whole containment: SIGKILL at once when `immediate`, else SIGTERM to every
/// process of it and SIGKILL at the grace or the local deadline, whichever comes first. Returns
/// once nothing of it can act any more (see [`Running::kill_all`]).
async fn stop_child(
    child: &mut Running,
    leadership: &Leadership,
    grace: Duration,
    immediate: bool,
) {
    let now = Instant::now();
    let deadline = leadership.deadline().unwrap_or(now);
    let kill_at = if immediate {
        now
    } else {
        (now + grace).min(deadline)
    };
    // Lost while stopping: kill at once if the deadline itself has passed.
    let cut_short = async {
        leadership.lost().await;
        if leadership.is_leading() {
            std::future::pending::<()>().await;
        }
    };
    child.stop(kill_at, grace, cut_short).await;
}
