//! Containment: every process a command starts, held in something the command cannot leave.
//!
//! A process group is not enough: `timeout`, `setsid -f`, job control and daemons leave it. So
//! `baton run` holds the command in the strongest thing the host allows:
//!
//! - **cgroup v2**: a cgroup of its own that the command joins before `exec`. No process can
//!   leave a cgroup without write access to another one, and `cgroup.kill` SIGKILLs every member
//!   atomically, including one that is forking at that moment.
//! - **cgroup v1 freezer**: the same cgroup, killed by freezing it (nothing in it can fork or
//!   run), SIGKILLing every member and thawing it.
//! - **subreaper** (everywhere, and the only mechanism where no cgroup can be created): the guard
//!   and the supervisor are child subreapers (`PR_SET_CHILD_SUBREAPER`), so a process that
//!   double-forks or daemonizes is re-parented to them instead of to PID 1 and stays in their
//!   process tree. Killing walks that tree and repeats until a walk finds nothing alive, so a
//!   descendant forking while it is killed is found on the next walk.
//!
//! On top of any of these, **a PID namespace** (`--pid-namespace`, where the host lets us
//! create one): the command runs under an init of its own (PID 1 of a new namespace, a child of
//! the guard that dies with it), so when the guard dies — even by SIGKILL together with `baton
//! run` itself — the kernel kills every process of the namespace. Without it, only the command's
//! own process dies with the guard (its parent-death signal is SIGKILL); what it started is
//! killed by whichever of the supervisor and the guard survives.
//!
//! Signals to a process found by a walk go through a pidfd opened and checked against the
//! process's start time, so a PID reused by an unrelated process is never signalled.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

/// What `--containment` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// The strongest available: cgroup v2, else cgroup v1 freezer, else subreaper.
    Auto,
    /// A cgroup v2 (`cgroup.kill`); fail if none can be created.
    Cgroup,
    /// A cgroup v1 freezer cgroup; fail if none can be created.
    Freezer,
    /// The process tree under child subreapers only.
    Subreaper,
}

/// What `--pid-namespace` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PidNamespace {
    /// Run the command in a PID namespace of its own; fail if none can be created.
    On,
    /// Run the command in the host's PID namespace.
    Off,
}

/// The mechanism in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// cgroup v2 with `cgroup.kill`.
    CgroupV2,
    /// cgroup v1 freezer.
    Freezer,
    /// Process tree under subreapers.
    Subreaper,
}

impl Kind {
    fn tag(self) -> &'static str {
        match self {
            Kind::CgroupV2 => "cgroup2",
            Kind::Freezer => "freezer",
            Kind::Subreaper => "subreaper",
        }
    }
}

/// The containment of one `baton run`: a cgroup (if any) plus the process tree.
#[derive(Debug)]
pub struct Cage {
    kind: Kind,
    /// The cgroup directory, for the cgroup kinds.
    dir: Option<PathBuf>,
    /// `dir/cgroup.procs` as a C string, prepared ahead so that joining after `fork` only
    /// makes async-signal-safe calls.
    procs: Option<CString>,
    /// Whether this process created the directory (and so removes it).
    owned: bool,
    /// Why no stronger mechanism was used, when `auto` fell back to the subreaper.
    fallback: Option<String>,
    /// Whether the command runs in a PID namespace of its own, under an init that dies with
    /// the guard.
    pid_namespace: bool,
}

/// The environment variable that hands the cage to the guard: `KIND` or `KIND:DIR`.
pub const CAGE_ENV: &str = "BATON_CAGE";

impl Cage {
    /// Creates the containment `mode` asks for. `Err` says why a requested mechanism is not
    /// available here.
    pub fn create(mode: Mode) -> Result<Cage, String> {
        Cage::create_named(mode, &format!("baton-{}", std::process::id()))
    }

