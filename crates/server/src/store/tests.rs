//! Unit tests: exact responses, revisions and events for each of etcd's rules.

use super::*;
use crate::proto::etcdserverpb::{
    compare::{CompareResult, CompareTarget, TargetUnion},
    range_request::{SortOrder, SortTarget},
    request_op::Request,
    response_op::Response,
    Compare, RangeRequest, RangeResponse, RequestOp, ResponseHeader, ResponseOp,
};
use crate::proto::mvccpb::event::EventType;

fn store() -> Store {
    Store::new(StoreConfig::default())
}

fn put(key: &str, value: &str) -> PutRequest {
    PutRequest {
        key: key.into(),
        value: value.into(),
        ..PutRequest::default()
    }
}

fn put_leased(key: &str, value: &str, lease: i64) -> PutRequest {
    PutRequest {
        lease,
        ..put(key, value)
    }
}

fn delete(key: &str, range_end: &str) -> DeleteRangeRequest {
    DeleteRangeRequest {
        key: key.into(),
        range_end: range_end.into(),
        prev_kv: true,
    }
}

fn get(key: &str, range_end: &str) -> RangeRequest {
    RangeRequest {
        key: key.into(),
        range_end: range_end.into(),
        ..RangeRequest::default()
    }
}

fn kv(key: &str, value: &str, create: i64, modified: i64, version: i64, lease: i64) -> KeyValue {
    KeyValue {
        key: key.into(),
        value: value.into(),
        create_revision: create,
        mod_revision: modified,
        version,
        lease,
    }
}

fn tombstone(key: &str, revision: i64) -> KeyValue {
    KeyValue {
        key: key.into(),
        mod_revision: revision,
        ..KeyValue::default()
    }
}

fn put_event(kv: KeyValue, prev: Option<KeyValue>) -> Event {
    Event {
        r#type: EventType::Put as i32,
        kv: Some(kv),
        prev_kv: prev,
    }
}

fn delete_event(key: &str, revision: i64, prev: KeyValue) -> Event {
    Event {
        r#type: EventType::Delete as i32,
        kv: Some(tombstone(key, revision)),
        prev_kv: Some(prev),
    }
}

fn ok(applied: Applied) -> CommandResponse {
    match applied.result {
        Ok(response) => response,
        Err(error) => panic!("rejected: {error}"),
    }
}

fn apply_put(store: &mut Store, request: PutRequest) -> PutResponse {
    match ok(store.apply(&Command::Put(request))) {
        CommandResponse::Put(response) => response,
        other => panic!("{other:?}"),
    }
}

fn apply_txn(store: &mut Store, request: TxnRequest) -> TxnResponse {
    match ok(store.apply(&Command::Txn(request))) {
        CommandResponse::Txn(response) => response,
        other => panic!("{other:?}"),
    }
}

fn grant(store: &mut Store, id: i64) {
    ok(store.apply(&Command::LeaseGrant {
        id,
        ttl_seconds: 10,
    }));
}

fn keys(response: &RangeResponse) -> Vec<String> {
    response
        .kvs
        .iter()
        .map(|kv| String::from_utf8_lossy(&kv.key).into_owned())
        .collect()
}

/// Asserts the command is rejected with `error` and changes nothing.
fn assert_rejected(store: &mut Store, command: Command, error: StoreError) {
    let before = store.clone();
    let applied = store.apply(&command);
    assert_eq!(applied.result, Err(error), "{command:?}");
    assert_eq!(applied.revision, before.revision());
    assert!(applied.events.is_empty());
    assert_eq!(*store, before);
}

fn op(request: Request) -> RequestOp {
    RequestOp {
        request: Some(request),
    }
}

fn compare(key: &str, target: CompareTarget, result: CompareResult, union: TargetUnion) -> Compare {
    Compare {
        key: key.into(),
        target: target as i32,
        result: result as i32,
        target_union: Some(union),
        range_end: Vec::new(),
    }
}

fn range_of(response: &ResponseOp) -> &RangeResponse {
    match &response.response {
        Some(Response::ResponseRange(range)) => range,
        other => panic!("{other:?}"),
    }
}

fn header(revision: i64) -> Option<ResponseHeader> {
    Some(ResponseHeader {
        revision,
        ..ResponseHeader::default()
    })
}

#[test]
fn an_empty_store_is_at_revision_1() {
    let store = store();
    assert_eq!(store.revision(), 1);
    assert_eq!(store.compact_revision(), 0);
    let all = store.range(&get("\0", "\0")).unwrap();
    assert_eq!((all.kvs.len(), all.count, all.more), (0, 0, false));
}

#[test]
fn puts_bump_the_revision_and_the_version() {
    let mut store = store();
    let applied = store.apply(&Command::Put(put("a", "1")));
    assert_eq!(applied.revision, 2);
    assert_eq!(
        applied.events,
        vec![put_event(kv("a", "1", 2, 2, 1, 0), None)]
    );
    assert_eq!(
        applied.result,
        Ok(CommandResponse::Put(PutResponse::default()))
    );

    let response = apply_put(
        &mut store,
        PutRequest {
            prev_kv: true,
            ..put("a", "2")
        },
    );
    assert_eq!(response.prev_kv, Some(kv("a", "1", 2, 2, 1, 0)));
    assert_eq!(store.revision(), 3);
    let got = store.range(&get("a", "")).unwrap();
    assert_eq!(got.kvs, vec![kv("a", "2", 2, 3, 2, 0)]);
    assert_eq!(got.count, 1);
}

#[test]
fn a_deletion_ends_the_generation() {
    let mut store = store();
    apply_put(&mut store, put("a", "1"));
    apply_put(&mut store, put("a", "2"));
    let applied = store.apply(&Command::DeleteRange(delete("a", "")));
    assert_eq!(applied.revision, 4);
    assert_eq!(
        applied.events,
        vec![delete_event("a", 4, kv("a", "2", 2, 3, 2, 0))]
    );
    assert_eq!(
        applied.result,
        Ok(CommandResponse::DeleteRange(DeleteRangeResponse {
            header: None,
            deleted: 1,
            prev_kvs: vec![kv("a", "2", 2, 3, 2, 0)],
        }))
    );
    apply_put(&mut store, put("a", "3"));
    assert_eq!(
        store.range(&get("a", "")).unwrap().kvs,
        vec![kv("a", "3", 5, 5, 1, 0)]
    );
}

