//! `baton run --metrics ADDR`: metrics and health over plain HTTP/1.1.
//!
//! - `GET /metrics`: everything recorded, in Prometheus' text format (the library's metrics,
//!   see `baton::metrics`, and the supervisor's: [`COMMAND_RUNNING`], [`TERMS`]).
//! - `GET /healthz`: `200 ok`, or `503` and a one-line reason while this process runs a term
//!   whose lease is over, or whose renewals have stalled (see [`check`]), and once a lost term
//!   ends the run (see [`Terms::exiting`]).
//! - `GET /leader`: the leader as this process's observer last saw it, as `baton leader`
//!   prints it.
//!
//! Another method on these paths is `405` (`HEAD` is answered as `GET`, without the body),
//! anything else is `404`; a request that is not HTTP/1.x is `400`. One request per
//! connection, with a bounded head and a read timeout, and a bounded number of connections at
//! once: the server shares the supervisor's single runtime thread, so it never blocks and
//! never lets a client hold on to work.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton::{Election, LeaderInfo, Leadership, LeaseHealth, Observed};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::{LeaderLine, UsageError};

/// `baton_run_command_running{election}`: gauge, 1 while CMD (or anything it started) runs.
pub const COMMAND_RUNNING: &str = "baton_run_command_running";
/// `baton_run_terms_total{election}`: counter, terms of office in which CMD was started.
pub const TERMS: &str = "baton_run_terms_total";

/// Bound on a request's head (request line and headers); a larger one is refused.
const MAX_HEAD_BYTES: usize = 8 * 1024;
/// Bound on the time a client takes to send its request, and to take the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// After answering, how long (and how much) a connection is read until the client closes.
const LINGER: Duration = Duration::from_millis(500);
const MAX_LINGER_BYTES: usize = 64 * 1024;
/// Connections open at once. When a new one comes, the oldest that has not sent its whole
/// request yet (or is lingering after its answer) is closed to make room, so that clients
/// which connect and say nothing, or dribble a byte at a time, cannot lock a health probe out;
/// only with every connection busy composing an answer is the new one closed. Each accepted
/// connection reads what has arrived before the next is accepted, so a request waiting in
/// its socket is never taken for silence; and the bound is wide enough that one arriving a
/// moment after its connection is not closed by the next few connections of a flood.
const MAX_CONNECTIONS: usize = 64;
/// How often histograms are folded into their buckets when nobody scrapes (bounds memory).
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);
/// Buckets of `baton_renewal_latency_seconds`: a healthy renewal takes milliseconds; seconds
/// mean the lease is in danger.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A bound listener and the recorder behind `/metrics`.
pub struct Endpoint {
    listener: TcpListener,
    metrics: PrometheusHandle,
}

/// Binds `address` and installs the Prometheus recorder as the process's global recorder.
/// Either failing is bad input (exit 2), reported before the campaign starts.
pub async fn bind(address: SocketAddr) -> Result<Endpoint, UsageError> {
    let listener = TcpListener::bind(address)
        .await
        .map_err(|error| UsageError(format!("--metrics {address}: cannot listen: {error}")))?;
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(baton::metrics::RENEWAL_LATENCY.to_string()),
            LATENCY_BUCKETS,
        )
        .map_err(|error| UsageError(format!("--metrics: {error}")))?
        .build_recorder();
    let metrics = recorder.handle();
    metrics::set_global_recorder(recorder)
        .map_err(|error| UsageError(format!("--metrics: {error}")))?;
    baton::metrics::describe();
    metrics::describe_gauge!(
        COMMAND_RUNNING,
        "1 while the command or anything it started runs"
    );
    metrics::describe_counter!(TERMS, "terms of office in which the command was started");
    Ok(Endpoint { listener, metrics })
}

impl Endpoint {
    /// The address actually bound (with port 0, the port the system chose).
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves on the current runtime: the listener, an observer of `election` for `/leader`,
    /// and the recorder's upkeep. Each is a task; none blocks.
    pub fn spawn(self, election: Election, terms: Terms) {
        let (leader_tx, leader) = watch::channel(None);
        let name = election.name().to_string();
        tokio::spawn(follow_leader(election, leader_tx));
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(UPKEEP_INTERVAL).await;
                metrics.run_upkeep();
            }
        });
        let state = Arc::new(State {
            election: name,
            metrics: self.metrics,
            terms,
            leader,
        });
        tokio::spawn(accept(self.listener, state));
    }
}

/// What the supervisor tells the endpoint: the lease of the term now running, if any.
#[derive(Debug, Clone)]
pub struct Terms {
    election: String,
    health: Arc<Mutex<Health>>,
}

