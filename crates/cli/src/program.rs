//! Whether a command's program can be started here, checked before campaigning: a typo in
//! CMD would otherwise show only once elected (each candidate in turn winning and failing at
//! exec with 127 and, with `--requeue`, campaigning again).
//!
//! The check follows what `execvp` and the kernel will do, so that it never refuses what
//! would run: a name with a `/` is a path, any other is searched for in `PATH` (`/bin:/usr/bin`
//! when unset; an empty entry is the current directory), going on past entries exec would go
//! on past (missing, not executable) and stopping where exec stops (a symlink loop, say).
//! Execute permission is asked with the effective IDs and capabilities, as exec uses them. A
//! script's `#!` interpreter is checked the same way, a few levels deep. An error the check
//! cannot read for certain (a sandbox that blocks `faccessat2` with EPERM, an I/O error) lets
//! the program through: exec decides. What it cannot foresee (a program removed after the
//! check, an `env` in the `#!` line that finds nothing, a `binfmt_misc` handler) still fails at
//! exec, with 127 or 126.

use std::ffi::{CString, OsStr};
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::UsageError;

/// How many `#!` interpreters deep the check follows (Linux stops a little deeper, with ELOOP).
const INTERPRETER_DEPTH: usize = 4;

/// The kernel reads this much of a file to find its `#!` line (`BINPRM_BUF_SIZE`).
const SHEBANG_BUFFER: usize = 256;

/// Refuses, with the reason, a program that cannot be started here.
pub(crate) fn check(program: &OsStr) -> Result<(), UsageError> {
    check_with_path(program, std::env::var_os("PATH").as_deref())
}

fn check_with_path(program: &OsStr, path: Option<&OsStr>) -> Result<(), UsageError> {
    let refuse = |why: String| {
        Err(UsageError(format!(
            "cannot start {}: {why}",
            program.to_string_lossy()
        )))
    };
    if program.is_empty() {
        return Err(UsageError("the command is an empty string".into()));
    }
    if program.as_bytes().contains(&b'/') {
        return executable(Path::new(program), 0).or_else(|unusable| refuse(unusable.reason()));
    }
    let path = path.unwrap_or(OsStr::new("/bin:/usr/bin"));
    let mut denied = None;
    for dir in std::env::split_paths(path) {
        let dir = if dir.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            dir
        };
        let candidate = dir.join(program);
        match executable(&candidate, 0) {
            Ok(()) => return Ok(()),
            Err(Unusable::Absent(_)) => {}
            Err(Unusable::Denied(why)) => {
                denied.get_or_insert(format!("{}: {why}", candidate.display()));
            }
            Err(Unusable::Fatal(why)) => {
                return refuse(format!("{}: {why}", candidate.display()));
            }
        }
    }
    match denied {
        Some(why) => refuse(why),
        None if path.is_empty() => {
            refuse("not in the current directory, the only place searched (PATH is empty)".into())
        }
        None => refuse(format!(
            "command not found in PATH ({})",
            path.to_string_lossy()
        )),
    }
}

/// Why a path cannot be executed, sorted as `execvp` sorts exec's errors.
#[derive(Debug)]
enum Unusable {
    /// Not there (or not reachable: ENOTDIR, ESTALE, ...): the search goes on, silently.
    Absent(String),
    /// There but not usable (EACCES): the search goes on, and the first such reason is the one
    /// given if nothing is found.
    Denied(String),
    /// A symlink loop or a name too long: exec gives up here, and so does the check.
    Fatal(String),
}

impl Unusable {
    fn reason(self) -> String {
        match self {
            Unusable::Absent(why) | Unusable::Denied(why) | Unusable::Fatal(why) => why,
        }
    }

    /// Sorts a failed `stat`; `None` for an error that does not tell (exec decides).
    fn from_errno(error: std::io::Error) -> Option<Unusable> {
        match error.raw_os_error()? {
            libc::ENOENT => Some(Unusable::Absent("no such file".into())),
            libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => {
                Some(Unusable::Absent(error.to_string()))
            }
            libc::EACCES => Some(Unusable::Denied(error.to_string())),
            libc::ELOOP | libc::ENAMETOOLONG => Some(Unusable::Fatal(error.to_string())),
            _ => None,
        }
    }
}

