//! Fencing on etcd: a transaction that checks the leader key, with the caller's operations
//! nested inside it.

use std::time::Duration;

use super::client::{Client, Compare, CompareOp, Txn, TxnOp, TxnOpResponse};

use super::timed;
use crate::backend::{BoxFuture, Fencer};
use crate::error::{Error, Result};
use crate::fenced::{FencedCompare, FencedOp, FencedTxn, FencedTxnResponse};

/// The fence of one leadership: its leader key, which exists with create revision `token`
/// exactly while that leadership holds (no key with a lower revision can appear later, so if it
/// exists it is still the lowest).
#[derive(Clone)]
pub(crate) struct EtcdFencer {
    pub(super) client: Client,
    pub(super) leader_key: Vec<u8>,
}

impl std::fmt::Debug for EtcdFencer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdFencer")
            .field("leader_key", &String::from_utf8_lossy(&self.leader_key))
            .finish()
    }
}

impl Fencer for EtcdFencer {
    fn run<'a>(
        &'a self,
        election: &'a str,
        token: u64,
        txn: &'a FencedTxn,
        limit: Duration,
    ) -> BoxFuture<'a, Result<FencedTxnResponse>> {
        Box::pin(self.fenced(election, token, txn, limit))
    }
}

impl EtcdFencer {
    /// Runs `txn` nested inside a transaction that checks the leader key first: one atomic
    /// step, bounded by `limit`.
    pub(super) async fn fenced(
        &self,
        election: &str,
        token: u64,
        txn: &FencedTxn,
        limit: Duration,
    ) -> Result<FencedTxnResponse> {
        txn.validate()?;
        let revision = i64::try_from(token).unwrap_or(i64::MAX);
        let compares: Vec<Compare> = txn
            .compares
            .iter()
            .map(|compare| match compare {
                FencedCompare::Value { key, value: None } => {
                    Compare::create_revision(key.as_str(), CompareOp::Equal, 0)
                }
                FencedCompare::Value {
                    key,
                    value: Some(value),
                } => Compare::value(key.as_str(), CompareOp::Equal, value.clone()),
            })
            .collect();
        // An absent key has no value to compare: etcd's value comparison fails for it, which
        // is the answer we want for "equals Some(..)".
        let inner = Txn::new()
            .when(compares)
            .and_then(txn.then.iter().map(to_etcd_op).collect::<Vec<_>>())
            .or_else(txn.otherwise.iter().map(to_etcd_op).collect::<Vec<_>>());
        let outer = Txn::new()
            .when([Compare::create_revision(
                self.leader_key.clone(),
                CompareOp::Equal,
                revision,
            )])
            .and_then([TxnOp::txn(inner)]);
        let mut client = self.client.clone();
        let response = timed(limit, "fenced transaction", client.txn(outer)).await?;
        if !response.succeeded() {
            return Err(Error::Fenced {
                election: election.to_string(),
                token,
            });
        }
        let Some(TxnOpResponse::Txn(inner)) = response.op_responses().first() else {
            return Err(Error::protocol(
                "etcd",
                "fenced transaction",
                "the answer lacks the nested transaction",
            ));
        };
        let values = inner
            .op_responses()
            .iter()
            .filter_map(|op| match op {
                TxnOpResponse::Get(get) => Some(get.kvs().first().map(|kv| kv.value().to_vec())),
                _ => None,
            })
            .collect();
        Ok(FencedTxnResponse {
            succeeded: inner.succeeded(),
            values,
        })
    }
}

fn to_etcd_op(op: &FencedOp) -> TxnOp {
    match op {
        FencedOp::Put { key, value } => TxnOp::put(key.as_str(), value.clone(), None),
        FencedOp::Delete { key } => TxnOp::delete(key.as_str(), None),
        FencedOp::Get { key } => TxnOp::get(key.as_str(), None),
    }
}
