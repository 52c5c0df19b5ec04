//! `baton bench`: the headline measurements, against a real backend.
//!
//! Process-level figures (handoff, failover, RSS) start real `baton run` supervisors of this
//! same binary; each command announces itself through a FIFO, so "successor's command running"
//! is timed when its first line arrives. Request-level figures (herd, elections) use the
//! library in this process and count requests on the client side.

use std::ffi::CString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use baton::{parse_duration, Backend, Election, ElectionConfig};
use clap::{Args, Subcommand};

use crate::UsageError;

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchKind,
}

#[derive(Debug, Subcommand)]
enum BenchKind {
    /// Graceful handoff: SIGTERM to the leader's `baton run` → successor's command running.
    Handoff(ProcessArgs),
    /// Crash failover: kill -9 of the leader's `baton run` → successor's command running.
    Failover(ProcessArgs),
    /// Requests, watch events and wake-ups per handoff with many waiters.
    Herd(HerdArgs),
    /// Renewal traffic and memory of one process holding many elections on one lease.
    Elections(ElectionsArgs),
    /// Resident memory of `baton run` and its guard while the command runs.
    Rss(Common),
    /// Shard ownership: time to a balanced assignment, shards moved per join and leave,
    /// renewals per member, memory per owned shard.
    Shards(crate::bench_shards::ShardsBenchArgs),
    /// Load a server speaking the etcd v3 API (etcd or `baton server`): create-if-absent
    /// transactions, create/delete cycles, keep-alives or lease grants from N clients.
    Load(crate::load::LoadArgs),
    /// PostgreSQL: one small transaction unfenced, fenced inside it with
    /// `baton::postgres::fence`, and as baton's own fenced transaction (`guarded_put`).
    #[cfg(feature = "postgres")]
    Fenced(FencedArgs),
}

#[cfg(feature = "postgres")]
#[derive(Debug, Args)]
struct FencedArgs {
    #[command(flatten)]
    common: Common,
    /// Transactions of each kind.
    #[arg(long, default_value_t = 500)]
    rounds: usize,
}

#[derive(Debug, Args)]
struct Common {
    /// Backend URL.
    #[arg(long, env = "BATON_BACKEND")]
    backend: String,
}

#[derive(Debug, Args)]
struct ProcessArgs {
    #[command(flatten)]
    common: Common,
    /// Number of handoffs to measure.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Lease TTL of the candidates.
    #[arg(long, default_value = "2s", value_parser = duration)]
    ttl: Duration,
    /// Measure `etcdctl lock NAME CMD` instead of `baton run`, for comparison (handoff only;
    /// implies --command-exit, since etcdctl releases its lock only when its command exits).
    #[arg(long)]
    etcdctl: bool,
    /// Measure kazoo's `Election` (Python, `pip install kazoo`) running the command through
    /// scripts/kazoo-election.py (or $BATON_KAZOO_SCRIPT), for comparison on a zk:// backend
    /// (handoff only; implies --command-exit: kazoo releases when its function returns).
    #[arg(long, conflicts_with = "etcdctl")]
    kazoo: bool,
    /// Hand off by ending the leader's command (SIGKILL to it) instead of signalling the
    /// supervisor (handoff only).
    #[arg(long)]
    command_exit: bool,
}

#[derive(Debug, Args)]
struct HerdArgs {
    #[command(flatten)]
    common: Common,
    /// Waiting candidates.
    #[arg(long, default_value_t = 50)]
    waiters: usize,
    /// Connections (each with its lease) the waiters are spread over; default: one each.
    #[arg(long)]
    connections: Option<usize>,
    /// Handoffs to measure.
    #[arg(long, default_value_t = 10)]
    rounds: usize,
}

#[derive(Debug, Args)]
struct ElectionsArgs {
    #[command(flatten)]
    common: Common,
    /// Comma-separated numbers of elections to hold at once.
    #[arg(long, value_delimiter = ',', default_value = "1,100,1000")]
    counts: Vec<usize>,
    /// How long to measure each count.
    #[arg(long, default_value = "10s", value_parser = duration)]
    window: Duration,
}

