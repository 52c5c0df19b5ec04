//! Transactions, as etcd 3.4's `applierV3backend.Txn`: every compare on the path (nested ones
//! too) is evaluated against the state before the txn; the ops on the chosen path are checked
//! (leases, ignore_* targets, range revisions); only then are they applied in order, each
//! seeing the earlier ones' writes, all writes sharing one revision.

use std::cmp::Ordering;

use crate::proto::etcdserverpb::{
    compare::{CompareResult, CompareTarget, TargetUnion},
    request_op::Request,
    response_op::Response,
    Compare, PutResponse, RangeRequest, RangeResponse, RequestOp, ResponseHeader, ResponseOp,
    TxnRequest, TxnResponse,
};
use crate::proto::mvccpb::KeyValue;

use super::read::ReadAt;
use super::write::delete_response;
use super::{check, Store, StoreError};

/// Which branch each txn on the path takes: the outer txn's, then one per nested txn in the
/// chosen branch, in op order.
struct Path {
    succeeded: bool,
    nested: Vec<Path>,
}

/// The txn's write revision, and whether anything was written yet.
struct Writer {
    revision: i64,
    changed: bool,
}

impl Writer {
    /// The revision a read inside the txn reports: the write revision once something changed.
    fn current(&self) -> i64 {
        if self.changed {
            self.revision
        } else {
            self.revision - 1
        }
    }
}

fn header(revision: i64) -> Option<ResponseHeader> {
    Some(ResponseHeader {
        revision,
        ..ResponseHeader::default()
    })
}

impl Store {
    pub(super) fn txn(&mut self, request: &TxnRequest) -> Result<TxnResponse, StoreError> {
        check::txn(request, self.config.max_txn_operations)?;
        let path = self.path(request);
        let mut ops = Vec::new();
        ops_on_path(request, &path, &mut ops);
        self.check_ops(&ops)?;
        let mut writer = Writer {
            revision: self.revision + 1,
            changed: false,
        };
        let mut response = self.run_txn(request, &path, &mut writer);
        response.header = None;
        if writer.changed {
            self.revision = writer.revision;
        }
        Ok(response)
    }

    /// A txn that writes on no branch (etcd's `isTxnReadonly`), answered from the current state
    /// without a place in the log; `None` for a txn that may write. The answer is exactly what
    /// applying it would give, and applying it would change nothing.
    pub fn read_txn(&self, request: &TxnRequest) -> Option<Result<TxnResponse, StoreError>> {
        if !txn_is_read_only(request) {
            return None;
        }
        let answer = || {
            check::txn(request, self.config.max_txn_operations)?;
            let path = self.path(request);
            let mut ops = Vec::new();
            ops_on_path(request, &path, &mut ops);
            self.check_ops(&ops)?;
            let mut response = self.read_path(request, &path);
            response.header = None;
            Ok(response)
        };
        Some(answer())
    }

    /// [`Store::run_txn`] for a read-only txn: nothing to write, so `&self`.
    fn read_path(&self, request: &TxnRequest, path: &Path) -> TxnResponse {
        let mut nested = path.nested.iter();
        let responses = branch(request, path.succeeded)
            .iter()
            .map(|op| ResponseOp {
                response: match op.request.as_ref() {
                    Some(Request::RequestRange(range)) => {
                        Some(Response::ResponseRange(self.read_op(range, self.revision)))
                    }
                    Some(Request::RequestTxn(txn)) => nested
                        .next()
                        .map(|path| Response::ResponseTxn(self.read_path(txn, path))),
                    // `read_only` let no write through.
                    Some(Request::RequestPut(_) | Request::RequestDeleteRange(_)) | None => None,
                },
            })
            .collect();
        TxnResponse {
            header: Some(ResponseHeader::default()),
            succeeded: path.succeeded,
            responses,
        }
    }

    /// A range inside a txn, whose reads report the revision `current`. Its revision was
    /// checked against the state before the txn; 0 reads the txn's own writes so far.
    fn read_op(&self, range: &RangeRequest, current: i64) -> RangeResponse {
        let at = match range.revision {
            revision if revision > 0 => ReadAt::Revision(revision),
            _ => ReadAt::Latest,
        };
        let mut response = self.range_at(range, at);
        response.header = header(current);
        response
    }

    /// Evaluates the compares of the txn and of the nested txns it will run.
    fn path(&self, request: &TxnRequest) -> Path {
        let succeeded = request
            .compare
            .iter()
            .all(|compare| self.compare_holds(compare));
        let nested = branch(request, succeeded)
            .iter()
            .filter_map(|op| match &op.request {
                Some(Request::RequestTxn(nested)) => Some(self.path(nested)),
                _ => None,
            })
            .collect();
        Path { succeeded, nested }
    }

    /// etcd's `applyCompare`: a compare on a range holds if it holds for every key; on no key
    /// it compares a zero key-value, except that a VALUE compare then fails.
    fn compare_holds(&self, compare: &Compare) -> bool {
        let mut kvs = self.live(&compare.key, &compare.range_end).peekable();
        if kvs.peek().is_none() {
            return compare.target != CompareTarget::Value as i32
                && compare_kv(compare, &KeyValue::default());
        }
        kvs.all(|kv| compare_kv(compare, kv))
    }

    /// etcd's `checkRequestPut` over the whole path, then `checkRequestRange`, against the
    /// state before the txn.
    fn check_ops(&self, ops: &[&Request]) -> Result<(), StoreError> {
        for op in ops {
            if let Request::RequestPut(put) = op {
                self.check_put_target(put)?;
                self.check_lease_exists(put.lease)?;
            }
        }
        for op in ops {
            if let Request::RequestRange(range) = op {
                self.read_revision(range.revision, self.revision)?;
            }
        }
        Ok(())
    }