    /// [`Cage::create`] with a cgroup named `name` (`baton-PID` or `baton-PID-N`, PID this
    /// process's: the sweep of stale cgroups reads it).
    pub fn create_named(mode: Mode, name: &str) -> Result<Cage, String> {
        let name = name.to_string();
        let attempts: &[Kind] = match mode {
            Mode::Auto => &[Kind::CgroupV2, Kind::Freezer, Kind::Subreaper],
            Mode::Cgroup => &[Kind::CgroupV2],
            Mode::Freezer => &[Kind::Freezer],
            Mode::Subreaper => &[Kind::Subreaper],
        };
        let mut why = String::new();
        for &kind in attempts {
            let dir = match kind {
                Kind::Subreaper => {
                    let mut cage = Cage::subreaper();
                    cage.fallback = (!why.is_empty()).then_some(why);
                    return Ok(cage);
                }
                Kind::CgroupV2 => create_cgroup(&name, "cgroup2", None, "cgroup.kill"),
                Kind::Freezer => create_cgroup(&name, "cgroup", Some("freezer"), "freezer.state"),
            };
            match dir {
                Ok(dir) => {
                    sweep_stale(&dir);
                    return Ok(Cage::at(kind, dir, true));
                }
                Err(error) => {
                    if !why.is_empty() {
                        why.push_str("; ");
                    }
                    why.push_str(&error);
                }
            }
        }
        Err(why)
    }

    fn subreaper() -> Cage {
        Cage {
            kind: Kind::Subreaper,
            dir: None,
            procs: None,
            owned: false,
            fallback: None,
            pid_namespace: false,
        }
    }

    fn at(kind: Kind, dir: PathBuf, owned: bool) -> Cage {
        let procs = CString::new(dir.join("cgroup.procs").as_os_str().as_bytes()).ok();
        Cage {
            kind,
            dir: Some(dir),
            procs,
            owned,
            fallback: None,
            pid_namespace: false,
        }
    }

    /// Puts the command in a PID namespace of its own (see the module's docs). `Err` says why
    /// this host cannot.
    pub fn use_pid_namespace(&mut self, choice: PidNamespace) -> Result<(), String> {
        if choice == PidNamespace::On {
            probe_pid_namespace()?;
            self.pid_namespace = true;
        }
        Ok(())
    }

    /// Whether the command runs in a PID namespace of its own.
    pub fn pid_namespace(&self) -> bool {
        self.pid_namespace
    }

    /// Whether the guard can start the command itself, placed by the kernel as it is created
    /// (see [`crate::spawn`]): `Some(Some(dir))` into this cgroup v2, `Some(None)` with no
    /// cgroup (the subreaper kind). `None`: through a launcher, which joins ahead (the
    /// freezer is joined through `cgroup.procs`, which can wait for an RCU grace period) or
    /// stays as a PID namespace's init.
    pub fn direct_start(&self) -> Option<Option<&std::path::Path>> {
        if self.pid_namespace || !crate::spawn::SUPPORTED {
            return None;
        }
        match self.kind {
            Kind::CgroupV2 => self.dir.as_deref().map(Some),
            Kind::Subreaper => Some(None),
            Kind::Freezer => None,
        }
    }

    /// Marks the cgroup as in use (its modification time), so that no other `baton run`
    /// takes it for a stale one while it is empty (see `sweep_stale`).
    pub fn touch(&self) {
        let Some(dir) = &self.dir else { return };
        if let Ok(path) = CString::new(dir.as_os_str().as_bytes()) {
            // SAFETY: utimensat on a NUL-terminated path we own; null times mean "now".
            unsafe { libc::utimensat(libc::AT_FDCWD, path.as_ptr(), std::ptr::null(), 0) };
        }
    }

    /// The value of [`CAGE_ENV`] that describes this cage to the guard.
    pub fn to_env(&self) -> String {
        let pidns = if self.pid_namespace { "+pidns" } else { "" };
        match &self.dir {
            Some(dir) => format!("{}{pidns}:{}", self.kind.tag(), dir.display()),
            None => format!("{}{pidns}", self.kind.tag()),
        }
    }

