//! Which member owns which shard: a balanced rendezvous assignment.
//!
//! Every member of a group computes the assignment on its own from the same inputs (the shard
//! names and the ids of the live members), so the function must give the same answer on every
//! host, in every release: the hash is spelled out here (FNV-1a 64 with a SplitMix64
//! finaliser), never a standard-library hasher whose output may change.
//!
//! Each (shard, member) pair gets a score. Plain rendezvous hashing gives each shard to its
//! highest-scoring member; a join or a leave then moves only the shards whose best member
//! changed (about 1/N of them), but the counts per member vary by a few percent. Here each
//! member also has a capacity (`shards / members`, one more for the first `shards % members`
//! members by their own hash), and pairs are taken in descending score order, skipping a pair
//! whose shard is taken or whose member is full. Counts then differ by at most one, and a
//! change of membership still moves close to the minimum (see the tests).
//!
//! Ties (equal scores) are broken by shard index then member index after sorting members, so
//! the result does not depend on the order the inputs come in.

/// 64-bit FNV-1a of `bytes`.
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// SplitMix64's finaliser: spreads every input bit over the output.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The score of `member` for a shard whose name hashes to `shard` (higher wins).
fn score(shard: u64, member: u64) -> u64 {
    mix(shard ^ mix(member.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15))
}

/// The owner of each shard: `result[i]` is the index in `members` of the member that should own
/// `shards[i]`, or `None` for every shard when there are no members. Members are identified by
/// their ids; a repeated id counts once (its first index is used).
pub fn assign<S: AsRef<str>, M: AsRef<str>>(shards: &[S], members: &[M]) -> Vec<Option<usize>> {
    // Distinct members, sorted by id: the answer must not depend on the input order.
    let mut order: Vec<usize> = (0..members.len()).collect();
    order.sort_by(|&a, &b| members[a].as_ref().cmp(members[b].as_ref()).then(a.cmp(&b)));
    order.dedup_by(|a, b| members[*a].as_ref() == members[*b].as_ref());
    if order.is_empty() {
        return vec![None; shards.len()];
    }
    let member_hashes: Vec<u64> = order
        .iter()
        .map(|&m| fnv1a(members[m].as_ref().as_bytes()))
        .collect();
    let shard_hashes: Vec<u64> = shards
        .iter()
        .map(|s| fnv1a(s.as_ref().as_bytes()))
        .collect();
    // Capacities: the first `extra` members by their own hash take one more.
    let n = order.len();
    let (base, extra) = (shards.len() / n, shards.len() % n);
    let mut by_hash: Vec<usize> = (0..n).collect();
    by_hash.sort_by_key(|&m| (mix(member_hashes[m]), m));
    let mut capacity = vec![base; n];
    for &m in by_hash.iter().take(extra) {
        capacity[m] += 1;
    }
    // Every (shard, member) pair by descending score.
    let mut pairs: Vec<(u64, u32, u32)> = Vec::with_capacity(shards.len() * n);
    for (s, &sh) in shard_hashes.iter().enumerate() {
        for (m, &mh) in member_hashes.iter().enumerate() {
            pairs.push((score(sh, mh), s as u32, m as u32));
        }
    }
    pairs.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut owner: Vec<Option<usize>> = vec![None; shards.len()];
    let mut left = shards.len();
    for (_, s, m) in pairs {
        if left == 0 {
            break;
        }
        let (s, m) = (s as usize, m as usize);
        if owner[s].is_some() || capacity[m] == 0 {
            continue;
        }
        capacity[m] -= 1;
        owner[s] = Some(order[m]);
        left -= 1;
    }
    owner
}

