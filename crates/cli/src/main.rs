//! `baton`: run a command on exactly one host, inspect and observe elections.
//!
//! Exit codes: the child's own code for `baton run` when the child exits; 2 for bad input
//! (flags, durations, URLs, an unreachable backend); 3 when leadership was lost and `--requeue`
//! was not given; 128+N after stopping on signal N; 1 for other runtime failures.

mod bench;
mod bench_shards;
mod containment;
mod demo;
mod guard;
mod load;
mod log;
mod program;
mod run;
mod serve;
mod server;
mod shard_child;
mod shards;
mod spawn;

use std::ffi::OsString;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use baton::{Backend, Election, ElectionConfig};
use clap::{Args, Parser, Subcommand};
use serde::Serialize;
use tracing_subscriber::layer::SubscriberExt;

/// Exit code for bad input.
pub const EXIT_USAGE: u8 = 2;
/// Exit code when leadership was lost (without `--requeue`).
pub const EXIT_LOST: u8 = 3;

#[derive(Debug, Parser)]
#[command(
    name = "baton",
    version,
    about = "Make \"exactly one node does this job\" safe."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run CMD only while this host leads the election; kill it before the lease could be won
    /// elsewhere.
    Run(run::RunArgs),
    /// Run CMD once for each shard this member owns: members of a group split its shards, one
    /// owner per shard, each with its own fencing token (`shards status`: who owns what).
    Shards(shards::ShardsArgs),
    /// Print the current leader as one JSON object.
    Leader(Target),
    /// Print the leader as JSON, then one line per change.
    Observe(Target),
    /// Run bully, ring, Raft-style and lease election under identical faults in a
    /// deterministic simulator (no backend needed).
    Lab(baton_lab::LabArgs),
    /// Measure handoff, failover, herd behaviour, lease sharing and memory against a backend.
    Bench(bench::BenchArgs),
    /// Serve the etcd v3 API subset that leases, elections and locks use (baton's own
    /// coordination server: point `--backend etcd://IP:PORT/prefix` at it).
    Server(server::ServerArgs),
    /// The main job, end to end: five `baton run` candidates write to a fenced store while
    /// the leader is killed, paused and stopped; a live view, a summary and an HTML report.
    Demo(demo::DemoArgs),
    /// Internal: the job of a `baton demo` candidate (writes to the demo's fenced store).
    #[command(name = "__demo-worker", hide = true)]
    DemoWorker(demo::WorkerArgs),
    /// Internal: the supervisor of one shard's command, started by `baton shards`.
    #[command(name = "__shard", hide = true)]
    ShardChild(shard_child::ShardChildArgs),
    /// Internal: opens a `baton server` Raft log and exits (a damaged one makes redb panic).
    #[command(name = "__open-log", hide = true)]
    OpenLog { path: std::path::PathBuf },
    /// Internal: the process-group guard started by `baton run`.
    #[command(name = "__guard", hide = true)]
    Guard {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<OsString>,
    },
}

/// Which election to look at.
#[derive(Debug, Args)]
pub struct Target {
    /// Backend URL: etcd://127.0.0.1:2379/baton, zk://127.0.0.1:2181/baton or
    /// postgres://user:password@127.0.0.1:5432/db?schema=baton.
    #[arg(long, env = "BATON_BACKEND")]
    backend: String,
    /// Election name.
    #[arg(long, env = "BATON_ELECTION")]
    election: String,
}

/// The JSON contract of `baton leader` and `baton observe`.
#[derive(Debug, Serialize)]
struct LeaderLine<'a> {
    election: &'a str,
    leader: Option<baton::LeaderInfo>,
}

/// What `baton observe` prints while the backend cannot be seen (the last leader line may be
/// stale); a leader line follows once it can be seen again.
#[derive(Debug, Serialize)]
struct UnavailableLine<'a> {
    election: &'a str,
    unavailable: &'a str,
}

/// An error that is the user's input, not a runtime failure: exit code 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// The process exit code, carried as an error so `main` is the one place that exits.
#[derive(Debug)]
pub struct Exit(pub u8);

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit {}", self.0)
    }
}

impl std::error::Error for Exit {}