#[test]
fn a_delete_of_nothing_keeps_the_revision() {
    let mut store = store();
    apply_put(&mut store, put("a", "1"));
    let applied = store.apply(&Command::DeleteRange(delete("b", "")));
    assert_eq!(applied.revision, 2);
    assert!(applied.events.is_empty());
    assert_eq!(
        applied.result,
        Ok(CommandResponse::DeleteRange(DeleteRangeResponse::default()))
    );
}

#[test]
fn a_range_delete_makes_one_revision_and_one_event_per_key() {
    let mut store = store();
    for key in ["a", "b", "c", "d"] {
        apply_put(&mut store, put(key, key));
    }
    let applied = store.apply(&Command::DeleteRange(DeleteRangeRequest {
        prev_kv: false,
        ..delete("b", "d")
    }));
    assert_eq!(applied.revision, 6);
    assert_eq!(
        applied.events,
        vec![
            delete_event("b", 6, kv("b", "b", 3, 3, 1, 0)),
            delete_event("c", 6, kv("c", "c", 4, 4, 1, 0)),
        ]
    );
    assert_eq!(
        applied.result,
        Ok(CommandResponse::DeleteRange(DeleteRangeResponse {
            header: None,
            deleted: 2,
            prev_kvs: Vec::new(),
        }))
    );
    assert_eq!(keys(&store.range(&get("\0", "\0")).unwrap()), ["a", "d"]);
}

#[test]
fn range_end_rules() {
    let mut store = store();
    for key in ["a", "ab", "b", "c"] {
        apply_put(&mut store, put(key, ""));
    }
    let keys_of = |key: &str, end: &str| keys(&store.range(&get(key, end)).unwrap());
    assert_eq!(keys_of("ab", ""), ["ab"]);
    assert_eq!(keys_of("ab", "\0"), ["ab", "b", "c"]);
    assert_eq!(keys_of("\0", "\0"), ["a", "ab", "b", "c"]);
    assert_eq!(keys_of("a", "b"), ["a", "ab"]);
    assert_eq!(keys_of("b", "a"), Vec::<String>::new());
    assert_eq!(keys_of("b", "b"), Vec::<String>::new());
    assert_eq!(keys_of("zz", ""), Vec::<String>::new());

    assert!(in_range(b"a", b"", b"a"));
    assert!(!in_range(b"a", b"", b"ab"));
    assert!(in_range(b"a", b"\0", b"zzz"));
    assert!(!in_range(b"b", b"\0", b"a"));
    assert!(in_range(b"\0", b"\0", b"\0"));
    assert!(in_range(b"a", b"b", b"a\xff"));
    assert!(!in_range(b"a", b"b", b"b"));
    assert!(!in_range(b"b", b"a", b"b"));
}

#[test]
fn range_limit_count_and_more() {
    let mut store = store();
    for key in ["a", "b", "c"] {
        apply_put(&mut store, put(key, key));
    }
    let limited = store
        .range(&RangeRequest {
            limit: 2,
            ..get("a", "\0")
        })
        .unwrap();
    assert_eq!(
        (keys(&limited), limited.count, limited.more),
        (vec!["a".into(), "b".into()], 3, true)
    );
    let exact = store
        .range(&RangeRequest {
            limit: 3,
            ..get("a", "\0")
        })
        .unwrap();
    assert_eq!((exact.kvs.len(), exact.count, exact.more), (3, 3, false));
    for limit in [0, -1, i64::MAX, i64::MIN] {
        let all = store
            .range(&RangeRequest {
                limit,
                ..get("a", "\0")
            })
            .unwrap();
        assert_eq!((all.kvs.len(), all.more), (3, false), "limit {limit}");
    }
    let counted = store
        .range(&RangeRequest {
            count_only: true,
            limit: 1,
            ..get("a", "\0")
        })
        .unwrap();
    assert_eq!(
        (counted.kvs.len(), counted.count, counted.more),
        (0, 3, false)
    );
    let keys_only = store
        .range(&RangeRequest {
            keys_only: true,
            ..get("b", "")
        })
        .unwrap();
    assert_eq!(keys_only.kvs, vec![kv("b", "", 3, 3, 1, 0)]);
}

#[test]
fn range_sorts_then_limits() {
    let mut store = store();
    apply_put(&mut store, put("c", "1")); // 2
    apply_put(&mut store, put("a", "3")); // 3
    apply_put(&mut store, put("b", "2")); // 4
    apply_put(&mut store, put("c", "4")); // 5: c version 2, create 2, mod 5
    let sorted = |order: SortOrder, target: SortTarget, limit: i64| {
        keys(
            &store
                .range(&RangeRequest {
                    sort_order: order as i32,
                    sort_target: target as i32,
                    limit,
                    ..get("a", "\0")
                })
                .unwrap(),
        )
    };
    assert_eq!(sorted(SortOrder::None, SortTarget::Key, 0), ["a", "b", "c"]);
    assert_eq!(
        sorted(SortOrder::Descend, SortTarget::Key, 0),
        ["c", "b", "a"]
    );
    // A target other than KEY with order NONE sorts ascending, as etcd does.
    assert_eq!(
        sorted(SortOrder::None, SortTarget::Create, 0),
        ["c", "a", "b"]
    );
    assert_eq!(
        sorted(SortOrder::Descend, SortTarget::Mod, 0),
        ["c", "b", "a"]
    );
    assert_eq!(
        sorted(SortOrder::Ascend, SortTarget::Value, 0),
        ["b", "a", "c"]
    );
    // Equal versions stay in key order.
    assert_eq!(
        sorted(SortOrder::Descend, SortTarget::Version, 0),
        ["c", "a", "b"]
    );
    assert_eq!(sorted(SortOrder::Descend, SortTarget::Create, 1), ["b"]);
    assert_eq!(sorted(SortOrder::Ascend, SortTarget::Create, 2), ["c", "a"]);
}

