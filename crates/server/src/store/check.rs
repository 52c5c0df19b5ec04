//! The checks that do not depend on the state: those etcd's gRPC layer makes before
//! proposing (`checkPutRequest`, `checkTxnRequest`, `checkIntervals`, ...), in etcd's order so
//! that a request with several faults gets etcd's error.

use crate::proto::etcdserverpb::{
    compare::{CompareResult, CompareTarget},
    range_request::{SortOrder, SortTarget},
    request_op::Request,
    Compare, DeleteRangeRequest, PutRequest, RangeRequest, RequestOp, TxnRequest,
};

use super::{intervals, StoreError, MAX_LEASE_TTL_SECONDS, MAX_TXN_DEPTH};

/// etcd's `checkRangeRequest`, with 3.5's sort option check (unknown enum numbers come from
/// the network as plain integers).
pub(super) fn range(request: &RangeRequest) -> Result<(), StoreError> {
    if request.key.is_empty() {
        return Err(StoreError::KeyNotProvided);
    }
    let order_known = SortOrder::try_from(request.sort_order).is_ok();
    let target_known = SortTarget::try_from(request.sort_target).is_ok();
    if !order_known || !target_known {
        return Err(StoreError::InvalidSortOption);
    }
    Ok(())
}

/// etcd's `checkPutRequest`.
pub(super) fn put(request: &PutRequest) -> Result<(), StoreError> {
    if request.key.is_empty() {
        return Err(StoreError::KeyNotProvided);
    }
    if request.ignore_value && !request.value.is_empty() {
        return Err(StoreError::ValueProvided);
    }
    if request.ignore_lease && request.lease != 0 {
        return Err(StoreError::LeaseProvided);
    }
    Ok(())
}

/// etcd's `checkDeleteRequest`.
pub(super) fn delete(request: &DeleteRangeRequest) -> Result<(), StoreError> {
    if request.key.is_empty() {
        return Err(StoreError::KeyNotProvided);
    }
    Ok(())
}

/// etcd's check of a grant's TTL, made before the lease id is looked at.
pub(super) fn lease_ttl(ttl_seconds: i64) -> Result<(), StoreError> {
    if ttl_seconds > MAX_LEASE_TTL_SECONDS {
        return Err(StoreError::LeaseTtlTooLarge);
    }
    Ok(())
}

/// etcd's `checkTxnRequest` then `checkIntervals` on both branches.
pub(super) fn txn(request: &TxnRequest, max_operations: usize) -> Result<(), StoreError> {
    txn_level(request, max_operations, 1)?;
    // After the per-level checks, as etcd does, so a huge request is refused before the
    // interval work.
    intervals::check(&request.success)?;
    intervals::check(&request.failure)?;
    Ok(())
}

/// One level of `checkTxnRequest`: nested txns get what is left of the operation budget.
fn txn_level(request: &TxnRequest, budget: usize, depth: usize) -> Result<(), StoreError> {
    if depth > MAX_TXN_DEPTH {
        return Err(StoreError::TxnTooDeep);
    }
    let operations = request
        .compare
        .len()
        .max(request.success.len())
        .max(request.failure.len());
    if operations > budget {
        return Err(StoreError::TooManyOperations);
    }
    for compare in &request.compare {
        self::compare(compare)?;
    }
    let nested_budget = budget - operations;
    for op in request.success.iter().chain(&request.failure) {
        request_op(op, nested_budget, depth)?;
    }
    Ok(())
}

/// A compare names a key, and (our addition) known enum values.
fn compare(compare: &Compare) -> Result<(), StoreError> {
    if compare.key.is_empty() {
        return Err(StoreError::KeyNotProvided);
    }
    let result_known = CompareResult::try_from(compare.result).is_ok();
    let target_known = CompareTarget::try_from(compare.target).is_ok();
    if !result_known || !target_known {
        return Err(StoreError::InvalidCompare);
    }
    Ok(())
}

/// etcd's `checkRequestOp`: an op with no request is "key not found", as in etcd.
fn request_op(op: &RequestOp, budget: usize, depth: usize) -> Result<(), StoreError> {
    match &op.request {
        Some(Request::RequestRange(request)) => range(request),
        Some(Request::RequestPut(request)) => put(request),
        Some(Request::RequestDeleteRange(request)) => delete(request),
        Some(Request::RequestTxn(request)) => txn_level(request, budget, depth + 1),
        None => Err(StoreError::KeyNotFound),
    }
}