fn main() -> ExitCode {
    // `baton __launch -- CMD` (internal: started by the guard inside the command's cgroup, it
    // becomes the command): straight there, without building the command line's parser. Its
    // exec of CMD is on the handoff's path, and the less memory a process has touched, the
    // sooner exec is done with it.
    let mut args = std::env::args_os().skip(1);
    if args.next().is_some_and(|first| first == "__launch") {
        let mut command: Vec<OsString> = args.collect();
        if command.first().is_some_and(|arg| arg == "--") {
            command.remove(0);
        }
        guard::launch(&command);
    }
    let cli = match Cli::try_parse_from(join_negative_values(std::env::args_os().collect())) {
        Ok(cli) => cli,
        Err(error) => {
            use clap::error::ErrorKind;
            if matches!(
                error.kind(),
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion
            ) {
                let _ = error.print();
                return ExitCode::SUCCESS;
            }
            // One clear line: clap's first line, without the usage block.
            let rendered = error.render().to_string();
            let mut lines = rendered.lines().map(str::trim).filter(|l| !l.is_empty());
            let mut first = lines
                .next()
                .unwrap_or("invalid arguments")
                .trim_start_matches("error: ")
                .to_string();
            // "the following required arguments were not provided:" names them on the next line.
            if first.ends_with(':') {
                if let Some(next) = lines.next() {
                    first = format!("{first} {next}");
                }
            }
            log::line(&format!("baton: error: {first} (see baton --help)"));
            log::flush(EXIT_FLUSH);
            return ExitCode::from(EXIT_USAGE);
        }
    };
    match &cli.command {
        Command::Guard { command } => guard::main(command),
        // A plain blocking loop: no runtime, no panic hook, nothing of the supervisor's.
        Command::DemoWorker(args) => return demo::store::worker(&args.store),
        // Before the panic hook below: a panic in redb must not print "internal error".
        Command::OpenLog { path } => return server::open_log(path),
        _ => {}
    }
    // A panic must not unwind past the supervisor's clean-up into a half-dead process: abort,
    // so the guard's parent-death signal fires and it kills the command's containment.
    std::panic::set_hook(Box::new(|info| {
        log::line(&format!("baton: internal error: {info}"));
        log::flush(EXIT_FLUSH);
        std::process::abort();
    }));
    // The library reports retries and resynchronisations as warnings; show them on stderr
    // (through the non-blocking writer: a stalled stderr must never stall renewals). The demo
    // shows what happens in its own view, and a failure in one line: only errors there.
    // openraft's own errors are left out: `baton server` reports a stop of its Raft node in
    // one line of its own, where openraft writes several per failed request. The ZooKeeper
    // client's notes are left out until the backend is connected: an ensemble that cannot be
    // reached is baton's one-line error, not a line per attempt before it; once connected,
    // its notes of lost connections and reconnects are shown.
    let level = if matches!(cli.command, Command::Demo(_)) {
        tracing::Level::ERROR
    } else {
        tracing::Level::WARN
    };
    let subscriber = tracing_subscriber::fmt()
        .with_writer(log::Writer::default)
        .event_format(BatonLines)
        .finish()
        .with(
            tracing_subscriber::filter::Targets::new()
                .with_default(level)
                .with_target("openraft", tracing::level_filters::LevelFilter::OFF),
        )
        .with(zookeeper_notes_once_connected(&CONNECTED));
    let _ = tracing::subscriber::set_global_default(subscriber);
    let command = match cli.command {
        Command::Server(args) => {
            let code = match server::main(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(error) => exit_code_for(&error),
            };
            log::flush(EXIT_FLUSH);
            return code;
        }
        other => other,
    };
    // `baton shards` starts and feeds a process per owned shard: on one thread that work could
    // hold up the lease's renewals, so it gets a second worker.
    let mut builder = if matches!(command, Command::Shards(_)) {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(2);
        builder
    } else {
        tokio::runtime::Builder::new_current_thread()
    };
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            log::line(&format!("baton: error: cannot start the runtime: {error}"));
            log::flush(EXIT_FLUSH);
            return ExitCode::FAILURE;
        }
    };
    let supervisor = matches!(command, Command::Run(_));
    let code = match runtime.block_on(dispatch(command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => exit_code_for(&error),
    };
    log::flush(EXIT_FLUSH);
    if supervisor {
        // Its command is gone and its entry deleted: the teardown yields to the successor.
        containment::lower_priority();
    }
    code
}

/// How long an exiting `baton` waits for its last notes to reach stderr.
const EXIT_FLUSH: Duration = Duration::from_millis(200);

fn exit_code_for(error: &anyhow::Error) -> ExitCode {
    if let Some(Exit(code)) = error.downcast_ref::<Exit>() {
        return ExitCode::from(*code);
    }
    log::line(&format!("baton: error: {}", one_line(error)));
    ExitCode::from(exit_status_of(error))
}

/// The exit code for `error`: [`EXIT_USAGE`] for bad input, 1 otherwise.
pub(crate) fn exit_status_of(error: &anyhow::Error) -> u8 {
    if error.downcast_ref::<UsageError>().is_some() || is_input_error(error) {
        EXIT_USAGE
    } else {
        1
    }
}