#[test]
fn range_filters_apply_before_sort_and_limit_and_not_to_count() {
    let mut store = store();
    for key in ["a", "b", "c", "d"] {
        apply_put(&mut store, put(key, "")); // a:2 b:3 c:4 d:5
    }
    apply_put(&mut store, put("a", "")); // a: create 2, mod 6
    let filtered = |request: RangeRequest| store.range(&request).unwrap();
    let created = filtered(RangeRequest {
        min_create_revision: 3,
        max_create_revision: 4,
        ..get("a", "\0")
    });
    assert_eq!(
        (keys(&created), created.count),
        (vec!["b".into(), "c".into()], 4)
    );
    let modified = filtered(RangeRequest {
        min_mod_revision: 5,
        ..get("a", "\0")
    });
    assert_eq!(keys(&modified), ["a", "d"]);
    let last_before = filtered(RangeRequest {
        max_create_revision: 4,
        sort_order: SortOrder::Descend as i32,
        sort_target: SortTarget::Create as i32,
        limit: 1,
        ..get("a", "\0")
    });
    assert_eq!(
        (keys(&last_before), last_before.more),
        (vec!["c".into()], true)
    );
}

#[test]
fn range_at_past_revisions() {
    let mut store = store();
    apply_put(&mut store, put("a", "1")); // 2
    apply_put(&mut store, put("b", "1")); // 3
    apply_put(&mut store, put("a", "2")); // 4
    ok(store.apply(&Command::DeleteRange(delete("b", "")))); // 5
    let at = |store: &Store, revision: i64| {
        store.range(&RangeRequest {
            revision,
            ..get("\0", "\0")
        })
    };
    assert_eq!(at(&store, 1).unwrap().kvs, vec![]);
    assert_eq!(at(&store, 2).unwrap().kvs, vec![kv("a", "1", 2, 2, 1, 0)]);
    assert_eq!(
        at(&store, 3).unwrap().kvs,
        vec![kv("a", "1", 2, 2, 1, 0), kv("b", "1", 3, 3, 1, 0)]
    );
    assert_eq!(
        at(&store, 4).unwrap().kvs,
        vec![kv("a", "2", 2, 4, 2, 0), kv("b", "1", 3, 3, 1, 0)]
    );
    assert_eq!(at(&store, 5).unwrap().kvs, vec![kv("a", "2", 2, 4, 2, 0)]);
    assert_eq!(at(&store, 0), at(&store, 5));
    assert_eq!(at(&store, -7), at(&store, 5));
    assert_eq!(at(&store, 6), Err(StoreError::FutureRevision));

    ok(store.apply(&Command::Compact { revision: 3 }));
    assert_eq!(
        at(&store, 2),
        Err(StoreError::Compacted {
            compact_revision: 3
        })
    );
    // The compact revision itself is still readable, as in etcd.
    assert_eq!(at(&store, 3).unwrap().kvs.len(), 2);
    assert_eq!(at(&store, 4).unwrap().kvs.len(), 2);
}

#[test]
fn puts_with_ignore_value_and_ignore_lease() {
    let mut store = store();
    grant(&mut store, 7);
    apply_put(&mut store, put_leased("a", "v", 7)); // 2
    let keep_value = PutRequest {
        ignore_value: true,
        lease: 0,
        ..put("a", "")
    };
    apply_put(&mut store, keep_value.clone()); // 3: lease dropped
    assert_eq!(
        store.range(&get("a", "")).unwrap().kvs,
        vec![kv("a", "v", 2, 3, 2, 0)]
    );
    apply_put(&mut store, put_leased("a", "w", 7)); // 4
    let keep_lease = PutRequest {
        ignore_lease: true,
        ..put("a", "x")
    };
    apply_put(&mut store, keep_lease.clone()); // 5
    assert_eq!(
        store.range(&get("a", "")).unwrap().kvs,
        vec![kv("a", "x", 2, 5, 4, 7)]
    );
    assert_eq!(store.lease(7).unwrap().keys, vec![b"a".to_vec()]);

    let missing = |request: PutRequest| {
        Command::Put(PutRequest {
            key: "b".into(),
            ..request
        })
    };
    assert_rejected(&mut store, missing(keep_value), StoreError::KeyNotFound);
    assert_rejected(&mut store, missing(keep_lease), StoreError::KeyNotFound);
    let with_value = PutRequest {
        ignore_value: true,
        ..put("a", "y")
    };
    assert_rejected(
        &mut store,
        Command::Put(with_value),
        StoreError::ValueProvided,
    );
    let with_lease = PutRequest {
        ignore_lease: true,
        ..put_leased("a", "y", 7)
    };
    assert_rejected(
        &mut store,
        Command::Put(with_lease),
        StoreError::LeaseProvided,
    );
}

#[test]
fn empty_keys_and_bad_sort_options_are_refused() {
    let mut store = store();
    assert_rejected(
        &mut store,
        Command::Put(put("", "v")),
        StoreError::KeyNotProvided,
    );
    assert_rejected(
        &mut store,
        Command::DeleteRange(delete("", "\0")),
        StoreError::KeyNotProvided,
    );
    assert_eq!(store.range(&get("", "\0")), Err(StoreError::KeyNotProvided));
    for (sort_order, sort_target) in [(3, 0), (0, 5), (-1, 0), (i32::MAX, i32::MIN)] {
        let request = RangeRequest {
            sort_order,
            sort_target,
            ..get("a", "")
        };
        assert_eq!(store.range(&request), Err(StoreError::InvalidSortOption));
    }
}

#[test]
fn leases_hold_keys() {
    let mut store = store();
    let applied = store.apply(&Command::LeaseGrant {
        id: 5,
        ttl_seconds: 30,
    });
    assert_eq!(applied.revision, 1);
    assert_eq!(
        applied.result,
        Ok(CommandResponse::LeaseGrant(LeaseGrantResponse {
            header: None,
            id: 5,
            ttl: 30,
            error: String::new(),
        }))
    );
    grant(&mut store, 3);
    assert_eq!(store.leases(), vec![(3, 10), (5, 30)]);

    apply_put(&mut store, put_leased("a", "", 5));
    apply_put(&mut store, put_leased("b", "", 5));
    apply_put(&mut store, put_leased("b", "", 3)); // moves b to lease 3
    apply_put(&mut store, put_leased("c", "", 3));
    apply_put(&mut store, put("c", "")); // detaches c
    assert_eq!(store.lease(5).unwrap().keys, vec![b"a".to_vec()]);
    assert_eq!(
        store.lease(3),
        Some(LeaseView {
            ttl_seconds: 10,
            keys: vec![b"b".to_vec()]
        })
    );
    ok(store.apply(&Command::DeleteRange(delete("a", ""))));
    assert_eq!(store.lease(5).unwrap().keys, Vec::<Vec<u8>>::new());
    assert_eq!(store.lease(4), None);

    assert_rejected(
        &mut store,
        Command::Put(put_leased("d", "", 4)),
        StoreError::LeaseNotFound,
    );
}

