//! The model-based property test and the decode-anything fuzz test.
//!
//! The model is deliberately naive: it keeps a full copy of the key map for every revision and
//! every event ever made, finds keys by scanning, and checks txn conflicts with plain lists.
//! Random command sequences over a small key space must give the same results from the store
//! and the model, and the same ranges (at every revision still kept, and below it) and events.

use std::collections::BTreeMap;

use proptest::prelude::*;
use prost::Message;

use super::*;
use crate::proto::etcdserverpb::{
    compare::{CompareTarget, TargetUnion},
    range_request::{SortOrder, SortTarget},
    request_op::Request,
    response_op::Response,
    Compare, RangeRequest, RangeResponse, RequestOp, ResponseHeader, ResponseOp,
};
use crate::proto::mvccpb::event::EventType;

type Map = BTreeMap<Vec<u8>, KeyValue>;

const CONFIG: StoreConfig = StoreConfig {
    history_revisions: 3,
    max_txn_operations: 7,
};

fn model_in_range(key: &[u8], range_end: &[u8], candidate: &[u8]) -> bool {
    if range_end.is_empty() {
        candidate == key
    } else if range_end == [0] {
        candidate >= key
    } else {
        key <= candidate && candidate < range_end
    }
}

struct Model {
    revision: i64,
    compact: i64,
    /// The key map at every revision from 1 on.
    states: BTreeMap<i64, Map>,
    /// Lease id → TTL.
    leases: BTreeMap<i64, i64>,
    /// Every event ever made.
    events: Vec<Event>,
}

/// A txn being applied to a copy of the map.
struct Work {
    map: Map,
    revision: i64,
    changed: bool,
    events: Vec<Event>,
}

impl Work {
    fn current(&self) -> i64 {
        if self.changed {
            self.revision
        } else {
            self.revision - 1
        }
    }

    fn put(&mut self, request: &PutRequest) -> Option<KeyValue> {
        let prev = self.map.get(&request.key).cloned();
        let mut kv = KeyValue {
            key: request.key.clone(),
            create_revision: self.revision,
            mod_revision: self.revision,
            version: 1,
            value: request.value.clone(),
            lease: request.lease,
        };
        if let Some(prev) = &prev {
            kv.create_revision = prev.create_revision;
            kv.version = prev.version + 1;
            if request.ignore_value {
                kv.value = prev.value.clone();
            }
            if request.ignore_lease {
                kv.lease = prev.lease;
            }
        }
        self.map.insert(kv.key.clone(), kv.clone());
        self.events.push(Event {
            r#type: EventType::Put as i32,
            kv: Some(kv),
            prev_kv: prev.clone(),
        });
        self.changed = true;
        prev
    }

    fn delete(&mut self, keys: Vec<Vec<u8>>) -> Vec<KeyValue> {
        let mut deleted = Vec::new();
        for key in keys {
            if let Some(prev) = self.map.remove(&key) {
                self.events.push(Event {
                    r#type: EventType::Delete as i32,
                    kv: Some(KeyValue {
                        key,
                        mod_revision: self.revision,
                        ..KeyValue::default()
                    }),
                    prev_kv: Some(prev.clone()),
                });
                deleted.push(prev);
                self.changed = true;
            }
        }
        deleted
    }
}

fn keys_in(map: &Map, key: &[u8], range_end: &[u8]) -> Vec<Vec<u8>> {
    map.keys()
        .filter(|candidate| model_in_range(key, range_end, candidate))
        .cloned()
        .collect()
}