/// Library errors that mean the input was wrong (or the backend named by it is unreachable).
fn is_input_error(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<baton::Error>(),
            Some(
                baton::Error::InvalidUrl { .. }
                    | baton::Error::Config(_)
                    | baton::Error::InvalidName { .. }
                    | baton::Error::Unsupported(_)
                    | baton::Error::Unreachable { .. }
                    | baton::Error::DuplicateId { .. }
                    // Refused for good (a wrong password, a missing permission).
                    | baton::Error::Backend {
                        retryable: false,
                        ..
                    }
            )
        )
    })
}

/// The error and its causes on one line.
pub(crate) fn one_line(error: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in error.chain() {
        let text = cause.to_string();
        // A client library's error often restates what its wrapper said, behind prefixes of
        // its own ("db error: FATAL: <message>"): its last part is enough to tell.
        let tail = text.rsplit(": ").next().unwrap_or(&text);
        if !parts.iter().any(|p| p.contains(tail)) {
            parts.push(text);
        }
    }
    printable(&parts.join(": "))
}

/// `text` on one line for a terminal: line breaks and tabs become spaces, other control
/// characters (a `\r` from a script saved with Windows line endings, an escape sequence in a
/// name) are shown escaped, never sent raw.
pub(crate) fn printable(text: &str) -> String {
    let mut line = String::with_capacity(text.len());
    for c in text.replace("\r\n", "\n").chars() {
        match c {
            '\n' | '\t' => line.push(' '),
            c if c.is_control() => line.extend(c.escape_default()),
            c => line.push(c),
        }
    }
    line
}

async fn dispatch(command: Command) -> anyhow::Result<()> {
    let result = match command {
        Command::Run(args) => run::run(args).await,
        Command::Shards(args) => shards::shards(args).await,
        Command::ShardChild(args) => shard_child::shard_child(args).await,
        Command::Leader(target) => leader(target).await,
        Command::Observe(target) => observe(target).await,
        Command::Bench(args) => bench::bench(args).await,
        Command::Demo(args) => demo::demo(args).await,
        Command::Lab(args) => baton_lab::run(&args).map_err(|error| match error {
            // A closed pipe (`baton lab | head`) is a normal way to stop.
            baton_lab::LabError::Stdout(cause)
                if cause.kind() == std::io::ErrorKind::BrokenPipe =>
            {
                Exit(0).into()
            }
            // Output that cannot be written is not bad input: exit 1.
            baton_lab::LabError::Stdout(_) | baton_lab::LabError::Write { .. } => {
                anyhow::Error::new(error)
            }
            _ => UsageError(error.to_string()).into(),
        }),
        Command::Guard { .. }
        | Command::Server(_)
        | Command::OpenLog { .. }
        | Command::DemoWorker(_) => {
            unreachable!("handled before the runtime starts")
        }
    };
    // Every term has ended by now (and its command is gone): end the backend's leases and
    // sessions at the server at once, rather than leaving them to time out (a `baton run`
    // from cron every minute would otherwise pile up ZooKeeper sessions). Bounded: an
    // unreachable server must not hold up the exit.
    if let Some(backend) = OPENED.get() {
        let _ = tokio::time::timeout(CLOSE_LIMIT, backend.close()).await;
    }
    result
}

/// The backend this process opened, closed on the way out.
static OPENED: std::sync::OnceLock<Backend> = std::sync::OnceLock::new();

/// How long an exiting `baton` waits for its backend to close its leases.
const CLOSE_LIMIT: Duration = Duration::from_secs(2);

/// Connects and builds the election; every failure here is bad input (exit 2).
pub async fn open_election(
    backend_url: &str,
    election: &str,
    config: ElectionConfig,
) -> anyhow::Result<(Backend, Election)> {
    let backend = connect(backend_url).await?;
    let _ = OPENED.set(backend.clone());
    let election = Election::new(&backend, election, config)?;
    Ok((backend, election))
}

/// Connects to a backend that other processes can share: `memory://` lives inside one
/// process, so every command refuses it (it is for the library's tests).
pub async fn connect(backend_url: &str) -> anyhow::Result<Backend> {
    if let Ok(baton::BackendUrl::Memory { .. }) = baton::BackendUrl::parse(backend_url) {
        return Err(UsageError(format!(
            "invalid backend URL {backend_url:?}: memory:// is a store inside one process (for \
             the library's tests); the baton command needs a shared backend such as etcd://"
        ))
        .into());
    }
    let backend = Backend::connect(backend_url).await?;
    CONNECTED.store(true, Ordering::Relaxed);
    Ok(backend)
}