#[test]
fn lease_grant_rules() {
    let mut store = store();
    grant(&mut store, 1);
    let grant_of = |id: i64, ttl_seconds: i64| Command::LeaseGrant { id, ttl_seconds };
    assert_rejected(&mut store, grant_of(1, 10), StoreError::LeaseExists);
    assert_rejected(&mut store, grant_of(0, 10), StoreError::LeaseNotFound);
    assert_rejected(
        &mut store,
        grant_of(2, 9_000_000_001),
        StoreError::LeaseTtlTooLarge,
    );
    // The TTL check comes before the id checks, as in etcd.
    assert_rejected(
        &mut store,
        grant_of(0, i64::MAX),
        StoreError::LeaseTtlTooLarge,
    );
    assert_rejected(
        &mut store,
        grant_of(1, i64::MAX),
        StoreError::LeaseTtlTooLarge,
    );
    for (id, ttl) in [(2, 0), (3, -5), (4, i64::MIN)] {
        match ok(store.apply(&grant_of(id, ttl))) {
            CommandResponse::LeaseGrant(response) => assert_eq!(response.ttl, 1),
            other => panic!("{other:?}"),
        }
    }
    ok(store.apply(&grant_of(-9, 9_000_000_000)));
    assert_eq!(store.leases()[0], (-9, 9_000_000_000));
    assert_eq!(store.revision(), 1);
}

#[test]
fn a_revoke_deletes_the_keys_at_one_revision() {
    let mut store = store();
    grant(&mut store, 1);
    grant(&mut store, 2);
    apply_put(&mut store, put_leased("c", "3", 1)); // 2
    apply_put(&mut store, put_leased("a", "1", 1)); // 3
    apply_put(&mut store, put_leased("b", "2", 2)); // 4
    let applied = store.apply(&Command::LeaseRevoke { id: 1 });
    assert_eq!(
        applied.result,
        Ok(CommandResponse::LeaseRevoke(LeaseRevokeResponse::default()))
    );
    assert_eq!(applied.revision, 5);
    assert_eq!(
        applied.events,
        vec![
            delete_event("a", 5, kv("a", "1", 3, 3, 1, 1)),
            delete_event("c", 5, kv("c", "3", 2, 2, 1, 1)),
        ]
    );
    assert_eq!(keys(&store.range(&get("\0", "\0")).unwrap()), ["b"]);
    assert_eq!(store.leases(), vec![(2, 10)]);
    assert_rejected(
        &mut store,
        Command::LeaseRevoke { id: 1 },
        StoreError::LeaseNotFound,
    );

    ok(store.apply(&Command::DeleteRange(delete("b", ""))));
    let applied = store.apply(&Command::LeaseRevoke { id: 2 });
    assert_eq!((applied.revision, applied.events.len()), (6, 0));
    assert!(store.leases().is_empty());
}

#[test]
fn txn_compares() {
    let mut store = store();
    grant(&mut store, 9);
    apply_put(&mut store, put("a", "x")); // 2
    apply_put(&mut store, put_leased("a", "y", 9)); // 3: create 2, mod 3, version 2
    apply_put(&mut store, put("b", "z")); // 4
    use CompareResult::*;
    use CompareTarget::*;
    let holds = |store: &mut Store, compares: Vec<Compare>| {
        apply_txn(
            store,
            TxnRequest {
                compare: compares,
                ..TxnRequest::default()
            },
        )
        .succeeded
    };
    let cases = [
        (compare("a", Version, Equal, TargetUnion::Version(2)), true),
        (
            compare("a", Version, Greater, TargetUnion::Version(1)),
            true,
        ),
        (
            compare("a", Create, Equal, TargetUnion::CreateRevision(2)),
            true,
        ),
        (compare("a", Mod, Less, TargetUnion::ModRevision(4)), true),
        (
            compare("a", Mod, NotEqual, TargetUnion::ModRevision(3)),
            false,
        ),
        (
            compare("a", Value, Equal, TargetUnion::Value("y".into())),
            true,
        ),
        (
            compare("a", Value, Greater, TargetUnion::Value("x".into())),
            true,
        ),
        (compare("a", Lease, Equal, TargetUnion::Lease(9)), true),
        // A union of another kind compares against 0, as in etcd.
        (
            compare("a", Version, Greater, TargetUnion::ModRevision(100)),
            true,
        ),
        // A missing key has version, create, mod and lease 0...
        (
            compare("m", Create, Equal, TargetUnion::CreateRevision(0)),
            true,
        ),
        (compare("m", Version, Less, TargetUnion::Version(1)), true),
        (compare("m", Lease, Equal, TargetUnion::Lease(0)), true),
        // ...and a value compare on it always fails.
        (
            compare("m", Value, Equal, TargetUnion::Value(Vec::new())),
            false,
        ),
        (
            compare("m", Value, NotEqual, TargetUnion::Value("q".into())),
            false,
        ),
    ];
    for (compare, expected) in cases {
        assert_eq!(
            holds(&mut store, vec![compare.clone()]),
            expected,
            "{compare:?}"
        );
    }
    // Over a range: holds if it holds for every key.
    let over = |result, version, range_end: &str| Compare {
        range_end: range_end.into(),
        ..compare("a", Version, result, TargetUnion::Version(version))
    };
    assert!(holds(&mut store, vec![over(Greater, 0, "c")]));
    assert!(!holds(&mut store, vec![over(Equal, 2, "c")]));
    assert!(holds(&mut store, vec![over(Equal, 2, "b")]));
    assert!(holds(&mut store, vec![over(Equal, 0, "a")])); // empty range: zero key-value
    assert!(!holds(
        &mut store,
        vec![over(Equal, 1, "\0"), over(Greater, 0, "\0")]
    ));
    // Read-only txns never bump the revision.
    assert_eq!(store.revision(), 4);
}

