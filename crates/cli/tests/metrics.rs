//! `baton run --metrics ADDR`: real processes against the real etcd, read over HTTP. Each node
//! binds port 0 and says on stderr which port it got.

mod common;

use common::proxy::Proxy;
use common::*;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The address a node announced on stderr.
fn metrics_address(node: &Runner) -> SocketAddr {
    let marker = "serving /metrics, /healthz and /leader on http://";
    wait_for(
        "the metrics address on stderr",
        Duration::from_secs(5),
        || {
            let stderr = node.stderr();
            let line = stderr.lines().find(|line| line.contains(marker))?;
            line.split(marker).nth(1)?.trim().parse().ok()
        },
    )
}

/// Sends `request` as is and returns the whole answer, up to the server's close.
fn send(address: SocketAddr, request: &[u8]) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(request)?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    String::from_utf8(response).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Sends `request` as is and returns the status code and the body.
fn exchange(address: SocketAddr, request: &[u8]) -> (u16, String) {
    let response = send(address, request).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("a response head");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("Content-Length: "))
        .and_then(|n| n.parse().ok())
        .expect("a Content-Length");
    assert_eq!(body.len(), length, "{response}");
    (status, body.to_string())
}

fn get(address: SocketAddr, path: &str) -> (u16, String) {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\n\r\n");
    exchange(address, request.as_bytes())
}

/// The value of the series `name{labels}` (exactly these labels) in a Prometheus exposition.
fn series(exposition: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let wanted: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
    exposition
        .lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (series_name, series_labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.strip_suffix('}')?),
                None => (series, ""),
            };
            let mut have: Vec<&str> = series_labels.split(',').filter(|l| !l.is_empty()).collect();
            have.sort();
            let mut want: Vec<&str> = wanted.iter().map(String::as_str).collect();
            want.sort();
            (series_name == name && have == want).then(|| value.parse().ok())?
        })
}

/// Waits until `node`'s `/metrics` has `name{labels}` at `value`; returns the exposition.
fn wait_series(address: SocketAddr, name: &str, labels: &[(&str, &str)], value: f64) -> String {
    wait_for(
        &format!("{name}{labels:?} = {value} at {address}"),
        Duration::from_secs(5),
        || {
            let (status, body) = get(address, "/metrics");
            assert_eq!(status, 200);
            (series(&body, name, labels) == Some(value)).then_some(body)
        },
    )
}

