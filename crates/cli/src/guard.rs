//! The guard: the one process `baton run` starts directly, and the keeper of the command's
//! containment.
//!
//! `baton run` starts `baton __guard -- CMD ARGS` *while it campaigns*, so that the guard's own start-up is off the handoff's critical path. The guard
//! is a child subreaper (orphans of the command are re-parented to it, not to PID 1), arranges
//! to be told when its parent dies (`PR_SET_PDEATHSIG`), then waits on its control pipe (fd 3)
//! for `TOKEN DEADLINE`. It starts CMD with `BATON_TOKEN` set, inside the cgroup `baton run`
//! created (see [`crate::containment`]).
//!
//! While CMD runs the guard is a dead-man switch: the supervisor sends every later local deadline
//! (`CLOCK_BOOTTIME` nanoseconds, so time suspended counts) down the control pipe, and the guard
//! kills the whole containment when the last deadline it heard of passes, then reports
//! `expired`. So a supervisor that is killed (parent-death signal), frozen, or stalled cannot
//! leave CMD acting past its lease.
//!
//! The term lasts while anything CMD started still runs: when CMD exits and nothing of it is
//! left (no child of the guard, the cgroup empty), the guard reports `exit CODE` on the status
//! pipe (fd 4) and exits with CODE; when CMD exits but processes it started live on (a daemon
//! it forked), the guard reports `left CODE` once and keeps guarding them.
//!
//! Signals: the guard ignores every terminating or stopping signal meant for the job (`pkill -HUP -f JOB` also matches the guard's command line). Its parent-death signal
//! (SIGUSR1) counts only when its parent really is gone.

use std::ffi::OsString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use crate::containment::{self, Cage, CAGE_ENV};
use crate::spawn;

/// The control pipe's file descriptor, set up by `baton run`: the token and deadlines arrive here.
pub const CONTROL_FD: i32 = 3;
/// The status pipe's file descriptor: the guard's reports go back here.
pub const STATUS_FD: i32 = 4;

/// The signal the kernel sends the guard when its parent dies.
const PARENT_DEATH_SIGNAL: libc::c_int = libc::SIGUSR1;

/// Signals meant for the job (or stray), which must not end or stop the guard: every signal
/// whose default action terminates or stops, except SIGKILL, SIGSTOP, the parent-death signal
/// and the faults (SIGSEGV and the like, which only the process itself raises). The realtime
/// signals are added in `main`.
const IGNORED: [libc::c_int; 17] = [
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGUSR2,
    libc::SIGQUIT,
    libc::SIGALRM,
    libc::SIGPIPE,
    libc::SIGVTALRM,
    libc::SIGPROF,
    libc::SIGXCPU,
    libc::SIGXFSZ,
    libc::SIGPWR,
    libc::SIGSTKFLT,
    libc::SIGIO,
    libc::SIGTSTP,
    libc::SIGTTIN,
    libc::SIGTTOU,
];

/// The write end of the self-pipe that signal handlers use to wake the main loop.
static WAKE_FD: AtomicI32 = AtomicI32::new(-1);

extern "C" fn wake(_: libc::c_int) {
    // SAFETY: write is async-signal-safe; errno is saved and restored around it.
    unsafe {
        let saved = *libc::__errno_location();
        let fd = WAKE_FD.load(Ordering::Relaxed);
        if fd >= 0 {
            libc::write(fd, [1u8].as_ptr().cast(), 1);
        }
        *libc::__errno_location() = saved;
    }
}

extern "C" fn ignore(_: libc::c_int) {}

fn install(signal: libc::c_int, handler: extern "C" fn(libc::c_int)) {
    // SAFETY: plain sigaction with a handler that only calls async-signal-safe functions. A
    // handler (not SIG_IGN) is used so that CMD, after exec, gets the default disposition.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler as usize;
        libc::sigemptyset(&mut action.sa_mask);
        action.sa_flags = libc::SA_RESTART;
        libc::sigaction(signal, &action, std::ptr::null_mut());
    }
}