/// A backend has been connected: the ZooKeeper client's notes are shown from now on.
static CONNECTED: AtomicBool = AtomicBool::new(false);

/// Lets the ZooKeeper client's notes through only once `connected` is set; everything else
/// always. Asked at every note, not once per place in its code: a note first made while
/// connecting (a member refusing the session, say) must still show when it comes again later.
fn zookeeper_notes_once_connected<S: tracing::Subscriber>(
    connected: &'static AtomicBool,
) -> impl tracing_subscriber::Layer<S> {
    let zookeeper = |meta: &tracing::Metadata<'_>| meta.target().starts_with("zookeeper_client");
    tracing_subscriber::filter::dynamic_filter_fn(move |meta, _| {
        !zookeeper(meta) || connected.load(Ordering::Relaxed)
    })
    .with_callsite_filter(move |meta| {
        if zookeeper(meta) {
            tracing::subscriber::Interest::sometimes()
        } else {
            tracing::subscriber::Interest::always()
        }
    })
}

/// The config used only to look at an election (validated, never campaigned with).
fn inspect_config() -> ElectionConfig {
    ElectionConfig::default().with_ttl(Duration::from_secs(10))
}

async fn leader(target: Target) -> anyhow::Result<()> {
    let (_backend, election) =
        open_election(&target.backend, &target.election, inspect_config()).await?;
    let leader = election.leader().await.context("reading the leader")?;
    print_line(&target.election, leader)
}

async fn observe(target: Target) -> anyhow::Result<()> {
    let (_backend, election) =
        open_election(&target.backend, &target.election, inspect_config()).await?;
    let mut observer = election.observe().await.context("starting to observe")?;
    let closed = stdout_closed();
    tokio::pin!(closed);
    loop {
        let observed = tokio::select! {
            observed = observer.next() => observed,
            // `baton observe | head -1` on a quiet election: end now, not at the next change.
            () = &mut closed => return Err(Exit(0).into()),
        };
        let Some(observed) = observed else { break };
        match observed {
            baton::Observed::Leader(leader) => print_line(&target.election, leader)?,
            baton::Observed::Unavailable { reason } => {
                print_json(&UnavailableLine {
                    election: &target.election,
                    unavailable: &reason,
                })?;
            }
        }
    }
    Err(baton::Error::Closed).context("observing")
}

/// Resolves when stdout is a pipe or socket whose reader has gone (the kernel then reports an
/// error condition on our end); never for a terminal or a file, which cannot be watched.
async fn stdout_closed() {
    use std::os::fd::AsFd;
    use tokio::io::{unix::AsyncFd, Interest};
    let watched = std::io::stdout()
        .as_fd()
        .try_clone_to_owned()
        .ok()
        // SAFETY: `fd` is an OwnedFd the AsyncFd owns: open, and the same, until dropped.
        .and_then(|fd| unsafe { AsyncFd::register_with_interest(fd, Interest::ERROR) }.ok());
    match watched {
        Some(fd) => {
            let _ = fd.ready(Interest::ERROR).await;
        }
        None => std::future::pending().await,
    }
}

fn print_line(election: &str, leader: Option<baton::LeaderInfo>) -> anyhow::Result<()> {
    print_json(&LeaderLine { election, leader })
}

fn print_json(value: &impl Serialize) -> anyhow::Result<()> {
    print_out(&serde_json::to_string(value)?)
}

/// Writes one line on stdout: a closed pipe ends the command quietly (exit 0), any other
/// failure is an error that names stdout (never `println!`'s panic).
pub(crate) fn print_out(line: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    match writeln!(stdout, "{line}").and_then(|()| stdout.flush()) {
        Ok(()) => Ok(()),
        // A closed pipe (`baton observe | head -1`) is a normal way to stop.
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => Err(Exit(0).into()),
        Err(error) => Err(anyhow::Error::new(error).context("writing to stdout")),
    }
}

/// The library's warnings as `baton run`'s own lines: `baton: warning: MESSAGE field=value ..`
/// (no timestamp, like every other line baton writes).
struct BatonLines;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for BatonLines
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let level = match *event.metadata().level() {
            tracing::Level::ERROR => "error",
            tracing::Level::WARN => "warning",
            _ => "note",
        };
        write!(writer, "baton: {level}: ")?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// `--ttl -1s` reads to clap as `--ttl` without its value followed by an unknown flag `-1s`