#[test]
fn txn_writes_share_one_revision_and_see_earlier_ops() {
    let mut store = store();
    apply_put(&mut store, put("a", "1")); // 2
    apply_put(&mut store, put("b", "1")); // 3
    let request = TxnRequest {
        compare: vec![compare(
            "a",
            CompareTarget::Value,
            CompareResult::Equal,
            TargetUnion::Value("1".into()),
        )],
        success: vec![
            op(Request::RequestPut(PutRequest {
                prev_kv: true,
                ..put("a", "2")
            })),
            op(Request::RequestRange(get("a", "\0"))),
            op(Request::RequestDeleteRange(delete("b", ""))),
            op(Request::RequestPut(put("c", "1"))),
            // An explicit revision reads the state before the txn.
            op(Request::RequestRange(RangeRequest {
                revision: 3,
                ..get("a", "\0")
            })),
            op(Request::RequestTxn(TxnRequest {
                success: vec![op(Request::RequestRange(get("c", "")))],
                ..TxnRequest::default()
            })),
        ],
        failure: vec![op(Request::RequestPut(put("a", "failed")))],
    };
    let applied = store.apply(&Command::Txn(request));
    assert_eq!(applied.revision, 4);
    assert_eq!(
        applied.events,
        vec![
            put_event(kv("a", "2", 2, 4, 2, 0), Some(kv("a", "1", 2, 2, 1, 0))),
            delete_event("b", 4, kv("b", "1", 3, 3, 1, 0)),
            put_event(kv("c", "1", 4, 4, 1, 0), None),
        ]
    );
    let Ok(CommandResponse::Txn(response)) = applied.result else {
        panic!("{:?}", applied.result);
    };
    assert!(response.succeeded);
    assert_eq!(response.header, None);
    let responses = &response.responses;
    assert_eq!(
        responses[0].response,
        Some(Response::ResponsePut(PutResponse {
            header: header(4),
            prev_kv: Some(kv("a", "1", 2, 2, 1, 0)),
        }))
    );
    let seen = range_of(&responses[1]);
    assert_eq!(
        seen.kvs,
        vec![kv("a", "2", 2, 4, 2, 0), kv("b", "1", 3, 3, 1, 0)]
    );
    assert_eq!(seen.header, header(4));
    assert_eq!(
        responses[2].response,
        Some(Response::ResponseDeleteRange(DeleteRangeResponse {
            header: header(4),
            deleted: 1,
            prev_kvs: vec![kv("b", "1", 3, 3, 1, 0)],
        }))
    );
    assert_eq!(
        keys(range_of(&responses[4])),
        ["a", "b"],
        "an explicit revision reads the past"
    );
    let Some(Response::ResponseTxn(nested)) = &responses[5].response else {
        panic!("{:?}", responses[5]);
    };
    assert_eq!(nested.header, Some(ResponseHeader::default()));
    assert_eq!(
        range_of(&nested.responses[0]).kvs,
        vec![kv("c", "1", 4, 4, 1, 0)]
    );
}

#[test]
fn a_failed_txn_runs_its_failure_branch() {
    let mut store = store();
    apply_put(&mut store, put("a", "1"));
    let request = TxnRequest {
        compare: vec![compare(
            "a",
            CompareTarget::Version,
            CompareResult::Equal,
            TargetUnion::Version(5),
        )],
        success: vec![op(Request::RequestPut(put("a", "2")))],
        failure: vec![op(Request::RequestRange(get("a", "")))],
    };
    let applied = store.apply(&Command::Txn(request));
    assert_eq!((applied.revision, applied.events.len()), (2, 0));
    let Ok(CommandResponse::Txn(response)) = applied.result else {
        panic!("{:?}", applied.result);
    };
    assert!(!response.succeeded);
    assert_eq!(range_of(&response.responses[0]).header, header(2));
    assert_eq!(
        range_of(&response.responses[0]).kvs,
        vec![kv("a", "1", 2, 2, 1, 0)]
    );
    // A write branch that changes nothing does not bump either.
    let deletes_nothing = TxnRequest {
        success: vec![op(Request::RequestDeleteRange(delete("zz", "")))],
        ..TxnRequest::default()
    };
    let applied = store.apply(&Command::Txn(deletes_nothing));
    assert_eq!((applied.revision, applied.events.len()), (2, 0));
}

fn txn_of(success: Vec<Request>) -> Command {
    Command::Txn(TxnRequest {
        success: success.into_iter().map(op).collect(),
        ..TxnRequest::default()
    })
}

#[test]
fn txn_rejections_change_nothing() {
    let mut store = Store::new(StoreConfig {
        max_txn_operations: 3,
        ..StoreConfig::default()
    });
    apply_put(&mut store, put("a", "1"));
    let p = |key: &str| Request::RequestPut(put(key, "v"));
    let d = |key: &str, end: &str| Request::RequestDeleteRange(delete(key, end));
    let nested = |success: Vec<Request>, failure: Vec<Request>| {
        Request::RequestTxn(TxnRequest {
            success: success.into_iter().map(op).collect(),
            failure: failure.into_iter().map(op).collect(),
            ..TxnRequest::default()
        })
    };
    use StoreError::*;
    let cases = [
        (txn_of(vec![p("b"), p("b")]), DuplicateKey),
        (txn_of(vec![p("b"), d("a", "c")]), DuplicateKey),
        (txn_of(vec![d("a", "\0"), p("b")]), DuplicateKey),
        (txn_of(vec![d("b", ""), p("b")]), DuplicateKey),
        (
            txn_of(vec![nested(vec![p("b")], vec![]), p("b")]),
            DuplicateKey,
        ),
        (
            txn_of(vec![d("b", "c"), nested(vec![], vec![p("b")])]),
            DuplicateKey,
        ),
        (
            txn_of(vec![
                nested(vec![p("b")], vec![]),
                nested(vec![], vec![p("b")]),
            ]),
            DuplicateKey,
        ),
        (
            txn_of(vec![p("b"), p("c"), p("d"), p("e")]),
            TooManyOperations,
        ),
        (
            txn_of(vec![p("b"), nested(vec![p("c"), p("d")], vec![])]),
            TooManyOperations,
        ),
        (
            txn_of(vec![p("b"), Request::RequestPut(put("", "v"))]),
            KeyNotProvided,
        ),
        (
            txn_of(vec![p("b"), Request::RequestPut(put_leased("c", "", 4))]),
            LeaseNotFound,
        ),
        (
            txn_of(vec![
                p("b"),
                Request::RequestPut(PutRequest {
                    ignore_value: true,
                    ..put("c", "")
                }),
            ]),
            KeyNotFound,
        ),
        (
            txn_of(vec![
                p("b"),
                Request::RequestRange(RangeRequest {
                    revision: 3,
                    ..get("a", "")
                }),
            ]),
            FutureRevision,
        ),
        (
            txn_of(vec![
                p("b"),
                Request::RequestRange(RangeRequest {
                    sort_order: 9,
                    ..get("a", "")
                }),
            ]),
            InvalidSortOption,
        ),
        (
            Command::Txn(TxnRequest {
                success: vec![op(p("b")), RequestOp { request: None }],
                ..TxnRequest::default()
            }),
            KeyNotFound,
        ),
    ];
    for (command, error) in cases {
        assert_rejected(&mut store, command, error);
    }
    // Only one branch of a nested txn runs, so both may put the same key.
    ok(store.apply(&txn_of(vec![nested(vec![p("b")], vec![p("b")])])));
    // A lease missing only in the branch not taken does not matter.
    ok(store.apply(&Command::Txn(TxnRequest {
        success: vec![op(p("c"))],
        failure: vec![op(Request::RequestPut(put_leased("c", "", 4)))],
        ..TxnRequest::default()
    })));
    assert_eq!(store.revision(), 4);
}

