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

use crate::containment::{Cage, Mode};
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
    /// The command to run for each owned shard.
    #[arg(last = true, value_name = "CMD")]
    command: Vec<OsString>,
}

/// How long a shard waits before campaigning again after its command exited by itself.
const RESTART_PAUSE: Duration = Duration::from_secs(1);

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
    Cage::create(args.containment)
        .map(|cage| cage.remove())
        .map_err(|why| UsageError(format!("--containment: {why}")))?;
    let mut signals = crate::run::Signals::install()?;
    let backend = crate::connect(&url).await?;
    let _ = crate::OPENED.set(backend.clone());
    let mut member = ShardMember::join(&backend, &group, &id, ShardSet::Count(count), config)
        .await
        .map_err(|error| match error {
            baton::Error::InvalidName { .. } | baton::Error::Config(_) => {
                anyhow::Error::new(UsageError(error.to_string()))
            }
            baton::Error::DuplicateId { .. } => anyhow::Error::new(UsageError(format!(
                "a live member of group {group} already has id {id:?}"
            ))),
            other => anyhow::Error::new(other).context("joining the group"),
        })?;
    note(
        &group,
        format_args!("joined as {id:?}; {count} shards in the group"),
    );
    let spec = Spec {
        group: group.clone(),
        id: id.clone(),
        grace: args.grace,
        containment: args.containment,
        command: args.command.clone(),
    };
    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Done>();
    let mut running: HashMap<String, mpsc::UnboundedSender<Order>> = HashMap::new();
    let stopped_by = loop {
        tokio::select! {
            event = member.next() => match event {
                Some(ShardEvent::Acquired { shard, token, leadership }) => {
                    let (orders, orders_rx) = mpsc::unbounded_channel();
                    running.insert(shard.clone(), orders);
                    tokio::spawn(run_shard(spec.clone(), shard, token, leadership, orders_rx, done_tx.clone()));
                }
                Some(ShardEvent::Released { shard, reason }) => {
                    if let Some(orders) = running.get(&shard) {
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
            Some(done) = done_rx.recv() => {
                running.remove(&done.shard);
            }
            signal = signals.stop() => break Some(signal),
        }
    };
    // Stop every command at once, then give every shard up and leave.
    for orders in running.values() {
        let _ = orders.send(Order::Stop);
    }
    while !running.is_empty() {
        match done_rx.recv().await {
            Some(done) => {
                running.remove(&done.shard);
            }
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
    match stopped_by {
        Some(signal) => Err(Exit(128 + signal as u8).into()),
        None => Err(baton::Error::Closed).context("the membership ended"),
    }
}

#[derive(Debug, Clone)]
struct Spec {
    group: String,
    id: String,
    grace: Duration,
    containment: Mode,
    command: Vec<OsString>,
}

/// One owned shard: its supervisor process, fed with the deadline, until the command is gone;
/// then the leadership is dropped (resigned).
async fn run_shard(
    spec: Spec,
    shard: String,
    token: u64,
    leadership: Leadership,
    mut orders: mpsc::UnboundedReceiver<Order>,
    done: mpsc::UnboundedSender<Done>,
) {
    let election = baton::shards::shard_election(&spec.group, &shard);
    let outcome = supervise(&spec, &shard, &election, token, &leadership, &mut orders).await;
    match outcome {
        Ok(Some(code)) => {
            note(
                &spec.group,
                format_args!(
                    "shard {shard}: command exited with code {code}; it runs again after {}",
                    baton::format_duration(RESTART_PAUSE)
                ),
            );
            // Keep the shard (and let nothing run) for a moment: a command failing at once
            // must not spin; a handover or a loss meanwhile ends the wait.
            tokio::select! {
                _ = tokio::time::sleep(RESTART_PAUSE) => {}
                _ = orders.recv() => {}
                _ = leadership.lost() => {}
            }
        }
        Ok(None) => {}
        Err(error) => note(&spec.group, format_args!("shard {shard}: {error:#}")),
    }
    drop(leadership);
    let _ = done.send(Done { shard });
}

/// Runs the shard's supervisor until its command is gone: `Some(code)` if the command exited
/// by itself.
async fn supervise(
    spec: &Spec,
    shard: &str,
    election: &str,
    token: u64,
    leadership: &Leadership,
    orders: &mut mpsc::UnboundedReceiver<Order>,
) -> anyhow::Result<Option<u8>> {
    let Some(deadline) = leadership.deadline().filter(|_| leadership.is_leading()) else {
        return Ok(None);
    };
    let me = std::env::current_exe().context("finding the baton executable")?;
    let mut child = Command::new(me)
        .arg("__shard")
        .arg("--election")
        .arg(election)
        .arg("--id")
        .arg(&spec.id)
        .arg("--grace")
        .arg(baton::format_duration(spec.grace))
        .arg("--containment")
        .arg(
            clap::ValueEnum::to_possible_value(&spec.containment)
                .map_or("auto".into(), |v| v.get_name().to_string()),
        )
        .arg("--")
        .args(&spec.command)
        .env("BATON_GROUP", &spec.group)
        .env("BATON_SHARD", shard)
        .env("BATON_ID", &spec.id)
        .stdin(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .context("starting the shard's supervisor")?;
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
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    // Once told to stop: by when it must have exited.
    let mut stop_by: Option<Instant> = None;
    loop {
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
                let code = crate::guard::exit_code(status) as u8;
                return Ok(stop_by.is_none().then_some(code));
            }
            _ = overdue => {
                // A supervisor that does not end (stopped, wedged) is killed; its guard then
                // kills the command, its parent having died, and in any case by the last
                // deadline it heard of: the shard is resigned only after that.
                let _ = child.kill().await;
                note(
                    &spec.group,
                    format_args!("shard {shard}: its supervisor did not end; killed it"),
                );
                tokio::time::sleep_until(sent + Duration::from_millis(100)).await;
                return Ok(None);
            }
            _ = tick.tick(), if stdin.is_some() => {
                if let Some(later) = leadership.deadline().filter(|d| *d > sent) {
                    sent = later;
                    send(&mut stdin, &format!("{}\n", crate::run::guard_clock(later))).await;
                }
            }
        }
    }
}

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
