//! The process-group guard: the one process `baton run` starts directly.
//!
//! `baton run` starts `baton __guard -- CMD ARGS` as the leader of a new process group *while
//! it campaigns*, so that the guard's own start-up is off the handoff's critical path. The guard
//! arranges to be told when its parent dies (`PR_SET_PDEATHSIG`), then waits on its control pipe
//! (fd 3) for `TOKEN DEADLINE`. It starts CMD in the same group with `BATON_TOKEN` set; if the
//! pipe closes first it exits quietly.
//!
//! While CMD runs the guard is a dead-man switch: the supervisor sends every later local deadline
//! (`CLOCK_MONOTONIC` nanoseconds) down the control pipe, and the guard SIGKILLs the whole group
//! when the last deadline it heard of passes. So a supervisor that is killed (parent-death
//! signal), frozen, or stalled (say, blocked writing to a full stderr pipe) cannot leave CMD
//! acting past its lease. When CMD exits, the guard writes its exit code to the status pipe
//! (fd 4) at once and exits with the same code. The guard ignores a plain SIGTERM to the group
//! (CMD gets it and decides).

use std::os::fd::FromRawFd;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;

/// The control pipe's file descriptor, set up by `baton run`: the token arrives here.
pub const CONTROL_FD: i32 = 3;
/// The status pipe's file descriptor: CMD's exit code goes back here the moment CMD exits,
/// before the guard's own (slower) exit.
pub const STATUS_FD: i32 = 4;

/// The signal the kernel sends the guard when its parent dies.
const PARENT_DEATH_SIGNAL: libc::c_int = libc::SIGUSR1;

extern "C" fn kill_group(_: libc::c_int) {
    // SAFETY: kill is async-signal-safe; 0 means "my process group", which includes us.
    unsafe {
        libc::kill(0, libc::SIGKILL);
    }
}

extern "C" fn ignore(_: libc::c_int) {}

fn install(signal: libc::c_int, handler: extern "C" fn(libc::c_int)) {
    // SAFETY: plain sigaction with a handler that only calls async-signal-safe functions. A
    // handler (not SIG_IGN) is used for SIGTERM so that CMD, after exec, gets the default.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = handler as usize;
        libc::sigemptyset(&mut action.sa_mask);
        action.sa_flags = libc::SA_RESTART;
        libc::sigaction(signal, &action, std::ptr::null_mut());
    }
}