fn model_range(map: &Map, request: &RangeRequest) -> RangeResponse {
    let all: Vec<KeyValue> = map
        .values()
        .filter(|kv| model_in_range(&request.key, &request.range_end, &kv.key))
        .cloned()
        .collect();
    let count = all.len() as i64;
    if request.count_only {
        return RangeResponse {
            count,
            ..RangeResponse::default()
        };
    }
    let unset_or = |bound: i64, ok: bool| bound == 0 || ok;
    let mut kvs: Vec<KeyValue> = all
        .into_iter()
        .filter(|kv| {
            unset_or(
                request.min_mod_revision,
                kv.mod_revision >= request.min_mod_revision,
            )
        })
        .filter(|kv| {
            unset_or(
                request.max_mod_revision,
                kv.mod_revision <= request.max_mod_revision,
            )
        })
        .filter(|kv| {
            unset_or(
                request.min_create_revision,
                kv.create_revision >= request.min_create_revision,
            )
        })
        .filter(|kv| {
            unset_or(
                request.max_create_revision,
                kv.create_revision <= request.max_create_revision,
            )
        })
        .collect();
    let mut order = request.sort_order;
    if request.sort_target != 0 && order == 0 {
        order = 1;
    }
    if order != 0 {
        let target = request.sort_target;
        kvs.sort_by(|a, b| {
            let ordering = match target {
                0 => a.key.cmp(&b.key),
                1 => a.version.cmp(&b.version),
                2 => a.create_revision.cmp(&b.create_revision),
                3 => a.mod_revision.cmp(&b.mod_revision),
                _ => a.value.cmp(&b.value),
            };
            if order == 2 {
                ordering.reverse()
            } else {
                ordering
            }
        });
    }
    let mut more = false;
    if request.limit > 0 && kvs.len() as i64 > request.limit {
        kvs.truncate(request.limit as usize);
        more = true;
    }
    if request.keys_only {
        for kv in &mut kvs {
            kv.value.clear();
        }
    }
    RangeResponse {
        header: None,
        kvs,
        more,
        count,
    }
}

fn model_compare_kv(compare: &Compare, kv: &KeyValue) -> bool {
    let (actual, wanted): (Vec<u8>, Vec<u8>);
    let ordering = if compare.target == CompareTarget::Value as i32 {
        actual = kv.value.clone();
        wanted = match &compare.target_union {
            Some(TargetUnion::Value(value)) => value.clone(),
            _ => Vec::new(),
        };
        actual.cmp(&wanted)
    } else {
        let (field, wanted) = match (compare.target, &compare.target_union) {
            (0, Some(TargetUnion::Version(v))) => (kv.version, *v),
            (0, _) => (kv.version, 0),
            (1, Some(TargetUnion::CreateRevision(v))) => (kv.create_revision, *v),
            (1, _) => (kv.create_revision, 0),
            (2, Some(TargetUnion::ModRevision(v))) => (kv.mod_revision, *v),
            (2, _) => (kv.mod_revision, 0),
            (_, Some(TargetUnion::Lease(v))) => (kv.lease, *v),
            _ => (kv.lease, 0),
        };
        field.cmp(&wanted)
    };
    match compare.result {
        0 => ordering.is_eq(),
        1 => ordering.is_gt(),
        2 => ordering.is_lt(),
        _ => ordering.is_ne(),
    }
}

fn model_compare(map: &Map, compare: &Compare) -> bool {
    let kvs: Vec<&KeyValue> = map
        .values()
        .filter(|kv| model_in_range(&compare.key, &compare.range_end, &kv.key))
        .collect();
    if kvs.is_empty() {
        compare.target != CompareTarget::Value as i32
            && model_compare_kv(compare, &KeyValue::default())
    } else {
        kvs.iter().all(|kv| model_compare_kv(compare, kv))
    }
}

/// etcd's checkTxnRequest, naively.
fn model_check_txn(txn: &TxnRequest, budget: usize, depth: usize) -> Result<(), StoreError> {
    if depth > MAX_TXN_DEPTH {
        return Err(StoreError::TxnTooDeep);
    }
    let operations = [txn.compare.len(), txn.success.len(), txn.failure.len()]
        .into_iter()
        .max()
        .unwrap_or(0);
    if operations > budget {
        return Err(StoreError::TooManyOperations);
    }
    for compare in &txn.compare {
        if compare.key.is_empty() {
            return Err(StoreError::KeyNotProvided);
        }
        if !(0..=3).contains(&compare.result) || !(0..=4).contains(&compare.target) {
            return Err(StoreError::InvalidCompare);
        }
    }
    for op in txn.success.iter().chain(&txn.failure) {
        match &op.request {
            None => return Err(StoreError::KeyNotFound),
            Some(Request::RequestRange(range)) => model_check_range(range)?,
            Some(Request::RequestPut(put)) => model_check_put(put)?,
            Some(Request::RequestDeleteRange(delete)) if delete.key.is_empty() => {
                return Err(StoreError::KeyNotProvided)
            }
            Some(Request::RequestDeleteRange(_)) => {}
            Some(Request::RequestTxn(nested)) => {
                model_check_txn(nested, budget - operations, depth + 1)?
            }
        }
    }
    Ok(())
}