#[test]
fn txn_compare_checks() {
    let mut store = store();
    let with_compare = |compare: Compare| {
        Command::Txn(TxnRequest {
            compare: vec![compare],
            ..TxnRequest::default()
        })
    };
    let good = compare(
        "a",
        CompareTarget::Version,
        CompareResult::Equal,
        TargetUnion::Version(0),
    );
    assert_rejected(
        &mut store,
        with_compare(Compare {
            key: Vec::new(),
            ..good.clone()
        }),
        StoreError::KeyNotProvided,
    );
    assert_rejected(
        &mut store,
        with_compare(Compare {
            result: 4,
            ..good.clone()
        }),
        StoreError::InvalidCompare,
    );
    assert_rejected(
        &mut store,
        with_compare(Compare {
            target: -1,
            ..good.clone()
        }),
        StoreError::InvalidCompare,
    );
    let too_many = TxnRequest {
        compare: vec![good; 129],
        ..TxnRequest::default()
    };
    assert_rejected(
        &mut store,
        Command::Txn(too_many),
        StoreError::TooManyOperations,
    );
}

#[test]
fn txns_nest_at_most_max_depth() {
    let mut store = store();
    let mut txn = TxnRequest::default();
    for _ in 1..MAX_TXN_DEPTH {
        txn = TxnRequest {
            success: vec![op(Request::RequestTxn(txn))],
            ..TxnRequest::default()
        };
    }
    ok(store.apply(&Command::Txn(txn.clone())));
    let deeper = TxnRequest {
        success: vec![op(Request::RequestTxn(txn))],
        ..TxnRequest::default()
    };
    assert_rejected(&mut store, Command::Txn(deeper), StoreError::TxnTooDeep);
}

/// The requests Go's clientv3 concurrency Mutex (etcd 3.4) sends, for two sessions.
#[test]
fn the_clientv3_mutex_sequence() {
    let mut store = store();
    let prefix = "/lock/";
    let prefix_end = "/lock0";
    let try_acquire = |store: &mut Store, my_key: &str, lease: i64| {
        let get_owner = Request::RequestRange(RangeRequest {
            sort_order: SortOrder::Ascend as i32,
            sort_target: SortTarget::Create as i32,
            limit: 1,
            ..get(prefix, prefix_end)
        });
        apply_txn(
            store,
            TxnRequest {
                compare: vec![compare(
                    my_key,
                    CompareTarget::Create,
                    CompareResult::Equal,
                    TargetUnion::CreateRevision(0),
                )],
                success: vec![
                    op(Request::RequestPut(put_leased(my_key, "", lease))),
                    op(get_owner.clone()),
                ],
                failure: vec![op(Request::RequestRange(get(my_key, ""))), op(get_owner)],
            },
        )
    };
    let wait_deletes_range = |store: &Store, max_create_revision: i64| {
        store
            .range(&RangeRequest {
                sort_order: SortOrder::Descend as i32,
                sort_target: SortTarget::Create as i32,
                limit: 1,
                max_create_revision,
                ..get(prefix, prefix_end)
            })
            .unwrap()
    };
    grant(&mut store, 0x1a);
    grant(&mut store, 0x2b);
    let (key1, key2) = ("/lock/1a", "/lock/2b");

    // Session 1 takes the free lock: its key is the oldest.
    let first = try_acquire(&mut store, key1, 0x1a);
    assert!(first.succeeded);
    let my_rev1 = store.revision();
    assert_eq!(my_rev1, 2);
    assert_eq!(
        range_of(&first.responses[1]).kvs[0].create_revision,
        my_rev1
    );

    // Session 2 queues behind it and waits for the deletion of the last older key.
    let second = try_acquire(&mut store, key2, 0x2b);
    assert!(second.succeeded);
    let my_rev2 = store.revision();
    assert_eq!(my_rev2, 3);
    assert_eq!(keys(range_of(&second.responses[1])), [key1]);
    let older = wait_deletes_range(&store, my_rev2 - 1);
    assert_eq!(keys(&older), [key1]);
    let watch_from = store.revision();

    // Session 2 retrying finds its own key through the failure branch.
    let again = try_acquire(&mut store, key2, 0x2b);
    assert!(!again.succeeded);
    assert_eq!(
        range_of(&again.responses[0]).kvs[0].create_revision,
        my_rev2
    );
    assert_eq!(store.revision(), 3);

    // Session 1's lease expires: its key is deleted, the watch sees it, session 2 holds.
    let revoked = store.apply(&Command::LeaseRevoke { id: 0x1a });
    assert_eq!(revoked.revision, 4);
    let events = store
        .events_since(key1.as_bytes(), b"", watch_from)
        .unwrap();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].r#type, EventType::Delete as i32);
    assert_eq!(events[0].kv, Some(tombstone(key1, 4)));
    assert!(wait_deletes_range(&store, my_rev2 - 1).kvs.is_empty());
    let owner = store
        .range(&RangeRequest {
            sort_order: SortOrder::Ascend as i32,
            sort_target: SortTarget::Create as i32,
            limit: 1,
            ..get(prefix, prefix_end)
        })
        .unwrap();
    assert_eq!(owner.kvs[0].create_revision, my_rev2);
}