/// Gives each of `signals` a handler that does nothing: unlike `SIG_IGN`, a handler is reset
/// by exec, so what we start still gets the default disposition. A signal this process was
/// started with ignored (`nohup`'s SIGHUP, the SIGINT and SIGQUIT of a script's background job)
/// stays ignored, so that what we start inherits that as it would without us. Not SIGPIPE:
/// Rust ignores it in every process it starts, so its being ignored says nothing of our caller
/// (and CMD gets its default, as from any Rust program).
pub fn ignore_signals(signals: impl IntoIterator<Item = libc::c_int>) {
    for signal in signals {
        if !inherited_ignore(signal) {
            install(signal, ignore);
        }
    }
}

/// The environment variable that tells the guard (and its launcher) which of the signals baton
/// must handle itself were ignored when `baton run` started: CMD gets them ignored.
pub const KEEP_IGNORED_ENV: &str = "BATON_KEEP_IGNORED";

/// The signals baton handles whatever its caller did (it waits for its children; the guard's
/// parent-death signal), which CMD must still inherit ignored if they were.
const HANDLED_ANYWAY: [libc::c_int; 2] = [libc::SIGCHLD, PARENT_DEATH_SIGNAL];

static KEPT_IGNORED: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Records which of [`HANDLED_ANYWAY`] this process was started with ignored; call before
/// installing any handler.
pub fn note_inherited_ignores() {
    let _ = KEPT_IGNORED.set(
        HANDLED_ANYWAY
            .into_iter()
            .filter(|&signal| inherited_ignore(signal))
            .map(|signal| signal.to_string())
            .collect::<Vec<_>>()
            .join(","),
    );
}

/// The value of [`KEEP_IGNORED_ENV`] for our guard.
pub fn kept_ignored() -> String {
    KEPT_IGNORED.get().cloned().unwrap_or_default()
}

/// The signals [`KEEP_IGNORED_ENV`] names (at most those of [`HANDLED_ANYWAY`]).
fn keep_ignored_from_env() -> Vec<libc::c_int> {
    std::env::var(KEEP_IGNORED_ENV)
        .unwrap_or_default()
        .split(',')
        .filter_map(|n| n.parse().ok())
        .filter(|n| HANDLED_ANYWAY.contains(n))
        .collect()
}

/// Sets each of `signals` to `SIG_IGN`: an exec keeps that.
fn set_ignored(signals: &[libc::c_int]) {
    for &signal in signals {
        // SAFETY: signal with SIG_IGN; async-signal-safe (used between fork and exec too).
        unsafe { libc::signal(signal, libc::SIG_IGN) };
    }
}

/// Whether `signal` is ignored (`SIG_IGN`) now and that can only have come from our caller.
pub fn inherited_ignore(signal: libc::c_int) -> bool {
    signal != libc::SIGPIPE && disposition(signal) == Some(libc::SIG_IGN)
}

/// What `signal` does now: `SIG_DFL`, `SIG_IGN` or a handler's address; `None` if the
/// kernel will not say (not a signal).
pub fn disposition(signal: libc::c_int) -> Option<libc::sighandler_t> {
    // SAFETY: a sigaction query into a value we own.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(signal, std::ptr::null(), &mut old) == 0).then_some(old.sa_sigaction)
    }
}