fn model_check_range(range: &RangeRequest) -> Result<(), StoreError> {
    if range.key.is_empty() {
        return Err(StoreError::KeyNotProvided);
    }
    if !(0..=2).contains(&range.sort_order) || !(0..=4).contains(&range.sort_target) {
        return Err(StoreError::InvalidSortOption);
    }
    Ok(())
}

fn model_check_put(put: &PutRequest) -> Result<(), StoreError> {
    if put.key.is_empty() {
        return Err(StoreError::KeyNotProvided);
    }
    if put.ignore_value && !put.value.is_empty() {
        return Err(StoreError::ValueProvided);
    }
    if put.ignore_lease && put.lease != 0 {
        return Err(StoreError::LeaseProvided);
    }
    Ok(())
}

/// etcd's checkIntervals with plain lists: (puts, deletes as (key, range_end)).
type Intervals = (Vec<Vec<u8>>, Vec<(Vec<u8>, Vec<u8>)>);

fn model_intervals(ops: &[RequestOp]) -> Result<Intervals, StoreError> {
    let deleted = |dels: &[(Vec<u8>, Vec<u8>)], key: &[u8]| {
        dels.iter()
            .any(|(start, end)| model_in_range(start, end, key))
    };
    let mut dels: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    for op in ops {
        if let Some(Request::RequestDeleteRange(delete)) = &op.request {
            dels.push((delete.key.clone(), delete.range_end.clone()));
        }
    }
    let mut puts: Vec<Vec<u8>> = Vec::new();
    for op in ops {
        if let Some(Request::RequestTxn(txn)) = &op.request {
            let (puts_then, dels_then) = model_intervals(&txn.success)?;
            let (puts_else, dels_else) = model_intervals(&txn.failure)?;
            for key in &puts_then {
                if puts.contains(key) || deleted(&dels, key) {
                    return Err(StoreError::DuplicateKey);
                }
                puts.push(key.clone());
            }
            for key in &puts_else {
                if (puts.contains(key) && !puts_then.contains(key)) || deleted(&dels, key) {
                    return Err(StoreError::DuplicateKey);
                }
                // etcd keeps a set: the success branch may have put it already.
                if !puts.contains(key) {
                    puts.push(key.clone());
                }
            }
            dels.extend(dels_then);
            dels.extend(dels_else);
        }
    }
    for op in ops {
        if let Some(Request::RequestPut(put)) = &op.request {
            if puts.contains(&put.key) || deleted(&dels, &put.key) {
                return Err(StoreError::DuplicateKey);
            }
            puts.push(put.key.clone());
        }
    }
    Ok((puts, dels))
}

impl Model {
    fn new() -> Model {
        Model {
            revision: 1,
            compact: 0,
            states: BTreeMap::from([(1, Map::new())]),
            leases: BTreeMap::new(),
            events: Vec::new(),
        }
    }

    fn map(&self) -> &Map {
        &self.states[&self.revision]
    }

    fn work(&self) -> Work {
        Work {
            map: self.map().clone(),
            revision: self.revision + 1,
            changed: false,
            events: Vec::new(),
        }
    }

    fn commit(&mut self, work: Work) -> Vec<Event> {
        if work.changed {
            self.revision = work.revision;
            self.states.insert(work.revision, work.map);
            self.events.extend(work.events.iter().cloned());
        }
        work.events
    }

    fn apply(&mut self, command: &Command) -> Applied {
        let mut events = Vec::new();
        let result = match command {
            Command::Put(put) => self.put(put, &mut events),
            Command::DeleteRange(delete) => self.delete(delete, &mut events),
            Command::Txn(txn) => self.txn(txn, &mut events),
            Command::LeaseGrant { id, ttl_seconds } => self.grant(*id, *ttl_seconds),
            Command::LeaseRevoke { id } => self.revoke(*id, &mut events),
            Command::Compact { revision } => self.compact_at(*revision),
        };
        if self.revision - self.compact > 2 * CONFIG.history_revisions {
            self.compact = self.revision - CONFIG.history_revisions;
        }
        Applied {
            result,
            revision: self.revision,
            events,
        }
    }

