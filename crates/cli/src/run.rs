//! `baton run`: the supervisor.
//!
//! It campaigns; while leader it runs CMD (through the guard, in its own process group) with
//! `BATON_ELECTION`, `BATON_ID` and `BATON_TOKEN`; when leadership ends it stops the group no
//! later than the local deadline; when CMD exits it resigns and exits with CMD's code.

use std::ffi::OsString;
use std::time::Duration;

use anyhow::Context;
use baton::{parse_duration, ElectionConfig, Leadership, LossReason};
use clap::Args;
use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::time::Instant;

use crate::{guard, open_election, Exit, EXIT_LOST};
use std::os::fd::AsRawFd;

/// Flags of `baton run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Backend URL, for example etcd://127.0.0.1:2379/baton.
    #[arg(long, env = "BATON_BACKEND")]
    backend: String,
    /// Election name: one leader per name.
    #[arg(long, env = "BATON_ELECTION")]
    election: String,
    /// This candidate's id, shown by `baton leader` [default: HOSTNAME-PID].
    #[arg(long, env = "BATON_ID")]
    id: Option<String>,
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
    /// The command to run while leader.
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

fn duration(text: &str) -> Result<Duration, String> {
    parse_duration(text).map_err(|error| error.to_string())
}

fn default_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "host".into());
    format!("{host}-{}", std::process::id())
}

fn note(election: &str, message: std::fmt::Arguments<'_>) {
    eprintln!("baton: {election}: {message}");
}

/// Signals that matter to the supervisor.
struct Signals {
    term: Signal,
    int: Signal,
}

impl Signals {
    fn install() -> anyhow::Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate()).context("installing a SIGTERM handler")?,
            int: signal(SignalKind::interrupt()).context("installing a SIGINT handler")?,
        })
    }

    /// Waits for SIGTERM or SIGINT; returns the signal number.
    async fn stop(&mut self) -> i32 {
        tokio::select! {
            _ = self.term.recv() => libc::SIGTERM,
            _ = self.int.recv() => libc::SIGINT,
        }
    }
}

