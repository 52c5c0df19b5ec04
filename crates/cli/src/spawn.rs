//! Starting CMD from the guard itself, the way `posix_spawn` does: a child that shares the
//! guard's memory (`CLONE_VM`) while the guard waits (`CLONE_VFORK`), placed in the command's
//! cgroup v2 by the kernel as it is created (`CLONE_INTO_CGROUP`), and that only execs.
//!
//! Why: a handoff's last stage is the successor's command starting. Through a launcher (a
//! `baton __launch` process waiting in the cgroup) it costs the launcher's wake-up and, at its
//! exec, the teardown of the launcher's own address space; a forked copy of the guard would
//! cost copying and then tearing down the guard's. A child that shares the guard's memory has
//! neither: its exec only drops a reference. Joining a cgroup by writing to `cgroup.procs`
//! can wait for an RCU grace period (over 10 ms here), which is why the launcher joins it
//! ahead; `CLONE_INTO_CGROUP` takes no such wait.
//!
//! Everything the child needs (every path to try, argv, the environment, the old signal mask)
//! is prepared before the token comes; the child makes only async-signal-safe system calls on
//! a stack of its own. Only on x86-64 Linux; elsewhere (and when `clone3` is refused) the guard
//! falls back to the launcher or a plain fork.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};

/// The child's stack: what it runs (a signal reset loop, `prctl`, `execve`) needs little.
const STACK_SIZE: usize = 64 * 1024;

/// `clone3`'s flag that puts the child in the cgroup whose directory `cgroup` names.
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// `ChildArgs::error` of a probe: the child exits at once.
const PROBE: i32 = -1;

/// Whether this build can start CMD this way at all.
pub const SUPPORTED: bool = cfg!(all(target_os = "linux", target_arch = "x86_64"));

/// CMD, ready to start.
pub struct Prepared {
    /// The paths to exec, in the order `execvp` tries them.
    paths: Vec<CString>,
    argv: Vec<CString>,
    /// The environment CMD gets, but for `BATON_TOKEN`.
    env: Vec<CString>,
    /// The cgroup v2 directory CMD starts in; `None`: the guard's own.
    cgroup: Option<OwnedFd>,
    /// The signals the guard handles, which the child sets back to their defaults.
    handled: libc::sigset_t,
    /// Of those, the ones `baton run` was started with ignored: the child ignores them.
    keep_ignored: libc::sigset_t,
    stack: Stack,
}

/// What the child reads (and, on failure, writes): shared with the guard, which waits.
#[repr(C)]
struct ChildArgs {
    paths: *const *const libc::c_char,
    argv: *const *const libc::c_char,
    /// argv for `/bin/sh PATH ARGS...`, slot 1 filled by the child (a file without `#!`).
    sh_argv: *mut *const libc::c_char,
    envp: *const *const libc::c_char,
    handled: libc::sigset_t,
    keep_ignored: libc::sigset_t,
    mask: libc::sigset_t,
    guard: libc::pid_t,
    /// The `errno` of the last exec tried; stays 0 if one succeeded.
    error: AtomicI32,
}

