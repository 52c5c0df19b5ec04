//! etcd's `checkIntervals`: within one txn branch no key is put twice, and no key is put that
//! the branch also deletes (nested txns included; a nested txn's two branches may put the same
//! key, since only one runs).
//!
//! One deviation: a delete with range_end "\0" (every key from `key` on) counts as the range
//! it deletes. etcd 3.4 compares "\0" as a plain string there, so it never conflicts.

use std::cmp::max;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Bound;

use crate::proto::etcdserverpb::{request_op::Request, RequestOp};

use super::StoreError;

/// The exclusive end of a key interval.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum End {
    /// Keys below this one.
    Before(Vec<u8>),
    /// Every key.
    Unbounded,
}

impl End {
    /// Whether the interval ending here reaches `key` (touching counts, so adjacent spans merge).
    fn reaches(&self, key: &[u8]) -> bool {
        match self {
            End::Before(end) => end.as_slice() >= key,
            End::Unbounded => true,
        }
    }

    /// Whether `key` lies below this end.
    fn above(&self, key: &[u8]) -> bool {
        match self {
            End::Before(end) => key < end.as_slice(),
            End::Unbounded => true,
        }
    }
}

/// A union of key intervals as disjoint spans (start → end), so that a lookup is a logarithmic
/// search however many deletes a request holds.
#[derive(Default)]
struct IntervalSet {
    spans: BTreeMap<Vec<u8>, End>,
}

impl IntervalSet {
    /// Adds the keys a delete of [key, range_end) removes, with etcd's range_end rules.
    fn insert_delete(&mut self, key: &[u8], range_end: &[u8]) {
        let end = match range_end {
            [] => End::Before([key, &[0]].concat()),
            [0] => End::Unbounded,
            end => End::Before(end.to_vec()),
        };
        self.insert(key.to_vec(), end);
    }

    fn insert(&mut self, mut start: Vec<u8>, mut end: End) {
        if !end.above(&start) {
            return;
        }
        let before = self
            .spans
            .range::<[u8], _>((Bound::Unbounded, Bound::Included(start.as_slice())))
            .next_back();
        if let Some((span_start, span_end)) = before {
            if span_end.reaches(&start) {
                end = max(end, span_end.clone());
                start = span_start.clone();
            }
        }
        let swallowed: Vec<Vec<u8>> = self
            .spans
            .range::<[u8], _>((Bound::Included(start.as_slice()), Bound::Unbounded))
            .take_while(|(span_start, _)| end.reaches(span_start))
            .map(|(span_start, _)| span_start.clone())
            .collect();
        for span_start in swallowed {
            if let Some(span_end) = self.spans.remove(&span_start) {
                end = max(end, span_end);
            }
        }
        self.spans.insert(start, end);
    }

    fn union(&mut self, other: IntervalSet) {
        for (start, end) in other.spans {
            self.insert(start, end);
        }
    }

    fn contains(&self, key: &[u8]) -> bool {
        self.spans
            .range::<[u8], _>((Bound::Unbounded, Bound::Included(key)))
            .next_back()
            .is_some_and(|(_, end)| end.above(key))
    }
}

/// The keys a branch puts and the keys it deletes.
struct Writes<'a> {
    puts: BTreeSet<&'a [u8]>,
    deletes: IntervalSet,
}

/// Checks one branch (and, recursively, the txns nested in it).
pub(super) fn check(ops: &[RequestOp]) -> Result<(), StoreError> {
    writes(ops).map(|_| ())
}

fn writes(ops: &[RequestOp]) -> Result<Writes<'_>, StoreError> {
    let mut found = Writes {
        puts: BTreeSet::new(),
        deletes: IntervalSet::default(),
    };
    // This level's deletes first: a put conflicts with a delete before or after it.
    for op in ops {
        if let Some(Request::RequestDeleteRange(delete)) = &op.request {
            found.deletes.insert_delete(&delete.key, &delete.range_end);
        }
    }
    for op in ops {
        if let Some(Request::RequestTxn(txn)) = &op.request {
            add_nested(&mut found, writes(&txn.success)?, writes(&txn.failure)?)?;
        }
    }
    for op in ops {
        if let Some(Request::RequestPut(put)) = &op.request {
            add_put(&mut found, &put.key)?;
        }
    }
    Ok(found)
}

/// Merges a nested txn's branches into its parent's writes, as etcd does.
fn add_nested<'a>(
    found: &mut Writes<'a>,
    then: Writes<'a>,
    otherwise: Writes<'a>,
) -> Result<(), StoreError> {
    for key in &then.puts {
        add_put(found, key)?;
    }
    for key in &otherwise.puts {
        // A key the success branch put is no conflict: only one branch runs.
        let put_by_other_txn = found.puts.contains(key) && !then.puts.contains(key);
        if put_by_other_txn || found.deletes.contains(key) {
            return Err(StoreError::DuplicateKey);
        }
        found.puts.insert(key);
    }
    found.deletes.union(then.deletes);
    found.deletes.union(otherwise.deletes);
    Ok(())
}

fn add_put<'a>(found: &mut Writes<'a>, key: &'a [u8]) -> Result<(), StoreError> {
    if found.deletes.contains(key) || !found.puts.insert(key) {
        return Err(StoreError::DuplicateKey);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(deletes: &[(&[u8], &[u8])]) -> IntervalSet {
        let mut set = IntervalSet::default();
        for (key, end) in deletes {
            set.insert_delete(key, end);
        }
        set
    }

    #[test]
    fn interval_set_merges_and_finds() {
        let set = set(&[
            (b"b", b"d"),
            (b"a", b""),
            (b"c", b"f"),
            (b"x", b"\0"),
            (b"m", b"k"),
        ]);
        for key in [&b"a"[..], b"b", b"c", b"e", b"x", b"xyz", b"\xff"] {
            assert!(set.contains(key), "{key:?}");
        }
        for key in [&b"a\0\0"[..], b"f", b"k", b"l", b"m", b"w"] {
            assert!(!set.contains(key), "{key:?}");
        }
        // [a, a\0) and [b, f) stay apart: nothing lies between, but they do not touch.
        assert_eq!(set.spans.len(), 3);
    }
}