/// Runs the guard; never returns.
pub fn main(command: &[OsString]) -> ! {
    let supervisor: i32 = std::env::var("BATON_SUPERVISOR_PID")
        .ok()
        .and_then(|pid| pid.parse().ok())
        .unwrap_or(-1);
    let cage = Cage::from_env(&std::env::var(CAGE_ENV).unwrap_or_default());
    let Ok((wake_read, wake_write)) = pipe(libc::O_NONBLOCK) else {
        // Without a wake-up pipe the guard cannot watch anything: refuse to start CMD.
        std::process::exit(1);
    };
    WAKE_FD.store(wake_write.as_raw_fd(), Ordering::Relaxed);
    std::mem::forget(wake_write);
    install(PARENT_DEATH_SIGNAL, wake);
    install(libc::SIGCHLD, wake);
    ignore_signals(
        IGNORED
            .into_iter()
            .chain(libc::SIGRTMIN()..=libc::SIGRTMAX()),
    );
    // SAFETY: prctl has no memory-safety preconditions.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL as libc::c_ulong);
    }
    // Every orphan of CMD must come to us: our "no child left" is the supervisor's proof that
    // nothing of CMD runs any more. Without it, no term.
    if let Err(error) = containment::become_subreaper() {
        let _ = writeln_stderr(&format!(
            "baton: error: the guard cannot become a child subreaper: {error}"
        ));
        std::process::exit(1);
    }
    // SAFETY: fcntl on descriptors `baton run` set up for us: they must not leak into CMD.
    unsafe {
        libc::fcntl(CONTROL_FD, libc::F_SETFD, libc::FD_CLOEXEC);
        libc::fcntl(STATUS_FD, libc::F_SETFD, libc::FD_CLOEXEC);
        let flags = libc::fcntl(CONTROL_FD, libc::F_GETFL);
        libc::fcntl(CONTROL_FD, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
    let mut guard = Guard {
        cage,
        supervisor,
        wake: wake_read,
        timer: timerfd(),
        control: Control::default(),
        relay: None,
        relayed: Control::default(),
    };
    if command.is_empty() {
        let _ = report("error __guard needs a command");
        std::process::exit(2);
    }
    // With a PID namespace, our next child (the launcher) is its PID 1: the namespace dies,
    // and the kernel kills every process in it, when that init dies, and it dies with us.
    // SAFETY: unshare has no memory-safety preconditions.
    if guard.cage.pid_namespace() && unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
        let error = std::io::Error::last_os_error();
        let _ = writeln_stderr(&format!(
            "baton: error: cannot create the command's PID namespace: {error}"
        ));
        std::process::exit(1);
    }
    // CMD starts from here, prepared ahead and placed in its cgroup by the kernel as it is
    // created (see `crate::spawn`). Where that cannot be (the freezer, a PID namespace), a
    // launcher process already sits inside the cgroup while we campaign, waiting for the
    // token: moving a process into a cgroup can cost a full RCU grace period (over 10 ms
    // here), which must not be on the handoff's critical path.
    let mut direct = guard.cage.direct_start().and_then(|cgroup| {
        spawn::Prepared::new(
            command,
            cgroup,
            &["BATON_SUPERVISOR_PID", CAGE_ENV, KEEP_IGNORED_ENV],
            &keep_ignored_from_env(),
        )
        .ok()
    });
    let launcher = if direct.is_some() {
        Launcher { started: None }
    } else {
        Launcher::spawn(command, &guard.cage)
    };
    // An empty cgroup that looks old may be swept by another `baton run` that cannot see our
    // PID (another PID namespace): touched while we wait.
    let touch_every = direct.is_some().then_some(Duration::from_secs(20));
    let mut touched = std::time::Instant::now();
    if guard.cage.pid_namespace() && launcher.started.is_none() {
        // Whatever we started next would be the namespace's init: never CMD itself.
        let _ = writeln_stderr("baton: error: cannot start the command's PID namespace init");
        std::process::exit(1);
    }
    // The first line is "TOKEN DEADLINE"; nothing (the pipe closed) means the supervisor
    // stopped before winning, or died: nothing to run.
    let (token, deadline) = loop {
        guard.check_parent();
        if let Some(line) = guard.control.pop_line() {
            let mut fields = line.split_whitespace();
            match (
                fields.next().map(str::parse::<u64>),
                fields.next().map(str::parse::<u64>),
            ) {
                (Some(Ok(token)), Some(Ok(deadline))) => break (token, deadline),
                _ => launcher.cancel(),
            }
        }
        if guard.control.closed {
            launcher.cancel();
        }
        if guard.cage.pid_namespace() && launcher.exited() {
            // The namespace's init was killed: no process can start in the namespace any
            // more. Exit, so that `baton run` starts another guard rather than a term that
            // cannot run its command.
            std::process::exit(1);
        }
        guard.poll(None, touch_every);
        if touch_every.is_some_and(|every| touched.elapsed() >= every) {
            guard.cage.touch();
            touched = std::time::Instant::now();
        }
    };
    if clock_nanos() >= deadline {
        // The lease ran out between the election and now: never start without one.
        launcher.cancel();
    }
    if let Some(started) = direct.as_mut().map(|d| d.spawn(token)) {
        match started {
            Ok(pid) => guard_loop(&mut guard, pid, deadline),
            Err(Some(error)) => {
                // No path could be exec'd; the child has exited.
                let code = cannot_start(&command[0], &error);
                let _ = reap_children(-1, &mut None);
                let _ = report(&format!("exit {code}"));
                std::process::exit(code);
            }
            // clone3 refused (an older kernel, a cgroup it will not place us in): the
            // slower ways below.
            Err(None) => {}
        }
    }
    let cmd = match launcher.start(token) {
        Some((pid, relay)) => {
            guard.relay = Some(relay);
            pid
        }
        None => start_directly(command, &guard.cage, token),
    };
    guard_loop(&mut guard, cmd, deadline)
}