    fn put(
        &mut self,
        put: &PutRequest,
        events: &mut Vec<Event>,
    ) -> Result<CommandResponse, StoreError> {
        model_check_put(put)?;
        if put.lease != 0 && !self.leases.contains_key(&put.lease) {
            return Err(StoreError::LeaseNotFound);
        }
        if (put.ignore_value || put.ignore_lease) && !self.map().contains_key(&put.key) {
            return Err(StoreError::KeyNotFound);
        }
        let mut work = self.work();
        let prev = work.put(put);
        *events = self.commit(work);
        Ok(CommandResponse::Put(PutResponse {
            header: None,
            prev_kv: if put.prev_kv { prev } else { None },
        }))
    }

    fn delete(
        &mut self,
        delete: &DeleteRangeRequest,
        events: &mut Vec<Event>,
    ) -> Result<CommandResponse, StoreError> {
        if delete.key.is_empty() {
            return Err(StoreError::KeyNotProvided);
        }
        let mut work = self.work();
        let deleted = work.delete(keys_in(&work.map, &delete.key, &delete.range_end));
        *events = self.commit(work);
        Ok(CommandResponse::DeleteRange(DeleteRangeResponse {
            header: None,
            deleted: deleted.len() as i64,
            prev_kvs: if delete.prev_kv { deleted } else { Vec::new() },
        }))
    }

    fn grant(&mut self, id: i64, ttl: i64) -> Result<CommandResponse, StoreError> {
        if ttl > MAX_LEASE_TTL_SECONDS {
            return Err(StoreError::LeaseTtlTooLarge);
        }
        if id == 0 {
            return Err(StoreError::LeaseNotFound);
        }
        if self.leases.contains_key(&id) {
            return Err(StoreError::LeaseExists);
        }
        let ttl = ttl.max(1);
        self.leases.insert(id, ttl);
        Ok(CommandResponse::LeaseGrant(LeaseGrantResponse {
            header: None,
            id,
            ttl,
            error: String::new(),
        }))
    }

    fn revoke(&mut self, id: i64, events: &mut Vec<Event>) -> Result<CommandResponse, StoreError> {
        if self.leases.remove(&id).is_none() {
            return Err(StoreError::LeaseNotFound);
        }
        let mut work = self.work();
        let keys: Vec<Vec<u8>> = work
            .map
            .values()
            .filter(|kv| kv.lease == id)
            .map(|kv| kv.key.clone())
            .collect();
        work.delete(keys);
        *events = self.commit(work);
        Ok(CommandResponse::LeaseRevoke(LeaseRevokeResponse::default()))
    }

    fn compact_at(&mut self, revision: i64) -> Result<CommandResponse, StoreError> {
        if revision <= self.compact {
            return Err(StoreError::Compacted {
                compact_revision: self.compact,
            });
        }
        if revision > self.revision {
            return Err(StoreError::FutureRevision);
        }
        self.compact = revision;
        Ok(CommandResponse::Compact(CompactionResponse::default()))
    }

    fn txn(
        &mut self,
        txn: &TxnRequest,
        events: &mut Vec<Event>,
    ) -> Result<CommandResponse, StoreError> {
        model_check_txn(txn, CONFIG.max_txn_operations, 1)?;
        model_intervals(&txn.success)?;
        model_intervals(&txn.failure)?;
        let before = self.map().clone();
        let mut ops = Vec::new();
        self.path_ops(&before, txn, &mut ops);
        for op in &ops {
            if let Request::RequestPut(put) = op {
                if (put.ignore_value || put.ignore_lease) && !before.contains_key(&put.key) {
                    return Err(StoreError::KeyNotFound);
                }
                if put.lease != 0 && !self.leases.contains_key(&put.lease) {
                    return Err(StoreError::LeaseNotFound);
                }
            }
        }
        for op in &ops {
            if let Request::RequestRange(range) = op {
                self.check_revision(range.revision)?;
            }
        }
        let mut work = self.work();
        let mut response = self.run_txn(&before, txn, &mut work);
        response.header = None;
        *events = self.commit(work);
        Ok(CommandResponse::Txn(response))
    }