fn leader_json(address: SocketAddr) -> serde_json::Value {
    let (status, body) = get(address, "/leader");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

#[test]
fn leadership_moves_between_two_nodes_in_their_metrics_and_leader_json() {
    let dir = scratch("metrics-handoff");
    let election = unique("metrics-handoff");
    let this = [("election", election.as_str())];
    let flags = ["--ttl", "2s", "--requeue", "--metrics", "127.0.0.1:0"];
    let a = Runner::start_with(&url(), &election, &flags, &dir, "a");
    let a_token = a.wait_running(Duration::from_secs(5));
    let a_address = metrics_address(&a);
    let b = Runner::start_with(&url(), &election, &flags, &dir, "b");
    let b_address = metrics_address(&b);

    // a leads and runs the command; b campaigns.
    let a_metrics = wait_series(a_address, "baton_is_leader", &this, 1.0);
    assert_eq!(
        series(&a_metrics, "baton_leadership_transitions_total", &this),
        Some(1.0)
    );
    assert_eq!(
        series(&a_metrics, "baton_run_command_running", &this),
        Some(1.0)
    );
    assert_eq!(
        series(&a_metrics, "baton_run_terms_total", &this),
        Some(1.0)
    );
    let remaining = series(&a_metrics, "baton_deadline_remaining_seconds", &this).unwrap();
    assert!(remaining > 0.0 && remaining < 2.0, "{remaining}");
    // Renewals are timed (every 667 ms at this TTL).
    wait_for("a renewal timed", Duration::from_secs(5), || {
        let (_, body) = get(a_address, "/metrics");
        let count = series(&body, "baton_renewal_latency_seconds_count", &[])?;
        (count >= 1.0).then_some(())
    });
    let b_metrics = wait_series(b_address, "baton_is_leader", &this, 0.0);
    assert_eq!(
        series(&b_metrics, "baton_run_command_running", &this),
        Some(0.0)
    );
    assert_eq!(get(a_address, "/healthz"), (200, "ok\n".to_string()));
    assert_eq!(get(b_address, "/healthz"), (200, "ok\n".to_string()));
    let expected =
        serde_json::json!({"election": election, "leader": {"id": "a", "token": a_token}});
    for address in [a_address, b_address] {
        wait_for("the leader seen", Duration::from_secs(5), || {
            (leader_json(address) == expected).then_some(())
        });
    }

    // a's key is deleted: a loses (and campaigns again), b takes over.
    let a_pid = a.child_pid().unwrap();
    delete_leader_key(&election);
    let b_token = b.wait_running(Duration::from_secs(5));
    assert!(b_token > a_token);
    wait_for("a's command stopped", Duration::from_secs(2), || {
        (!alive(a_pid)).then_some(())
    });
    let b_metrics = wait_series(b_address, "baton_is_leader", &this, 1.0);
    assert_eq!(
        series(&b_metrics, "baton_leadership_transitions_total", &this),
        Some(1.0)
    );
    assert_eq!(
        series(&b_metrics, "baton_run_command_running", &this),
        Some(1.0)
    );
    let a_metrics = wait_series(a_address, "baton_is_leader", &this, 0.0);
    let entry_deleted = [("election", election.as_str()), ("reason", "entry_deleted")];
    assert_eq!(
        series(&a_metrics, "baton_losses_total", &entry_deleted),
        Some(1.0)
    );
    let a_metrics = wait_series(a_address, "baton_run_command_running", &this, 0.0);
    assert_eq!(
        series(&a_metrics, "baton_run_terms_total", &this),
        Some(1.0)
    );
    let expected =
        serde_json::json!({"election": election, "leader": {"id": "b", "token": b_token}});
    for address in [a_address, b_address] {
        wait_for("the new leader seen", Duration::from_secs(5), || {
            (leader_json(address) == expected).then_some(())
        });
    }
    assert_eq!(get(a_address, "/healthz"), (200, "ok\n".to_string()));
    assert_eq!(get(b_address, "/healthz"), (200, "ok\n".to_string()));
}

/// A leader "a" of a fresh election, started with `flags`, whose backend it reaches only
/// through a proxy the test can cut: what the cut-off tests need of it.
struct BehindProxy {
    proxy: Proxy,
    a: Runner,
    election: String,
    /// a's command.
    pid: u64,
    /// a's metrics endpoint.
    address: SocketAddr,
    _dir: Scratch,
}

fn leader_behind_proxy(name: &str, flags: &[&str]) -> BehindProxy {
    let dir = scratch(name);
    let election = unique(name);
    let proxy = Proxy::start(server());
    let through_proxy = url_at(&format!("127.0.0.1:{}", proxy.port));
    let a = Runner::start_with(&through_proxy, &election, flags, &dir, "a");
    a.wait_running(Duration::from_secs(5));
    let pid = a.child_pid().unwrap();
    let address = metrics_address(&a);
    BehindProxy {
        proxy,
        a,
        election,
        pid,
        address,
        _dir: dir,
    }
}

#[test]
fn healthz_turns_503_while_renewals_stall_before_the_lease_runs_out_and_200_after() {
    // A long TTL and frequent renewals: renewals count as stalled 2 s after the last answered
    // one, while the lease lasts almost 10 s.
    let flags = [
        "--ttl",
        "10s",
        "--renew-interval",
        "1s",
        "--metrics",
        "127.0.0.1:0",
    ];
    let BehindProxy {
        proxy,
        mut a,
        election,
        pid,
        address,
        _dir,
    } = leader_behind_proxy("metrics-stall", &flags);
    for _ in 0..5 {
        assert_eq!(get(address, "/healthz"), (200, "ok\n".to_string()));
        std::thread::sleep(Duration::from_millis(300));
    }

    proxy.set_partitioned(true);
    let partitioned_at = Instant::now();
    let reason = wait_for("503 from /healthz", Duration::from_secs(6), || {
        let (status, body) = get(address, "/healthz");
        (status == 503).then_some(body)
    });
    let stalled_after = partitioned_at.elapsed();
    // Before the lease ran out: the command still runs under it.
    assert!(alive(pid), "the command was stopped: the lease ran out");
    assert!(stalled_after < Duration::from_secs(6), "{stalled_after:?}");
    assert!(reason.starts_with("lease renewals stalled"), "{reason}");
    assert_eq!(reason.lines().count(), 1, "{reason}");
    // Still the leader, still running.
    let (_, exposition) = get(address, "/metrics");
    let this = [("election", election.as_str())];
    assert_eq!(series(&exposition, "baton_is_leader", &this), Some(1.0));

    proxy.set_partitioned(false);
    wait_for(
        "200 from /healthz after healing",
        Duration::from_secs(5),
        || (get(address, "/healthz").0 == 200).then_some(()),
    );
    assert!(alive(pid), "the term survived the stall");
    assert!(a.child.try_wait().unwrap().is_none());
    let (_, exposition) = get(address, "/metrics");
    assert_eq!(series(&exposition, "baton_is_leader", &this), Some(1.0));
    assert_eq!(
        series(&exposition, "baton_leadership_transitions_total", &this),
        Some(1.0)
    );
}

/// `baton_is_leader` goes to 0 when the lease is over, not when the process gets round to
/// ending the term: a leader cut off from its backend counted as one until its candidacy's
/// request to the unreachable backend gave up (6.5 s after its command was stopped, on
/// ZooKeeper), so an alert on `sum(baton_is_leader) > 1` fired for a leader already stopped.
#[test]
fn is_leader_drops_as_the_lease_runs_out_while_the_backend_is_away() {
    // --requeue: the process outlives the term, campaigning again, so its metrics can be read.
    let flags = ["--ttl", "2s", "--metrics", "127.0.0.1:0", "--requeue"];
    let BehindProxy {
        proxy,
        mut a,
        election,
        pid,
        address,
        _dir,
    } = leader_behind_proxy("metrics-over", &flags);
    let this = [("election", election.as_str())];
    wait_series(address, "baton_is_leader", &this, 1.0);

    proxy.set_partitioned(true);
    wait_for(
        "the command stopped at the deadline",
        Duration::from_secs(5),
        || (!alive(pid)).then_some(()),
    );
    let stopped_at = Instant::now();
    wait_for("baton_is_leader 0", Duration::from_secs(5), || {
        let (_, exposition) = get(address, "/metrics");
        (series(&exposition, "baton_is_leader", &this) == Some(0.0)).then_some(())
    });
    let lag = stopped_at.elapsed();
    assert!(
        lag < Duration::from_millis(500),
        "0 only {lag:?} after the command stopped"
    );
    assert!(a.child.try_wait().unwrap().is_none(), "baton run exited");
    let (_, exposition) = get(address, "/metrics");
    assert_eq!(
        series(&exposition, "baton_deadline_remaining_seconds", &this),
        Some(0.0)
    );
    proxy.set_partitioned(false);
}

/// Without `--requeue`, a lost term ends the run: while it resigns (slowly, with the backend
/// away) and exits, `/healthz` says so with a 503, not the `200 ok` of a campaigning process.
#[test]
fn healthz_says_a_run_that_lost_its_term_is_exiting() {
    let flags = ["--ttl", "2s", "--metrics", "127.0.0.1:0"];
    let BehindProxy {
        proxy,
        mut a,
        pid,
        address,
        _dir,
        ..
    } = leader_behind_proxy("metrics-exiting", &flags);
    proxy.set_partitioned(true);
    wait_for(
        "the command stopped at the deadline",
        Duration::from_secs(5),
        || (!alive(pid)).then_some(()),
    );
    // The resign waits for the unreachable backend: the process is still there, and says why
    // it is not healthy (never `ok` on the way out).
    let (status, body) = get(address, "/healthz");
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "baton run exited already"
    );
    assert_eq!(status, 503, "{body}");
    assert!(
        body.starts_with("leadership lost (") && body.ends_with("exiting\n"),
        "{body}"
    );
    proxy.set_partitioned(false);
    let code = a.child.wait().unwrap().code();
    assert_eq!(code, Some(3));
}