fn duration(text: &str) -> Result<Duration, String> {
    parse_duration(text).map_err(|error| error.to_string())
}

fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("bench-{name}-{}-{nanos}", std::process::id())
}

pub async fn bench(args: BenchArgs) -> anyhow::Result<()> {
    match args.what {
        BenchKind::Handoff(args) => processes(args, libc::SIGTERM, "graceful handoff").await,
        BenchKind::Failover(args) => processes(args, libc::SIGKILL, "crash failover").await,
        BenchKind::Herd(args) => herd(args).await,
        BenchKind::Elections(args) => elections(args).await,
        BenchKind::Rss(args) => rss(args).await,
        BenchKind::Shards(args) => crate::bench_shards::shards(args).await,
        BenchKind::Load(args) => crate::load::bench(args).await,
        #[cfg(feature = "postgres")]
        BenchKind::Fenced(args) => fenced(args).await,
    }
}

/// Summary statistics of a sample, in milliseconds.
fn summary(label: &str, samples: &mut [Duration]) -> anyhow::Result<()> {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    crate::print_out(&format!(
        "{label}: n={} median={:.2}ms p90={:.2}ms min={:.2}ms max={:.2}ms",
        samples.len(),
        ms(at(0.5)),
        ms(at(0.9)),
        ms(samples[0]),
        ms(samples[samples.len() - 1]),
    ))
}

fn first_child(pid: u32) -> Option<u32> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    for task in tasks.flatten() {
        let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
        if let Some(child) = children
            .split_whitespace()
            .next()
            .and_then(|c| c.parse().ok())
        {
            return Some(child);
        }
    }
    None
}

/// Which supervisor a process benchmark runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tool {
    /// `baton run`.
    Baton,
    /// `etcdctl lock NAME CMD`, for comparison.
    EtcdctlLock,
    /// kazoo's `Election` running CMD, for comparison.
    Kazoo,
}

/// One `baton run` whose command writes its token into a FIFO when it starts.
struct Runner {
    child: Child,
    fifo: PathBuf,
    started: mpsc::Receiver<(Instant, u64)>,
}

impl Runner {
    fn start(
        url: &str,
        election: &str,
        ttl: Duration,
        dir: &Path,
        name: &str,
    ) -> anyhow::Result<Runner> {
        Runner::start_with(Tool::Baton, url, election, ttl, dir, name, 0)
    }

