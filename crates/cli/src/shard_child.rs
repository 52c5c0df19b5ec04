//! `baton __shard`: the supervisor of one shard's command, started by `baton shards` for each
//! shard it owns.
//!
//! A process of its own per shard, so that each command has a containment and a process tree of
//! its own: stopping one shard's command (which walks the supervisor's descendants and kills
//! its cgroup) never touches another's. It is `baton run`'s supervisor without the campaign:
//! the term comes from `baton shards` on stdin:
//!
//! - first line `TOKEN DEADLINE`: start CMD (through the guard, see [`crate::guard`]) with
//!   `BATON_TOKEN`; `DEADLINE` is the local deadline in `CLOCK_BOOTTIME` nanoseconds;
//! - `DEADLINE` lines: a later local deadline (after a renewal);
//! - `stop`: the shard is handed over: SIGTERM, SIGKILL after the grace (never past the
//!   deadline);
//! - `kill`, or end of input (`baton shards` died): the term is over: SIGKILL at once.
//!
//! It also stops CMD on its own when the last deadline it heard of passes, and the guard does
//! the same should this process be frozen or killed. Exit code: CMD's own when CMD exited by
//! itself, 0 after `stop`, 3 (`EXIT_LOST`) after `kill`, the end of input or the deadline.
//!
//! The containment (a cgroup) is made by `baton shards` and handed over in `BATON_CAGE`: so
//! `baton shards` can kill what is left in it, and see it empty, even when this process and
//! the guard were killed together. Stop signals (SIGTERM, SIGINT, SIGHUP: a Ctrl-C reaches the
//! whole process group, systemd signals every process of the unit) are ignored here: the stop
//! comes from `baton shards`, which gives CMD its grace.

use std::ffi::OsString;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use std::os::fd::FromRawFd;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::unix::pipe;
use tokio::time::Instant;

use crate::containment::{self, Cage, CAGE_ENV};
use crate::run::{GuardEvent, Standby};
use crate::{guard, log, Exit, EXIT_LOST};

/// Flags of `baton __shard` (internal).
#[derive(Debug, Args)]
pub struct ShardChildArgs {
    /// The shard's election (`BATON_ELECTION` for CMD, and the label of notes).
    #[arg(long)]
    election: String,
    /// The member's id.
    #[arg(long)]
    id: String,
    /// How long CMD may take to exit after SIGTERM before SIGKILL.
    #[arg(long, value_parser = crate::run::duration)]
    grace: Duration,
    /// The command.
    #[arg(last = true, required = true)]
    command: Vec<OsString>,
}

/// A `CLOCK_BOOTTIME` deadline from the parent as a tokio instant (never later than it).
fn to_instant(nanos: u64) -> Instant {
    let now = Instant::now();
    // Read after `now`: time passing between the two reads moves the result earlier.
    let boot = guard::clock_nanos();
    now + Duration::from_nanos(nanos.saturating_sub(boot))
}

/// How often the deadline and the guard are looked at besides the events (the deadline also
/// has a timer of its own below).
const TICK: Duration = Duration::from_millis(200);

enum Line {
    Deadline(Instant),
    Stop,
    Kill,
}

fn parse(line: &str) -> Option<Line> {
    match line.trim() {
        "stop" => Some(Line::Stop),
        "kill" => Some(Line::Kill),
        nanos => nanos.parse().ok().map(|n| Line::Deadline(to_instant(n))),
    }
}

pub async fn shard_child(args: ShardChildArgs) -> anyhow::Result<()> {
    // Gone with `baton shards`, however it ends: the guard then kills CMD (its parent died).
    // SAFETY: prctl with integer arguments.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    if std::os::unix::process::parent_id() == 1 {
        return Err(Exit(EXIT_LOST).into());
    }
    guard::ignore_signals(
        [libc::SIGTERM, libc::SIGINT, libc::SIGHUP]
            .into_iter()
            .chain(crate::run::STRAY)
            .chain(libc::SIGRTMIN()..=libc::SIGRTMAX()),
    );
    containment::become_subreaper().context("becoming a child subreaper")?;
    let cage =
        std::env::var(CAGE_ENV).context("BATON_CAGE is not set (started by baton shards only)")?;
    let cage = Arc::new(Cage::from_env(&cage));
    let _remove = crate::run::CageGuard(cage.clone());
    let standby = Standby::spawn(&args.command, &args.election, &args.id, &cage)?;
    // SAFETY: fd 0 is ours, and nothing else in this process uses it.
    let stdin = unsafe { std::os::fd::OwnedFd::from_raw_fd(0) };
    let stdin = pipe::Receiver::from_owned_fd(stdin).context("stdin is not a pipe")?;
    let mut lines = BufReader::new(stdin).lines();
    let first = lines.next_line().await.ok().flatten().unwrap_or_default();
    let mut words = first.split_whitespace();
    let (Some(token), Some(nanos)) = (
        words.next().and_then(|w| w.parse::<u64>().ok()),
        words.next().and_then(|w| w.parse::<u64>().ok()),
    ) else {
        // No term after all.
        standby.cancel().await;
        return Err(Exit(EXIT_LOST).into());
    };
    let mut deadline = to_instant(nanos);
    if deadline <= Instant::now() {
        standby.cancel().await;
        return Err(Exit(EXIT_LOST).into());
    }
    let mut child = standby.start(token, deadline)?;
    let mut tick = tokio::time::interval(TICK);
    let mut input_open = true;
    let ending = loop {
        tokio::select! {
            biased;
            line = lines.next_line(), if input_open => match line.ok().flatten().as_deref().map(parse) {
                Some(Some(Line::Deadline(later))) => {
                    if later > deadline {
                        deadline = later;
                        child.extend_deadline(Some(deadline));
                    }
                }
                Some(Some(Line::Stop)) => break Ending::Stop,
                Some(Some(Line::Kill)) => break Ending::Kill,
                Some(None) => {}
                None => {
                    input_open = false;
                    break Ending::Kill;
                }
            },
            event = child.event() => match event {
                GuardEvent::Exited(code) => break Ending::Exited(code),
                GuardEvent::Left(code) => log::line(&format!(
                    "baton: {}: command exited with code {code} but processes it started still \
                     run; the term lasts until they exit",
                    args.election
                )),
                GuardEvent::Expired | GuardEvent::Died(_) => break Ending::Kill,
            },
            _ = tokio::time::sleep_until(deadline) => break Ending::Kill,
            _ = tick.tick() => {
                child.extend_deadline(Some(deadline));
                if child.stalled() {
                    break Ending::Kill;
                }
            }
        }
    };
    match ending {
        Ending::Exited(code) => {
            child.kill_all(args.grace).await;
            if code == 0 {
                Ok(())
            } else {
                Err(Exit(code).into())
            }
        }
        Ending::Stop => {
            let kill_at = (Instant::now() + args.grace).min(deadline);
            // The term ended meanwhile: `kill`, or the end of our input.
            let cut_short = async {
                loop {
                    if !input_open {
                        return std::future::pending().await;
                    }
                    match lines.next_line().await.ok().flatten().as_deref().map(parse) {
                        Some(Some(Line::Kill)) | None => return,
                        _ => {}
                    }
                }
            };
            child.stop(kill_at, args.grace, cut_short).await;
            Ok(())
        }
        Ending::Kill => {
            child.kill_all(args.grace).await;
            Err(Exit(EXIT_LOST).into())
        }
    }
}

enum Ending {
    Exited(u8),
    Stop,
    Kill,
}
