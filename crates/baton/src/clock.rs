//! The cores' timeline: time since a backend's origin, *including* time the host spent
//! suspended.
//!
//! A lease keeps running at the server while this host is suspended, so local deadlines must
//! count suspended time: a host resumed after a suspend longer than the TTL must stop at once.
//! tokio's clock (like std's `Instant`: `CLOCK_MONOTONIC` on Linux) stops during a suspend;
//! `CLOCK_BOOTTIME` does not. So the timeline is tokio's clock since the origin plus the time
//! suspended since the origin, measured as the growth of `CLOCK_BOOTTIME − CLOCK_MONOTONIC`.
//! That growth is zero under tokio's paused clock, so tests that pause time are unaffected;
//! tests inject suspends instead.
//!
//! tokio's timers do not advance during a suspend either, so whoever must act at a time on this
//! timeline (the lease driver, at its next timeout) also arms an [`Alarm`]: a `timerfd` on
//! `CLOCK_BOOTTIME`, which fires as soon as the host resumes if its time passed meanwhile.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use baton_core::Instant;

/// A clock origin. Each backend takes its own, so that tests running under tokio's paused clock
/// in different runtimes never compare instants from different timelines.
#[derive(Debug, Clone)]
pub(crate) struct Clock {
    origin: tokio::time::Instant,
    suspended: Suspended,
}

/// Where the time suspended since the origin comes from.
#[derive(Debug, Clone)]
enum Suspended {
    /// Measured on this host.
    Host(Arc<HostSuspend>),
    /// Set by a test.
    #[cfg(test)]
    Injected(Arc<tokio::sync::watch::Sender<Duration>>),
}

#[derive(Debug)]
struct HostSuspend {
    /// `CLOCK_BOOTTIME − CLOCK_MONOTONIC` at the origin, in nanoseconds.
    at_origin: u64,
    /// The largest offset measured so far. Two clocks cannot be read at once, so measurements
    /// jitter by a few nanoseconds; keeping the largest keeps the timeline monotonic, and errs
    /// towards counting more suspended time (towards stopping earlier).
    highest: AtomicU64,
}

impl Clock {
    /// A clock whose origin is now.
    pub(crate) fn new() -> Clock {
        let at_origin = boottime_minus_monotonic_nanos();
        Clock {
            origin: tokio::time::Instant::now(),
            suspended: Suspended::Host(Arc::new(HostSuspend {
                at_origin,
                highest: AtomicU64::new(at_origin),
            })),
        }
    }

    /// A clock whose suspended time is set through the returned sender (tests: a real suspend
    /// cannot be done). Changing it also fires every [`Alarm`] of this clock, as a resume does.
    #[cfg(test)]
    pub(crate) fn with_injected_suspend() -> (Clock, Arc<tokio::sync::watch::Sender<Duration>>) {
        let suspended = Arc::new(tokio::sync::watch::Sender::new(Duration::ZERO));
        let clock = Clock {
            origin: tokio::time::Instant::now(),
            suspended: Suspended::Injected(suspended.clone()),
        };
        (clock, suspended)
    }

    /// Now, for the cores: tokio's time since the origin plus the time suspended since then.
    pub(crate) fn now(&self) -> Instant {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.origin);
        Instant::ZERO + elapsed + self.suspended()
    }

    /// Time the host spent suspended since the origin. Never decreases.
    fn suspended(&self) -> Duration {
        match &self.suspended {
            Suspended::Host(host) => {
                let measured = boottime_minus_monotonic_nanos();
                let highest = host
                    .highest
                    .fetch_max(measured, Ordering::Relaxed)
                    .max(measured);
                Duration::from_nanos(highest.saturating_sub(host.at_origin))
            }
            #[cfg(test)]
            Suspended::Injected(suspended) => *suspended.borrow(),
        }
    }

    /// The tokio instant at which this timeline reaches `at` if the host is not suspended
    /// meanwhile: tokio's now plus the time remaining, or in the past if `at` has passed (after
    /// a resume, a deadline that passed during the suspend is already behind tokio's now).
    pub(crate) fn to_tokio(&self, at: Instant) -> tokio::time::Instant {
        let tokio_now = tokio::time::Instant::now();
        let now = self.now();
        if at >= now {
            let remaining = at - now;
            // Saturate rather than overflow: a deadline that far away is "never".
            tokio_now
                .checked_add(remaining)
                .unwrap_or_else(|| tokio_now + Duration::from_secs(100 * 365 * 86_400))
        } else {
            tokio_now.checked_sub(now - at).unwrap_or(tokio_now)
        }
    }

    /// An alarm on this timeline that also fires after a suspend (one per lease driver).
    pub(crate) fn alarm(&self) -> Alarm {
        let kind = match &self.suspended {
            Suspended::Host(_) => AlarmKind::host(),
            #[cfg(test)]
            Suspended::Injected(suspended) => AlarmKind::Injected(suspended.subscribe()),
        };
        Alarm {
            clock: self.clone(),
            armed: None,
            kind,
        }
    }
}

