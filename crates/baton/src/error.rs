//! The library's error type.

use baton_core::{ConfigError, LossReason};

/// Everything that can go wrong in the library.
///
/// [`Error::is_retryable`] separates transient failures (the backend is briefly unreachable)
/// from ones that retrying cannot fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The backend URL is malformed or names an unknown scheme.
    #[error("invalid backend url {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The election configuration was rejected.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The backend cannot do what the configuration asks.
    #[error("{0}")]
    Unsupported(String),
    /// A key given to a fenced operation is not usable.
    #[error("invalid key {key:?}: {reason}")]
    InvalidKey {
        /// The key given.
        key: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// An election name or candidate id is not usable.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidName {
        /// "election name" or "candidate id".
        what: &'static str,
        /// The value given.
        value: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// The backend could not be reached. Always retryable.
    #[error("cannot reach {backend}{}: {detail}", at(endpoints))]
    Unreachable {
        /// Backend kind, such as "etcd".
        backend: &'static str,
        /// The endpoints tried (empty when the failure came from an established client).
        endpoints: String,
        /// The underlying error, in one line.
        detail: String,
    },
    /// A request did not complete in time.
    #[error("{operation} timed out after {after_ms} ms")]
    Timeout {
        /// What was being done.
        operation: &'static str,
        /// How long we waited.
        after_ms: u64,
    },
    /// The backend answered with an error. The backend classifies it: `retryable` when the
    /// same request may succeed later (the server is overloaded, a leader election is under
    /// way), not when retrying cannot help (permission denied, an invalid request).
    #[error("{backend} error during {operation}: {detail}")]
    Backend {
        /// Backend kind.
        backend: &'static str,
        /// What was being done.
        operation: &'static str,
        /// The backend's message, in one line.
        detail: String,
        /// Whether the same request may succeed later.
        retryable: bool,
        /// The client library's error, when there is one.
        #[source]
        source: Option<BoxError>,
    },
    /// The campaign ended before leadership was gained.
    #[error("campaign ended before leadership was gained: {0}")]
    CampaignLost(LossReason),
    /// A new entry's revision was not above a fencing token this election already issued, or
    /// above an earlier entry of the same candidacy: the backend's revision went backwards (restored from an older snapshot, or wiped). The
    /// candidacy ends, with requeue too; resources fenced with the old tokens will refuse every
    /// new leader until their fence is reset.
    #[error(
        "election {election:?}: new fencing token {token} is not above {highest}, which the \
         election already reached: the backend's revision went backwards (restored from an \
         older snapshot or wiped); \
         fenced resources will reject new leaders until their fence is reset"
    )]
    TokenRegressed {
        /// The election.
        election: String,
        /// The revision our new entry got.
        token: u64,
        /// The highest position this process saw the election reach: a token issued, or an
        /// entry of this candidacy.
        highest: u64,
    },
    /// Another live candidate of the election already uses this id (in this process or
    /// another). Ids name candidates in `leader()` output and logs, so they must be unique; a
    /// crashed candidate's id is free again once its lease expires (within the TTL).
    #[error("candidate id {id:?} is already campaigning in election {election:?} (entry {entry})")]
    DuplicateId {
        /// The election.
        election: String,
        /// The id.
        id: String,
        /// The other candidate's entry.
        entry: String,
    },
    /// A guarded write was refused because the token no longer leads the election.
    #[error("write refused: fencing token {token} no longer leads election {election:?}")]
    Fenced {
        /// The election.
        election: String,
        /// The stale token.
        token: u64,
    },
    /// A resource fenced inside the caller's own database transaction has already seen a
    /// newer token: nothing of that transaction may commit (PostgreSQL's `fence`).
    #[error("stale fencing token {token} for {resource:?}: a newer token has been used there")]
    StaleToken {
        /// The resource.
        resource: String,
        /// The stale token.
        token: u64,
    },
    /// The backend was closed ([`crate::Backend::close`]), or the background task serving
    /// this object has stopped.
    #[error("the backend was closed (or the election's driver has stopped)")]
    Closed,
}

/// A client library's error, kept as the source of an [`Error::Backend`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// " at ENDPOINTS", when they are known.
fn at(endpoints: &str) -> String {
    if endpoints.is_empty() {
        String::new()
    } else {
        format!(" at {endpoints}")
    }
}

impl Error {
    /// Whether the same call may succeed later without any change.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Unreachable { .. } | Error::Timeout { .. } => true,
            Error::Backend { retryable, .. } => *retryable,
            _ => false,
        }
    }

    /// A protocol error of baton's own making (the server's answer broke an invariant): not
    /// retryable as such, no source.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    pub(crate) fn protocol(backend: &'static str, operation: &'static str, detail: &str) -> Error {
        Error::Backend {
            backend,
            operation,
            detail: detail.to_string(),
            retryable: false,
            source: None,
        }
    }
}

/// The library's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