/// A `baton __launch -- CMD` process in the cgroup, waiting on its fd 3 for the token.
///
/// fd 3 is one end of a socket pair: the token goes down it, and with a PID namespace (where
/// the launcher stays as the namespace's init and CMD is its child) CMD's exit comes back up it
/// as `exit CODE`. The launcher's parent-death signal is SIGKILL: CMD (or, with a PID
/// namespace, the init and so the whole namespace) dies with the guard, even when the guard is
/// killed together with `baton run`.
struct Launcher {
    /// Its pid and our end of its socket; `None` if it could not be started.
    started: Option<(i32, OwnedFd)>,
}

impl Launcher {
    fn spawn(command: &[OsString], cage: &Cage) -> Launcher {
        let started = (|| {
            let me = std::env::current_exe().ok()?;
            let (ours, theirs) = socket_pair().ok()?;
            // Ours is read in the guard's loop, which must never block (the token fits in an
            // empty socket's buffer, so sending it cannot fail for want of room).
            nonblocking(ours.as_raw_fd()).ok()?;
            let their_fd = theirs.as_raw_fd();
            let mut join = cage.joiner();
            let mut launch = Command::new(me);
            launch
                .arg("__launch")
                .arg("--")
                .args(command)
                .env_remove("BATON_SUPERVISOR_PID")
                .env_remove(CAGE_ENV);
            // SAFETY: only async-signal-safe calls (open, write, close, dup2, prctl) after fork.
            unsafe {
                launch.pre_exec(move || {
                    join()?;
                    if libc::dup2(their_fd, CONTROL_FD) < 0
                        || libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let child = launch.spawn().ok()?;
            drop(theirs);
            Some((child.id() as i32, ours))
        })();
        Launcher { started }
    }

    /// Hands it the token: it starts CMD. Returns its pid and our end of its socket (kept open:
    /// the launcher takes the socket closing as our death). `None` if there is no launcher.
    fn start(self, token: u64) -> Option<(i32, OwnedFd)> {
        let (pid, socket) = self.started?;
        send(&socket, format!("{token}\n").as_bytes()).ok()?;
        Some((pid, socket))
    }

    /// Whether it has exited (it was killed: it only exits on its own once it has a token or
    /// its socket closed). Reaps it if so.
    fn exited(&self) -> bool {
        let Some((pid, _)) = &self.started else {
            return true;
        };
        let mut status = 0;
        // SAFETY: waitpid on our own child, non-blocking.
        unsafe { libc::waitpid(*pid, &mut status, libc::WNOHANG) == *pid }
    }

    /// No term after all: the launcher sees its pipe close and exits; we wait for it, then
    /// exit quietly.
    fn cancel(self) -> ! {
        if let Some((pid, pipe)) = self.started {
            drop(pipe);
            let mut status = 0;
            // SAFETY: waitpid on our own child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
        }
        std::process::exit(0)
    }
}

/// `baton __launch -- CMD ARGS`: waits on fd 3 for the token, then becomes CMD with
/// `BATON_TOKEN` set. The socket closing first means there is no term: exit quietly.
///
/// As PID 1 of a PID namespace it stays, as the namespace's init: it mounts the namespace's own
/// /proc (so the PIDs CMD sees match /proc), starts CMD as its child, reaps every orphan, tells
/// the guard CMD's exit code, and exits (with that code) only when no process is left in the
/// namespace.
pub fn launch(command: &[OsString]) -> ! {
    // SAFETY: getpid has no preconditions.
    let init = unsafe { libc::getpid() } == 1;
    if init {
        mount_own_proc();
    }
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    loop {
        // SAFETY: read into a buffer we own, from the descriptor the guard set up.
        let read = unsafe { libc::read(CONTROL_FD, byte.as_mut_ptr().cast(), 1) };
        if read == 1 && byte[0] != b'\n' && line.len() < 32 {
            line.push(byte[0]);
        } else if read < 0
            && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
        {
            continue;
        } else {
            break;
        }
    }
    let Some(token) = std::str::from_utf8(&line)
        .ok()
        .and_then(|t| t.parse::<u64>().ok())
    else {
        std::process::exit(0);
    };
    // Our parent-death signal was set before the token could arrive; if the guard still holds
    // its end of the socket now, its death from here on kills us.
    if guard_gone() {
        std::process::exit(0);
    }
    let Some((program, args)) = command.split_first() else {
        std::process::exit(2);
    };
    let keep = keep_ignored_from_env();
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env("BATON_TOKEN", token.to_string())
        .env_remove(KEEP_IGNORED_ENV);
    if init {
        // SAFETY: fcntl on our own descriptor: CMD must not inherit the socket.
        unsafe { libc::fcntl(CONTROL_FD, libc::F_SETFD, libc::FD_CLOEXEC) };
        init_main(cmd, program, keep);
    }
    set_ignored(&keep);
    // SAFETY: closing our copy of the socket, which CMD must not inherit.
    unsafe { libc::close(CONTROL_FD) };
    let error = cmd.exec();
    std::process::exit(cannot_start(program, &error))
}

/// Says on stderr that `program` cannot start; returns the exit code a shell would give.
fn cannot_start(program: &std::ffi::OsStr, error: &std::io::Error) -> i32 {
    // The check made before the campaign says why when it can (a `#!` interpreter gone, say,
    // where exec only says "No such file").
    let line = match crate::program::check(program) {
        Err(crate::UsageError(why)) => format!("baton: error: {why}"),
        Ok(()) => format!(
            "baton: error: cannot start {}: {error}",
            program.to_string_lossy()
        ),
    };
    let _ = writeln_stderr(&crate::printable(&line));
    // 126/127 as the shell reports "cannot execute" / "command not found".
    if error.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}

/// Whether the guard closed its end of the launcher's socket (it died).
fn guard_gone() -> bool {
    let mut byte = 0u8;
    // SAFETY: peek into a byte we own.
    let got = unsafe {
        libc::recv(
            CONTROL_FD,
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    got == 0
}

/// The PID namespace's init: starts CMD, reaps everything, reports CMD's exit to the guard
/// if processes it started live on, and exits (with CMD's code) when the namespace is empty. Signals without a handler never reach a namespace's
/// init (but SIGKILL from the guard), so it needs none.
fn init_main(mut cmd: Command, program: &std::ffi::OsStr, keep: Vec<libc::c_int>) -> ! {
    let relay = |code: i32| {
        let line = format!("exit {code}\n");
        // SAFETY: send from a buffer we own; MSG_NOSIGNAL: a dead guard is no SIGPIPE.
        unsafe {
            libc::send(
                CONTROL_FD,
                line.as_ptr().cast(),
                line.len(),
                libc::MSG_NOSIGNAL,
            )
        };
    };
    // A closure makes std fork and call execvp, as the other ways of starting CMD do, not
    // posix_spawnp: only execvp runs a script without a `#!` line with /bin/sh (posix_spawnp
    // fails it with "Exec format error"). It also gives CMD the signals to keep ignored (not
    // us: as the namespace's init we reap, so SIGCHLD must not be ignored here).
    // SAFETY: the closure only calls `signal`, which is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            set_ignored(&keep);
            Ok(())
        });
    }
    let cmd_pid = match cmd.spawn() {
        Ok(child) => child.id() as i32,
        // Nothing else runs here: our exit status carries the code to the guard.
        Err(error) => std::process::exit(cannot_start(program, &error)),
    };
    let mut code = None;
    loop {
        let mut status = 0;
        // SAFETY: waitpid on any child.
        let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
        if pid == cmd_pid {
            let exited = exit_code(Ok(std::process::ExitStatus::from_raw(status)));
            code = Some(exited);
            // With nothing else left, exit at once: our exit status carries CMD's code. A
            // relayed code while we still live would have the guard report leftovers that
            // do not exist.
            if !reap_children(-1, &mut None) {
                std::process::exit(exited);
            }
            relay(exited);
        } else if pid < 0
            && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
        {
            // No child left: the namespace is empty.
            std::process::exit(code.unwrap_or(1));
        }
    }
}

/// Gives the PID namespace a /proc of its own, in a mount namespace of its own, so that the
/// PIDs its processes see (their own, their children's) are the ones /proc shows them. Mounts
/// made on the host later still propagate in (the root is a slave); ours never leak out. If
/// any step fails, CMD sees the host's /proc.
fn mount_own_proc() {
    // SAFETY: unshare and mount with constant, NUL-terminated arguments.
    unsafe {
        if libc::unshare(libc::CLONE_NEWNS) != 0 {
            return;
        }
        if libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_SLAVE,
            std::ptr::null(),
        ) != 0
        {
            return;
        }
        libc::mount(
            c"proc".as_ptr(),
            c"/proc".as_ptr(),
            c"proc".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        );
    }
}

/// Starts CMD from the guard itself (when no launcher could be started): it joins the cgroup
/// between fork and exec.
fn start_directly(command: &[OsString], cage: &Cage, token: u64) -> i32 {
    let program = &command[0];
    let join = cage.joiner();
    let mut start = Command::new(program);
    start
        .args(&command[1..])
        .env("BATON_TOKEN", token.to_string())
        .env_remove("BATON_SUPERVISOR_PID")
        .env_remove(CAGE_ENV)
        .env_remove(KEEP_IGNORED_ENV);
    let mut join = join;
    let keep = keep_ignored_from_env();
    // SAFETY: the closure only makes async-signal-safe calls (open, write, close, prctl).
    unsafe {
        start.pre_exec(move || {
            join()?;
            set_ignored(&keep);
            // CMD dies with us, as a launcher would.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    match start.spawn() {
        Ok(child) => child.id() as i32,
        Err(error) => {
            let code = cannot_start(program, &error);
            let _ = report(&format!("exit {code}"));
            std::process::exit(code);
        }
    }
}

/// The guard's life while CMD runs; never returns.
fn guard_loop(guard: &mut Guard, cmd: i32, mut deadline: u64) -> ! {
    let mut code: Option<i32> = None;
    let mut told_left = false;
    loop {
        while let Some(line) = guard.relayed.pop_line() {
            // From the PID namespace's init: CMD itself has exited.
            if let Some(relayed) = line.trim().strip_prefix("exit ") {
                code = code.or(relayed.parse().ok());
            }
        }
        let children_left = reap_children(cmd, &mut code);
        if let Some(code) = code {
            if !children_left && guard.cage.is_empty() {
                let _ = report(&format!("exit {code}"));
                // The supervisor, woken by that report, resigns next; it is often queued on
                // this CPU, behind our own exit (tearing down a process takes a few hundred
                // microseconds), and the successor's processes come soon after. Our exit
                // goes last: the handoff waits for them, not for us.
                containment::step_aside();
                std::process::exit(code);
            }
            if !told_left {
                told_left = true;
                let _ = report(&format!("left {code}"));
            }
        }
        guard.check_parent();
        if clock_nanos() >= deadline {
            // Kill first and say nothing on stderr: it may be the very pipe that stalled the
            // supervisor. The supervisor (if it ever runs again) hears `expired`.
            guard.kill_everything();
            let _ = report("expired");
            std::process::exit(1);
        }
        while let Some(line) = guard.control.pop_line() {
            if line.trim() == "kill" {
                // The supervisor ends the term: everything goes, and our exit says it is gone.
                guard.kill_everything();
                let _ = report("killed");
                std::process::exit(0);
            }
            if let Ok(next) = line.trim().parse::<u64>() {
                deadline = deadline.max(next);
            }
        }
        // With CMD gone but its cgroup not yet empty, look again shortly.
        let recheck = code.map(|_| Duration::from_millis(100));
        guard.poll(Some(deadline), recheck);
    }
}

/// Reaps every exited child (CMD, or an orphan re-parented to us); records CMD's exit code.
/// Returns whether any child is left.
fn reap_children(cmd: i32, code: &mut Option<i32>) -> bool {
    loop {
        let mut status = 0;
        // SAFETY: waitpid on any child, non-blocking.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid > 0 {
            if pid == cmd && code.is_none() {
                *code = Some(exit_code(Ok(std::process::ExitStatus::from_raw(status))));
            }
            continue;
        }
        if pid == 0 {
            return true;
        }
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return false;
        }
    }
}

struct Guard {
    cage: Cage,
    supervisor: i32,
    wake: OwnedFd,
    timer: Option<OwnedFd>,
    control: Control,
    /// Our end of the launcher's socket, once CMD started: with a PID namespace, its init
    /// reports CMD's exit here.
    relay: Option<OwnedFd>,
    relayed: Control,
}

impl Guard {
    /// If the supervisor is gone (killed, even by SIGKILL, or crashed), kills everything and
    /// exits. A stray SIGUSR1 while it lives changes nothing.
    fn check_parent(&mut self) {
        // SAFETY: getppid has no preconditions.
        if unsafe { libc::getppid() } != self.supervisor {
            self.kill_everything();
            // Nobody else will remove the cgroup now.
            self.cage.remove();
            std::process::exit(1);
        }
    }

