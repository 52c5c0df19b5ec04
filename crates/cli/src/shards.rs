//! `baton shards`: run CMD once for each shard this member owns; `baton shards status`: who owns
//! each shard.
//!
//! The member joins the group through the library ([`baton::shards::ShardMember`]). For each
//! shard it acquires it starts `baton __shard` (see [`crate::shard_child`]), a supervisor of
//! that shard's command alone, and passes it the token and every later local deadline; a shard
//! is resigned only once its supervisor has exited, that is once its command and everything it
//! started are gone. A command that exits by itself ends its term: after a pause the member
//! campaigns for the shard again (a new token) while the shard is assigned to it.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::fd::AsRawFd;
use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use baton::shards::{ReleaseReason, ShardConfig, ShardEvent, ShardMember, ShardSet};
use baton::{ElectionConfig, Leadership};
use clap::{Args, Subcommand};
use tokio::io::AsyncWriteExt;
use tokio::process::{ChildStdin, Command};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::containment::{Cage, Mode, PidNamespace, CAGE_ENV};
use crate::{log, print_json, Exit, UsageError};

/// Flags of `baton shards`.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct ShardsArgs {
    #[command(subcommand)]
    status: Option<ShardsCommand>,
    #[command(flatten)]
    run: MemberArgs,
}

#[derive(Debug, Subcommand)]
enum ShardsCommand {
    /// Print who owns each shard of a group as one JSON object.
    Status(StatusArgs),
}

/// Flags of `baton shards status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Backend URL, for example etcd://127.0.0.1:2379/baton.
    #[arg(long, env = "BATON_BACKEND")]
    backend: String,
    /// The group.
    #[arg(long, env = "BATON_GROUP")]
    group: String,
    /// The number of shards [default: what the group's live members serve].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    shards: Option<u32>,
}

/// Flags of `baton shards -- CMD`.
#[derive(Debug, Args)]
pub struct MemberArgs {
    /// Backend URL, for example etcd://127.0.0.1:2379/baton.
    #[arg(long, env = "BATON_BACKEND", required = true)]
    backend: Option<String>,
    /// The group: members of one group split its shards.
    #[arg(long, env = "BATON_GROUP", required = true)]
    group: Option<String>,
    /// The number of shards, named 0 to N-1.
    #[arg(long, required = true, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    shards: Option<u32>,
    /// This member's id, unique in the group [default: HOSTNAME-PID].
    #[arg(long, env = "BATON_ID")]
    id: Option<String>,
    /// Lease TTL: how long a crashed member's shards stay blocked.
    #[arg(long, default_value = "10s", value_parser = crate::run::duration)]
    ttl: Duration,
    /// How long a shard's command may take to exit after SIGTERM before SIGKILL (never past the
    /// local deadline).
    #[arg(long, default_value = "5s", value_parser = crate::run::duration)]
    grace: Duration,
    /// How long the membership must stay unchanged before shards move.
    #[arg(long, default_value = "500ms", value_parser = crate::run::duration)]
    settle: Duration,
    /// Assumed bound on clock-rate difference to the server, in parts per million.
    #[arg(long, default_value_t = 10_000)]
    max_drift_ppm: u32,
    /// Extra time taken off the local deadline to cover stopping a command.
    #[arg(long, default_value = "100ms", value_parser = crate::run::duration)]
    safety_margin: Duration,
    /// What holds each shard's command and everything it starts.
    #[arg(long, env = "BATON_CONTAINMENT", value_enum, default_value_t = Mode::Auto)]
    containment: Mode,
    /// Run each shard's command in a PID namespace of its own (needs root or CAP_SYS_ADMIN):
    /// then nothing of it survives even `kill -9` of every baton process at once.
    #[arg(long, env = "BATON_PID_NAMESPACE", value_enum, default_value_t = PidNamespace::Off)]
    pid_namespace: PidNamespace,
    /// The command to run for each owned shard.
    #[arg(last = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// How long a shard stays idle after its command exited by itself, before it is given up and
/// campaigned for again: doubled for each exit in a row that came within [`QUICK_EXIT`] of the
/// start, up to [`MAX_RESTART_PAUSE`].
const RESTART_PAUSE: Duration = Duration::from_secs(1);
const MAX_RESTART_PAUSE: Duration = Duration::from_secs(30);
const QUICK_EXIT: Duration = Duration::from_secs(10);

/// How often a shard's task passes the deadline on and looks at its supervisor.
const TICK: Duration = Duration::from_millis(200);

/// A supervisor that leaves its input unread this long is stalled (stopped, wedged): killed.
const SUPERVISOR_STALL: Duration = Duration::from_secs(2);
/// How long a supervisor may take to start and read its term (hundreds start at once when a
/// member takes its shards); until it has, nothing of the command runs.
const SUPERVISOR_START: Duration = Duration::from_secs(15);

fn note(group: &str, message: std::fmt::Arguments<'_>) {
    log::line(&format!("baton: {group}: {message}"));
}

pub async fn shards(args: ShardsArgs) -> anyhow::Result<()> {
    match args.status {
        Some(ShardsCommand::Status(status)) => status_command(status).await,
        None => member(args.run).await,
    }
}

async fn status_command(args: StatusArgs) -> anyhow::Result<()> {
    let backend = crate::connect(&args.backend).await?;
    let _ = crate::OPENED.set(backend.clone());
    let status = ShardMember::status(&backend, &args.group, args.shards.map(ShardSet::Count))
        .await
        .map_err(|error| match error {
            baton::Error::InvalidName { .. } => UsageError(error.to_string()).into(),
            other => anyhow::Error::new(other).context("reading the shards' owners"),
        })?;
    print_json(&status)
}

/// What a shard's task reports when its command is gone and its leadership dropped.
struct Done {
    shard: String,
    token: u64,
    /// The command exited by itself within [`QUICK_EXIT`] of its start.
    quick_exit: bool,
}

/// A message to a shard's task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Handed over: stop gracefully.
    Stop,
    /// Over: kill at once.
    Kill,
}