/// Whether `path` can be executed: the file itself and, for a script, its interpreter.
fn executable(path: &Path, depth: usize) -> Result<(), Unusable> {
    permitted(path)?;
    if depth >= INTERPRETER_DEPTH {
        return Ok(());
    }
    let Some(interpreter) = interpreter(path) else {
        return Ok(());
    };
    let context = |why: String| {
        let mut text = format!("its #! interpreter {}: {why}", interpreter.display());
        if interpreter.as_os_str().as_bytes().ends_with(b"\r") {
            text.push_str(" (the script has Windows line endings)");
        }
        text
    };
    executable(&interpreter, depth + 1).map_err(|why| match why {
        // A missing interpreter is exec's ENOENT: the search goes on past it, but it is the
        // reason to give.
        Unusable::Absent(why) | Unusable::Denied(why) => Unusable::Denied(context(why)),
        Unusable::Fatal(why) => Unusable::Fatal(context(why)),
    })
}

/// The interpreter a script's `#!` line names, read as the kernel reads it: after `#!` and
/// any blanks, up to a blank, a NUL or the end of the line. `None` for anything else: no `#!`
/// line (exec runs binaries; `execvp` hands other files to /bin/sh), a name that does not
/// end within the kernel's buffer (exec refuses it and `execvp` falls back to /bin/sh), or a
/// file the check cannot read (exec may still run a binary nobody can read).
fn interpreter(path: &Path) -> Option<PathBuf> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let mut head = Vec::with_capacity(SHEBANG_BUFFER);
    file.take(SHEBANG_BUFFER as u64)
        .read_to_end(&mut head)
        .ok()?;
    let line = head.strip_prefix(b"#!")?;
    let start = line.iter().position(|&b| b != b' ' && b != b'\t')?;
    let name = &line[start..];
    let end = name
        .iter()
        .position(|&b| matches!(b, b' ' | b'\t' | b'\n' | b'\0'));
    let name = match end {
        Some(end) => &name[..end],
        None if head.len() == SHEBANG_BUFFER => return None,
        None => name,
    };
    if name.is_empty() {
        return None;
    }
    Some(PathBuf::from(OsStr::from_bytes(name)))
}