    /// SIGKILLs the cgroup and every descendant, again and again until we have no child at
    /// all and the cgroup is empty. As a subreaper we are the parent of every orphan, so "no
    /// child" (the kernel's answer, atomic, unlike a walk of /proc) means no descendant: a
    /// chain that forks and exits faster than a walk can follow is still caught.
    fn kill_everything(&mut self) {
        let me = std::process::id() as i32;
        let mut pause = Duration::from_millis(1);
        loop {
            self.cage.kill();
            containment::signal_tree(me, libc::SIGKILL, None);
            let mut ignored = None;
            let children_left = reap_children(-1, &mut ignored);
            if !children_left && self.cage.is_empty() {
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// Waits until a signal, a control message, the deadline (on `CLOCK_BOOTTIME`, through a
    /// timerfd, so a suspend does not delay it) or `recheck` comes.
    fn poll(&mut self, deadline: Option<u64>, recheck: Option<Duration>) {
        let mut timeout_ms: i32 = recheck.map_or(-1, |r| r.as_millis() as i32);
        if let Some(deadline) = deadline {
            let left = deadline.saturating_sub(clock_nanos());
            // Round up so we never wake just before the deadline and spin.
            let left_ms = i32::try_from(left.div_ceil(1_000_000)).unwrap_or(i32::MAX);
            timeout_ms = if timeout_ms < 0 {
                left_ms
            } else {
                timeout_ms.min(left_ms)
            };
            if let Some(timer) = &self.timer {
                arm(timer, deadline);
            }
        }
        let mut fds = [
            pollfd(self.wake.as_raw_fd()),
            pollfd(self.timer.as_ref().map_or(-1, |t| t.as_raw_fd())),
            pollfd(if self.control.closed { -1 } else { CONTROL_FD }),
            pollfd(match (&self.relay, self.relayed.closed) {
                (Some(relay), false) => relay.as_raw_fd(),
                _ => -1,
            }),
        ];
        // SAFETY: poll on descriptors we own, in an array we own.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        drain(self.wake.as_raw_fd());
        if let Some(timer) = &self.timer {
            drain(timer.as_raw_fd());
        }
        self.control.fill(CONTROL_FD);
        if let Some(relay) = &self.relay {
            self.relayed.fill(relay.as_raw_fd());
        }
    }
}

fn pollfd(fd: i32) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// Reads a non-blocking descriptor until it is empty.
fn drain(fd: i32) {
    let mut chunk = [0u8; 64];
    // SAFETY: read into a buffer we own.
    while unsafe { libc::read(fd, chunk.as_mut_ptr().cast(), chunk.len()) } > 0 {}
}

/// A timerfd on `CLOCK_BOOTTIME`, if the kernel has one.
fn timerfd() -> Option<OwnedFd> {
    // SAFETY: timerfd_create returns a new descriptor or -1.
    let fd = unsafe {
        libc::timerfd_create(libc::CLOCK_BOOTTIME, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC)
    };
    // SAFETY: a descriptor just created and owned by nothing else.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Arms `timer` to fire at `deadline` (absolute `CLOCK_BOOTTIME` nanoseconds).
fn arm(timer: &OwnedFd, deadline: u64) {
    let spec = libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: (deadline / 1_000_000_000) as libc::time_t,
            // A zero value would disarm the timer.
            tv_nsec: ((deadline % 1_000_000_000).max(1)) as libc::c_long,
        },
    };
    // SAFETY: timerfd_settime on our descriptor with a spec we own.
    unsafe {
        libc::timerfd_settime(
            timer.as_raw_fd(),
            libc::TFD_TIMER_ABSTIME,
            &spec,
            std::ptr::null_mut(),
        );
    }
}

/// Writes one report line to the status pipe.
fn report(line: &str) -> std::io::Result<()> {
    write_fd(STATUS_FD, format!("{line}\n").as_bytes())
}

/// Writes to stderr without panicking (it may be closed).
fn writeln_stderr(line: &str) -> std::io::Result<()> {
    write_fd(libc::STDERR_FILENO, format!("{line}\n").as_bytes())
}

fn write_fd(fd: i32, bytes: &[u8]) -> std::io::Result<()> {
    // SAFETY: write from a buffer we own.
    let written = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
    if written < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A process's exit as a shell reports it: its code, or 128 + the signal that killed it.
pub fn exit_code(status: std::io::Result<std::process::ExitStatus>) -> i32 {
    match status {
        Ok(status) => match (status.code(), status.signal()) {
            (Some(code), _) => code,
            (None, Some(signal)) => 128 + signal,
            (None, None) => 1,
        },
        Err(_) => 1,
    }
}

/// `CLOCK_BOOTTIME` in nanoseconds: the clock the guard measures deadlines on. Unlike
/// `CLOCK_MONOTONIC` it counts time the host spent suspended, so a host resumed after a suspend
/// longer than the TTL finds the deadline passed at once.
pub fn clock_nanos() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe {
        libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut now);
    }
    (now.tv_sec as u64) * 1_000_000_000 + now.tv_nsec as u64
}

/// A pipe whose both ends are close-on-exec, with `flags` (such as `O_NONBLOCK`) added.
pub fn pipe(flags: libc::c_int) -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | flags) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nothing else.
    unsafe { Ok((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))) }
}

