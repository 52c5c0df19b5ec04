//! Reads: ranges at the current or a past revision, and the events a watch replays.

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::ops::Bound;

use crate::proto::etcdserverpb::{
    range_request::{SortOrder, SortTarget},
    RangeRequest, RangeResponse,
};
use crate::proto::mvccpb::{Event, KeyValue};

use super::{check, event_revision, Store, StoreError};

/// Whether `candidate` lies in [key, range_end) with etcd's rules: an empty range_end means
/// the single key `key`, range_end "\0" means every key >= `key` (so key "\0" with range_end
/// "\0" is every key), and a range_end at or below `key` matches nothing.
pub fn in_range(key: &[u8], range_end: &[u8], candidate: &[u8]) -> bool {
    match range_end {
        [] => candidate == key,
        [0] => candidate >= key,
        end => candidate >= key && candidate < end,
    }
}

/// A key range as `BTreeMap::range` takes it.
type KeyBounds<'a> = (Bound<&'a [u8]>, Bound<&'a [u8]>);

/// The bounds of [key, range_end) for a `BTreeMap` lookup, or `None` when nothing matches
/// (`BTreeMap::range` panics on a start above the end).
fn key_bounds<'a>(key: &'a [u8], range_end: &'a [u8]) -> Option<KeyBounds<'a>> {
    match range_end {
        [] => Some((Bound::Included(key), Bound::Included(key))),
        [0] => Some((Bound::Included(key), Bound::Unbounded)),
        end if end <= key => None,
        end => Some((Bound::Included(key), Bound::Excluded(end))),
    }
}

/// Where a read looks: the live keys (which, inside a txn, include its own writes so far) or
/// the state as it was at a revision.
#[derive(Clone, Copy, Debug)]
pub(super) enum ReadAt {
    Latest,
    Revision(i64),
}

impl Store {
    /// etcd's Range. `revision` 0 or negative reads the current state; a revision above the
    /// current one is a future revision; one below the compact revision has been compacted
    /// (the compact revision itself can still be read, as in etcd).
    pub fn range(&self, request: &RangeRequest) -> Result<RangeResponse, StoreError> {
        check::range(request)?;
        let at = self.read_revision(request.revision, self.revision)?;
        Ok(self.range_at(request, at))
    }

    /// Whether, in the current state, `own_key` exists with `own_create_revision` and nothing
    /// live in its queue was created before it, given `oldest`, the queue's
    /// [`Store::oldest_in`] (one scan of a scope serves every queue check on it): the client's
    /// entry is first (baton's `QueueCheck` watch extension). Once true it stays true until the
    /// entry itself goes, since every later key is created at a later revision.
    pub fn is_first(&self, own_key: &[u8], own_create_revision: i64, oldest: Option<i64>) -> bool {
        own_create_revision > 0
            && self
                .kvs
                .get(own_key)
                .is_some_and(|kv| kv.create_revision == own_create_revision)
            && oldest.is_none_or(|oldest| oldest >= own_create_revision)
    }

    /// The lowest create revision among the live keys of [key, range_end), if any.
    pub fn oldest_in(&self, key: &[u8], range_end: &[u8]) -> Option<i64> {
        self.live(key, range_end).map(|kv| kv.create_revision).min()
    }

    /// Resolves a requested revision against the revision `current` (inside a txn, the one
    /// before it). etcd's `rangeKeys` rules.
    pub(super) fn read_revision(&self, requested: i64, current: i64) -> Result<ReadAt, StoreError> {
        if requested > current {
            return Err(StoreError::FutureRevision);
        }
        if requested <= 0 {
            return Ok(ReadAt::Latest);
        }
        if requested < self.compact_revision {
            return Err(StoreError::Compacted {
                compact_revision: self.compact_revision,
            });
        }
        Ok(ReadAt::Revision(requested))
    }

    /// A checked range at a resolved revision, as etcd's `applierV3backend.Range`: `count` is
    /// every key in the range, before the min/max filters and the limit; filters, then sort,
    /// then limit.
    pub(super) fn range_at(&self, request: &RangeRequest, at: ReadAt) -> RangeResponse {
        let all = self.view(&request.key, &request.range_end, at);
        let count = i64::try_from(all.len()).unwrap_or(i64::MAX);
        if request.count_only {
            return RangeResponse {
                header: None,
                kvs: Vec::new(),
                more: false,
                count,
            };
        }
        let mut kvs: Vec<&KeyValue> = all
            .into_iter()
            .filter(|kv| passes_filters(request, kv))
            .collect();
        sort(&mut kvs, request);
        let limit = match usize::try_from(request.limit) {
            Ok(limit) if limit > 0 => limit,
            _ => usize::MAX,
        };
        let more = kvs.len() > limit;
        kvs.truncate(limit);
        let kvs = kvs
            .into_iter()
            .map(|kv| output(kv, request.keys_only))
            .collect();
        RangeResponse {
            header: None,
            kvs,
            more,
            count,
        }
    }