/// Whether exec may run the file at `path` itself: a regular file, executable for the
/// effective user with its capabilities (`AT_EACCESS`), on a mount that allows exec.
fn permitted(path: &Path) -> Result<(), Unusable> {
    let metadata = match std::fs::metadata(path) {
        Ok(metadata) => metadata,
        Err(error) => return Unusable::from_errno(error).map_or(Ok(()), Err),
    };
    if metadata.is_dir() {
        return Err(Unusable::Denied("is a directory".into()));
    }
    if !metadata.is_file() {
        return Err(Unusable::Denied("not a regular file".into()));
    }
    let Ok(c_path) = CString::new(path.as_os_str().as_bytes()) else {
        return Err(Unusable::Fatal("the name holds a NUL byte".into()));
    };
    // SAFETY: faccessat reads a valid NUL-terminated path and has no other preconditions.
    let status = unsafe {
        libc::faccessat(
            libc::AT_FDCWD,
            c_path.as_ptr(),
            libc::X_OK,
            libc::AT_EACCESS,
        )
    };
    let error = std::io::Error::last_os_error();
    match error.raw_os_error() {
        _ if status == 0 => Ok(()),
        Some(libc::EACCES) => Err(Unusable::Denied(format!("not executable ({error})"))),
        // Anything else (EPERM from a sandbox that blocks faccessat2, say) does not tell.
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    struct Dir(tempfile::TempDir);

    impl Dir {
        fn new() -> Dir {
            Dir(tempfile::tempdir().unwrap())
        }

        fn file(&self, name: &str, content: &[u8], mode: u32) -> String {
            let path = self.path(name);
            std::fs::write(&path, content).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            path
        }

        fn path(&self, name: &str) -> String {
            self.0.path().join(name).to_str().unwrap().to_string()
        }

        fn display(&self) -> String {
            self.0.path().to_str().unwrap().to_string()
        }
    }

    fn check_at(program: &str, path: Option<&str>) -> Result<(), String> {
        check_with_path(OsStr::new(program), path.map(OsStr::new)).map_err(|error| error.0)
    }

    #[test]
    fn paths_and_the_path_search() {
        let dir = Dir::new();
        let tool = dir.file("tool", b"\x7fELF", 0o755);
        assert_eq!(check_at(&tool, None), Ok(()));
        assert_eq!(
            check_at(&dir.path("missing"), None),
            Err(format!(
                "cannot start {}: no such file",
                dir.path("missing")
            ))
        );
        let dirs = format!("/nonexistent:{}", dir.display());
        assert_eq!(check_at("tool", Some(&dirs)), Ok(()));
        assert_eq!(
            check_at("nope", Some(&dirs)),
            Err(format!(
                "cannot start nope: command not found in PATH ({dirs})"
            ))
        );
        // A PATH entry that is a file is passed over as execvp passes over it (ENOTDIR), not
        // given as the reason; a path through a file is refused with it.
        let dirs = format!("{tool}:/nonexistent");
        assert_eq!(
            check_at("nope", Some(&dirs)),
            Err(format!(
                "cannot start nope: command not found in PATH ({dirs})"
            ))
        );
        assert_eq!(
            check_at(&format!("{tool}/x"), None),
            Err(format!(
                "cannot start {tool}/x: Not a directory (os error 20)"
            ))
        );
        assert!(
            check_at("sh", None).is_ok(),
            "PATH unset searches /bin:/usr/bin"
        );
        assert_eq!(
            check_at("nope", Some("")),
            Err(
                "cannot start nope: not in the current directory, the only place searched \
                 (PATH is empty)"
                    .into()
            )
        );
        assert_eq!(
            check_at("", None),
            Err("the command is an empty string".into())
        );
    }

    #[test]
    fn what_exec_refuses_is_refused_and_the_search_goes_on_past_it() {
        let dir = Dir::new();
        let plain = dir.file("plain", b"echo", 0o644);
        let refused = check_at(&plain, None).unwrap_err();
        assert!(
            refused.contains("not executable (Permission denied"),
            "{refused}"
        );
        assert!(check_at(&dir.display(), None)
            .unwrap_err()
            .ends_with("is a directory"));
        // A FIFO is refused at once, never opened (opening it would block).
        let fifo = CString::new(dir.path("fifo")).unwrap();
        // SAFETY: mkfifo reads a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o755) }, 0);
        assert!(check_at(&dir.path("fifo"), None)
            .unwrap_err()
            .ends_with("not a regular file"));
        // Neither stops the search: a later entry of PATH can still hold the program.
        std::fs::rename(&plain, dir.path("sh")).unwrap();
        std::fs::rename(dir.path("fifo"), dir.path("true")).unwrap();
        let dirs = format!("{}:/bin:/usr/bin", dir.display());
        assert_eq!(check_at("sh", Some(&dirs)), Ok(()));
        assert_eq!(check_at("true", Some(&dirs)), Ok(()));
    }

    #[test]
    fn a_symlink_loop_ends_the_search_as_it_ends_execvp() {
        let dir = Dir::new();
        std::os::unix::fs::symlink("b", dir.path("sh")).unwrap();
        std::os::unix::fs::symlink("sh", dir.path("b")).unwrap();
        let dirs = format!("{}:/bin:/usr/bin", dir.display());
        let refused = check_at("sh", Some(&dirs)).unwrap_err();
        assert!(refused.contains("symbolic links"), "{refused}");
    }

    #[test]
    fn interpreters_are_read_as_the_kernel_reads_them() {
        let dir = Dir::new();
        for (name, script) in [
            ("spaced", &b"#! \t/bin/sh -e\nexit 0\n"[..]),
            ("trailing", b"#!/bin/sh \t\nexit 0\n"),
            ("nul", b"#!/bin/sh\0garbage\nexit 0\n"),
            ("bare", b"#!\nexit 0\n"),
            ("none", b"exit 0\n"),
            ("empty", b""),
        ] {
            let script = dir.file(name, script, 0o755);
            assert_eq!(check_at(&script, None), Ok(()), "{name}");
        }
        // An interpreter name that does not end within the kernel's 256 bytes: exec refuses
        // the file and execvp runs it with /bin/sh, so the check lets it through.
        let long = format!("#!{}bin/sh\n", "/".repeat(300));
        let long = dir.file("long", long.as_bytes(), 0o755);
        assert_eq!(check_at(&long, None), Ok(()));
        let missing = dir.file("missing", b"#!/no/such/shell -e\n", 0o755);
        assert_eq!(
            check_at(&missing, None),
            Err(format!(
                "cannot start {missing}: its #! interpreter /no/such/shell: no such file"
            ))
        );
        let crlf = dir.file("crlf", b"#!/bin/sh\r\nexit 0\r\n", 0o755);
        assert!(check_at(&crlf, None)
            .unwrap_err()
            .ends_with("no such file (the script has Windows line endings)"));
    }

    #[test]
    fn an_interpreter_that_is_a_script_is_checked_in_turn() {
        let dir = Dir::new();
        let inner = dir.file("inner", b"#!/bin/sh\nexec \"$@\"\n", 0o755);
        let outer = dir.file("outer", format!("#!{inner}\n").as_bytes(), 0o755);
        assert_eq!(check_at(&outer, None), Ok(()));
        let broken = dir.file("broken", b"#!/no/such/shell\n", 0o755);
        let outer = dir.file("outer2", format!("#!{broken}\n").as_bytes(), 0o755);
        assert_eq!(
            check_at(&outer, None),
            Err(format!(
                "cannot start {outer}: its #! interpreter {broken}: its #! interpreter \
                 /no/such/shell: no such file"
            ))
        );
    }
}