    /// The cage described by [`CAGE_ENV`]; the guard removes its directory when it cleans up
    /// after the supervisor's death.
    pub fn from_env(value: &str) -> Cage {
        let (tag, dir) = value.split_once(':').unwrap_or((value, ""));
        let (tag, pid_namespace) = match tag.strip_suffix("+pidns") {
            Some(tag) => (tag, true),
            None => (tag, false),
        };
        let mut cage = match tag {
            "cgroup2" if !dir.is_empty() => Cage::at(Kind::CgroupV2, dir.into(), true),
            "freezer" if !dir.is_empty() => Cage::at(Kind::Freezer, dir.into(), true),
            _ => Cage::subreaper(),
        };
        cage.pid_namespace = pid_namespace;
        cage
    }

    /// One line for the user: what holds the command.
    pub fn describe(&self) -> String {
        let mechanism = self.describe_mechanism();
        if self.pid_namespace {
            format!("{mechanism}, in a PID namespace of its own")
        } else {
            mechanism
        }
    }

    fn describe_mechanism(&self) -> String {
        match (&self.kind, &self.dir) {
            (Kind::CgroupV2, Some(dir)) => format!("cgroup v2 {}", dir.display()),
            (Kind::Freezer, Some(dir)) => format!("cgroup v1 freezer {}", dir.display()),
            _ => match &self.fallback {
                Some(why) => format!("process tree under child subreapers (no cgroup: {why})"),
                None => "process tree under child subreapers".to_string(),
            },
        }
    }