/// How a term of office ended.
enum Outcome {
    ChildExited(u8),
    Lost(LossReason),
    Stopped(i32),
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
    // Signals first: a SIGTERM during the campaign must resign, not kill us mid-way.
    let mut signals = Signals::install()?;
    let mut cont =
        signal(SignalKind::from_raw(libc::SIGCONT)).context("installing a SIGCONT handler")?;
    let (_backend, election) = open_election(&args.backend, &name, config).await?;
    let mut candidacy = election.candidacy(&id)?;
    note(&name, format_args!("campaigning as {id:?}"));
    loop {
        // Start the guard while campaigning, so that winning only costs starting CMD.
        let standby = Standby::spawn(&args.command, &name, &id)?;
        let leadership = tokio::select! {
            leadership = candidacy.next() => leadership.context("campaigning")?,
            signal = signals.stop() => {
                candidacy.resign().await;
                return Err(Exit(128 + signal as u8).into());
            }
        };
        let token = leadership.token();
        if !leadership.is_leading() {
            // Won, but the local deadline has already passed (a pause between the election
            // and now): starting the command would be acting without a lease.
            note(
                &name,
                format_args!("elected with token {token} after the lease ran out; not starting"),
            );
            drop(leadership);
            drop(standby);
            if !args.requeue {
                candidacy.resign().await;
                return Err(Exit(EXIT_LOST).into());
            }
            continue;
        }
        let deadline = leadership.deadline().unwrap_or_else(Instant::now);
        let mut child = match standby.start(token, deadline) {
            Ok(child) => child,
            Err(error) => {
                candidacy.resign().await;
                return Err(error);
            }
        };
        // Logged after the start: the command need not wait for stderr.
        note(
            &name,
            format_args!("elected with token {token}; command started"),
        );
        match supervise(&mut child, &leadership, &mut signals, &mut cont).await {
            Outcome::ChildExited(code) => {
                // CMD is gone; its leftovers in the group (and the guard) die before we resign.
                child.kill_all(args.grace).await;
                // Resign the whole candidacy in one step (with --requeue, resigning only the
                // term would campaign again).
                candidacy.resign().await;
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
                note(
                    &name,
                    format_args!("stopped on signal {signal}; command stopped, resigning"),
                );
                candidacy.resign().await;
                drop(leadership);
                return Err(Exit(128 + signal as u8).into());
            }
            Outcome::Lost(reason) => {
                // A deleted key means a rival may win right now: no grace at all. Otherwise
                // SIGTERM first, SIGKILL at the grace or the local deadline, whichever is first.
                let immediate = reason == LossReason::KeyDeleted;
                // Stop first, log after: a blocked stderr must not delay the kill.
                stop_child(&mut child, &leadership, args.grace, immediate).await;
                note(
                    &name,
                    format_args!("leadership lost ({reason}); command stopped"),
                );
                drop(leadership);
                if !args.requeue {
                    candidacy.resign().await;
                    return Err(Exit(EXIT_LOST).into());
                }
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
) -> Outcome {
    // Renewals move the deadline every third of the TTL; passing it on within 50 ms keeps the
    // guard's copy close behind (it is never later than ours).
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            biased;
            // After a pause (SIGSTOP/SIGCONT of us or the whole host) look at the deadline
            // first thing, before anything else gets to run.
            _ = cont.recv() => {
                if !leadership.is_leading() {
                    return Outcome::Lost(LossReason::LeaseExpired);
                }
            }
            reason = leadership.lost() => return Outcome::Lost(reason),
            code = child.exited() => return Outcome::ChildExited(code),
            _ = tick.tick() => child.extend_deadline(leadership.deadline()),
            signal = signals.stop() => return Outcome::Stopped(signal),
        }
    }
}

/// A guard started ahead of time, waiting for its token on the control pipe.
struct Standby {
    child: Child,
    control: std::fs::File,
    status: Option<pipe::Receiver>,
}

/// The running guard and CMD.
struct Running {
    child: Child,
    /// The process group: the guard's pid.
    group: Option<i32>,
    /// The guard's control pipe: each new local deadline goes here (the guard kills the group
    /// at the last one it heard of, should this process stall).
    control: std::fs::File,
    sent_deadline: Instant,
    /// The guard reports CMD's exit code here as soon as CMD exits, before its own exit.
    status: Option<pipe::Receiver>,
    buffer: Vec<u8>,
    code: Option<u8>,
}

impl Running {
    /// CMD's exit code, as soon as it is known: from the guard's report, or else from the
    /// guard's own exit. Cancel-safe.
    async fn exited(&mut self) -> u8 {
        if let Some(code) = self.code {
            return code;
        }
        while let Some(status) = self.status.as_mut() {
            let mut chunk = [0u8; 16];
            match status.read(&mut chunk).await {
                Ok(0) | Err(_) => self.status = None,
                Ok(n) => {
                    self.buffer.extend_from_slice(&chunk[..n]);
                    if let Some(end) = self.buffer.iter().position(|&b| b == b'\n') {
                        let code = std::str::from_utf8(&self.buffer[..end])
                            .ok()
                            .and_then(|text| text.parse().ok())
                            .unwrap_or(1);
                        self.code = Some(code);
                        return code;
                    }
                    if self.buffer.len() > 64 {
                        self.status = None;
                    }
                }
            }
        }
        let code = guard::exit_code(self.child.wait().await) as u8;
        self.code = Some(code);
        code
    }

    fn signal(&self, signal: libc::c_int) {
        kill_group(self.group, signal);
    }

    /// Tells the guard about a later local deadline.
    fn extend_deadline(&mut self, deadline: Option<Instant>) {
        use std::io::Write;
        if let Some(deadline) = deadline.filter(|&d| d > self.sent_deadline) {
            // A full pipe cannot happen (the guard reads continuously); if the guard is gone,
            // the command is too, and the status pipe says so.
            let _ = writeln!(self.control, "{}", monotonic_deadline(deadline));
            self.sent_deadline = deadline;
        }
    }