async fn member(args: MemberArgs) -> anyhow::Result<()> {
    let (Some(url), Some(group), Some(count)) = (args.backend, args.group, args.shards) else {
        return Err(UsageError("--backend, --group and --shards are required".into()).into());
    };
    if args.command.is_empty() {
        return Err(UsageError("give the command to run for each shard after --".into()).into());
    }
    crate::program::check(&args.command[0])?;
    let config = ShardConfig {
        election: ElectionConfig::default()
            .with_ttl(args.ttl)
            .with_max_drift_ppm(args.max_drift_ppm)
            .with_safety_margin(args.safety_margin),
        settle: args.settle,
        ..ShardConfig::default()
    };
    let id = args.id.clone().unwrap_or_else(crate::run::default_id);
    // The containment must be available: find out now, not at the first shard.
    let mut probe = Cage::create_named(
        args.containment,
        &format!("baton-{}-probe", std::process::id()),
    )
    .map_err(|why| UsageError(format!("--containment: {why}")))?;
    let described = probe.describe();
    let pid_namespace = probe.use_pid_namespace(args.pid_namespace);
    probe.remove();
    pid_namespace.map_err(|why| UsageError(format!("--pid-namespace on: {why}")))?;
    let mut signals = crate::run::Signals::install()?;
    let backend = crate::connect(&url).await?;
    let _ = crate::OPENED.set(backend.clone());
    // An id in use may be a crashed earlier run's: wait for it as `baton run` does (`IdWait`).
    let mut id_wait = crate::run::IdWait::new(args.ttl);
    let joined = loop {
        let set = ShardSet::Count(count);
        match ShardMember::join(&backend, &group, &id, set, config.clone()).await {
            Err(baton::Error::DuplicateId { .. }) if id_wait.refused() => {
                if id_wait.refusals() == 1 {
                    note(
                        &group,
                        format_args!(
                            "a member of the group has id {id:?}: a crashed earlier run's entry \
                             lasts until the backend expires it, a live member's does not; \
                             waiting up to {} for the id",
                            id_wait.bound()
                        ),
                    );
                }
                signals.pause(Duration::from_secs(1)).await?;
            }
            joined => break joined,
        }
    };
    let mut member = joined.map_err(|error| match error {
        baton::Error::InvalidName { .. } | baton::Error::Config(_) => {
            anyhow::Error::new(UsageError(error.to_string()))
        }
        baton::Error::DuplicateId { .. } => anyhow::Error::new(UsageError(format!(
            "a live member of group {group} already has id {id:?} (still in use after {})",
            id_wait.bound()
        ))),
        other => anyhow::Error::new(other).context("joining the group"),
    })?;
    note(
        &group,
        format_args!(
            "joined as {id:?}; {count} shard{} in the group; containment: {described}",
            if count == 1 { "" } else { "s" }
        ),
    );
    let spec = Spec {
        group: group.clone(),
        id: id.clone(),
        grace: args.grace,
        containment: args.containment,
        pid_namespace: args.pid_namespace,
        command: args.command.clone(),
    };
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Done>();
    // Per shard: the running term's token and its orders.
    let mut running: HashMap<String, (u64, mpsc::UnboundedSender<Order>)> = HashMap::new();
    // Per shard: exits in a row that came soon after the start.
    let mut quick_exits: HashMap<String, u32> = HashMap::new();
    let mut serial: u64 = 0;
    let finish = |running: &mut HashMap<String, (u64, mpsc::UnboundedSender<Order>)>,
                  quick_exits: &mut HashMap<String, u32>,
                  done: Done| {
        if running
            .get(&done.shard)
            .is_some_and(|(token, _)| *token == done.token)
        {
            running.remove(&done.shard);
        }
        if done.quick_exit {
            *quick_exits.entry(done.shard).or_default() += 1;
        } else {
            quick_exits.remove(&done.shard);
        }
    };
    let stopped_by = loop {
        tokio::select! {
            event = member.next() => match event {
                Some(ShardEvent::Acquired { shard, token, leadership }) => {
                    let (orders, orders_rx) = mpsc::unbounded_channel();
                    running.insert(shard.clone(), (token, orders));
                    serial += 1;
                    let quick = quick_exits.get(&shard).copied().unwrap_or(0);
                    let pause = RESTART_PAUSE
                        .saturating_mul(1 << quick.min(5))
                        .min(MAX_RESTART_PAUSE);
                    let term = Term { shard, token, serial, pause };
                    tokio::spawn(run_shard(spec.clone(), term, leadership, orders_rx, done_tx.clone()));
                }
                Some(ShardEvent::Released { shard, reason }) => {
                    if let Some((_, orders)) = running.get(&shard) {
                        let order = match reason {
                            ReleaseReason::Lost(_) => Order::Kill,
                            ReleaseReason::Rebalanced | ReleaseReason::Leaving => Order::Stop,
                        };
                        let _ = orders.send(order);
                        note(&group, format_args!("shard {shard}: released ({reason})"));
                    }
                }
                None => break None,
            },
            Some(done) = done_rx.recv() => finish(&mut running, &mut quick_exits, done),
            signal = signals.stop() => break Some(signal),
        }
    };
    // Stop every command at once, then give every shard up and leave.
    for (_, orders) in running.values() {
        let _ = orders.send(Order::Stop);
    }
    while !running.is_empty() {
        match done_rx.recv().await {
            Some(done) => finish(&mut running, &mut quick_exits, done),
            None => break,
        }
    }
    member.leave();
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(event) = member.next().await {
            // Nothing runs any more: a late acquisition is given back at once.
            drop(event);
        }
    })
    .await;
    note(&group, format_args!("left; every shard released"));
    match (stopped_by, member.error()) {
        (Some(signal), _) => Err(Exit(128 + signal as u8).into()),
        (None, Some(why)) => Err(UsageError(format!("group {group}: {why}")).into()),
        (None, None) => Err(baton::Error::Closed).context("the membership ended"),
    }
}