    fn path_ops<'a>(&self, before: &Map, txn: &'a TxnRequest, ops: &mut Vec<&'a Request>) {
        let succeeded = txn
            .compare
            .iter()
            .all(|compare| model_compare(before, compare));
        let branch = if succeeded {
            &txn.success
        } else {
            &txn.failure
        };
        for op in branch {
            match &op.request {
                Some(Request::RequestTxn(nested)) => self.path_ops(before, nested, ops),
                Some(request) => ops.push(request),
                None => {}
            }
        }
    }

    fn check_revision(&self, revision: i64) -> Result<(), StoreError> {
        if revision > self.revision {
            Err(StoreError::FutureRevision)
        } else if revision > 0 && revision < self.compact {
            Err(StoreError::Compacted {
                compact_revision: self.compact,
            })
        } else {
            Ok(())
        }
    }

    fn run_txn(&self, before: &Map, txn: &TxnRequest, work: &mut Work) -> TxnResponse {
        let succeeded = txn
            .compare
            .iter()
            .all(|compare| model_compare(before, compare));
        let branch = if succeeded {
            &txn.success
        } else {
            &txn.failure
        };
        let header = |revision| {
            Some(ResponseHeader {
                revision,
                ..ResponseHeader::default()
            })
        };
        let mut responses = Vec::new();
        for op in branch {
            let response = match &op.request {
                Some(Request::RequestRange(range)) => {
                    let map = if range.revision > 0 {
                        &self.states[&self.state_revision(range.revision)]
                    } else {
                        &work.map
                    };
                    let mut response = model_range(map, range);
                    response.header = header(work.current());
                    Some(Response::ResponseRange(response))
                }
                Some(Request::RequestPut(put)) => {
                    let prev = work.put(put);
                    Some(Response::ResponsePut(PutResponse {
                        header: header(work.revision),
                        prev_kv: if put.prev_kv { prev } else { None },
                    }))
                }
                Some(Request::RequestDeleteRange(delete)) => {
                    let deleted = work.delete(keys_in(&work.map, &delete.key, &delete.range_end));
                    Some(Response::ResponseDeleteRange(DeleteRangeResponse {
                        header: header(work.current()),
                        deleted: deleted.len() as i64,
                        prev_kvs: if delete.prev_kv { deleted } else { Vec::new() },
                    }))
                }
                Some(Request::RequestTxn(nested)) => {
                    Some(Response::ResponseTxn(self.run_txn(before, nested, work)))
                }
                None => None,
            };
            responses.push(ResponseOp { response });
        }
        TxnResponse {
            header: Some(ResponseHeader::default()),
            succeeded,
            responses,
        }
    }

    /// Revisions only exist where something changed; the state at `revision` is the latest one
    /// at or before it.
    fn state_revision(&self, revision: i64) -> i64 {
        self.states
            .range(..=revision)
            .next_back()
            .map_or(1, |(revision, _)| *revision)
    }

    fn range(&self, request: &RangeRequest) -> Result<RangeResponse, StoreError> {
        model_check_range(request)?;
        self.check_revision(request.revision)?;
        let revision = if request.revision > 0 {
            request.revision
        } else {
            self.revision
        };
        Ok(model_range(
            &self.states[&self.state_revision(revision)],
            request,
        ))
    }

    fn events_since(
        &self,
        key: &[u8],
        range_end: &[u8],
        start: i64,
    ) -> Result<Vec<Event>, StoreError> {
        if start <= 0 {
            return Ok(Vec::new());
        }
        if start < self.compact {
            return Err(StoreError::Compacted {
                compact_revision: self.compact,
            });
        }
        Ok(self
            .events
            .iter()
            .filter(|event| {
                let kv = event.kv.as_ref().unwrap();
                kv.mod_revision >= start && model_in_range(key, range_end, &kv.key)
            })
            .cloned()
            .collect())
    }

    fn lease_keys(&self, id: i64) -> Vec<Vec<u8>> {
        self.map()
            .values()
            .filter(|kv| kv.lease == id)
            .map(|kv| kv.key.clone())
            .collect()
    }
}

// --- Strategies ---

fn key() -> impl Strategy<Value = Vec<u8>> {
    prop::sample::select(vec!["a", "b", "c", "d", "e"]).prop_map(|key| key.as_bytes().to_vec())
}

fn range_end() -> impl Strategy<Value = Vec<u8>> {
    prop::sample::select(vec!["", "", "", "\0", "b", "c", "e"])
        .prop_map(|end| end.as_bytes().to_vec())
}