impl Prepared {
    /// Prepares `command` to start in `cgroup` (a cgroup v2 directory), with the environment
    /// of this process minus the variables in `drop_env`.
    pub fn new(
        command: &[OsString],
        cgroup: Option<&Path>,
        drop_env: &[&str],
        keep_ignored: &[libc::c_int],
    ) -> std::io::Result<Prepared> {
        let invalid = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
        let program = command.first().ok_or_else(|| invalid("no command"))?;
        let c = |s: &OsStr| CString::new(s.as_bytes()).map_err(|_| invalid("a NUL byte"));
        let argv = command
            .iter()
            .map(|a| c(a))
            .collect::<Result<Vec<_>, _>>()?;
        let env = std::env::vars_os()
            .filter(|(key, _)| key != "BATON_TOKEN" && !drop_env.iter().any(|d| key == d))
            .map(|(key, value)| {
                let mut pair = key.into_vec();
                pair.push(b'=');
                pair.extend(value.into_vec());
                CString::new(pair).map_err(|_| invalid("a NUL byte"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let paths = search(program, std::env::var_os("PATH").as_deref())
            .into_iter()
            .map(|p| c(p.as_os_str()))
            .collect::<Result<Vec<_>, _>>()?;
        let cgroup = match cgroup {
            Some(dir) => {
                let dir = c(dir.as_os_str())?;
                // SAFETY: open on a NUL-terminated path we own.
                let fd = unsafe {
                    libc::open(
                        dir.as_ptr(),
                        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
                    )
                };
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // SAFETY: a descriptor just opened and owned by nothing else.
                Some(unsafe { OwnedFd::from_raw_fd(fd) })
            }
            None => None,
        };
        let mut prepared = Prepared {
            paths,
            argv,
            env,
            cgroup,
            handled: handled_signals(),
            keep_ignored: signal_set(keep_ignored),
            stack: Stack::new()?,
        };
        if prepared.cgroup.is_some() && !prepared.probe() {
            return Err(std::io::Error::other(
                "this kernel kills what clone3 places in a cgroup that was killed before",
            ));
        }
        Ok(prepared)
    }

    /// Starts a child in the cgroup that exits at once, and tells whether it lived to exit.
    /// Some kernels (6.18 here) compare the parent's cgroup's count of `cgroup.kill` writes
    /// with the target's when `clone3` places a child, and SIGKILL the child if they differ:
    /// once a term ended with a kill of the cgroup, every child placed in it would die at once.
    /// Nothing else kills our cgroup between this probe and the start.
    fn probe(&mut self) -> bool {
        // SAFETY: the probe's arguments: every pointer is null, which the child never reads
        // (it exits first).
        let mut args = unsafe {
            ChildArgs {
                paths: std::ptr::null(),
                argv: std::ptr::null(),
                sh_argv: std::ptr::null_mut(),
                envp: std::ptr::null(),
                handled: std::mem::zeroed(),
                keep_ignored: std::mem::zeroed(),
                mask: std::mem::zeroed(),
                guard: 0,
                error: AtomicI32::new(PROBE),
            }
        };
        let flags = (libc::CLONE_VM | libc::CLONE_VFORK) as u64 | CLONE_INTO_CGROUP;
        let cgroup = self.cgroup.as_ref().map_or(0, |fd| fd.as_raw_fd() as u64);
        let Ok(pid) = clone_and_exec(flags, cgroup, &self.stack, &mut args) else {
            return false;
        };
        let mut status = 0;
        // SAFETY: waitpid on the child just started.
        while unsafe { libc::waitpid(pid, &mut status, libc::__WALL) } < 0 {
            if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return false;
            }
        }
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
    }

    /// Starts CMD with `BATON_TOKEN=token`; returns its PID once it has exec'd. `Err(None)`:
    /// `clone3` was refused (start it another way); `Err(Some(error))`: no path could be
    /// exec'd (the child has exited; reap it as any other).
    pub fn spawn(&mut self, token: u64) -> Result<i32, Option<std::io::Error>> {
        let token = CString::new(format!("BATON_TOKEN={token}")).expect("digits only");
        let paths = null_terminated(self.paths.iter().map(|s| s.as_c_str()));
        let argv = null_terminated(self.argv.iter().map(|s| s.as_c_str()));
        let envp = null_terminated(
            self.env
                .iter()
                .chain(std::iter::once(&token))
                .map(|s| s.as_c_str()),
        );
        let sh = c"/bin/sh";
        let mut sh_argv = null_terminated(
            [sh, sh]
                .into_iter()
                .chain(self.argv[1..].iter().map(|a| a.as_c_str())),
        );
        // SAFETY: plain sigset operations on values we own; every signal stays blocked in
        // the guard (this thread: it has no other) while the child shares its memory, so no
        // handler of ours runs in the child before it has reset them.
        let mut args = unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            let mut mask: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut mask);
            ChildArgs {
                paths: paths.as_ptr(),
                argv: argv.as_ptr(),
                sh_argv: sh_argv.as_mut_ptr(),
                envp: envp.as_ptr(),
                handled: self.handled,
                keep_ignored: self.keep_ignored,
                mask,
                guard: libc::getpid(),
                error: AtomicI32::new(0),
            }
        };
        let flags = (libc::CLONE_VM | libc::CLONE_VFORK) as u64
            | if self.cgroup.is_some() {
                CLONE_INTO_CGROUP
            } else {
                0
            };
        let result = clone_and_exec(
            flags,
            self.cgroup.as_ref().map_or(0, |fd| fd.as_raw_fd() as u64),
            &self.stack,
            &mut args,
        );
        // SAFETY: restores the mask saved above.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &args.mask, std::ptr::null_mut()) };
        match result {
            Ok(pid) => match args.error.load(Ordering::Acquire) {
                0 => Ok(pid),
                errno => Err(Some(std::io::Error::from_raw_os_error(errno))),
            },
            Err(_) => Err(None),
        }
    }
}

/// A signal set of `signals`.
fn signal_set(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigset operations on a value we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &signal in signals {
            libc::sigaddset(&mut set, signal);
        }
        set
    }
}