/// Runs the guard; never returns.
pub fn main(command: &[std::ffi::OsString]) -> ! {
    install(PARENT_DEATH_SIGNAL, kill_group);
    install(libc::SIGTERM, ignore);
    install(libc::SIGINT, ignore);
    let supervisor: i32 = std::env::var("BATON_SUPERVISOR_PID")
        .ok()
        .and_then(|pid| pid.parse().ok())
        .unwrap_or(-1);
    // SAFETY: prctl and getppid have no memory-safety preconditions.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL as libc::c_ulong);
        // The supervisor may have died before the line above: then we are already orphaned.
        if libc::getppid() != supervisor {
            kill_group(0);
        }
    }
    let Some((program, args)) = command.split_first() else {
        eprintln!("baton: error: __guard needs a command");
        std::process::exit(2);
    };
    // Both pipes stay open in the guard but must not leak into CMD.
    // SAFETY: fcntl on descriptors `baton run` set up for us.
    unsafe {
        libc::fcntl(CONTROL_FD, libc::F_SETFD, libc::FD_CLOEXEC);
        libc::fcntl(STATUS_FD, libc::F_SETFD, libc::FD_CLOEXEC);
    }
    let mut control = Control::default();
    // The first line is "TOKEN DEADLINE"; nothing (the pipe closed) means the supervisor
    // stopped before winning, or died: nothing to run.
    let first = control.next_line(None).unwrap_or_default();
    let mut fields = first.split_whitespace();
    let (Some(Ok(token)), Some(Ok(mut deadline))) = (
        fields.next().map(str::parse::<u64>),
        fields.next().map(str::parse::<u64>),
    ) else {
        std::process::exit(0);
    };
    if monotonic_nanos() >= deadline {
        // The lease ran out between the election and now: never start without one.
        std::process::exit(0);
    }
    let child = Command::new(program)
        .args(args)
        .env("BATON_TOKEN", token.to_string())
        .env_remove("BATON_SUPERVISOR_PID")
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(error) => {
            eprintln!(
                "baton: error: cannot start {}: {error}",
                program.to_string_lossy()
            );
            // 126/127 as the shell reports "cannot execute" / "command not found".
            std::process::exit(if error.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            });
        }
    };
    std::thread::spawn(move || {
        let code = exit_code(child.wait());
        // SAFETY: fd 4 is the status pipe's write end, owned by nothing else in this process.
        let mut status_pipe = unsafe { std::fs::File::from_raw_fd(STATUS_FD) };
        use std::io::Write;
        let _ = writeln!(status_pipe, "{code}");
        // CMD may have left children behind (`worker & exit 0`). Without us they would have no
        // dead-man switch and no parent-death kill, so the whole group goes now; the
        // supervisor has CMD's exit code from the status pipe.
        kill_group(0);
        std::process::exit(code)
    });
    // The dead-man switch: the supervisor sends each new local deadline; if it stops doing so
    // (stopped, stalled, blocked writing a log line) the group dies at the last one it sent.
    loop {
        let now = monotonic_nanos();
        if now >= deadline {
            // Kill first and say nothing: stderr may be the very pipe that stalled the
            // supervisor. The supervisor (if it ever runs again) sees the group gone.
            kill_group(0);
        }
        match control.next_line(Some(deadline - now)) {
            Some(line) => {
                if let Ok(next) = line.trim().parse::<u64>() {
                    deadline = deadline.max(next);
                }
            }
            None if control.closed => {
                // The supervisor closed the pipe: keep enforcing the last deadline.
                let wait = deadline.saturating_sub(monotonic_nanos());
                std::thread::sleep(std::time::Duration::from_nanos(wait));
            }
            None => {}
        }
    }
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

/// `CLOCK_MONOTONIC` in nanoseconds: the clock both `baton run` and the guard measure
/// deadlines on (it is what tokio's and std's `Instant` use on Linux).
pub fn monotonic_nanos() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now);
    }
    (now.tv_sec as u64) * 1_000_000_000 + now.tv_nsec as u64
}

/// Lines from the control pipe, read without blocking past a timeout.
#[derive(Default)]
struct Control {
    buffer: Vec<u8>,
    closed: bool,
}

impl Control {
    /// The next complete line; `None` on timeout or once the pipe is closed.
    fn next_line(&mut self, timeout_nanos: Option<u64>) -> Option<String> {
        loop {
            if let Some(end) = self.buffer.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buffer.drain(..=end).collect();
                return Some(String::from_utf8_lossy(&line).into_owned());
            }
            if self.closed || self.buffer.len() > 4096 {
                return None;
            }
            let mut poll = libc::pollfd {
                fd: CONTROL_FD,
                events: libc::POLLIN,
                revents: 0,
            };
            let timeout_ms = match timeout_nanos {
                // Round up so we never wake just before the deadline and spin.
                Some(nanos) => i32::try_from(nanos.div_ceil(1_000_000)).unwrap_or(i32::MAX),
                None => -1,
            };
            // SAFETY: poll and read on our own descriptor and buffers.
            let ready = unsafe { libc::poll(&mut poll, 1, timeout_ms) };
            if ready == 0 {
                return None;
            }
            if ready < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    // Let the caller recompute the time left rather than wait the full
                    // timeout again (a signal must not push the deadline back).
                    return None;
                }
                self.closed = true;
                return None;
            }
            let mut chunk = [0u8; 256];
            let read = unsafe { libc::read(CONTROL_FD, chunk.as_mut_ptr().cast(), chunk.len()) };
            match read {
                n if n > 0 => self.buffer.extend_from_slice(&chunk[..n as usize]),
                n if n < 0
                    && std::io::Error::last_os_error().kind()
                        == std::io::ErrorKind::Interrupted => {}
                _ => {
                    self.closed = true;
                    return None;
                }
            }
        }
    }
}
