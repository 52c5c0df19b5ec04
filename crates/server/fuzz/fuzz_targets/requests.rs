//! Arbitrary bytes as etcd v3 requests (protobuf-decoded as a network peer would send them),
//! applied to a store that already has keys, leases and history. Checks, besides "no panic":
//! a rejected command changes nothing, a precheck rejection is also what applying says, and the
//! revision moves forward by at most one per command.
#![no_main]

use baton_server::proto::etcdserverpb::{
    DeleteRangeRequest, PutRequest, RangeRequest, TxnRequest, WatchCreateRequest,
};
use baton_server::store::{Command, Store, StoreConfig};
use libfuzzer_sys::fuzz_target;
use prost::Message;

/// A store with history: keys under two prefixes, two leases with keys, a compaction.
fn seeded() -> Store {
    let mut store = Store::new(StoreConfig {
        history_revisions: 16,
        ..StoreConfig::default()
    });
    let put = |key: &str, lease: i64| {
        Command::Put(PutRequest {
            key: key.as_bytes().to_vec(),
            value: b"value".to_vec(),
            lease,
            ..PutRequest::default()
        })
    };
    let mut commands = vec![
        Command::LeaseGrant { id: 1, ttl_seconds: 10 },
        Command::LeaseGrant { id: 2, ttl_seconds: 60 },
    ];
    for i in 0..12 {
        commands.push(put(&format!("/a/{i}"), 0));
        commands.push(put(&format!("/b/{}", i % 3), 1 + i % 2));
    }
    commands.push(Command::DeleteRange(DeleteRangeRequest {
        key: b"/a/1".to_vec(),
        range_end: b"/a/3".to_vec(),
        ..DeleteRangeRequest::default()
    }));
    commands.push(Command::Compact { revision: 6 });
    for command in &commands {
        store.apply(command);
    }
    store
}

fn apply_checked(store: &mut Store, command: Command) {
    let before = store.clone();
    let prechecked = store.precheck(&command);
    let applied = store.apply(&command);
    match &applied.result {
        Err(error) => {
            assert!(*store == before, "a rejected command changed the store: {error}");
        }
        Ok(_) => {
            assert!(prechecked.is_ok(), "precheck refused what apply accepted");
            let moved = store.revision() - before.revision();
            assert!((0..=1).contains(&moved), "revision moved by {moved}");
            assert_eq!(applied.revision, store.revision());
        }
    }
    if let Err(refused) = prechecked {
        assert_eq!(applied.result.as_ref().err(), Some(&refused));
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, bytes)) = data.split_first() else {
        return;
    };
    let mut store = seeded();
    match kind % 6 {
        0 => {
            if let Ok(request) = TxnRequest::decode(bytes) {
                apply_checked(&mut store, Command::Txn(request));
            }
        }
        1 => {
            if let Ok(request) = PutRequest::decode(bytes) {
                apply_checked(&mut store, Command::Put(request));
            }
        }
        2 => {
            if let Ok(request) = DeleteRangeRequest::decode(bytes) {
                apply_checked(&mut store, Command::DeleteRange(request));
            }
        }
        3 => {
            if let Ok(request) = RangeRequest::decode(bytes) {
                let _ = store.range(&request);
            }
        }
        4 => {
            if let Ok(request) = WatchCreateRequest::decode(bytes) {
                let _ = store.events_since(&request.key, &request.range_end, request.start_revision);
            }
        }
        _ => {
            // Several commands in a row, each a length-prefixed Txn.
            let mut rest = bytes;
            while let Some((&length, tail)) = rest.split_first() {
                let length = usize::from(length).min(tail.len());
                if let Ok(request) = TxnRequest::decode(&tail[..length]) {
                    apply_checked(&mut store, Command::Txn(request));
                }
                rest = &tail[length..];
            }
        }
    }
});