/// The signals this process has a handler for (not the default, not ignored).
fn handled_signals() -> libc::sigset_t {
    let handled: Vec<libc::c_int> = (1..libc::SIGRTMAX() + 1)
        .filter(|&signal| {
            crate::guard::disposition(signal)
                .is_some_and(|action| action != libc::SIG_DFL && action != libc::SIG_IGN)
        })
        .collect();
    signal_set(&handled)
}

/// The pointers to `strings`, then a null pointer: an argv or envp for `execve`.
fn null_terminated<'a>(strings: impl Iterator<Item = &'a CStr>) -> Vec<*const libc::c_char> {
    strings
        .map(CStr::as_ptr)
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// The paths `execvp` would try for `program`, in its order. Tried in that order at the
/// election, not reordered by what exists now: a program installed earlier in `PATH` while we
/// wait in line is the one a shell would run then (a failed exec costs a few microseconds).
fn search(program: &OsStr, path: Option<&OsStr>) -> Vec<std::path::PathBuf> {
    if program.as_bytes().contains(&b'/') {
        return vec![program.into()];
    }
    let path = path.map_or(&b"/bin:/usr/bin"[..], |p| p.as_bytes());
    path.split(|&b| b == b':')
        .map(|dir| {
            let dir = if dir.is_empty() { &b"."[..] } else { dir };
            Path::new(OsStr::from_bytes(dir)).join(program)
        })
        .collect()
}

/// An anonymous mapping for the child's stack.
struct Stack {
    base: *mut libc::c_void,
}

impl Stack {
    fn new() -> std::io::Result<Stack> {
        // SAFETY: a fresh private anonymous mapping; unmapped on drop.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                STACK_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Stack { base })
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, used by no child any more (the child runs on it
        // only until its exec or exit, and the guard waits for that).
        unsafe { libc::munmap(self.base, STACK_SIZE) };
    }
}

/// `struct clone_args` of `clone3(2)`, as far as the fields used here.
#[repr(C)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// Runs `child` in a new process on `stack` and returns its PID once it has exec'd or exited
/// (`CLONE_VFORK`), or the error `clone3` gave.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
fn clone_and_exec(
    flags: u64,
    cgroup: u64,
    stack: &Stack,
    args: &mut ChildArgs,
) -> std::io::Result<i32> {
    let clone_args = CloneArgs {
        flags,
        pidfd: 0,
        child_tid: 0,
        parent_tid: 0,
        exit_signal: libc::SIGCHLD as u64,
        stack: stack.base as u64,
        stack_size: STACK_SIZE as u64,
        tls: 0,
        set_tid: 0,
        set_tid_size: 0,
        cgroup,
    };
    let ret: i64;
    // SAFETY: clone3 with a stack of the child's own. The child starts at the instruction
    // after `syscall` with rax = 0 on that stack (16-byte aligned at its top), calls
    // `child_main(args)` and never comes back: `child_main` execs or exits. The parent only
    // goes on once the child has exec'd or exited (CLONE_VFORK); `args` and everything it
    // points to live in the parent's frame until then.
    unsafe {
        core::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "mov rdi, r12",
            "call r13",
            "mov edi, eax",
            "mov eax, 231",
            "syscall",
            "ud2",
            "2:",
            inlateout("rax") libc::SYS_clone3 => ret,
            in("rdi") &clone_args as *const CloneArgs,
            in("rsi") std::mem::size_of::<CloneArgs>(),
            in("r12") args as *mut ChildArgs,
            in("r13") child_main as extern "C" fn(*mut ChildArgs) -> libc::c_int,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    if ret < 0 {
        Err(std::io::Error::from_raw_os_error(-ret as i32))
    } else {
        Ok(ret as i32)
    }
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
fn clone_and_exec(
    _flags: u64,
    _cgroup: u64,
    _stack: &Stack,
    _args: &mut ChildArgs,
) -> std::io::Result<i32> {
    Err(std::io::Error::from_raw_os_error(libc::ENOSYS))
}

/// The child: default signal dispositions, death with the guard, then the first path that
/// execs. Only async-signal-safe calls; writes nothing of the guard's but `args.error`.
extern "C" fn child_main(args: *mut ChildArgs) -> libc::c_int {
    // SAFETY: `args` is the guard's, alive and unchanged while the guard waits for us; every
    // call below is a plain system call wrapper.
    unsafe {
        let args = &*args;
        if args.error.load(Ordering::Relaxed) == PROBE {
            libc::_exit(0);
        }
        // Our copy of the guard's handlers would run the guard's code in its memory, and a
        // signal meant for CMD would be swallowed: back to the defaults, as exec would set
        // them (ignored signals stay ignored, as through exec).
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        let mut ignored: libc::sigaction = std::mem::zeroed();
        ignored.sa_sigaction = libc::SIG_IGN;
        for signal in 1..libc::SIGRTMAX() + 1 {
            if libc::sigismember(&args.handled, signal) == 1 {
                // Those `baton run` was started with ignored, CMD inherits ignored.
                let keep = libc::sigismember(&args.keep_ignored, signal) == 1;
                let action = if keep { &ignored } else { &default };
                libc::sigaction(signal, action, std::ptr::null_mut());
            }
        }
        // CMD dies with the guard, as a launcher would; if the guard is already gone, so are we.
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0
            || libc::getppid() != args.guard
        {
            args.error.store(libc::ESRCH, Ordering::Release);
            libc::_exit(127);
        }
        libc::sigprocmask(libc::SIG_SETMASK, &args.mask, std::ptr::null_mut());
        let mut error = libc::ENOENT;
        let mut denied = false;
        let mut path = args.paths;
        while !(*path).is_null() {
            libc::execve(*path, args.argv, args.envp);
            let mut errno = *libc::__errno_location();
            if errno == libc::ENOEXEC {
                // No `#!` line: a shell script, as execvp runs it.
                *args.sh_argv.add(1) = *path;
                libc::execve(c"/bin/sh".as_ptr(), args.sh_argv.cast_const(), args.envp);
                errno = *libc::__errno_location();
            }
            match errno {
                libc::EACCES => denied = true,
                libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => {}
                other => {
                    error = other;
                    break;
                }
            }
            path = path.add(1);
        }
        if denied && error == libc::ENOENT {
            error = libc::EACCES;
        }
        args.error.store(error, Ordering::Release);
        libc::_exit(127)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_search_tries_every_candidate_in_path_order() {
        let path = OsString::from("/a::/b");
        assert_eq!(
            search(OsStr::new("tool"), Some(&path)),
            ["/a/tool", "./tool", "/b/tool"]
                .map(std::path::PathBuf::from)
                .to_vec()
        );
        assert_eq!(
            search(OsStr::new("./x"), Some(&path)),
            vec![std::path::PathBuf::from("./x")]
        );
        assert_eq!(
            search(OsStr::new("sh"), None),
            ["/bin/sh", "/usr/bin/sh"]
                .map(std::path::PathBuf::from)
                .to_vec()
        );
    }
}