    /// The live keys in [key, range_end), in key order.
    pub(super) fn live<'a>(
        &'a self,
        key: &'a [u8],
        range_end: &'a [u8],
    ) -> impl Iterator<Item = &'a KeyValue> + 'a {
        key_bounds(key, range_end)
            .into_iter()
            .flat_map(move |bounds| self.kvs.range::<[u8], _>(bounds).map(|(_, kv)| kv))
    }

    /// The keys in [key, range_end) as they were at `at`, in key order.
    fn view<'a>(&'a self, key: &'a [u8], range_end: &'a [u8], at: ReadAt) -> Vec<&'a KeyValue> {
        let ReadAt::Revision(revision) = at else {
            return self.live(key, range_end).collect();
        };
        let undone = self.undo(key, range_end, revision);
        if undone.is_empty() {
            return self.live(key, range_end).collect();
        }
        let mut state: BTreeMap<&[u8], &KeyValue> = self
            .live(key, range_end)
            .map(|kv| (kv.key.as_slice(), kv))
            .collect();
        for (changed, before) in undone {
            match before {
                Some(kv) => state.insert(changed, kv),
                None => state.remove(changed),
            };
        }
        state.into_values().collect()
    }

    /// For each key in the range changed after `revision`: its state at `revision` (`None` if
    /// it did not exist), which is the `prev_kv` of its first later event.
    fn undo<'a>(
        &'a self,
        key: &[u8],
        range_end: &[u8],
        revision: i64,
    ) -> BTreeMap<&'a [u8], Option<&'a KeyValue>> {
        let first = self
            .history
            .partition_point(|event| event_revision(event) <= revision);
        let mut undone = BTreeMap::new();
        for event in self.history.range(first..) {
            let Some(kv) = &event.kv else { continue };
            if in_range(key, range_end, &kv.key) {
                undone
                    .entry(kv.key.as_slice())
                    .or_insert(event.prev_kv.as_ref());
            }
        }
        undone
    }

    /// Events with revision >= `start_revision` on [key, range_end), oldest first, `prev_kv`
    /// filled whenever the key existed before the event. `start_revision` 0 or negative is
    /// etcd's "from now on": no past events. Refused with `Compacted` when `start_revision` is
    /// below the compact revision (the compact revision itself is still served, as in etcd).
    pub fn events_since(
        &self,
        key: &[u8],
        range_end: &[u8],
        start_revision: i64,
    ) -> Result<Vec<Event>, StoreError> {
        if start_revision <= 0 {
            return Ok(Vec::new());
        }
        if start_revision < self.compact_revision {
            return Err(StoreError::Compacted {
                compact_revision: self.compact_revision,
            });
        }
        let first = self
            .history
            .partition_point(|event| event_revision(event) < start_revision);
        let matching = self.history.range(first..).filter(|event| {
            event
                .kv
                .as_ref()
                .is_some_and(|kv| in_range(key, range_end, &kv.key))
        });
        Ok(matching.cloned().collect())
    }
}

/// etcd's min/max mod and create revision filters; 0 leaves a bound unset.
fn passes_filters(request: &RangeRequest, kv: &KeyValue) -> bool {
    let within =
        |value: i64, min: i64, max: i64| (min == 0 || value >= min) && (max == 0 || value <= max);
    within(
        kv.mod_revision,
        request.min_mod_revision,
        request.max_mod_revision,
    ) && within(
        kv.create_revision,
        request.min_create_revision,
        request.max_create_revision,
    )
}

/// etcd's sort: a target other than KEY with order NONE sorts ascending (the keys already come
/// in key order). Stable, so equal values stay in key order either way, as Go's insertion sort
/// leaves the short lists elections read.
fn sort(kvs: &mut [&KeyValue], request: &RangeRequest) {
    // Checked before: unknown numbers never get here; fall back to no sort all the same.
    let target = SortTarget::try_from(request.sort_target).unwrap_or(SortTarget::Key);
    let order = match SortOrder::try_from(request.sort_order).unwrap_or(SortOrder::None) {
        SortOrder::None if target != SortTarget::Key => SortOrder::Ascend,
        order => order,
    };
    let compare = |a: &&KeyValue, b: &&KeyValue| -> Ordering {
        match target {
            SortTarget::Key => a.key.cmp(&b.key),
            SortTarget::Version => a.version.cmp(&b.version),
            SortTarget::Create => a.create_revision.cmp(&b.create_revision),
            SortTarget::Mod => a.mod_revision.cmp(&b.mod_revision),
            SortTarget::Value => a.value.cmp(&b.value),
        }
    };
    match order {
        SortOrder::None => {}
        SortOrder::Ascend => kvs.sort_by(compare),
        SortOrder::Descend => kvs.sort_by(|a, b| compare(b, a)),
    }
}

fn output(kv: &KeyValue, keys_only: bool) -> KeyValue {
    if keys_only {
        KeyValue {
            value: Vec::new(),
            key: kv.key.clone(),
            ..*kv
        }
    } else {
        kv.clone()
    }
}
