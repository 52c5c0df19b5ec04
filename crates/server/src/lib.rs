//! baton server: a coordination server speaking the subset of the etcd v3 gRPC API that
//! leases, elections and locks use, replicated and made durable by openraft.
//!
//! The etcd semantics (revisions, keys, leases, watch history) live in the sans-IO
//! [`store::Store`], which never reads a clock and never does I/O. Around it: the Raft log on
//! disk with group commit ([`log_store`]), the openraft state machine and snapshots ([`raft`]),
//! the leader's lease timers ([`lease`]), watchers ([`watch`]) and the gRPC services
//! ([`service`]). [`start`] runs one member in the current tokio runtime; `baton server` is the
//! command around it.
//!
//! Without its default feature `node` the crate is only the store and the API types (what the
//! fuzz target builds).
//!
//! It never expires a lease early: timers live only on the leader, start again in full after a
//! restart or a change of leader, and a keep-alive that comes after a lease ran out is refused.
#![warn(missing_docs)]

#[cfg(feature = "node")]
pub mod lease;
#[cfg(feature = "node")]
pub mod log_store;
#[cfg(feature = "node")]
mod network;
#[cfg(feature = "node")]
mod node;
#[cfg(feature = "node")]
pub mod raft;
#[cfg(feature = "node")]
pub mod service;
pub mod store;
#[cfg(feature = "node")]
pub mod watch;

#[cfg(feature = "node")]
pub use node::{start, Node, RunningServer, ServerConfig};

/// The generated etcd v3 API types and gRPC services (the `baton-etcd-proto` crate, shared with
/// the library's etcd client).
pub use baton_etcd_proto as proto;

/// Why a server could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The listen address could not be bound (in use, not local, no permission).
    #[error("cannot listen on {0}: {1}")]
    Listen(std::net::SocketAddr, #[source] std::io::Error),
    /// The data directory could not be created, opened, read or written.
    #[error("data directory {path}: {1}", path = .0.display())]
    Data(std::path::PathBuf, #[source] std::io::Error),
    /// A setting is out of range.
    #[error("invalid setting: {0}")]
    Config(String),
    /// The Raft node failed to start or to elect itself.
    #[error("raft: {0}")]
    Raft(String),
    /// Serving stopped with an error.
    #[error("serving stopped: {0}")]
    Serve(String),
}
