//! The process-group guard: the one process `baton run` starts directly.
//!
//! `baton run` starts `baton __guard -- CMD ARGS` as the leader of a new process group *while
//! it campaigns*, so that the guard's own start-up is off the handoff's critical path. The guard
//! arranges to be told when its parent dies (`PR_SET_PDEATHSIG`), then waits on its control pipe
//! (file descriptor 3) for the fencing token. When the token arrives it starts CMD in the same
//! group with `BATON_TOKEN` set and waits for it; if the pipe closes first it exits quietly. If the supervisor dies, even by SIGKILL, the guard's signal
//! handler SIGKILLs the whole group, CMD's own children included, so no orphaned leader can go on
//! acting. The guard ignores a plain SIGTERM to the group (CMD gets it and decides) so that it
//! can report CMD's exit status, which `baton run` propagates.

use std::io::BufRead;
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
    // SAFETY: `baton run` hands us fd 3 as the read end of the control pipe and nothing else
    // in this process owns it. Dropping the reader closes it, so CMD does not inherit it.
    let control = unsafe { std::fs::File::from_raw_fd(CONTROL_FD) };
    let mut line = String::new();
    let read = std::io::BufReader::new(control).read_line(&mut line);
    let token = match (read, line.trim().parse::<u64>()) {
        (Ok(_), Ok(token)) => token,
        // The supervisor stopped before winning (or died): nothing to run.
        _ => std::process::exit(0),
    };
    // SAFETY: fd 4 is the status pipe's write end, handed to us by `baton run` and owned by
    // nothing else here. Close-on-exec keeps it away from CMD.
    let mut status_pipe = unsafe {
        libc::fcntl(STATUS_FD, libc::F_SETFD, libc::FD_CLOEXEC);
        std::fs::File::from_raw_fd(STATUS_FD)
    };
    let status = Command::new(program)
        .args(args)
        .env("BATON_TOKEN", token.to_string())
        .env_remove("BATON_SUPERVISOR_PID")
        .status();
    match status {
        Ok(status) => {
            let code = match (status.code(), status.signal()) {
                (Some(code), _) => code,
                (None, Some(signal)) => 128 + signal,
                (None, None) => 1,
            };
            use std::io::Write;
            let _ = writeln!(status_pipe, "{code}");
            std::process::exit(code)
        }
        Err(error) => {
            eprintln!(
                "baton: error: cannot start {}: {error}",
                program.to_string_lossy()
            );
            // 127 is the shell's "command not found".
            std::process::exit(if error.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            });
        }
    }
}