    #[allow(clippy::too_many_arguments)]
    fn start_with(
        tool: Tool,
        url: &str,
        election: &str,
        ttl: Duration,
        dir: &Path,
        name: &str,
        round: u64,
    ) -> anyhow::Result<Runner> {
        let fifo = dir.join(format!("{name}.fifo"));
        let path = CString::new(fifo.to_string_lossy().as_bytes())?;
        // SAFETY: mkfifo reads a valid NUL-terminated path.
        if unsafe { libc::mkfifo(path.as_ptr(), 0o600) } != 0 {
            bail!(
                "cannot create fifo {}: {}",
                fifo.display(),
                std::io::Error::last_os_error()
            );
        }
        let (tx, started) = mpsc::channel();
        let reader_path = fifo.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            let Ok(file) = std::fs::File::open(&reader_path) else {
                return;
            };
            let mut line = String::new();
            if std::io::BufReader::new(file).read_line(&mut line).is_ok() {
                let at = Instant::now();
                if let Ok(token) = line.trim().parse() {
                    let _ = tx.send((at, token));
                }
            }
        });
        let child = match tool {
            Tool::Baton => {
                let script = format!(
                    "echo $BATON_TOKEN > '{}'; exec sleep 100000",
                    fifo.display()
                );
                Command::new(std::env::current_exe()?)
                    .args([
                        "run",
                        "--backend",
                        url,
                        "--election",
                        election,
                        "--id",
                        name,
                    ])
                    .args(["--ttl", &baton::format_duration(ttl), "--grace", "1s"])
                    .args(["--", "sh", "-c", &script])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .context("starting baton run")?
            }
            Tool::EtcdctlLock => {
                // etcdctl has no tokens; the round number stands in so ordering is checked.
                let script = format!("echo {round} > '{}'; exec sleep 100000", fifo.display());
                let endpoints = match baton::BackendUrl::parse(url)? {
                    baton::BackendUrl::Etcd { endpoints, .. } => endpoints.join(","),
                    other => anyhow::bail!("etcdctl lock needs an etcd backend, not {other:?}"),
                };
                Command::new("etcdctl")
                    .env("ETCDCTL_API", "3")
                    .args([
                        "--endpoints",
                        &endpoints,
                        "lock",
                        election,
                        "--",
                        "sh",
                        "-c",
                        &script,
                    ])
                    .process_group(0)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .context("starting etcdctl lock (is etcd-client installed?)")?
            }
            Tool::Kazoo => {
                // kazoo has no tokens; the round number stands in so ordering is checked.
                let script = format!("echo {round} > '{}'; exec sleep 100000", fifo.display());
                let (hosts, chroot) = match baton::BackendUrl::parse(url)? {
                    baton::BackendUrl::ZooKeeper { endpoints, chroot } => {
                        (endpoints.join(","), chroot)
                    }
                    other => anyhow::bail!("kazoo needs a zk:// backend, not {other:?}"),
                };
                let harness = std::env::var("BATON_KAZOO_SCRIPT")
                    .unwrap_or_else(|_| "scripts/kazoo-election.py".into());
                Command::new("python3")
                    .arg(&harness)
                    .arg(format!("{hosts}{chroot}"))
                    .arg(format!("/{election}"))
                    .arg(name)
                    .arg(ttl.as_secs_f64().to_string())
                    .args(["--", "sh", "-c", &script])
                    .process_group(0)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .with_context(|| format!("starting {harness} (python3 with kazoo)"))?
            }
        };
        Ok(Runner {
            child,
            fifo,
            started,
        })
    }

    fn wait_started(&self, limit: Duration) -> anyhow::Result<(Instant, u64)> {
        self.started.recv_timeout(limit).with_context(|| {
            format!(
                "command of {} did not start within {limit:?}",
                self.fifo.display()
            )
        })
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe {
            libc::kill(self.child.id() as i32, signal);
        }
    }

    /// Kills the supervised command itself (the deepest process under the supervisor), so the
    /// supervisor sees its command exit; returns when it was killed. The handoff counts from
    /// there: the walk of /proc that finds the command is the benchmark's own work, deeper
    /// under `baton run` (supervisor, guard, command) than under `etcdctl lock`.
    fn end_command(&self) -> anyhow::Result<Instant> {
        let mut pid = self.child.id();
        let mut depth = 0;
        while let Some(child) = first_child(pid) {
            pid = child;
            depth += 1;
        }
        if depth == 0 {
            bail!("supervisor {} has no command running", self.child.id());
        }
        let at = Instant::now();
        // SAFETY: kill has no memory-safety preconditions.
        unsafe {
            libc::kill(pid as i32, libc::SIGKILL);
        }
        Ok(at)
    }

    /// Stops it (see the `Drop` below, which also runs when a benchmark fails half-way).
    fn stop(self) {
        drop(self);
    }
}

impl Drop for Runner {
    /// SIGTERM, then SIGKILL after a while; never leaves its processes behind.
    fn drop(&mut self) {
        self.signal(libc::SIGTERM);
        // etcdctl lock waits for its command even after SIGTERM: give up after a while.
        let deadline = Instant::now() + Duration::from_secs(3);
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // etcdctl lock leaves its command running when it exits: clear its group.
        // SAFETY: kill has no memory-safety preconditions.
        unsafe {
            libc::kill(-(self.child.id() as i32), libc::SIGKILL);
        }
        // Unblock the reader thread if the command never started.
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags_nonblock()
            .open(&self.fifo);
    }
}