#[derive(Debug, Clone)]
struct Spec {
    group: String,
    id: String,
    grace: Duration,
    containment: Mode,
    pid_namespace: PidNamespace,
    command: Vec<OsString>,
}

/// One term of one shard.
struct Term {
    shard: String,
    token: u64,
    /// Unique in this process: names the term's cgroup.
    serial: u64,
    /// How long the shard stays idle if its command exits by itself.
    pause: Duration,
}

/// How a shard's supervisor ended.
enum Outcome {
    /// It exited with CMD's own code: CMD exited by itself.
    Exited(u8),
    /// It was told to stop or kill, or it died, was killed or hit the deadline.
    Ended(String),
}

/// One owned shard: its containment and supervisor process, fed with the deadline, until
/// nothing of the command is left; then the leadership is dropped (resigned).
async fn run_shard(
    spec: Spec,
    term: Term,
    leadership: Leadership,
    mut orders: mpsc::UnboundedReceiver<Order>,
    done: mpsc::UnboundedSender<Done>,
) {
    let Term {
        shard,
        token,
        serial,
        pause,
    } = term;
    let started = Instant::now();
    let mut quick_exit = false;
    match supervise(&spec, &shard, token, serial, &leadership, &mut orders).await {
        Ok(Outcome::Exited(code)) => {
            quick_exit = started.elapsed() < QUICK_EXIT;
            note(
                &spec.group,
                format_args!(
                    "shard {shard}: command exited with code {code}; the shard is given up \
                     after {} and campaigned for again",
                    baton::format_duration(pause)
                ),
            );
            // Keep the shard (and let nothing run) for a moment: a command failing at once
            // must not spin; a handover or a loss meanwhile ends the wait.
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = orders.recv() => {}
                _ = leadership.lost() => {}
            }
        }
        Ok(Outcome::Ended(how)) => {
            if !how.is_empty() {
                note(&spec.group, format_args!("shard {shard}: {how}"));
            }
        }
        Err(error) => note(&spec.group, format_args!("shard {shard}: {error:#}")),
    }
    drop(leadership);
    let _ = done.send(Done {
        shard,
        token,
        quick_exit,
    });
}