    /// Applies the checked path. Infallible: every way to fail was checked.
    fn run_txn(&mut self, request: &TxnRequest, path: &Path, writer: &mut Writer) -> TxnResponse {
        let mut nested = path.nested.iter();
        let responses = branch(request, path.succeeded)
            .iter()
            .map(|op| ResponseOp {
                response: self.run_op(op, &mut nested, writer),
            })
            .collect();
        TxnResponse {
            // etcd gives a nested txn an empty header.
            header: Some(ResponseHeader::default()),
            succeeded: path.succeeded,
            responses,
        }
    }

    fn run_op<'p>(
        &mut self,
        op: &RequestOp,
        nested: &mut impl Iterator<Item = &'p Path>,
        writer: &mut Writer,
    ) -> Option<Response> {
        let response = match op.request.as_ref()? {
            Request::RequestRange(range) => {
                Response::ResponseRange(self.read_op(range, writer.current()))
            }
            Request::RequestPut(put) => {
                let prev = self.write_put(put, writer.revision);
                writer.changed = true;
                Response::ResponsePut(PutResponse {
                    header: header(writer.revision),
                    prev_kv: prev.filter(|_| put.prev_kv),
                })
            }
            Request::RequestDeleteRange(delete) => {
                let prev_kvs = self.write_delete(&delete.key, &delete.range_end, writer.revision);
                writer.changed |= !prev_kvs.is_empty();
                let header = header(writer.current());
                Response::ResponseDeleteRange(delete_response(prev_kvs, delete.prev_kv, header))
            }
            Request::RequestTxn(txn) => {
                let path = nested.next()?;
                Response::ResponseTxn(self.run_txn(txn, path, writer))
            }
        };
        Some(response)
    }
}

/// Whether no op on any branch, nested txns included, writes.
pub fn txn_is_read_only(request: &TxnRequest) -> bool {
    !any_op(request, &|op| {
        matches!(op, Request::RequestPut(_) | Request::RequestDeleteRange(_))
    })
}

/// Whether a txn may put on some branch (nested txns included): what the quota refuses at
/// the limit. A txn that only reads or deletes frees room or leaves it as it is.
pub fn txn_may_put(request: &TxnRequest) -> bool {
    any_op(request, &|op| matches!(op, Request::RequestPut(_)))
}

/// Whether an op on either branch, nested txns looked into, is one `hit` is true of.
fn any_op(request: &TxnRequest, hit: &dyn Fn(&Request) -> bool) -> bool {
    request
        .success
        .iter()
        .chain(&request.failure)
        .any(|op| match &op.request {
            Some(Request::RequestTxn(nested)) => any_op(nested, hit),
            Some(other) => hit(other),
            None => false,
        })
}

/// The ops a txn runs when its compares did (not) hold.
fn branch(request: &TxnRequest, succeeded: bool) -> &[RequestOp] {
    if succeeded {
        &request.success
    } else {
        &request.failure
    }
}

/// The non-txn ops on the path, nested ones flattened in place.
fn ops_on_path<'a>(request: &'a TxnRequest, path: &Path, ops: &mut Vec<&'a Request>) {
    let mut nested = path.nested.iter();
    for op in branch(request, path.succeeded) {
        match &op.request {
            Some(Request::RequestTxn(txn)) => {
                if let Some(path) = nested.next() {
                    ops_on_path(txn, path, ops);
                }
            }
            Some(request) => ops.push(request),
            None => {}
        }
    }
}

/// etcd's `compareKV`: a target_union of another kind than the target compares as 0 (or the
/// empty value).
fn compare_kv(compare: &Compare, kv: &KeyValue) -> bool {
    let union = compare.target_union.as_ref();
    let number = |pick: fn(&TargetUnion) -> Option<i64>| union.and_then(pick).unwrap_or(0);
    let ordering = match CompareTarget::try_from(compare.target) {
        Ok(CompareTarget::Value) => {
            let value = match union {
                Some(TargetUnion::Value(value)) => value.as_slice(),
                _ => &[],
            };
            kv.value.as_slice().cmp(value)
        }
        Ok(CompareTarget::Version) => kv.version.cmp(&number(|u| match u {
            TargetUnion::Version(v) => Some(*v),
            _ => None,
        })),
        Ok(CompareTarget::Create) => kv.create_revision.cmp(&number(|u| match u {
            TargetUnion::CreateRevision(v) => Some(*v),
            _ => None,
        })),
        Ok(CompareTarget::Mod) => kv.mod_revision.cmp(&number(|u| match u {
            TargetUnion::ModRevision(v) => Some(*v),
            _ => None,
        })),
        Ok(CompareTarget::Lease) => kv.lease.cmp(&number(|u| match u {
            TargetUnion::Lease(v) => Some(*v),
            _ => None,
        })),
        // Refused by the checks; etcd compares an unknown target as equal.
        Err(_) => Ordering::Equal,
    };
    match CompareResult::try_from(compare.result) {
        Ok(CompareResult::Equal) => ordering == Ordering::Equal,
        Ok(CompareResult::NotEqual) => ordering != Ordering::Equal,
        Ok(CompareResult::Greater) => ordering == Ordering::Greater,
        Ok(CompareResult::Less) => ordering == Ordering::Less,
        // Refused by the checks; etcd lets an unknown result hold.
        Err(_) => true,
    }
}