#[test]
fn events_since_filters_and_refuses_compacted_starts() {
    let mut store = store();
    apply_put(&mut store, put("a", "1")); // 2
    apply_put(&mut store, put("b", "1")); // 3
    apply_put(&mut store, put("a", "2")); // 4
    ok(store.apply(&Command::DeleteRange(delete("a", "")))); // 5
    let on_a = store.events_since(b"a", b"", 3).unwrap();
    assert_eq!(
        on_a,
        vec![
            put_event(kv("a", "2", 2, 4, 2, 0), Some(kv("a", "1", 2, 2, 1, 0))),
            delete_event("a", 5, kv("a", "2", 2, 4, 2, 0)),
        ]
    );
    assert_eq!(store.events_since(b"\0", b"\0", 1).unwrap().len(), 4);
    assert_eq!(store.events_since(b"b", b"\0", 2).unwrap().len(), 1);
    assert!(store.events_since(b"a", b"", 6).unwrap().is_empty());
    assert!(store.events_since(b"a", b"", 0).unwrap().is_empty());
    assert!(store.events_since(b"a", b"", -3).unwrap().is_empty());

    ok(store.apply(&Command::Compact { revision: 4 }));
    assert_eq!(
        store.events_since(b"a", b"", 3),
        Err(StoreError::Compacted {
            compact_revision: 4
        })
    );
    assert_eq!(store.events_since(b"a", b"", 4).unwrap().len(), 2);
}

#[test]
fn compaction_rules() {
    let mut store = store();
    for value in ["1", "2", "3"] {
        apply_put(&mut store, put("a", value)); // 2, 3, 4
    }
    assert_rejected(
        &mut store,
        Command::Compact { revision: 5 },
        StoreError::FutureRevision,
    );
    let applied = store.apply(&Command::Compact { revision: 3 });
    assert_eq!(
        applied.result,
        Ok(CommandResponse::Compact(CompactionResponse::default()))
    );
    assert_eq!((applied.revision, store.compact_revision()), (4, 3));
    for revision in [3, 2, 0, -1] {
        assert_rejected(
            &mut store,
            Command::Compact { revision },
            StoreError::Compacted {
                compact_revision: 3,
            },
        );
    }
    ok(store.apply(&Command::Compact { revision: 4 }));
    assert_eq!(store.compact_revision(), 4);
}

#[test]
fn history_is_compacted_automatically() {
    let mut store = Store::new(StoreConfig {
        history_revisions: 10,
        ..StoreConfig::default()
    });
    for i in 0..19 {
        apply_put(&mut store, put("a", &i.to_string())); // revisions 2..=20
    }
    assert_eq!(store.compact_revision(), 0);
    apply_put(&mut store, put("b", "")); // 21: 21 - 0 > 2 * 10
    assert_eq!(store.compact_revision(), 11);
    assert_eq!(store.history.len(), 11);
    assert!(store.events_since(b"a", b"", 11).is_ok());
    assert!(store.events_since(b"a", b"", 10).is_err());
    let at_11 = store
        .range(&RangeRequest {
            revision: 11,
            ..get("a", "")
        })
        .unwrap();
    assert_eq!(at_11.kvs, vec![kv("a", "9", 2, 11, 10, 0)]);
}

#[test]
fn the_store_round_trips_through_bincode() {
    let mut store = store();
    grant(&mut store, 1);
    apply_put(&mut store, put_leased("a", "1", 1));
    apply_put(&mut store, put("b", "2"));
    ok(store.apply(&Command::DeleteRange(delete("b", ""))));
    let bytes = bincode::serialize(&store).unwrap();
    let back: Store = bincode::deserialize(&bytes).unwrap();
    assert_eq!(back, store);
    let command = txn_of(vec![Request::RequestPut(put("c", ""))]);
    let bytes = bincode::serialize(&command).unwrap();
    assert_eq!(bincode::deserialize::<Command>(&bytes).unwrap(), command);
}

#[test]
fn precheck_matches_apply_for_stateless_faults() {
    let store = store();
    assert_eq!(
        store.precheck(&Command::Put(put("", ""))),
        Err(StoreError::KeyNotProvided)
    );
    assert_eq!(
        store.precheck(&txn_of(vec![
            Request::RequestPut(put("a", "")),
            Request::RequestPut(put("a", ""))
        ])),
        Err(StoreError::DuplicateKey)
    );
    assert_eq!(
        store.precheck(&Command::Put(put_leased("a", "", 3))),
        Ok(())
    );
}

/// 100,000 sessions, each a lease with one key, then every lease revoked: history stays
/// bounded and the snapshot round trips.
#[test]
fn a_hundred_thousand_leases_and_keys() {
    let mut store = store();
    let sessions = 100_000i64;
    for id in 1..=sessions {
        ok(store.apply(&Command::LeaseGrant {
            id,
            ttl_seconds: 60,
        }));
        apply_put(&mut store, put_leased(&format!("/s/{id:06}"), "v", id));
    }
    assert_eq!(store.key_count(), 100_000);
    assert!(store.history.len() <= 20_000);
    let bytes = bincode::serialize(&store).unwrap();
    assert_eq!(bincode::deserialize::<Store>(&bytes).unwrap(), store);
    let first = store
        .range(&RangeRequest {
            sort_order: SortOrder::Ascend as i32,
            sort_target: SortTarget::Create as i32,
            limit: 1,
            ..get("/s/", "/s0")
        })
        .unwrap();
    assert_eq!(
        (keys(&first), first.count),
        (vec!["/s/000001".to_string()], 100_000)
    );
    for id in 1..=sessions {
        ok(store.apply(&Command::LeaseRevoke { id }));
    }
    assert_eq!(store.key_count(), 0);
    assert!(store.leases().is_empty());
    assert!(store.history.len() <= 20_000);
}