    /// SIGKILLs the whole group and waits until nothing in it can run any more: the guard
    /// reaped, and no other member alive (zombies aside). A member stuck in uninterruptible
    /// I/O (say, on NFS) may still complete a write it had started, so resigning waits for it,
    /// up to `limit`, after which we resign anyway rather than block the election forever.
    async fn kill_all(&mut self, limit: Duration) {
        self.signal(libc::SIGKILL);
        let _ = self.child.wait().await;
        // Even with --grace 0, give a killed process a moment to finish dying.
        let give_up = Instant::now() + limit.max(MIN_KILL_WAIT);
        while group_has_live_members(self.group) {
            if Instant::now() >= give_up {
                eprintln!(
                    "baton: warning: processes of the command's group survived SIGKILL for {}; resigning anyway",
                    baton::format_duration(limit.max(MIN_KILL_WAIT))
                );
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// The least time `kill_all` waits for a SIGKILLed group to be gone.
const MIN_KILL_WAIT: Duration = Duration::from_secs(1);

/// Whether any process of `group`, other than zombies, is still there.
fn group_has_live_members(group: Option<i32>) -> bool {
    let Some(group) = group.filter(|&g| g > 0) else {
        return false;
    };
    // SAFETY: kill with signal 0 only checks for existence.
    if unsafe { libc::kill(-group, 0) } != 0 {
        return false;
    }
    // Something (perhaps only zombies) remains: look closer.
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|entry| {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            return false;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            return false;
        };
        let Some((_, after)) = stat.rsplit_once(')') else {
            return false;
        };
        let mut fields = after.split_whitespace();
        let state = fields.next().unwrap_or("");
        let group_of = fields.nth(1).and_then(|g| g.parse::<i32>().ok());
        if group_of != Some(group) {
            return false;
        }
        // A zombie leader thread can hide a live thread (say, one in an NFS write): the
        // process counts as gone only when every thread is.
        is_live_state(state) || any_live_thread(pid)
    })
}

fn is_live_state(state: &str) -> bool {
    state != "Z" && state != "X"
}

fn any_live_thread(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|task| {
        std::fs::read_to_string(task.path().join("stat"))
            .ok()
            .and_then(|stat| {
                let (_, after) = stat.rsplit_once(')')?;
                after.split_whitespace().next().map(is_live_state)
            })
            .unwrap_or(false)
    })
}

impl Standby {
    /// Starts the guard for `command`; it waits until [`Standby::start`].
    fn spawn(command: &[OsString], election: &str, id: &str) -> anyhow::Result<Standby> {
        let me = std::env::current_exe().context("finding the baton executable")?;
        let (read_end, write_end) = pipe(0).context("creating the guard's control pipe")?;
        let read_fd = read_end.as_raw_fd();
        // Non-blocking for tokio's reader; the guard's one short write never blocks either.
        let (status_read, status_write) =
            pipe(libc::O_NONBLOCK).context("creating the guard's status pipe")?;
        let status_fd = status_write.as_raw_fd();
        let mut guard = Command::new(me);
        guard
            .arg("__guard")
            .arg("--")
            .args(command)
            .env("BATON_ELECTION", election)
            .env("BATON_ID", id)
            .env("BATON_SUPERVISOR_PID", std::process::id().to_string())
            .process_group(0)
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
            control: std::fs::File::from(write_end),
            status,
        })
    }

    /// Hands the guard its token and the local deadline: it starts CMD at once.
    fn start(mut self, token: u64, deadline: Instant) -> anyhow::Result<Running> {
        use std::io::Write;
        let deadline_nanos = monotonic_deadline(deadline);
        writeln!(self.control, "{token} {deadline_nanos}")
            .context("starting the command (its guard is gone)")?;
        let group = self.child.id().map(|pid| pid as i32);
        Ok(Running {
            child: self.child,
            group,
            control: self.control,
            sent_deadline: deadline,
            status: self.status,
            buffer: Vec::new(),
            code: None,
        })
    }
}

/// A tokio deadline as `CLOCK_MONOTONIC` nanoseconds, the guard's clock.
fn monotonic_deadline(deadline: Instant) -> u64 {
    // Read the guard's clock first: time passing between the two reads then moves the result
    // earlier (safe), never later.
    let nanos = guard::monotonic_nanos();
    let now = Instant::now();
    if deadline > now {
        nanos.saturating_add(u64::try_from((deadline - now).as_nanos()).unwrap_or(u64::MAX))
    } else {
        nanos.saturating_sub(u64::try_from((now - deadline).as_nanos()).unwrap_or(u64::MAX))
    }
}

/// A pipe whose both ends are close-on-exec, with `flags` (such as `O_NONBLOCK`) added.
fn pipe(flags: libc::c_int) -> std::io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | flags) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nothing else.
    unsafe {
        Ok((
            std::os::fd::OwnedFd::from_raw_fd(fds[0]),
            std::os::fd::OwnedFd::from_raw_fd(fds[1]),
        ))
    }
}

fn kill_group(group: Option<i32>, signal: libc::c_int) {
    if let Some(group) = group.filter(|&g| g > 0) {
        // SAFETY: kill has no memory-safety preconditions; a negative pid names a group.
        unsafe {
            libc::kill(-group, signal);
        }
    }
}

/// Stops the child's whole group: SIGKILL at once when `immediate`, else SIGTERM and SIGKILL at
/// the grace or the local deadline, whichever comes first. Returns once nothing in the group can
/// act any more (see [`Running::kill_all`]).
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
    if kill_at > now {
        child.signal(libc::SIGTERM);
        tokio::select! {
            _ = child.exited() => {}
            _ = tokio::time::sleep_until(kill_at) => {}
            _ = leadership.lost(), if !immediate => {
                // Lost while stopping: kill at once if the deadline itself has passed.
                if !leadership.is_leading() {
                    child.signal(libc::SIGKILL);
                }
                tokio::select! {
                    _ = child.exited() => {}
                    _ = tokio::time::sleep_until(kill_at) => {}
                }
            }
        }
    }
    // Whatever is left of the group, CMD's children and the guard included, dies now.
    child.kill_all(grace).await;
}