/// Runs the shard's supervisor until nothing of its command is left.
async fn supervise(
    spec: &Spec,
    shard: &str,
    token: u64,
    serial: u64,
    leadership: &Leadership,
    orders: &mut mpsc::UnboundedReceiver<Order>,
) -> anyhow::Result<Outcome> {
    let Some(deadline) = leadership.deadline().filter(|_| leadership.is_leading()) else {
        return Ok(Outcome::Ended(String::new()));
    };
    let election = baton::shards::shard_election(&spec.group, shard);
    // The term's containment is ours: whatever becomes of the supervisor and its guard, we
    // kill what is left in it, and see it empty, before the shard is resigned.
    let mut cage = Cage::create_named(
        spec.containment,
        &format!("baton-{}-{serial}", std::process::id()),
    )
    .map_err(anyhow::Error::msg)?;
    if let Err(why) = cage.use_pid_namespace(spec.pid_namespace) {
        cage.remove();
        anyhow::bail!("--pid-namespace on: {why}");
    }
    let me = std::env::current_exe().context("finding the baton executable")?;
    let mut command = Command::new(me);
    command
        .arg("__shard")
        .arg("--election")
        .arg(&election)
        .arg("--id")
        .arg(&spec.id)
        .arg("--grace")
        .arg(baton::format_duration(spec.grace))
        .arg("--")
        .args(&spec.command)
        .env("BATON_GROUP", &spec.group)
        .env("BATON_SHARD", shard)
        .env("BATON_ID", &spec.id)
        .env(CAGE_ENV, cage.to_env())
        .stdin(Stdio::piped())
        .kill_on_drop(true);
    // On a runtime worker, never a blocking-pool thread: the supervisor's parent-death signal
    // fires when the *thread* that started it exits, and the pool's threads come and go.
    // (`baton shards` runs two workers, so a start never holds up the lease's renewals.)
    let spawned = {
        let _slot = STARTS.acquire().await;
        command.spawn()
    };
    let mut child = match spawned {
        Ok(child) => child,
        Err(error) => {
            cage.remove();
            return Err(anyhow::Error::new(error).context("starting the shard's supervisor"));
        }
    };
    let mut stdin = child.stdin.take();
    let mut sent = deadline;
    send(
        &mut stdin,
        &format!("{token} {}\n", crate::run::guard_clock(deadline)),
    )
    .await;
    note(
        &spec.group,
        format_args!("shard {shard}: acquired with token {token}; command started"),
    );
    let mut tick = tokio::time::interval(TICK);
    // Once told to stop: by when it must have exited.
    let mut stop_by: Option<Instant> = None;
    let mut unread_since: Option<Instant> = None;
    // Until the supervisor has read its term, a slow start is not a stall.
    let mut reading = false;
    let spawned_at = Instant::now();
    let outcome = loop {
        let overdue = async {
            match stop_by {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            _ = leadership.lost(), if stdin.is_some() => {
                send(&mut stdin, "kill\n").await;
                stdin = None;
                stop_by = Some(Instant::now() + STOP_LIMIT);
            }
            order = orders.recv(), if stop_by.is_none() => {
                let line = match order {
                    Some(Order::Stop) => "stop\n",
                    Some(Order::Kill) | None => "kill\n",
                };
                send(&mut stdin, line).await;
                stop_by = Some(Instant::now() + spec.grace + STOP_LIMIT);
            }
            status = child.wait() => {
                break match status {
                    Ok(status) if stop_by.is_none() => match (status.code(), status.signal()) {
                        (Some(code), _) if code != i32::from(crate::EXIT_LOST) => {
                            Outcome::Exited(code as u8)
                        }
                        (Some(_), _) => Outcome::Ended("the local deadline passed; command stopped".into()),
                        (_, signal) => Outcome::Ended(format!(
                            "its supervisor died (signal {}); command stopped",
                            signal.unwrap_or(0)
                        )),
                    },
                    _ => Outcome::Ended(String::new()),
                };
            }
            _ = overdue => {
                // A supervisor that does not end (stopped, wedged) is killed; its guard then
                // kills the command, its parent having died, and we empty the cgroup below.
                let _ = child.kill().await;
                break Outcome::Ended("its supervisor did not end in time; killed it".into());
            }
            _ = tick.tick() => {
                if let Some(later) = leadership.deadline().filter(|d| *d > sent) {
                    if stdin.is_some() {
                        sent = later;
                        send(&mut stdin, &format!("{}\n", crate::run::guard_clock(later))).await;
                    }
                }
                if stop_by.is_none()
                    && stalled(stdin.as_ref(), &mut unread_since, &mut reading, spawned_at)
                {
                    let _ = child.kill().await;
                    break Outcome::Ended(
                        "its supervisor stopped reading (stopped or wedged); killed it".into(),
                    );
                }
            }
        }
    };
    drop(stdin);
    empty(&cage, spec.grace, sent).await;
    cage.remove();
    Ok(outcome)
}

/// Kills what is left in the term's cgroup until it is empty. If it will not empty (a process
/// stuck in the kernel), waits until the last deadline the supervisor was sent has passed: by
/// then the guard's dead-man switch has fired too. Without a cgroup (`--containment
/// subreaper`) there is nothing to look at: the guard's parent-death signal is what stops the
/// command there.
async fn empty(cage: &Cage, grace: Duration, sent: Instant) {
    let give_up = Instant::now() + grace.max(Duration::from_secs(1));
    loop {
        cage.kill();
        if cage.is_empty() {
            return;
        }
        if Instant::now() >= give_up {
            log::line("baton: warning: processes of a shard's command survived SIGKILL; resigning after its last deadline");
            tokio::time::sleep_until(sent + Duration::from_millis(100)).await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Whether the supervisor has left data unread on its input for [`SUPERVISOR_STALL`] (or,
/// before it ever read, for [`SUPERVISOR_START`] since it was started).
fn stalled(
    stdin: Option<&ChildStdin>,
    unread_since: &mut Option<Instant>,
    reading: &mut bool,
    spawned_at: Instant,
) -> bool {
    let Some(pipe) = stdin else {
        return false;
    };
    if crate::run::unread_bytes(pipe.as_raw_fd()) == 0 {
        *reading = true;
        *unread_since = None;
        return false;
    }
    if !*reading {
        return spawned_at.elapsed() > SUPERVISOR_START;
    }
    unread_since.get_or_insert_with(Instant::now).elapsed() > SUPERVISOR_STALL
}

/// Shard supervisors being started at once.
static STARTS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(8);

/// How long a shard's supervisor gets to end after `kill` (after `stop`: beyond the grace).
const STOP_LIMIT: Duration = Duration::from_secs(5);

/// Writes a line to the supervisor, within a second (one that does not read is killed; its
/// guard then kills the command, its parent having died).
async fn send(stdin: &mut Option<ChildStdin>, line: &str) {
    let Some(pipe) = stdin.as_mut() else { return };
    let written =
        tokio::time::timeout(Duration::from_secs(1), pipe.write_all(line.as_bytes())).await;
    if !matches!(written, Ok(Ok(()))) {
        *stdin = None;
    }
}