    /// A closure for `pre_exec` that moves the new process into the cgroup (a no-op for the
    /// subreaper kind). It only makes async-signal-safe calls, as `pre_exec` requires.
    pub fn joiner(&self) -> impl FnMut() -> std::io::Result<()> + Send + Sync + 'static {
        let procs = self.procs.clone();
        move || match &procs {
            Some(procs) => join(procs),
            None => Ok(()),
        }
    }

    /// The processes in the cgroup and in the cgroups below it (a nested `baton run` makes
    /// one); empty for the subreaper kind.
    pub fn members(&self) -> Vec<i32> {
        let Some(dir) = &self.dir else {
            return Vec::new();
        };
        let mut found = Vec::new();
        members_below(dir, &mut found, 0);
        found
    }

    /// Whether the cgroup holds no process (always true for the subreaper kind).
    pub fn is_empty(&self) -> bool {
        if let (Kind::CgroupV2, Some(dir)) = (self.kind, &self.dir) {
            // One file answers for the cgroup and every cgroup below it.
            let events = std::fs::read_to_string(dir.join("cgroup.events")).unwrap_or_default();
            if let Some(populated) = events.lines().find_map(|l| l.strip_prefix("populated ")) {
                return populated.trim() == "0";
            }
        }
        self.members().is_empty()
    }

    /// Sends `signal` to every member of the cgroup; returns the processes it went to.
    pub fn signal_members(&self, signal: libc::c_int) -> Vec<Process> {
        let mut sent = Vec::new();
        for pid in self.members() {
            if let Some(process) = process(pid) {
                send(&process, signal);
                sent.push(process);
            }
        }
        sent
    }

    /// SIGKILLs every member of the cgroup, in a way a forking member cannot race.
    pub fn kill(&self) {
        let Some(dir) = &self.dir else { return };
        match self.kind {
            // Not when it is empty: nothing can enter it then but what our guard starts, and
            // a kill, even of nobody, makes some kernels kill what clone3 places in the cgroup
            // afterwards (see `crate::spawn`), which would cost the next term its fast start.
            Kind::CgroupV2 if !self.is_empty() => {
                let _ = std::fs::write(dir.join("cgroup.kill"), "1");
            }
            Kind::CgroupV2 => {}
            Kind::Freezer => {
                let state = dir.join("freezer.state");
                let _ = std::fs::write(&state, "FROZEN");
                // Freezing completes asynchronously; a frozen member can no longer fork.
                for _ in 0..1000 {
                    let now = std::fs::read_to_string(&state).unwrap_or_default();
                    if now.trim() != "FREEZING" {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                let _ = self.signal_members(libc::SIGKILL);
                let _ = std::fs::write(&state, "THAWED");
            }
            Kind::Subreaper => {}
        }
    }

    /// Removes the cgroup directory (once it is empty), and any empty cgroups a nested
    /// `baton run` left below it, if this process created it.
    pub fn remove(&self) {
        if let (true, Some(dir)) = (self.owned, &self.dir) {
            remove_tree(dir, 0);
        }
    }
}

/// How deep nested cgroups are followed (bounds the recursion).
const MAX_DEPTH: usize = 16;

fn members_below(dir: &std::path::Path, found: &mut Vec<i32>, depth: usize) {
    found.extend(
        std::fs::read_to_string(dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| line.trim().parse::<i32>().ok()),
    );
    if depth < MAX_DEPTH {
        for child in subdirectories(dir) {
            members_below(&child, found, depth + 1);
        }
    }
}

fn subdirectories(dir: &std::path::Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Removes `dir` and the (empty) cgroups below it, deepest first.
fn remove_tree(dir: &std::path::Path, depth: usize) {
    if depth < MAX_DEPTH {
        for child in subdirectories(dir) {
            remove_tree(&child, depth + 1);
        }
    }
    let _ = std::fs::remove_dir(dir);
}

/// Removes the cgroups that `baton run`s which were killed outright (supervisor and guard
/// both, say by `killall -9 baton`) left next to `dir`: named `baton-PID` for a PID no longer
/// running, and empty (a cgroup with processes cannot be removed, so a live one never is).
fn sweep_stale(dir: &std::path::Path) {
    let Some(parent) = dir.parent() else { return };
    for sibling in subdirectories(parent) {
        let Some(pid) = sibling
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("baton-"))
            .and_then(|p| p.split('-').next()?.parse::<i32>().ok())
        else {
            continue;
        };
        // Old enough too: a `baton run` in another PID namespace (whose PID we cannot see)
        // may have just created its cgroup and not yet moved its launcher in, or be
        // campaigning with its cgroup empty (its guard touches it more often than this).
        let old = std::fs::metadata(&sibling)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|at| at.elapsed().ok())
            .is_some_and(|age| age > STALE_AFTER);
        if sibling != dir && old && process(pid).is_none() {
            let mut found = Vec::new();
            members_below(&sibling, &mut found, 0);
            if found.is_empty() {
                remove_tree(&sibling, 0);
            }
        }
    }
}

/// How old an empty `baton-PID` cgroup of a PID we cannot see must be before it is swept.
const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Writes "0" (the writing process) to the cgroup.procs file at `procs`: joins that cgroup.
fn join(procs: &CString) -> std::io::Result<()> {
    // SAFETY: open, write and close on a path and buffer we own; all async-signal-safe.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let written = libc::write(fd, b"0".as_ptr().cast(), 1);
        let error = std::io::Error::last_os_error();
        libc::close(fd);
        if written != 1 {
            return Err(error);
        }
    }
    Ok(())
}