#[test]
fn requests_other_than_the_three_endpoints_are_refused_without_harm() {
    let dir = scratch("metrics-requests");
    let election = unique("metrics-requests");
    let flags = ["--ttl", "2s", "--metrics", "127.0.0.1:0"];
    let a = Runner::start_with(&url(), &election, &flags, &dir, "a");
    a.wait_running(Duration::from_secs(5));
    let address = metrics_address(&a);

    assert_eq!(get(address, "/").0, 404);
    assert_eq!(get(address, "/metrics/x").0, 404);
    assert_eq!(get(address, "/healthz?verbose=1").0, 200);
    assert_eq!(
        exchange(
            address,
            b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
        )
        .0,
        405
    );
    // HEAD (a load balancer's check): GET's head, no body.
    let answer = send(address, b"HEAD /healthz HTTP/1.1\r\n\r\n").unwrap();
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.contains("Content-Length: 3\r\n"), "{answer}");
    assert!(answer.ends_with("\r\n\r\n"), "{answer}");
    for garbage in [
        &b"hello\r\n\r\n"[..],
        b"GET /metrics HTTP/9.9\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nno header line\r\n\r\n",
        b"\x00\xff\x16\x03\x01\r\n\r\n",
    ] {
        assert_eq!(exchange(address, garbage).0, 400, "{garbage:?}");
    }
    // A head without end is cut off at its bound.
    let endless = format!(
        "GET /metrics HTTP/1.1\r\nX-Long: {}\r\n",
        "a".repeat(20_000)
    );
    assert_eq!(exchange(address, endless.as_bytes()).0, 431);
    // Clients that connect and say nothing tie up nothing: others are served meanwhile, also
    // when there are more of them than connections served at once (the oldest silent one is
    // closed to make room), so a liveness probe is never locked out by them.
    let idle: Vec<TcpStream> = (0..150)
        .map(|_| TcpStream::connect(address).unwrap())
        .collect();
    for _ in 0..3 {
        assert_eq!(get(address, "/healthz").0, 200);
    }
    drop(idle);
    // The node is unharmed.
    assert!(a.child_pid().is_some_and(alive));
    assert_eq!(get(address, "/healthz"), (200, "ok\n".to_string()));
}