/// A benchmark's scratch directory: removed when dropped, whether the benchmark finished or
/// failed.
struct RemovedOnDrop(PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

trait NonBlock {
    fn custom_flags_nonblock(&mut self) -> &mut Self;
}

impl NonBlock for std::fs::OpenOptions {
    fn custom_flags_nonblock(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.custom_flags(libc::O_NONBLOCK)
    }
}

async fn processes(args: ProcessArgs, signal: libc::c_int, label: &str) -> anyhow::Result<()> {
    if args.rounds == 0 {
        return Err(UsageError("--rounds must be at least 1".into()).into());
    }
    // Fail fast, with the usual message, if the backend is unreachable.
    crate::connect(&args.common.backend).await?;
    let dir = std::env::temp_dir().join(unique("fifos"));
    std::fs::create_dir_all(&dir)?;
    let election = unique(if signal == libc::SIGKILL {
        "failover"
    } else {
        "handoff"
    });
    let url = args.common.backend.clone();
    let ttl = args.ttl;
    let rounds = args.rounds;
    let etcdctl = args.etcdctl;
    let kazoo = args.kazoo;
    let command_exit = args.command_exit || etcdctl || kazoo;
    if command_exit && signal != libc::SIGTERM {
        return Err(UsageError(
            "--etcdctl, --kazoo and --command-exit apply to the handoff benchmark only".into(),
        )
        .into());
    }
    let label = match (etcdctl, command_exit) {
        (true, _) => {
            "etcdctl lock handoff (command exits -> successor's command running)".to_string()
        }
        (false, true) if kazoo => {
            "kazoo Election handoff (command exits -> successor's command running)".to_string()
        }
        (false, true) => {
            "baton run handoff (command exits -> successor's command running)".to_string()
        }
        (false, false) if signal == libc::SIGKILL => {
            format!("{label} (kill -9 of baton run -> successor's command running)")
        }
        (false, false) => format!("{label} (SIGTERM to baton run -> successor's command running)"),
    };
    let label = label.as_str();
    let samples = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<Duration>> {
        // Declared before the runners: dropped after them, also when a round fails.
        let _dir = RemovedOnDrop(dir.clone());
        let mut samples = Vec::new();
        let tool = if etcdctl {
            Tool::EtcdctlLock
        } else if kazoo {
            Tool::Kazoo
        } else {
            Tool::Baton
        };
        let mut leader = Runner::start_with(tool, &url, &election, ttl, &dir, "r0", 0)?;
        let (_, mut last_token) = leader.wait_started(Duration::from_secs(10))?;
        for round in 1..=rounds {
            let name = format!("r{round}");
            let waiter = Runner::start_with(tool, &url, &election, ttl, &dir, &name, round as u64)?;
            // Let the waiter queue up behind the leader.
            std::thread::sleep(Duration::from_millis(300));
            let sent = if command_exit {
                leader.end_command()?
            } else {
                let at = Instant::now();
                leader.signal(signal);
                at
            };
            let (started, token) = waiter.wait_started(ttl * 3 + Duration::from_secs(5))?;
            if token <= last_token {
                bail!("token did not increase: {token} after {last_token}");
            }
            last_token = token;
            samples.push(started.duration_since(sent));
            leader.stop();
            leader = waiter;
        }
        leader.stop();
        Ok(samples)
    })
    .await??;
    let mut samples = samples;
    let setting = if etcdctl {
        "etcdctl's own 60s lease".to_string()
    } else if kazoo {
        format!("session timeout {}", baton::format_duration(ttl))
    } else {
        format!("ttl {}", baton::format_duration(ttl))
    };
    summary(&format!("{label} ({setting})"), &mut samples)?;
    Ok(())
}