/// Creates `NAME` under this process's own cgroup in the hierarchy mounted with `fstype`
/// (and, for v1, the `controller`), and checks that `probe` exists in it.
fn create_cgroup(
    name: &str,
    fstype: &str,
    controller: Option<&str>,
    probe: &str,
) -> Result<PathBuf, String> {
    let what = match controller {
        Some(controller) => format!("cgroup v1 {controller}"),
        None => "cgroup v2".to_string(),
    };
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|error| format!("{what}: cannot read /proc/self/mountinfo: {error}"))?;
    let mount = mountinfo
        .lines()
        .find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mount_point = left.split_whitespace().nth(4)?;
            let mut right = right.split_whitespace();
            let found_type = right.next()?;
            let options = right.nth(1).unwrap_or("");
            let has_controller =
                controller.is_none_or(|c| options.split(',').any(|option| option == c));
            (found_type == fstype && has_controller).then(|| PathBuf::from(mount_point))
        })
        .ok_or_else(|| format!("{what} is not mounted"))?;
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|error| format!("{what}: cannot read /proc/self/cgroup: {error}"))?;
    let own_path = own
        .lines()
        .find_map(|line| {
            let mut fields = line.splitn(3, ':');
            let (id, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
            let matches = match controller {
                None => id == "0" && controllers.is_empty(),
                Some(c) => controllers.split(',').any(|found| found == c),
            };
            matches.then(|| path.to_string())
        })
        .ok_or_else(|| format!("{what}: this process is in no such cgroup"))?;
    let dir = mount.join(own_path.trim_start_matches('/')).join(name);
    std::fs::create_dir(&dir)
        .map_err(|error| format!("{what}: cannot create {}: {error}", dir.display()))?;
    if !dir.join(probe).exists() {
        let _ = std::fs::remove_dir(&dir);
        return Err(format!("{what}: {probe} is not supported by this kernel"));
    }
    Ok(dir)
}

/// Checks that this process may create a PID namespace and a mount namespace (for the
/// namespace's own /proc), by trying in a child that exits at once.
fn probe_pid_namespace() -> Result<(), String> {
    // SAFETY: the child makes raw system calls only (unshare, _exit), which is all a child
    // of a multi-threaded process may do.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(format!("cannot fork: {}", std::io::Error::last_os_error()));
    }
    if pid == 0 {
        // SAFETY: see above.
        unsafe {
            let code = if libc::unshare(libc::CLONE_NEWPID | libc::CLONE_NEWNS) == 0 {
                0
            } else {
                *libc::__errno_location()
            };
            libc::_exit(code.clamp(0, 255));
        }
    }
    let mut status = 0;
    // SAFETY: waitpid on the child we just forked.
    while unsafe { libc::waitpid(pid, &mut status, 0) } < 0 {
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return Err("cannot wait for the namespace probe".into());
        }
    }
    match libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status)) {
        Some(0) => Ok(()),
        Some(errno) => Err(format!(
            "cannot create a PID namespace: {} (it needs root or CAP_SYS_ADMIN)",
            std::io::Error::from_raw_os_error(errno)
        )),
        None => Err("cannot create a PID namespace: the probe died".into()),
    }
}

/// Makes this process a child subreaper: orphaned descendants are re-parented to it.
pub fn become_subreaper() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Lowers every thread of this process to [`EXIT_NICE`], for a process whose part in a handoff
/// is over (its command gone, its entry deleted) and which only exits now.
///
/// Tearing down a process takes a few hundred microseconds of CPU, in the very moments when the
/// successor's watch event, read, launcher and command start want both CPUs of a small host.
/// At a lower priority the exit yields to them when they wake. (The teardown runs in whichever
/// thread lets go of the memory last, so every thread is lowered.)
pub fn lower_priority() {
    let threads = tasks(std::process::id() as i32)
        .filter_map(|task| task.file_name().to_str()?.parse::<i32>().ok());
    // Thread 0 is the caller, should /proc be unreadable.
    for tid in threads.chain([0]) {
        lower_thread(tid);
    }
}

/// Lowers the calling thread to [`EXIT_NICE`] (see [`lower_priority`]) and gives up the CPU: a
/// lower priority alone does not make a task that is already waiting run first.
pub fn step_aside() {
    lower_thread(0);
    // SAFETY: sched_yield has no preconditions.
    unsafe { libc::sched_yield() };
}

/// The nice value of a process on its way out. Not `SCHED_IDLE`, and not nice 19: on a host
/// whose CPUs are busy with other work those leave the exit almost no CPU (measured: a `baton
/// run` of a 300 ms command took up to 1.04 s to exit with four busy loops on two cores under
/// `SCHED_IDLE`, against at most 368 ms before); at nice 10 it still gets about a tenth of a
/// busy CPU (at most 384 ms there), while a task at nice 0 that wakes preempts it.
pub const EXIT_NICE: i32 = 10;