#[test]
fn first_in_queue_checks_the_own_entry_and_everything_created_before_it() {
    let mut store = store();
    apply_put(&mut store, put("/other", "")); // revision 2, outside the scope
    apply_put(&mut store, put("/q/b", "")); // 3
    apply_put(&mut store, put("/q/a", "")); // 4: a name before b, created after it
    apply_put(&mut store, put("/q/c", "")); // 5
    let first = |store: &Store, own: &str, created: i64| {
        store.is_first(own.as_bytes(), created, store.oldest_in(b"/q/", b"/q0"))
    };
    assert!(
        first(&store, "/q/b", 3),
        "oldest in the scope; /other does not count"
    );
    assert!(!first(&store, "/q/a", 4), "b was created before it");
    assert!(!first(&store, "/q/b", 4), "another incarnation of b");
    assert!(!first(&store, "/q/missing", 1));
    assert!(!first(&store, "/q/b", 0));
    ok(store.apply(&Command::DeleteRange(delete("/q/b", ""))));
    assert!(first(&store, "/q/a", 4));
    assert!(!first(&store, "/q/c", 5), "a is still ahead");
    ok(store.apply(&Command::DeleteRange(delete("/q/a", "/q/b"))));
    assert!(first(&store, "/q/c", 5));
    ok(store.apply(&Command::DeleteRange(delete("/q/c", ""))));
    assert!(!first(&store, "/q/c", 5), "gone itself");
}

/// A fresh count of what `store` holds, as a store loaded from a snapshot makes it.
fn recounted(store: &Store) -> u64 {
    let bytes = bincode::serialize(store).unwrap();
    let mut back: Store = bincode::deserialize(&bytes).unwrap();
    back.bytes()
}

/// The byte counts kept in step with every kind of change equal a count from scratch: puts
/// (new keys, overwrites, leased), deletes, a txn, a lease's revocation (its keys go) and a
/// compaction.
#[test]
fn byte_counts_stay_in_step_with_the_state() {
    let mut store = store();
    assert_eq!(store.bytes(), 0);
    grant(&mut store, 7);
    let check = |store: &mut Store, what: &str| {
        assert_eq!(store.bytes(), recounted(store), "after {what}");
    };
    apply_put(&mut store, put("a", "1"));
    check(&mut store, "a new key");
    apply_put(&mut store, put("a", &"x".repeat(1000)));
    check(&mut store, "an overwrite");
    apply_put(&mut store, put_leased("l1", "leased", 7));
    apply_put(&mut store, put_leased("l2", "leased", 7));
    check(&mut store, "leased keys");
    ok(store.apply(&Command::DeleteRange(delete("a", ""))));
    check(&mut store, "a delete");
    ok(store.apply(&Command::Txn(TxnRequest {
        success: vec![
            RequestOp {
                request: Some(Request::RequestPut(put("t1", "v"))),
            },
            RequestOp {
                request: Some(Request::RequestDeleteRange(delete("l1", ""))),
            },
        ],
        ..TxnRequest::default()
    })));
    check(&mut store, "a txn");
    ok(store.apply(&Command::LeaseRevoke { id: 7 }));
    check(&mut store, "a revocation");
    let revision = store.revision();
    ok(store.apply(&Command::Compact { revision }));
    check(&mut store, "a compaction");
    assert!(store.bytes() > 0);
}

/// With a byte bound, history is compacted (oldest first, down to half the bound) however few
/// revisions it has: a big value written over and over cannot fill memory.
#[test]
fn history_is_compacted_to_its_byte_bound() {
    let mut store = store();
    store.set_history_bytes(100_000);
    let big = "v".repeat(10_000);
    for _ in 0..100 {
        apply_put(&mut store, put("a", &big));
        assert!(
            store.sizes().history <= 100_000,
            "history holds {} bytes",
            store.sizes().history
        );
    }
    assert!(
        store.compact_revision() > 80,
        "{}",
        store.compact_revision()
    );
    // The live value and the latest revisions are still there.
    let now = store.range(&get("a", "")).unwrap();
    assert_eq!(now.kvs[0].value.len(), 10_000);
    assert!(store.events_since(b"a", b"", store.revision()).is_ok());
    assert!(store.events_since(b"a", b"", 2).is_err());
    // Without a bound only the revision count compacts.
    let mut unbounded = self::store();
    for _ in 0..100 {
        apply_put(&mut unbounded, put("a", &big));
    }
    assert_eq!(unbounded.compact_revision(), 0);
}

/// At the quota, a write that adds data is refused before it is proposed; deletions, reads
/// in a txn, revocations and compactions pass, and once space is freed writes pass again.
#[test]
fn the_quota_refuses_writes_that_add_data() {
    let mut store = store();
    apply_put(&mut store, put("a", &"v".repeat(5_000)));
    let quota = store.sizes().live;
    let add = Command::Put(put("b", "1"));
    assert_eq!(store.check_quota(&add, quota), Err(StoreError::NoSpace));
    assert_eq!(store.check_quota(&add, quota + 1), Ok(()));
    let writing_txn = Command::Txn(TxnRequest {
        success: vec![RequestOp {
            request: Some(Request::RequestPut(put("b", "1"))),
        }],
        ..TxnRequest::default()
    });
    assert_eq!(
        store.check_quota(&writing_txn, quota),
        Err(StoreError::NoSpace)
    );
    let reading_txn = Command::Txn(TxnRequest {
        success: vec![RequestOp {
            request: Some(Request::RequestRange(get("a", ""))),
        }],
        ..TxnRequest::default()
    });
    // A txn that only deletes (baton's resign: delete if the create revision is ours), also
    // nested, frees room: it passes.
    let deleting_txn = Command::Txn(TxnRequest {
        success: vec![RequestOp {
            request: Some(Request::RequestTxn(TxnRequest {
                success: vec![RequestOp {
                    request: Some(Request::RequestDeleteRange(delete("a", ""))),
                }],
                ..TxnRequest::default()
            })),
        }],
        ..TxnRequest::default()
    });
    for passes in [
        reading_txn,
        deleting_txn,
        Command::DeleteRange(delete("a", "")),
        Command::LeaseRevoke { id: 1 },
        Command::Compact { revision: 2 },
    ] {
        assert_eq!(store.check_quota(&passes, quota), Ok(()), "{passes:?}");
    }
    // The deletion frees the room at once (its history is bounded apart).
    ok(store.apply(&Command::DeleteRange(delete("a", ""))));
    assert_eq!(store.check_quota(&add, quota), Ok(()));
}