/// Fires when the clock's timeline reaches the armed instant, counting suspended time, even
/// though tokio's timers do not advance during a suspend.
#[derive(Debug)]
pub(crate) struct Alarm {
    clock: Clock,
    armed: Option<Instant>,
    kind: AlarmKind,
}

#[derive(Debug)]
enum AlarmKind {
    /// A `timerfd` on `CLOCK_BOOTTIME`, set to absolute times.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    TimerFd(tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>),
    /// No such timer here (or it could not be made): only tokio's timers wake the driver, late
    /// by the length of a suspend. Deadlines are still compared on the full timeline.
    Unavailable,
    /// Fires whenever the injected suspended time changes.
    #[cfg(test)]
    Injected(tokio::sync::watch::Receiver<Duration>),
}

impl AlarmKind {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn host() -> AlarmKind {
        match boottime::timer() {
            Ok(fd) => AlarmKind::TimerFd(fd),
            Err(error) => {
                tracing::warn!(%error, "no CLOCK_BOOTTIME timer; a lease may end late after a suspend");
                AlarmKind::Unavailable
            }
        }
    }

    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    fn host() -> AlarmKind {
        AlarmKind::Unavailable
    }
}

impl Alarm {
    /// Sets the alarm to `at` on the timeline, replacing the previous setting.
    pub(crate) fn arm(&mut self, at: Instant) {
        if self.armed == Some(at) {
            return;
        }
        self.armed = Some(at);
        self.set_timer(at);
    }

    fn set_timer(&mut self, at: Instant) {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        if let AlarmKind::TimerFd(fd) = &self.kind {
            let remaining = at - self.clock.now();
            let target = boottime::now_nanos()
                .saturating_add(u64::try_from(remaining.as_nanos()).unwrap_or(u64::MAX));
            if let Err(error) = boottime::set(fd.get_ref(), target) {
                tracing::warn!(%error, "cannot set the CLOCK_BOOTTIME timer");
                self.kind = AlarmKind::Unavailable;
            }
        }
        let _ = at;
    }

    /// Resolves once the armed instant has passed on the timeline; pends while unarmed or
    /// before then. Cancel-safe.
    pub(crate) async fn fired(&mut self) {
        loop {
            self.wait_for_timer().await;
            let Some(at) = self.armed else { continue };
            if self.clock.now() >= at {
                return;
            }
            // Woken a little early (the two clocks are read at slightly different moments):
            // set the timer again for what remains.
            self.set_timer(at);
        }
    }

    async fn wait_for_timer(&mut self) {
        match &mut self.kind {
            #[cfg(any(target_os = "linux", target_os = "android"))]
            AlarmKind::TimerFd(fd) => loop {
                let Ok(mut ready) = fd.readable().await else {
                    return std::future::pending().await;
                };
                match ready.try_io(|fd| boottime::read_expirations(fd.get_ref())) {
                    Ok(Ok(_)) => return,
                    Ok(Err(error)) => {
                        tracing::warn!(%error, "cannot read the CLOCK_BOOTTIME timer");
                        self.kind = AlarmKind::Unavailable;
                        return std::future::pending().await;
                    }
                    // Not expired after all; readiness was cleared.
                    Err(_would_block) => continue,
                }
            },
            AlarmKind::Unavailable => std::future::pending().await,
            #[cfg(test)]
            AlarmKind::Injected(suspended) => {
                if suspended.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        }
    }
}

/// `CLOCK_BOOTTIME − CLOCK_MONOTONIC` in nanoseconds: the time this host has spent suspended
/// since it booted. Zero where there is no `CLOCK_BOOTTIME`.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn boottime_minus_monotonic_nanos() -> u64 {
    // Read monotonic first, boottime second: the difference is then an upper bound (by the
    // time between the reads). If preempted in between, read again and keep the smallest.
    let mut best = u64::MAX;
    for _ in 0..3 {
        let monotonic = boottime::clock_nanos(libc::CLOCK_MONOTONIC);
        let boot = boottime::clock_nanos(libc::CLOCK_BOOTTIME);
        let after = boottime::clock_nanos(libc::CLOCK_MONOTONIC);
        best = best.min(boot.saturating_sub(monotonic));
        if after.saturating_sub(monotonic) < 20_000 {
            break;
        }
    }
    best
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn boottime_minus_monotonic_nanos() -> u64 {
    0
}

/// The system calls behind the host's suspended time and its alarm.
#[cfg(any(target_os = "linux", target_os = "android"))]
mod boottime {
    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    const NANOS_PER_SECOND: u64 = 1_000_000_000;

    pub(super) fn clock_nanos(clock: libc::clockid_t) -> u64 {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes into the timespec we own.
        let result = unsafe { libc::clock_gettime(clock, &mut now) };
        // Both clocks exist on every kernel since 2.6.39; failing would be a broken libc.
        assert_eq!(result, 0, "clock_gettime({clock}) failed");
        (now.tv_sec as u64) * NANOS_PER_SECOND + now.tv_nsec as u64
    }