/// The names of `count` shards numbered from 0: `"0"`, `"1"`, ...
pub fn numbered(count: u32) -> Vec<String> {
    (0..count).map(|i| i.to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn members(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("member-{i}")).collect()
    }

    fn counts(owner: &[Option<usize>], n: usize) -> Vec<usize> {
        let mut counts = vec![0; n];
        for o in owner {
            counts[o.unwrap()] += 1;
        }
        counts
    }

    /// Owners by member id, for comparing assignments over different member lists.
    fn by_id(shards: &[String], members: &[String]) -> Vec<String> {
        assign(shards, members)
            .into_iter()
            .map(|o| members[o.unwrap()].clone())
            .collect()
    }

    fn moved(a: &[String], b: &[String]) -> usize {
        a.iter().zip(b).filter(|(x, y)| x != y).count()
    }

    #[test]
    fn no_members_no_owners() {
        assert_eq!(assign(&numbered(3), &[] as &[&str]), vec![None, None, None]);
        assert!(assign(&[] as &[&str], &["a"]).is_empty());
    }

    #[test]
    fn the_hash_is_fixed() {
        // Every host and every release must agree: these values must never change.
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        let owners = by_id(&numbered(8), &members(3));
        // Pinned: a change here splits a group whose members run different releases.
        assert_eq!(
            owners,
            [
                "member-0", "member-0", "member-2", "member-0", "member-1", "member-2", "member-1",
                "member-2"
            ]
        );
    }

    #[test]
    fn balanced_at_1000_shards() {
        for n in [1, 2, 3, 7, 10, 64] {
            let owner = assign(&numbered(1000), &members(n));
            let counts = counts(&owner, n);
            let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            assert!(max - min <= 1, "{n} members: {counts:?}");
        }
    }

    #[test]
    fn a_join_and_a_leave_move_about_one_nth() {
        let shards = numbered(1000);
        for n in [2, 3, 9] {
            let before = by_id(&shards, &members(n));
            let after = by_id(&shards, &members(n + 1));
            let ideal = 1000 / (n + 1);
            let moved = moved(&before, &after);
            // Every shard that moves goes to the newcomer, give or take capacity spill.
            assert!(moved >= ideal, "{n}→{}: {moved}", n + 1);
            assert!(
                moved <= ideal + ideal / 4 + n,
                "{n}→{}: moved {moved}, ideal {ideal}",
                n + 1
            );
            // A leave is the reverse.
            assert_eq!(moved, self::moved(&after, &before));
        }
    }

    proptest! {
        #[test]
        fn any_input_order_gives_the_same_owners(
            shards in 0u32..300,
            ids in proptest::collection::vec("[a-z]{1,6}", 1..12),
            seed in any::<u64>(),
        ) {
            let shards = numbered(shards);
            let mut shuffled = ids.clone();
            // A seeded shuffle.
            let mut state = seed;
            for i in (1..shuffled.len()).rev() {
                state = mix(state.wrapping_add(0x9e37_79b9_7f4a_7c15));
                shuffled.swap(i, (state % (i as u64 + 1)) as usize);
            }
            let a: Vec<_> = assign(&shards, &ids).into_iter().map(|o| ids[o.unwrap()].clone()).collect();
            let b: Vec<_> = assign(&shards, &shuffled).into_iter().map(|o| shuffled[o.unwrap()].clone()).collect();
            prop_assert_eq!(a, b);
        }

        #[test]
        fn every_shard_owned_and_counts_within_one(shards in 0u32..500, n in 1usize..20) {
            let owner = assign(&numbered(shards), &members(n));
            let counts = counts(&owner, n);
            let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            prop_assert!(max - min <= 1);
        }

        #[test]
        fn a_change_moves_few(shards in 50u32..400, n in 1usize..12, drop in 0usize..12) {
            let shards = numbered(shards);
            let before_members = members(n + 1);
            let mut after_members = before_members.clone();
            after_members.remove(drop % (n + 1));
            let before = by_id(&shards, &before_members);
            let after = by_id(&shards, &after_members);
            let left = before_members[drop % (n + 1)].clone();
            let orphaned = before.iter().filter(|o| **o == left).count();
            let moved = moved(&before, &after);
            // The leaver's shards move, and little else.
            prop_assert!(moved >= orphaned);
            prop_assert!(moved <= orphaned + orphaned / 2 + n + 1, "moved {} orphaned {}", moved, orphaned);
        }
    }
}