/// Lowers thread `tid` (0: the caller) to [`EXIT_NICE`].
fn lower_thread(tid: i32) {
    // SAFETY: setpriority on one of our own threads; one that exited meanwhile only makes it
    // fail.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, EXIT_NICE) };
}

/// One process as `/proc/PID/stat` describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Process {
    /// Its PID.
    pub pid: i32,
    /// Its parent's PID.
    pub parent: i32,
    /// Not a zombie: it can still run (or is in uninterruptible sleep).
    pub live: bool,
    /// Start time in clock ticks since boot: with the PID, an identity that is never reused.
    start: u64,
}

fn process(pid: i32) -> Option<Process> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, after) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // After the command: state(0) ppid(1) ... starttime is field 22 of the line, 19 here.
    let state = *fields.first()?;
    let parent = fields.get(1)?.parse().ok()?;
    let start = fields.get(19)?.parse().ok()?;
    let live = (state != "Z" && state != "X") || any_live_thread(pid);
    Some(Process {
        pid,
        parent,
        live,
        start,
    })
}

/// A zombie leader thread can hide a live thread (one in an NFS write, say): the process
/// counts as gone only when every thread is.
fn any_live_thread(pid: i32) -> bool {
    tasks(pid).any(|task| {
        std::fs::read_to_string(task.path().join("stat"))
            .ok()
            .and_then(|stat| {
                let (_, after) = stat.rsplit_once(')')?;
                let state = after.split_whitespace().next()?;
                Some(state != "Z" && state != "X")
            })
            .unwrap_or(false)
    })
}

/// Every process on the host.
fn all_processes() -> Vec<Process> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(process)
        .collect()
}

/// Every descendant of `root` (not `root` itself), zombies included.
///
/// Walks `/proc/PID/task/TID/children`, which costs the size of the tree, not of the host;
/// kernels without it (no `CONFIG_PROC_CHILDREN`) get a scan of every process.
pub fn descendants(root: i32) -> Vec<Process> {
    static HAS_CHILDREN_FILES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let fast = *HAS_CHILDREN_FILES.get_or_init(|| {
        let me = std::process::id();
        std::path::Path::new(&format!("/proc/{me}/task/{me}/children")).exists()
    });
    let mut found: Vec<Process> = Vec::new();
    let all = if fast { Vec::new() } else { all_processes() };
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        let children: Vec<Process> = if fast {
            children_of(parent)
                .into_iter()
                .filter_map(process)
                .collect()
        } else {
            all.iter().filter(|p| p.parent == parent).copied().collect()
        };
        for child in children {
            if child.pid != root && !found.iter().any(|f| f.pid == child.pid) {
                found.push(child);
                frontier.push(child.pid);
            }
        }
    }
    found
}

/// The `/proc/PID/task/TID` entries of every thread of `pid` (none if it is gone).
fn tasks(pid: i32) -> impl Iterator<Item = std::fs::DirEntry> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
}