/// Requests sent during a flood of connections that say nothing (beside a burst of other
/// clients) all get their answer: a connection whose request has arrived is never the one
/// closed to make room, however many newer connections were accepted before it was read.
#[test]
fn every_request_is_answered_during_a_flood_of_silent_connections() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let dir = scratch("metrics-flood");
    let election = unique("metrics-flood");
    let flags = ["--ttl", "2s", "--metrics", "127.0.0.1:0"];
    let a = Runner::start_with(&url(), &election, &flags, &dir, "a");
    a.wait_running(Duration::from_secs(5));
    let address = metrics_address(&a);
    let stop = AtomicBool::new(false);
    let (answered, failed) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let mut failures = Vec::new();
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| {
                // The flood yields the CPU to the probes (the test's 2 cores are shared by 6
                // threads here): a probe descheduled between its connect and its request, while
                // the flood opens 64 newer connections, would be closed as idle, rightly.
                let thread = unsafe { libc::syscall(libc::SYS_gettid) } as libc::id_t;
                unsafe { libc::setpriority(libc::PRIO_PROCESS, thread, 19) };
                while !stop.load(Ordering::Relaxed) {
                    let _ = TcpStream::connect(address);
                }
            });
        }
        let probes: Vec<_> = (0..4)
            .map(|_| {
                scope.spawn(|| {
                    let mut errors = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        match try_get(address, "/healthz") {
                            Ok(200) => answered.fetch_add(1, Ordering::Relaxed),
                            other => {
                                errors.push(format!("{other:?}"));
                                failed.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                    }
                    errors
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(3));
        stop.store(true, Ordering::Relaxed);
        for probe in probes {
            failures.extend(probe.join().unwrap());
        }
    });
    let answered = answered.into_inner();
    failures.truncate(5);
    assert_eq!(
        failed.into_inner(),
        0,
        "{answered} answered; first failures: {failures:?}"
    );
    assert!(answered > 0);
    assert!(a.child_pid().is_some_and(alive));
}

/// The status of `GET path`, or why there was none.
fn try_get(address: SocketAddr, path: &str) -> Result<u16, String> {
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\n\r\n");
    let response = send(address, request.as_bytes()).map_err(|e| e.to_string())?;
    response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| format!("no status in {response:?}"))
}

#[test]
fn a_bad_metrics_address_is_bad_input_before_campaigning() {
    let election = unique("metrics-bad");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = listener.local_addr().unwrap().to_string();
    for address in [
        "not-an-address",
        "127.0.0.1",
        "localhost:99999",
        taken.as_str(),
    ] {
        let output = run_script(&election, &["--metrics", address], "touch /dev/null")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{address}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{address}: {stderr}");
        assert!(stderr.contains("--metrics"), "{address}: {stderr}");
        assert!(!stderr.contains("campaigning"), "{address}: {stderr}");
    }
    // Nobody campaigned.
    let leader = baton()
        .args(["leader", "--backend", &url(), "--election", &election])
        .output()
        .unwrap();
    let line: serde_json::Value = serde_json::from_slice(&leader.stdout).unwrap();
    assert_eq!(line["leader"], serde_json::Value::Null);
}