/// ("unexpected argument '-1'", which says nothing of the TTL). A value that starts with `-`
/// and a digit is joined to the long option before it (`--ttl=-1s`), so that the option's own
/// parser meets it and says what is wrong with it. No option of baton's is `-` and a digit, and
/// nothing after `--` (the command) or under an internal subcommand (whose arguments are a
/// command's) is touched.
fn join_negative_values(args: Vec<OsString>) -> Vec<OsString> {
    let internal = args
        .get(1)
        .and_then(|first| first.to_str())
        .is_some_and(|first| first.starts_with("__"));
    if internal {
        return args;
    }
    let mut joined: Vec<OsString> = Vec::with_capacity(args.len());
    let mut rest = args.into_iter();
    for arg in rest.by_ref() {
        if arg == "--" {
            joined.push(arg);
            break;
        }
        let negative = arg.to_str().is_some_and(|value| {
            let mut chars = value.chars();
            chars.next() == Some('-') && chars.next().is_some_and(|c| c.is_ascii_digit())
        });
        let option = joined
            .last()
            .and_then(|last| last.to_str())
            .filter(|last| last.len() > 2 && last.starts_with("--") && !last.contains('='));
        match (negative, option) {
            (true, Some(option)) => {
                let mut value = OsString::from(format!("{option}="));
                value.push(&arg);
                *joined.last_mut().expect("an option is there") = value;
            }
            _ => joined.push(arg),
        }
    }
    joined.extend(rest);
    joined
}

#[cfg(test)]
mod tests {
    /// A ZooKeeper note from one place in its code, made before the backend is connected and
    /// again after: only the second shows (a filter asked once per place hid both).
    #[test]
    fn zookeeper_notes_show_once_connected_even_from_a_place_seen_before() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::Arc;
        use tracing_subscriber::layer::SubscriberExt;
        struct Count(Arc<AtomicUsize>);
        impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Count {
            fn on_event(
                &self,
                _: &tracing::Event<'_>,
                _: tracing_subscriber::layer::Context<'_, S>,
            ) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        static CONNECTED: AtomicBool = AtomicBool::new(false);
        let notes = Arc::new(AtomicUsize::new(0));
        let others = Arc::new(AtomicUsize::new(0));
        let subscriber = tracing_subscriber::registry()
            .with(super::zookeeper_notes_once_connected(&CONNECTED))
            .with(Count(notes.clone()));
        tracing::subscriber::with_default(subscriber, || {
            for connected in [false, true] {
                CONNECTED.store(connected, Ordering::SeqCst);
                tracing::warn!(target: "zookeeper_client::session", "a note");
            }
        });
        assert_eq!(notes.load(Ordering::SeqCst), 1);
        // Everything else shows before and after.
        CONNECTED.store(false, Ordering::SeqCst);
        let subscriber = tracing_subscriber::registry()
            .with(super::zookeeper_notes_once_connected(&CONNECTED))
            .with(Count(others.clone()));
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "baton::driver", "a warning");
        });
        assert_eq!(others.load(Ordering::SeqCst), 1);
    }

    use super::{join_negative_values, printable};
    use std::ffi::OsString;

    fn join(line: &str) -> Vec<String> {
        let args: Vec<OsString> = line.split(' ').map(OsString::from).collect();
        join_negative_values(args)
            .into_iter()
            .map(|arg| arg.into_string().unwrap())
            .collect()
    }

    #[test]
    fn a_negative_value_is_joined_to_its_option_and_nothing_else_is() {
        assert_eq!(
            join("baton run --ttl -1s --grace -2 -- sh --ttl -1s"),
            [
                "baton",
                "run",
                "--ttl=-1s",
                "--grace=-2",
                "--",
                "sh",
                "--ttl",
                "-1s"
            ]
        );
        // Flags and values as they were: an option's value, a flag before another option,
        // `--` itself, a short option, an option already given with `=`.
        assert_eq!(
            join("baton run --grace --ttl 2s -v -1 --ttl=-1s -5 -- -1"),
            [
                "baton",
                "run",
                "--grace",
                "--ttl",
                "2s",
                "-v",
                "-1",
                "--ttl=-1s",
                "-5",
                "--",
                "-1"
            ]
        );
        assert_eq!(
            join("baton __guard -- sh --ttl -1"),
            ["baton", "__guard", "--", "sh", "--ttl", "-1"]
        );
    }

    #[test]
    fn printable_keeps_one_line_and_escapes_control_characters() {
        assert_eq!(printable("a\r\nb\nc\td"), "a b c d");
        assert_eq!(printable("/bin/sh\r: x"), "/bin/sh\\r: x");
        assert_eq!(printable("\u{1b}[31mred\0"), "\\u{1b}[31mred\\u{0}");
        assert_eq!(printable("é ✓"), "é ✓");
    }
}