/// The children of every thread of `pid` (none if it is gone).
pub fn children_of(pid: i32) -> Vec<i32> {
    tasks(pid)
        .filter_map(|task| std::fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|text| {
            text.split_whitespace()
                .filter_map(|c| c.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}

/// Sends `signal` to every live descendant of `root` except `skip`; returns how many there were.
pub fn signal_tree(root: i32, signal: libc::c_int, skip: Option<i32>) -> usize {
    signal_all(&descendants(root), signal, skip)
}

/// Whether `a` and `b` are the same process (PID and start time).
pub fn same_process(a: &Process, b: &Process) -> bool {
    a.pid == b.pid && a.start == b.start
}

/// Sends `signal` to every live process of `processes` except `skip`; returns how many.
pub fn signal_all(processes: &[Process], signal: libc::c_int, skip: Option<i32>) -> usize {
    let mut count = 0;
    for process in processes.iter().filter(|p| p.live && Some(p.pid) != skip) {
        send(process, signal);
        count += 1;
    }
    count
}

/// Sends `signal` to exactly the process `target` describes: through a pidfd checked against
/// its start time, so a PID reused since the walk is left alone.
fn send(target: &Process, signal: libc::c_int) {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor we close below.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, target.pid, 0) } as i32;
    if fd < 0 {
        if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
            // Kernels before 5.3: a plain kill, after the same identity check.
            if process(target.pid).is_some_and(|now| now.start == target.start) {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(target.pid, signal) };
            }
        }
        return;
    }
    // With the pidfd open, the PID cannot be reused; check it is still the process we saw.
    if process(target.pid).is_some_and(|now| now.start == target.start) {
        // SAFETY: pidfd_send_signal on the descriptor we own, with no siginfo.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd,
                signal,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            );
        }
    }
    // SAFETY: closing the descriptor we opened.
    unsafe { libc::close(fd) };
}

/// Reaps every exited child of this process whose PID is in `pids` (orphans re-parented to
/// us), without blocking and without touching other children.
pub fn reap(pids: impl IntoIterator<Item = i32>) {
    for pid in pids {
        let mut status = 0;
        // SAFETY: waitpid on a specific child, non-blocking.
        unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_aside_lowers_only_the_calling_thread() {
        // SAFETY: gettid and getpriority on the calling thread.
        let nice = || unsafe {
            *libc::__errno_location() = 0;
            libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t)
        };
        let before = nice();
        let aside = std::thread::spawn(move || {
            step_aside();
            nice()
        })
        .join()
        .unwrap();
        assert_eq!(aside, EXIT_NICE);
        assert_eq!(nice(), before, "the other threads keep their priority");
    }

    #[test]
    fn env_round_trip() {
        let cage = Cage::at(Kind::CgroupV2, "/sys/fs/cgroup/x/baton-1".into(), false);
        let back = Cage::from_env(&cage.to_env());
        assert_eq!(back.kind, Kind::CgroupV2);
        assert_eq!(back.dir, cage.dir);
        assert_eq!(Cage::from_env("subreaper").kind, Kind::Subreaper);
        assert_eq!(Cage::from_env("garbage").kind, Kind::Subreaper);
    }

    #[test]
    fn descendants_of_this_process_include_a_grandchild() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 5 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let grandchild: i32 = line.trim().parse().unwrap();
        let me = std::process::id() as i32;
        let found = descendants(me);
        assert!(found.iter().any(|p| p.pid == child.id() as i32));
        assert!(found.iter().any(|p| p.pid == grandchild && p.live));
        signal_tree(child.id() as i32, libc::SIGKILL, None);
        child.wait().unwrap();
    }

    /// Only old, empty cgroups of processes we cannot see are swept: a fresh one may belong to
    /// a `baton run` in another PID namespace that has not moved its launcher in yet.
    #[test]
    fn sweeping_spares_fresh_cgroups_of_unseen_processes() {
        let parent = std::env::temp_dir().join(format!("baton-sweep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&parent);
        let ours = parent.join(format!("baton-{}", std::process::id()));
        // PIDs above the kernel's maximum (4194304) are never alive.
        let fresh = parent.join("baton-2147483000");
        let old = parent.join("baton-2147483001");
        for dir in [&ours, &fresh, &old] {
            std::fs::create_dir_all(dir).unwrap();
        }
        let long_ago = std::time::SystemTime::now() - 2 * STALE_AFTER;
        std::fs::File::open(&old)
            .unwrap()
            .set_modified(long_ago)
            .unwrap();
        sweep_stale(&ours);
        assert!(ours.exists() && fresh.exists(), "a fresh cgroup was swept");
        assert!(
            !old.exists(),
            "an old empty cgroup of a dead process was kept"
        );
        std::fs::remove_dir_all(&parent).unwrap();
    }
}