#[derive(Debug, Default)]
struct Health {
    /// The lease of the term now running, if any.
    term: Option<LeaseHealth>,
    /// Why this process is on its way out after a term ended badly (no campaign follows).
    exiting: Option<String>,
}

impl Terms {
    /// No term yet; the supervisor's series exist from the start.
    pub fn new(election: &str) -> Terms {
        metrics::gauge!(COMMAND_RUNNING, "election" => election.to_string()).set(0.0);
        metrics::counter!(TERMS, "election" => election.to_string()).increment(0);
        Terms {
            election: election.to_string(),
            health: Arc::default(),
        }
    }

    /// The process leads no more and campaigns no more: it resigns (which can take a while
    /// with the backend away) and exits. `/healthz` says so from now on: `200 ok` would tell a
    /// probe that all is well with a process about to exit with code 3.
    pub fn exiting(&self, why: String) {
        self.lock().exiting = Some(why);
    }

    /// CMD was started under `leadership`. The term lasts until the returned value is dropped,
    /// which the supervisor does once nothing of the command can run any more.
    pub fn begin(&self, leadership: &Leadership) -> Term {
        self.lock().term = Some(leadership.lease_health());
        metrics::counter!(TERMS, "election" => self.election.clone()).increment(1);
        metrics::gauge!(COMMAND_RUNNING, "election" => self.election.clone()).set(1.0);
        Term {
            terms: self.clone(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Health> {
        self.health.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `/healthz`: see [`check`].
    fn health(&self) -> Result<(), String> {
        let health = self.lock();
        match &health.exiting {
            Some(why) => Err(why.clone()),
            None => check(health.term.as_ref()),
        }
    }
}

/// A running term, from CMD's start until its containment is empty.
#[derive(Debug)]
pub struct Term {
    terms: Terms,
}

impl Drop for Term {
    fn drop(&mut self) {
        self.terms.lock().term = None;
        metrics::gauge!(COMMAND_RUNNING, "election" => self.terms.election.clone()).set(0.0);
    }
}

/// The health rule, after client-go's leader-election `HealthzAdaptor`. Campaigning, or
/// between terms, is healthy. During a term (the command may be running) it is unhealthy when
/// the lease is over, or when the last acknowledged renewal was sent more than two renew
/// intervals ago: one renewal went unanswered and the next is late too, while the lease has
/// not run out yet.
pub fn check(term: Option<&LeaseHealth>) -> Result<(), String> {
    let Some(lease) = term else {
        return Ok(());
    };
    if !lease.is_live() {
        return Err("the lease is over but the command's term has not ended".into());
    }
    let age = lease.since_last_renewal();
    let limit = 2 * lease.renew_interval();
    if age > limit {
        return Err(format!(
            "lease renewals stalled: the last acknowledged renewal was sent {} ms ago \
             (limit {} ms, twice the renew interval)",
            age.as_millis(),
            limit.as_millis()
        ));
    }
    Ok(())
}

/// Keeps `leader` at the leader as this process observes it (`None` while unknown).
async fn follow_leader(election: Election, leader: watch::Sender<Option<Option<LeaderInfo>>>) {
    loop {
        if let Ok(mut observer) = election.observe().await {
            while let Some(observed) = observer.next().await {
                match observed {
                    Observed::Leader(current) => leader.send_replace(Some(current)),
                    // Unknown while the backend cannot be seen.
                    Observed::Unavailable { .. } => leader.send_replace(None),
                };
            }
        }
        // The observer ended: unknown until a new one is up.
        leader.send_replace(None);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

struct State {
    election: String,
    metrics: PrometheusHandle,
    terms: Terms,
    leader: watch::Receiver<Option<Option<LeaderInfo>>>,
}

/// One open connection, as the accept loop sees it.
struct Open {
    task: tokio::task::AbortHandle,
    /// Not composing an answer: waiting for the request, or lingering after the answer.
    idle: Arc<AtomicBool>,
}

async fn accept(listener: TcpListener, state: Arc<State>) {
    let limit = connection_limit();
    let mut open: VecDeque<Open> = VecDeque::with_capacity(limit);
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            // Out of descriptors: free one held by a silent connection, and do not spin on it.
            Err(error) if matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                open.retain(|connection| !connection.task.is_finished());
                close_oldest_idle(&mut open);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            // One connection's trouble (aborted before it was accepted, say): the next.
            Err(_) => continue,
        };
        open.retain(|connection| !connection.task.is_finished());
        if open.len() >= limit && !close_oldest_idle(&mut open) {
            continue;
        }
        let idle = Arc::new(AtomicBool::new(true));
        let task = tokio::spawn({
            let state = state.clone();
            let idle = idle.clone();
            async move { serve(stream, &state, &idle).await }
        });
        open.push_back(Open {
            task: task.abort_handle(),
            idle,
        });
        // Let the new connection read what has arrived before the next is accepted: on a
        // busy listener the loop would otherwise take many in a row, and a request already
        // waiting in its socket would look like silence.
        tokio::task::yield_now().await;
    }
}

/// [`MAX_CONNECTIONS`], or a quarter of the descriptors the process may open if that is less
/// (a container with `ulimit -n 100`): the rest stay for the backend, the guard and CMD.
fn connection_limit() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return MAX_CONNECTIONS;
    }
    let quarter = usize::try_from(limit.rlim_cur / 4).unwrap_or(usize::MAX);
    MAX_CONNECTIONS.min(quarter).max(1)
}

/// Closes the oldest connection that has not sent its whole request (or that lingers after
/// its answer); whether there was one.
fn close_oldest_idle(open: &mut VecDeque<Open>) -> bool {
    let Some(oldest) = open.iter().position(|c| c.idle.load(Ordering::Relaxed)) else {
        return false;
    };
    if let Some(closed) = open.remove(oldest) {
        closed.task.abort();
    }
    true
}

/// Serves one request and closes the connection.
async fn serve(mut stream: TcpStream, state: &State, idle: &AtomicBool) {
    let head = tokio::time::timeout(IO_TIMEOUT, read_head(&mut stream)).await;
    idle.store(false, Ordering::Relaxed);
    // HEAD (a load balancer's check, say) gets GET's answer without its body.
    let (response, with_body) = match head {
        Err(_) => (Response::text(408, "request timeout"), true),
        Ok(Head::Closed) => return,
        Ok(Head::TooLarge) => (Response::text(431, "request head too large"), true),
        Ok(Head::Complete(head)) => match parse(&head) {
            Some(request) => (route(&request, state), request.method != "HEAD"),
            None => (Response::text(400, "bad request"), true),
        },
    };
    let bytes = response.into_bytes(with_body);
    let _ = tokio::time::timeout(IO_TIMEOUT, async {
        stream.write_all(&bytes).await?;
        stream.shutdown().await
    })
    .await;
    idle.store(true, Ordering::Relaxed);
    // Closing with unread bytes (the rest of a refused head) would reset the connection,
    // and the client could lose the answer: read a bounded amount until it closes.
    let _ = tokio::time::timeout(LINGER, async {
        let mut chunk = [0u8; 1024];
        let mut drained = 0;
        while drained < MAX_LINGER_BYTES {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
    })
    .await;
}

enum Head {
    /// The request line and headers, up to the blank line.
    Complete(Vec<u8>),
    /// More than [`MAX_HEAD_BYTES`] without a blank line.
    TooLarge,
    /// The client went away (or sent nothing).
    Closed,
}

async fn read_head(stream: &mut TcpStream) -> Head {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(end) = end_of_head(&head) {
            head.truncate(end);
            return Head::Complete(head);
        }
        if head.len() > MAX_HEAD_BYTES {
            return Head::TooLarge;
        }
        match stream.read(&mut chunk).await {
            Ok(0) if head.is_empty() => return Head::Closed,
            // Closed mid-request: answer what we have (it will not parse).
            Ok(0) => return Head::Complete(head),
            Ok(n) => head.extend_from_slice(&chunk[..n]),
            Err(_) => return Head::Closed,
        }
    }
}

/// Where the head ends: at the first blank line (`\r\n\r\n`, or `\n\n` from lenient clients).
fn end_of_head(bytes: &[u8]) -> Option<usize> {
    let crlf = bytes.windows(4).position(|w| w == b"\r\n\r\n");
    let lf = bytes.windows(2).position(|w| w == b"\n\n");
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A request's method and path (without the query string).
#[derive(Debug, PartialEq, Eq)]
struct Request<'a> {
    method: &'a str,
    path: &'a str,
}

/// Parses an HTTP/1.x request head; `None` when it is not one.
fn parse(head: &[u8]) -> Option<Request<'_>> {
    let head = std::str::from_utf8(head).ok()?;
    let mut lines = head
        .split('\n')
        .map(|line| line.strip_suffix('\r').unwrap_or(line));
    let mut parts = lines.next()?.split(' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    let is_token = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphabetic());
    if parts.next().is_some()
        || !is_token(method)
        || !target.starts_with('/')
        || !matches!(version, "HTTP/1.0" | "HTTP/1.1")
    {
        return None;
    }
    // Headers are not used, but a head that is not made of header lines is not HTTP.
    if !lines.all(|line| line.is_empty() || line.contains(':')) {
        return None;
    }
    let path = target.split_once('?').map_or(target, |(path, _)| path);
    Some(Request { method, path })
}

fn route(request: &Request<'_>, state: &State) -> Response {
    let known = ["/metrics", "/healthz", "/leader"];
    if !known.contains(&request.path) {
        return Response::text(404, "not found");
    }
    if !matches!(request.method, "GET" | "HEAD") {
        return Response::text(405, "method not allowed").header("Allow: GET, HEAD");
    }
    match request.path {
        "/metrics" => Response {
            status: 200,
            content_type: "text/plain; version=0.0.4; charset=utf-8",
            headers: Vec::new(),
            body: state.metrics.render(),
        },
        "/healthz" => match state.terms.health() {
            Ok(()) => Response::text(200, "ok"),
            Err(reason) => Response::text(503, &reason),
        },
        _ => match state.leader.borrow().clone() {
            Some(leader) => {
                let line = LeaderLine {
                    election: &state.election,
                    leader,
                };
                match serde_json::to_string(&line) {
                    Ok(json) => Response {
                        status: 200,
                        content_type: "application/json",
                        headers: Vec::new(),
                        body: json + "\n",
                    },
                    Err(_) => Response::text(500, "cannot encode the leader"),
                }
            }
            None => Response::text(503, "the leader is not known yet (observer not connected)"),
        },
    }
}

struct Response {
    status: u16,
    content_type: &'static str,
    headers: Vec<&'static str>,
    body: String,
}

impl Response {
    /// A plain-text response: `body` and a newline.
    fn text(status: u16, body: &str) -> Response {
        Response {
            status,
            content_type: "text/plain; charset=utf-8",
            headers: Vec::new(),
            body: format!("{body}\n"),
        }
    }

    fn header(mut self, line: &'static str) -> Response {
        self.headers.push(line);
        self
    }

    /// The answer on the wire; without the body (Content-Length still its length) for HEAD.
    fn into_bytes(self, with_body: bool) -> Vec<u8> {
        let reason = match self.status {
            200 => "OK",
            400 => "Bad Request",
            404 => "Not Found",
            405 => "Method Not Allowed",
            408 => "Request Timeout",
            431 => "Request Header Fields Too Large",
            503 => "Service Unavailable",
            _ => "Internal Server Error",
        };
        let mut head = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.status,
            self.content_type,
            self.body.len()
        );
        for line in self.headers {
            head.push_str(line);
            head.push_str("\r\n");
        }
        head.push_str("\r\n");
        let mut bytes = head.into_bytes();
        if with_body {
            bytes.extend_from_slice(self.body.as_bytes());
        }
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_request_lines() {
        let get = parse(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n").unwrap();
        assert_eq!(
            get,
            Request {
                method: "GET",
                path: "/metrics"
            }
        );
        assert!(parse(b"GET /healthz HTTP/1.0").is_some());
        for bad in [
            &b""[..],
            b"GET",
            b"GET /metrics",
            b"GET metrics HTTP/1.1",
            b"GET /metrics HTTP/2",
            b"GET  /metrics HTTP/1.1",
            b"GET /metrics HTTP/1.1 extra",
            b"G3T /metrics HTTP/1.1",
            b"GET /metrics HTTP/1.1\r\nno colon here",
            b"\xff\xfe /metrics HTTP/1.1",
        ] {
            assert_eq!(parse(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_head_ends_at_the_first_blank_line() {
        assert_eq!(end_of_head(b"GET / HTTP/1.1\r\n\r\nbody"), Some(14));
        assert_eq!(end_of_head(b"GET / HTTP/1.1\n\n"), Some(14));
        assert_eq!(end_of_head(b"GET / HTTP/1.1\r\n"), None);
    }

    #[test]
    fn responses_carry_their_length_and_close() {
        let bytes = Response::text(503, "renewals stalled").into_bytes(true);
        let text = String::from_utf8(bytes).unwrap();
        assert!(
            text.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{text}"
        );
        assert!(text.contains("Content-Length: 17\r\n"), "{text}");
        assert!(text.contains("Connection: close\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\nrenewals stalled\n"), "{text}");
        // For HEAD: the same head, no body.
        let bytes = Response::text(503, "renewals stalled").into_bytes(false);
        let head = String::from_utf8(bytes).unwrap();
        assert_eq!(Some(head.as_str()), text.strip_suffix("renewals stalled\n"));
    }

    #[test]
    fn campaigning_is_healthy() {
        assert_eq!(check(None), Ok(()));
    }
}