fn value() -> impl Strategy<Value = Vec<u8>> {
    prop::sample::select(vec!["", "x", "y"]).prop_map(|value| value.as_bytes().to_vec())
}

fn rarely() -> impl Strategy<Value = bool> {
    prop::bool::weighted(0.15)
}

fn put_request() -> impl Strategy<Value = PutRequest> {
    let ignore = || prop::bool::weighted(0.03);
    (key(), value(), 0..3i64, any::<bool>(), ignore(), ignore()).prop_map(
        |(key, value, lease, prev_kv, ignore_value, ignore_lease)| PutRequest {
            key,
            value,
            lease,
            prev_kv,
            ignore_value,
            ignore_lease,
        },
    )
}

fn delete_request() -> impl Strategy<Value = DeleteRangeRequest> {
    (key(), range_end(), any::<bool>()).prop_map(|(key, range_end, prev_kv)| DeleteRangeRequest {
        key,
        range_end,
        prev_kv,
    })
}

/// An enum number: mostly a known one, sometimes one past the last.
fn enum_number(known: i32) -> impl Strategy<Value = i32> {
    prop_oneof![80 => 0..known, 1 => Just(known)]
}

fn filter_bound() -> impl Strategy<Value = i64> {
    prop_oneof![4 => Just(0i64), 1 => 1..12i64]
}

fn range_request() -> impl Strategy<Value = RangeRequest> {
    (
        (key(), range_end(), 0..4i64, -1..25i64),
        (enum_number(3), enum_number(5), rarely(), rarely()),
        (
            filter_bound(),
            filter_bound(),
            filter_bound(),
            filter_bound(),
        ),
    )
        .prop_map(
            |(
                (key, range_end, limit, revision),
                (order, target, keys_only, count_only),
                filters,
            )| {
                RangeRequest {
                    key,
                    range_end,
                    limit,
                    revision,
                    sort_order: order,
                    sort_target: target,
                    serializable: false,
                    keys_only,
                    count_only,
                    min_mod_revision: filters.0,
                    max_mod_revision: filters.1,
                    min_create_revision: filters.2,
                    max_create_revision: filters.3,
                }
            },
        )
}

fn compare() -> impl Strategy<Value = Compare> {
    let union = prop_oneof![
        (0..6i64).prop_map(TargetUnion::Version),
        (0..12i64).prop_map(TargetUnion::CreateRevision),
        (0..12i64).prop_map(TargetUnion::ModRevision),
        value().prop_map(TargetUnion::Value),
        (0..3i64).prop_map(TargetUnion::Lease),
    ];
    let range_end = prop_oneof![3 => Just(Vec::new()), 1 => range_end()];
    (
        key(),
        range_end,
        enum_number(4),
        enum_number(5),
        prop::option::weighted(0.9, union),
    )
        .prop_map(|(key, range_end, result, target, target_union)| Compare {
            result,
            target,
            key,
            range_end,
            target_union,
        })
}

fn request_op() -> impl Strategy<Value = RequestOp> {
    let leaf = prop_oneof![
        4 => put_request().prop_map(Request::RequestPut),
        2 => delete_request().prop_map(Request::RequestDeleteRange),
        2 => range_request().prop_map(Request::RequestRange),
    ];
    with_nested_txns(leaf)
}

/// `leaf` ops, and txns (two levels deep at most) of them.
fn with_nested_txns(leaf: impl Strategy<Value = Request> + 'static) -> BoxedStrategy<RequestOp> {
    let leaf = leaf.prop_map(|request| RequestOp {
        request: Some(request),
    });
    leaf.prop_recursive(2, 8, 3, |inner| {
        (
            prop::collection::vec(compare(), 0..3),
            prop::collection::vec(inner.clone(), 0..3),
            prop::collection::vec(inner, 0..3),
        )
            .prop_map(|(compare, success, failure)| RequestOp {
                request: Some(Request::RequestTxn(TxnRequest {
                    compare,
                    success,
                    failure,
                })),
            })
    })
    .boxed()
}

/// A txn of `op`s.
fn txn_of(op: BoxedStrategy<RequestOp>) -> impl Strategy<Value = TxnRequest> {
    (
        prop::collection::vec(compare(), 0..3),
        prop::collection::vec(op.clone(), 0..5),
        prop::collection::vec(op, 0..3),
    )
        .prop_map(|(compare, success, failure)| TxnRequest {
            compare,
            success,
            failure,
        })
}