/// A connected pair of close-on-exec Unix stream sockets.
fn socket_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: socketpair writes two descriptors into the array we own.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    } != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nothing else.
    unsafe { Ok((OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1]))) }
}

/// Sends all of `bytes` on a socket, without SIGPIPE if the peer is gone.
fn send(socket: &OwnedFd, bytes: &[u8]) -> std::io::Result<()> {
    // SAFETY: send from a buffer we own.
    let sent = unsafe {
        libc::send(
            socket.as_raw_fd(),
            bytes.as_ptr().cast(),
            bytes.len(),
            libc::MSG_NOSIGNAL,
        )
    };
    if sent != bytes.len() as isize {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes `fd` non-blocking.
fn nonblocking(fd: i32) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Lines from a (non-blocking) pipe or socket.
#[derive(Default)]
struct Control {
    buffer: Vec<u8>,
    closed: bool,
}

impl Control {
    /// Reads whatever is available on `fd` without blocking.
    fn fill(&mut self, fd: i32) {
        while !self.closed {
            let mut chunk = [0u8; 256];
            // SAFETY: read into a buffer we own.
            let read = unsafe { libc::read(fd, chunk.as_mut_ptr().cast(), chunk.len()) };
            match read {
                n if n > 0 => {
                    self.buffer.extend_from_slice(&chunk[..n as usize]);
                    // Deadlines only matter as the latest one: a flood cannot grow memory.
                    if self.buffer.len() > 64 * 1024 {
                        let keep = self.buffer.len() - 4096;
                        self.buffer.drain(..keep);
                    }
                }
                0 => self.closed = true,
                _ => {
                    let kind = std::io::Error::last_os_error().kind();
                    if kind != std::io::ErrorKind::Interrupted {
                        if kind != std::io::ErrorKind::WouldBlock {
                            self.closed = true;
                        }
                        return;
                    }
                }
            }
        }
    }

    /// The next complete line, if one has arrived.
    fn pop_line(&mut self) -> Option<String> {
        let end = self.buffer.iter().position(|&b| b == b'\n')?;
        let line: Vec<u8> = self.buffer.drain(..=end).collect();
        Some(String::from_utf8_lossy(&line).into_owned())
    }
}