    pub(super) fn now_nanos() -> u64 {
        clock_nanos(libc::CLOCK_BOOTTIME)
    }

    /// A non-blocking `timerfd` on `CLOCK_BOOTTIME`, registered with tokio.
    pub(super) fn timer() -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
        // SAFETY: no pointers; the result is checked.
        let fd = unsafe {
            libc::timerfd_create(libc::CLOCK_BOOTTIME, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let interest = tokio::io::Interest::READABLE;
        // SAFETY: an `OwnedFd` keeps its descriptor open, and `as_raw_fd` returns that same
        // descriptor, for as long as the `AsyncFd` owns it.
        unsafe { tokio::io::unix::AsyncFd::register_with_interest(fd, interest) }
            .map_err(io::Error::from)
    }

    /// Sets the timer to expire once, when `CLOCK_BOOTTIME` reaches `boottime_nanos`.
    pub(super) fn set(fd: &OwnedFd, boottime_nanos: u64) -> io::Result<()> {
        // Zero would disarm the timer; any time in the past fires at once.
        let target = boottime_nanos.max(1);
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (target / NANOS_PER_SECOND) as libc::time_t,
                tv_nsec: (target % NANOS_PER_SECOND) as libc::c_long,
            },
        };
        // SAFETY: `spec` outlives the call; the old value is not asked for.
        let result = unsafe {
            libc::timerfd_settime(
                fd.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
        if result < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Reads the expiration count (fails with `WouldBlock` before the timer expired).
    pub(super) fn read_expirations(fd: &OwnedFd) -> io::Result<u64> {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into the buffer we own.
        let read = unsafe { libc::read(fd.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
        if read < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(u64::from_ne_bytes(count))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[tokio::test(start_paused = true)]
    async fn the_timeline_counts_injected_suspends() {
        let (clock, suspended) = Clock::with_injected_suspend();
        tokio::time::sleep(ms(500)).await;
        assert_eq!(clock.now(), Instant::from_millis(500));
        // The host sleeps 3 s: tokio's clock does not move, the timeline does.
        suspended.send_replace(ms(3_000));
        assert_eq!(clock.now(), Instant::from_millis(3_500));
        tokio::time::sleep(ms(100)).await;
        assert_eq!(clock.now(), Instant::from_millis(3_600));
    }

    #[tokio::test(start_paused = true)]
    async fn tokio_instants_come_from_the_time_remaining() {
        let (clock, suspended) = Clock::with_injected_suspend();
        let deadline = Instant::from_millis(2_000);
        let start = tokio::time::Instant::now();
        assert_eq!(clock.to_tokio(deadline), start + ms(2_000));
        tokio::time::sleep(ms(500)).await;
        assert_eq!(clock.to_tokio(deadline), start + ms(2_000));
        // After a 1 s suspend only 500 ms remain, although tokio saw only 500 ms pass.
        suspended.send_replace(ms(1_000));
        assert_eq!(clock.to_tokio(deadline), start + ms(1_000));
        // After a suspend beyond the deadline, it is already in tokio's past.
        suspended.send_replace(ms(4_000));
        let now = tokio::time::Instant::now();
        assert_eq!(clock.to_tokio(deadline), now - ms(2_500));
        assert!(clock.to_tokio(deadline) < now);
    }

    #[tokio::test(start_paused = true)]
    async fn an_injected_suspend_fires_the_alarm_without_tokio_time_passing() {
        let (clock, suspended) = Clock::with_injected_suspend();
        let mut alarm = clock.alarm();
        alarm.arm(Instant::from_millis(2_000));
        let start = tokio::time::Instant::now();
        let fire = tokio::spawn(async move {
            alarm.fired().await;
        });
        // A suspend that ends before the alarm's time does not fire it.
        suspended.send_replace(ms(1_000));
        tokio::task::yield_now().await;
        assert!(!fire.is_finished());
        suspended.send_replace(ms(2_500));
        fire.await.unwrap();
        assert_eq!(tokio::time::Instant::now(), start);
    }

    #[tokio::test]
    async fn the_host_timeline_never_goes_backwards() {
        let clock = Clock::new();
        let mut last = clock.now();
        for _ in 0..10_000 {
            let now = clock.now();
            assert!(now >= last);
            last = now;
        }
        // No suspend happens during a test run worth mentioning.
        assert!(clock.suspended() < Duration::from_secs(1));
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[tokio::test]
    async fn the_host_alarm_fires_on_boottime() {
        let clock = Clock::new();
        let mut alarm = clock.alarm();
        assert!(matches!(alarm.kind, AlarmKind::TimerFd(_)));
        let at = clock.now() + ms(50);
        alarm.arm(at);
        tokio::time::timeout(Duration::from_secs(5), alarm.fired())
            .await
            .expect("the timerfd fires");
        assert!(clock.now() >= at);
        // Armed in the past, it fires at once.
        alarm.arm(Instant::from_millis(1));
        tokio::time::timeout(ms(500), alarm.fired())
            .await
            .expect("fires at once");
    }
}