fn txn_request() -> impl Strategy<Value = TxnRequest> {
    txn_of(request_op().boxed())
}

/// Txns that write on no branch (answered without the log): ranges and nested such txns.
fn read_only_txn() -> impl Strategy<Value = TxnRequest> {
    txn_of(with_nested_txns(
        range_request().prop_map(Request::RequestRange),
    ))
}

/// Short TTLs (raised to the minimum) and, rarely, one too large.
fn ttl() -> impl Strategy<Value = i64> {
    prop_oneof![12 => -1..4i64, 1 => Just(MAX_LEASE_TTL_SECONDS + 1)]
}

fn command() -> impl Strategy<Value = Command> {
    prop_oneof![
        5 => put_request().prop_map(Command::Put),
        2 => delete_request().prop_map(Command::DeleteRange),
        4 => txn_request().prop_map(Command::Txn),
        2 => read_only_txn().prop_map(Command::Txn),
        2 => (0..3i64, ttl()).prop_map(|(id, ttl_seconds)| Command::LeaseGrant { id, ttl_seconds }),
        1 => (0..3i64).prop_map(|id| Command::LeaseRevoke { id }),
        1 => (-1..25i64).prop_map(|revision| Command::Compact { revision }),
    ]
}

/// Everything observable agrees between the store and the model.
fn assert_agree(store: &Store, model: &Model, probe: &RangeRequest) -> Result<(), TestCaseError> {
    prop_assert_eq!(store.revision(), model.revision);
    prop_assert_eq!(store.compact_revision(), model.compact);
    prop_assert_eq!(store.range(probe), model.range(probe), "probe {:?}", probe);
    let lowest = (model.compact - 1).max(-1);
    for revision in lowest..=model.revision + 1 {
        let all = RangeRequest {
            revision,
            ..RangeRequest {
                key: b"\0".to_vec(),
                range_end: b"\0".to_vec(),
                ..RangeRequest::default()
            }
        };
        prop_assert_eq!(
            store.range(&all),
            model.range(&all),
            "revision {}",
            revision
        );
        let of_probe = RangeRequest {
            revision,
            ..probe.clone()
        };
        prop_assert_eq!(store.range(&of_probe), model.range(&of_probe));
        for (key, end) in [
            (&b"\0"[..], &b"\0"[..]),
            (&probe.key[..], &probe.range_end[..]),
        ] {
            prop_assert_eq!(
                store.events_since(key, end, revision),
                model.events_since(key, end, revision),
                "events since {}",
                revision
            );
        }
    }
    let leases: Vec<(i64, i64)> = model.leases.iter().map(|(id, ttl)| (*id, *ttl)).collect();
    prop_assert_eq!(store.leases(), leases);
    for (id, ttl_seconds) in &model.leases {
        let view = LeaseView {
            ttl_seconds: *ttl_seconds,
            keys: model.lease_keys(*id),
        };
        prop_assert_eq!(store.lease(*id), Some(view));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn the_store_agrees_with_a_naive_model(
        steps in prop::collection::vec((command(), range_request()), 1..40)
    ) {
        let mut store = Store::new(CONFIG);
        let mut model = Model::new();
        for (command, probe) in &steps {
            let precheck = store.precheck(command);
            // A txn that cannot write is answered as a read: exactly what applying it gives,
            // and applying it changes nothing.
            let read = match command {
                Command::Txn(txn) => store.read_txn(txn),
                _ => None,
            };
            let revision = store.revision();
            let applied = store.apply(command);
            if let Some(read) = read {
                prop_assert_eq!(&applied.result, &read.map(CommandResponse::Txn), "read {:?}", command);
                prop_assert_eq!(applied.revision, revision);
                prop_assert!(applied.events.is_empty());
            }
            let expected = model.apply(command);
            prop_assert_eq!(&applied, &expected, "command {:?}", command);
            // A stateless fault found by precheck is the error apply gives.
            if let Err(error) = precheck {
                prop_assert_eq!(applied.result, Err(error));
            }
            assert_agree(&store, &model, probe)?;
            // The byte counts kept in step equal a count from scratch after every command.
            prop_assert_eq!(store.bytes(), store.bytes_from_scratch(), "after {:?}", command);
        }
        let bytes = bincode::serialize(&store).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut back: Store = bincode::deserialize(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(back.bytes(), store.bytes());
        prop_assert_eq!(back, store);
    }

    /// Whatever bytes arrive from the network, decoded as requests, nothing panics.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let mut store = Store::new(CONFIG);
        let _ = store.apply(&Command::LeaseGrant { id: 1, ttl_seconds: 5 });
        for key in ["a", "b", "c"] {
            let _ = store.apply(&Command::Put(PutRequest { key: key.into(), lease: 1, ..PutRequest::default() }));
        }
        if let Ok(txn) = TxnRequest::decode(bytes.as_slice()) {
            let _ = store.precheck(&Command::Txn(txn.clone()));
            let _ = store.apply(&Command::Txn(txn));
        }
        if let Ok(range) = RangeRequest::decode(bytes.as_slice()) {
            let _ = store.range(&range);
            let _ = store.events_since(&range.key, &range.range_end, range.revision);
        }
        if let Ok(put) = PutRequest::decode(bytes.as_slice()) {
            let _ = store.apply(&Command::Put(put));
        }
        if let Ok(delete) = DeleteRangeRequest::decode(bytes.as_slice()) {
            let _ = store.apply(&Command::DeleteRange(delete));
        }
        let _ = store.range(&RangeRequest { key: b"\0".to_vec(), range_end: b"\0".to_vec(), ..RangeRequest::default() });
    }

    /// Structured garbage: any numbers in every field of a range, txns with any enum values.
    #[test]
    fn arbitrary_fields_never_panic(
        key in prop::collection::vec(any::<u8>(), 0..4),
        range_end in prop::collection::vec(any::<u8>(), 0..4),
        numbers in prop::array::uniform8(any::<i64>()),
        enums in prop::array::uniform4(any::<i32>()),
    ) {
        let mut store = Store::new(CONFIG);
        let _ = store.apply(&Command::Put(PutRequest { key: key.clone(), ..PutRequest::default() }));
        let range = RangeRequest {
            key: key.clone(),
            range_end: range_end.clone(),
            limit: numbers[0],
            revision: numbers[1],
            sort_order: enums[0],
            sort_target: enums[1],
            min_mod_revision: numbers[2],
            max_mod_revision: numbers[3],
            min_create_revision: numbers[4],
            max_create_revision: numbers[5],
            ..RangeRequest::default()
        };
        let _ = store.range(&range);
        let compare = Compare {
            result: enums[2],
            target: enums[3],
            key: key.clone(),
            range_end: range_end.clone(),
            target_union: Some(TargetUnion::Version(numbers[6])),
        };
        let txn = TxnRequest {
            compare: vec![compare],
            success: vec![RequestOp { request: Some(Request::RequestRange(range)) }],
            failure: vec![RequestOp { request: Some(Request::RequestDeleteRange(DeleteRangeRequest { key, range_end, prev_kv: true })) }],
        };
        let _ = store.apply(&Command::Txn(txn));
        let _ = store.apply(&Command::Compact { revision: numbers[7] });
        let _ = store.apply(&Command::LeaseGrant { id: numbers[6], ttl_seconds: numbers[7] });
        let _ = store.apply(&Command::LeaseRevoke { id: numbers[6] });
    }
}

#[test]
fn the_model_agrees_with_itself_on_a_known_sequence() {
    // Guards the model: a hand-checked sequence.
    let mut model = Model::new();
    let put = |key: &str| {
        Command::Put(PutRequest {
            key: key.into(),
            ..PutRequest::default()
        })
    };
    model.apply(&put("a"));
    model.apply(&put("b"));
    let applied = model.apply(&Command::DeleteRange(DeleteRangeRequest {
        key: b"a".to_vec(),
        range_end: b"\0".to_vec(),
        prev_kv: false,
    }));
    assert_eq!(applied.revision, 4);
    assert_eq!(applied.events.len(), 2);
    let at_3 = model
        .range(&RangeRequest {
            key: b"a".to_vec(),
            range_end: b"\0".to_vec(),
            revision: 3,
            sort_order: SortOrder::Descend as i32,
            sort_target: SortTarget::Key as i32,
            ..RangeRequest::default()
        })
        .unwrap();
    assert_eq!(at_3.kvs.len(), 2);
    assert_eq!(at_3.kvs[0].key, b"b");
}
