//! Fenced operations inside the coordination service: reads and writes that take effect only
//! while a fencing token still leads its election, atomically with that check.
//!
//! A [`FencedTxn`] is a small compare-and-swap transaction: if every comparison holds, its
//! `then` operations run, otherwise its `otherwise` operations, and the whole of it runs only
//! while the token leads (else [`crate::Error::Fenced`]). A counter kept by the leader is a
//! fenced read followed by a fenced compare-and-swap:
//!
//! ```
//! # #[tokio::main] async fn main() -> baton::Result<()> {
//! # let url = std::env::var("BATON_BACKEND").unwrap_or("etcd://127.0.0.1:2379/baton".into());
//! # let backend = baton::Backend::connect(&url).await?;
//! # let config = baton::ElectionConfig::default().with_ttl(std::time::Duration::from_secs(5));
//! # let election = baton::Election::new(&backend, "counter-doc", config)?;
//! # let leadership = election.campaign("host-a").await?;
//! use baton::FencedTxn;
//! let old = leadership.fenced_get("/jobs/counter").await?;
//! let next = old
//!     .as_deref()
//!     .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
//!     .unwrap_or(0)
//!     + 1;
//! let txn = FencedTxn::new()
//!     .when_value("/jobs/counter", old.as_deref())
//!     .then_put("/jobs/counter", next.to_string());
//! let outcome = leadership.fenced_txn(txn).await?;
//! if !outcome.succeeded {
//!     // Someone else changed it between the read and the write: read again.
//! }
//! # leadership.resign().await;
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use crate::url::is_reserved;

/// A comparison in a [`FencedTxn`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FencedCompare {
    /// The key's value equals `value`; `None` means the key does not exist.
    Value {
        /// The key.
        key: String,
        /// The expected value, or `None` for "absent".
        value: Option<Vec<u8>>,
    },
}

/// An operation in a [`FencedTxn`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FencedOp {
    /// Set `key` to `value`.
    Put {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
    },
    /// Delete `key`.
    Delete {
        /// The key.
        key: String,
    },
    /// Read `key`; its value is returned in [`FencedTxnResponse::values`].
    Get {
        /// The key.
        key: String,
    },
}

impl FencedOp {
    pub(crate) fn key(&self) -> &str {
        match self {
            FencedOp::Put { key, .. } | FencedOp::Delete { key } | FencedOp::Get { key } => key,
        }
    }
}

/// A transaction that runs only while a fencing token leads its election.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FencedTxn {
    pub(crate) compares: Vec<FencedCompare>,
    pub(crate) then: Vec<FencedOp>,
    pub(crate) otherwise: Vec<FencedOp>,
}

/// What a [`FencedTxn`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencedTxnResponse {
    /// Whether every comparison held (so the `then` operations ran).
    pub succeeded: bool,
    /// For each `Get` of the branch that ran, in order: the value, or `None` if absent.
    pub values: Vec<Option<Vec<u8>>>,
}

impl FencedTxn {
    /// An empty transaction (no comparisons: the `then` branch runs).
    pub fn new() -> FencedTxn {
        FencedTxn::default()
    }

    /// Adds a comparison: `key` holds `value` (`None`: `key` does not exist).
    pub fn when_value(mut self, key: impl Into<String>, value: Option<&[u8]>) -> FencedTxn {
        self.compares.push(FencedCompare::Value {
            key: key.into(),
            value: value.map(<[u8]>::to_vec),
        });
        self
    }

    /// Puts `key` = `value` if the comparisons hold.
    pub fn then_put(mut self, key: impl Into<String>, value: impl Into<Vec<u8>>) -> FencedTxn {
        self.then.push(FencedOp::Put {
            key: key.into(),
            value: value.into(),
        });
        self
    }

    /// Deletes `key` if the comparisons hold.
    pub fn then_delete(mut self, key: impl Into<String>) -> FencedTxn {
        self.then.push(FencedOp::Delete { key: key.into() });
        self
    }

    /// Reads `key` if the comparisons hold.
    pub fn then_get(mut self, key: impl Into<String>) -> FencedTxn {
        self.then.push(FencedOp::Get { key: key.into() });
        self
    }

    /// Deletes `key` if a comparison fails.
    pub fn otherwise_delete(mut self, key: impl Into<String>) -> FencedTxn {
        self.otherwise.push(FencedOp::Delete { key: key.into() });
        self
    }

    /// Reads `key` if a comparison fails (say, to learn the current value).
    pub fn otherwise_get(mut self, key: impl Into<String>) -> FencedTxn {
        self.otherwise.push(FencedOp::Get { key: key.into() });
        self
    }

    /// Every key the transaction touches, checked before anything is sent.
    pub(crate) fn validate(&self) -> Result<()> {
        let compared = self.compares.iter().map(|c| match c {
            FencedCompare::Value { key, .. } => key.as_str(),
        });
        let operated = self.then.iter().chain(&self.otherwise).map(FencedOp::key);
        compared.chain(operated).try_for_each(validate_key)
    }
}

/// Keys of fenced operations must be absolute (start with `/`) and stay out of every
/// election's candidate entries: a write there would pose as a candidate (and, unleased, block
/// the election for ever).
pub(crate) fn validate_key(key: &str) -> Result<()> {
    let reason = if key.is_empty() {
        Some("must not be empty")
    } else if !key.starts_with('/') {
        Some("must be absolute (start with '/')")
    } else if key.split('/').any(is_reserved) {
        Some("is inside an election's candidate entries, which only baton writes")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(Error::InvalidKey {
            key: key.to_string(),
            reason,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked() {
        assert!(validate_key("/jobs/counter").is_ok());
        assert!(validate_key("/baton/cron/status").is_ok());
        for bad in [
            "",
            "jobs/counter",
            "/baton/cron/@candidates/0000000000000001-0",
            "/baton/cron/@candidates",
        ] {
            let message = validate_key(bad).unwrap_err().to_string();
            assert!(message.starts_with("invalid key"), "{message}");
        }
        let txn = FencedTxn::new()
            .when_value("/a", None)
            .then_put("/b", "1")
            .otherwise_get("relative");
        assert!(txn.validate().is_err());
    }
}