async fn herd(args: HerdArgs) -> anyhow::Result<()> {
    if args.rounds == 0 || args.rounds > args.waiters {
        return Err(UsageError("--rounds must be between 1 and --waiters".into()).into());
    }
    let config = ElectionConfig::default().with_ttl(Duration::from_secs(30));
    let name = unique("herd");
    let (tx, mut elected) = tokio::sync::mpsc::channel(args.waiters + 1);
    let mut backends = Vec::new();
    let first = crate::connect(&args.common.backend).await?;
    let mut current = Election::new(&first, &name, config.clone())?
        .campaign("leader")
        .await?;
    backends.push(first);
    let connections = args
        .connections
        .unwrap_or(args.waiters)
        .clamp(1, args.waiters);
    for _ in 0..connections {
        backends.push(crate::connect(&args.common.backend).await?);
    }
    for i in 0..args.waiters {
        let election = Election::new(&backends[1 + i % connections], &name, config.clone())?;
        let tx = tx.clone();
        tokio::spawn(async move {
            if let Ok(leadership) = election.campaign(&format!("w{i}")).await {
                let _ = tx.send(leadership).await;
            }
        });
    }
    let totals = |backends: &[Backend]| {
        backends
            .iter()
            .map(Backend::stats)
            .fold((0, 0, 0), |acc, s| {
                (
                    acc.0 + s.requests,
                    acc.1 + s.watch_events,
                    acc.2 + s.wakeups,
                )
            })
    };
    // Let every waiter queue: each watches the entry ahead of it, and the last requests that
    // takes are out (no request for half a second, or 5 s at most: where waiters poll, on
    // PostgreSQL behind a pooler, the traffic never goes quiet).
    let watching = |backends: &[Backend]| {
        backends
            .iter()
            .map(|b| b.stats().predecessor_watches)
            .sum::<u64>()
    };
    tokio::time::timeout(Duration::from_secs(120), async {
        while watching(&backends) < args.waiters as u64 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .context("the waiters did not all queue within 120s")?;
    let quiet_by = Instant::now() + Duration::from_secs(5);
    let mut last = totals(&backends);
    while Instant::now() < quiet_by {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = totals(&backends);
        if now == last {
            break;
        }
        last = now;
    }
    let mut latencies = Vec::new();
    let (mut requests, mut events, mut wakeups) = (0, 0, 0);
    for _ in 0..args.rounds {
        let before = totals(&backends);
        let started = Instant::now();
        current.resign().await;
        current = tokio::time::timeout(Duration::from_secs(10), elected.recv())
            .await
            .context("no successor within 10s")?
            .context("campaigns ended")?;
        latencies.push(started.elapsed());
        // Let stray traffic (if any) arrive before counting.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let after = totals(&backends);
        requests += after.0 - before.0;
        events += after.1 - before.1;
        wakeups += after.2 - before.2;
    }
    let rounds = args.rounds as f64;
    // Resign first: an unwritable stdout must not leave the election held until its lease
    // lapses.
    current.resign().await;
    for backend in &backends {
        backend.close().await;
    }
    crate::print_out(&format!(
        "herd ({} waiters on {connections} connections): per handoff {:.1} requests, {:.1} watch \
         events, {:.1} waiters woken",
        args.waiters,
        requests as f64 / rounds,
        events as f64 / rounds,
        wakeups as f64 / rounds
    ))?;
    summary(
        &format!("in-process handoff ({} waiters)", args.waiters),
        &mut latencies,
    )
}

pub(crate) fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
}

async fn elections(args: ElectionsArgs) -> anyhow::Result<()> {
    let config = ElectionConfig::default().with_ttl(Duration::from_secs(2));
    for count in args.counts {
        let backend = crate::connect(&args.common.backend).await?;
        // Every campaign at once: the library pipelines them (one task each, one connection).
        let started = Instant::now();
        let mut campaigns = Vec::with_capacity(count);
        for i in 0..count {
            let election = Election::new(&backend, &unique(&format!("many{i}")), config.clone())?;
            campaigns.push(tokio::spawn(
                async move { election.campaign("holder").await },
            ));
        }
        let mut held = Vec::with_capacity(count);
        for campaign in campaigns {
            held.push(campaign.await??);
        }
        let campaign_time = started.elapsed();
        let before = backend.stats();
        tokio::time::sleep(args.window).await;
        let after = backend.stats();
        let seconds = args.window.as_secs_f64();
        let leading = held.iter().filter(|l| l.is_leading()).count();
        let line = format!(
            "elections={count}: still leading {leading}, renewals/s {:.2}, other requests/s {:.2}, campaigns took {:.0}ms ({:.0}/s), process RSS {} KiB",
            (after.renewals - before.renewals) as f64 / seconds,
            (after.requests - before.requests) as f64 / seconds,
            campaign_time.as_secs_f64() * 1000.0,
            count as f64 / campaign_time.as_secs_f64(),
            rss_kib(std::process::id()).unwrap_or(0)
        );
        // Resign first: an unwritable stdout must not leave the elections held until their
        // leases lapse.
        for leadership in held {
            leadership.resign().await;
        }
        backend.close().await;
        crate::print_out(&line)?;
    }
    Ok(())
}

async fn rss(args: Common) -> anyhow::Result<()> {
    crate::connect(&args.backend).await?;
    let dir = std::env::temp_dir().join(unique("rss"));
    std::fs::create_dir_all(&dir)?;
    let _dir = RemovedOnDrop(dir.clone());
    let election = unique("rss");
    let runner = Runner::start(
        &args.backend,
        &election,
        Duration::from_secs(10),
        &dir,
        "rss",
    )?;
    let started = tokio::task::spawn_blocking(move || {
        let result = runner.wait_started(Duration::from_secs(10));
        (runner, result)
    })
    .await?;
    let (runner, result) = started;
    result?;
    // Let renewals settle into their steady state.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let supervisor = runner.child.id();
    let guard = std::fs::read_to_string(format!("/proc/{supervisor}/task/{supervisor}/children"))
        .ok()
        .and_then(|c| {
            c.split_whitespace()
                .next()
                .and_then(|p| p.parse::<u32>().ok())
        });
    crate::print_out(&format!(
        "baton run RSS: supervisor {} KiB, guard {} KiB",
        rss_kib(supervisor).unwrap_or(0),
        guard.and_then(rss_kib).unwrap_or(0)
    ))?;
    runner.stop();
    Ok(())
}

/// The cost of fencing: the same one-row upsert in its own transaction, unfenced, fenced
/// inside it, and as baton's fenced transaction.
#[cfg(feature = "postgres")]
async fn fenced(args: FencedArgs) -> anyhow::Result<()> {
    use baton::postgres::tokio_postgres;
    let url = &args.common.backend;
    let Ok(baton::BackendUrl::Postgres {
        url: raw_url,
        schema,
    }) = baton::BackendUrl::parse(url)
    else {
        return Err(UsageError("bench fenced needs a valid postgres:// backend".into()).into());
    };
    if args.rounds == 0 {
        return Err(UsageError("--rounds must be at least 1".into()).into());
    }
    let backend = crate::connect(url).await?;
    let election = Election::new(&backend, &unique("fenced"), ElectionConfig::default())?;
    let leadership = election.campaign("bench").await?;
    let (mut client, connection) = tokio_postgres::connect(&raw_url, tokio_postgres::NoTls)
        .await
        .context("connecting for the unfenced transactions")?;
    tokio::spawn(connection);
    let table = format!("{schema}.bench_fenced");
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (k text PRIMARY KEY, v bigint NOT NULL)"
        ))
        .await?;
    let upsert = format!(
        "INSERT INTO {table} (k, v) VALUES ($1, $2) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v"
    );
    let token = leadership.token();
    let mut unfenced = Vec::new();
    let mut inside = Vec::new();
    let mut guarded = Vec::new();
    for i in 0..args.rounds {
        let value = i as i64;
        let started = Instant::now();
        let transaction = client.transaction().await?;
        transaction.execute(&upsert, &[&"plain", &value]).await?;
        transaction.commit().await?;
        unfenced.push(started.elapsed());

        let started = Instant::now();
        let transaction = client.transaction().await?;
        baton::postgres::fence(&transaction, &schema, "bench", token).await?;
        transaction.execute(&upsert, &[&"fenced", &value]).await?;
        transaction.commit().await?;
        inside.push(started.elapsed());

        let started = Instant::now();
        leadership
            .guarded_put("/bench/fenced", &value.to_string())
            .await?;
        guarded.push(started.elapsed());
    }
    summary("upsert in a transaction, unfenced", &mut unfenced)?;
    summary(
        "the same, fenced inside it (baton::postgres::fence)",
        &mut inside,
    )?;
    summary("baton's fenced transaction (guarded_put)", &mut guarded)?;
    client.batch_execute(&format!("DROP TABLE {table}")).await?;
    leadership.resign().await;
    backend.close().await;
    Ok(())
}
