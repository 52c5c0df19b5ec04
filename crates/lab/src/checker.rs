//! The checker: safety properties and measurements over a recorded [`Trace`].
//!
//! Safety functions return the first counterexample, each naming the property's source. The
//! simulator already runs the same checks after every step (see [`crate::sim::Violation`]);
//! these re-derive them from the recorded intervals and writes, so a bug in either shows up
//! as a disagreement in the tests.

use std::collections::BTreeMap;

use crate::model::NodeId;
use crate::sim::{Nanos, Trace, Violation, WindowKind};

/// Periods in which two or more nodes acted as leader.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SplitBrain {
    /// How many separate periods.
    pub count: u64,
    /// Their total length.
    pub total: Nanos,
}

/// The fate of the writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Writes {
    /// Writes that reached the resource.
    pub total: u64,
    /// Of which stale (a different leadership with a token at least as high had already
    /// written). Without fencing, every one of them is accepted.
    pub stale: u64,
    /// Stale writes the fenced resource accepted anyway (tokens that do not order
    /// leaderships, such as two bully coordinators with the same epoch).
    pub stale_accepted_fenced: u64,
    /// Writes the fenced resource rejected.
    pub rejected_fenced: u64,
}

/// Everything the table shows about one run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunSummary {
    /// Leaderships started.
    pub elections: u64,
    /// Two or more acting at once.
    pub split_brain: SplitBrain,
    /// Time with nobody acting, after the first election.
    pub leaderless: Nanos,
    /// For each fault after which a new leader took over before the next fault: how long
    /// that took.
    pub time_to_elect: Vec<Nanos>,
    /// Election messages sent.
    pub election_messages: u64,
    /// All messages sent.
    pub messages: u64,
    /// The writes.
    pub writes: Writes,
    /// Violations found after every step: overlaps, shared tokens, fenced stale writes.
    pub violation_counts: [u64; 3],
    /// Events the simulator processed.
    pub events: u64,
    /// The trace hash.
    pub hash: u64,
    /// Whether each side of a long partition had its own leader (None: no long partition).
    pub partition_sides_led: Option<bool>,
}

/// Summarises one run.
pub fn summarize(trace: &Trace) -> RunSummary {
    RunSummary {
        elections: trace.leaderships.len() as u64,
        split_brain: split_brain(trace),
        leaderless: leaderless(trace),
        time_to_elect: time_to_elect(trace),
        election_messages: trace.election_messages,
        messages: trace.messages,
        writes: writes(trace),
        violation_counts: trace.violation_counts,
        events: trace.events,
        hash: trace.hash,
        partition_sides_led: partition_sides_led(trace),
    }
}

/// (instant, +1 for a start or −1 for an end), ends first at equal instants.
fn edges(trace: &Trace) -> Vec<(Nanos, i32)> {
    let mut edges: Vec<(Nanos, i32)> = trace
        .leaderships
        .iter()
        .filter(|interval| interval.end > interval.start)
        .flat_map(|interval| [(interval.start, 1), (interval.end, -1)])
        .collect();
    edges.sort_unstable();
    edges
}

/// Periods with two or more acting leaders. Source: the split-brain measure; for the
/// lease recipe, DESIGN.md §2 rule 1.
pub fn split_brain(trace: &Trace) -> SplitBrain {
    let periods = split_brain_periods(trace);
    SplitBrain {
        count: periods.len() as u64,
        total: periods.iter().map(|(start, end)| end - start).sum(),
    }
}

/// The periods themselves, in order (for charts).
pub fn split_brain_periods(trace: &Trace) -> Vec<(Nanos, Nanos)> {
    let mut periods = Vec::new();
    let mut acting = 0;
    let mut since = 0;
    for (at, delta) in edges(trace) {
        let before = acting;
        acting += delta;
        if before < 2 && acting >= 2 {
            since = at;
        } else if before >= 2 && acting < 2 {
            periods.push((since, at));
        }
    }
    periods
}

/// For runs with a long partition (at least 3 s, as in `minority-partition` and
/// `majority-partition`): whether both sides had a leader at once during it.
pub fn partition_sides_led(trace: &Trace) -> Option<bool> {
    let long = 3_000_000_000;
    let windows: Vec<_> = trace
        .faults
        .iter()
        .filter(|w| w.kind == WindowKind::Partition && w.end - w.start >= long)
        .collect();
    if windows.is_empty() {
        return None;
    }
    Some(
        windows
            .iter()
            .all(|w| both_sides_led(trace, w.start, w.end, w.nodes)),
    )
}

/// Time with nobody acting as leader, from the first election to the end of the run.
pub fn leaderless(trace: &Trace) -> Nanos {
    let edges = edges(trace);
    let Some(&(first, _)) = edges.first() else {
        return trace.duration;
    };
    let mut total = 0;
    let mut acting = 0;
    let mut since = first;
    for (at, delta) in edges {
        if acting == 0 && delta > 0 {
            total += at - since;
        }
        acting += delta;
        if acting == 0 {
            since = at;
        }
    }
    if acting == 0 {
        total += trace.duration.saturating_sub(since);
    }
    total
}

/// For each fault and each heal (clock changes aside), the time until a leadership that
/// started after it, if one started before the next fault or heal. Source: the issue's "time
/// to elect after each fault"; heals count because a returning node can force an election
/// (Raft without pre-vote, bully's bigger id).
pub fn time_to_elect(trace: &Trace) -> Vec<Nanos> {
    let mut starts: Vec<Nanos> = trace
        .faults
        .iter()
        .filter(|window| window.kind != WindowKind::Clock)
        .flat_map(|window| [window.start, window.end])
        .filter(|&at| at < trace.duration)
        .collect();
    starts.sort_unstable();
    starts.dedup();
    let mut elected: Vec<Nanos> = trace.leaderships.iter().map(|l| l.start).collect();
    elected.sort_unstable();
    starts
        .iter()
        .enumerate()
        .filter_map(|(i, &fault)| {
            let next_fault = starts.get(i + 1).copied().unwrap_or(trace.duration);
            let first = elected[elected.partition_point(|&at| at < fault)..]
                .first()
                .copied()?;
            (first < next_fault).then_some(first - fault)
        })
        .collect()
}

/// Counts the writes. Source: the issue's "writes accepted with a stale token, with fencing
/// on and off".
pub fn writes(trace: &Trace) -> Writes {
    let mut writes = Writes::default();
    for write in &trace.writes {
        writes.total += 1;
        writes.stale += u64::from(write.stale);
        writes.stale_accepted_fenced += u64::from(write.stale && write.accepted_fenced);
        writes.rejected_fenced += u64::from(!write.accepted_fenced);
    }
    writes
}

/// At most one leader per term (token). Source: Raft §5.2, Election Safety.
pub fn check_one_leader_per_token(trace: &Trace) -> Result<(), Violation> {
    let mut first: BTreeMap<u64, (NodeId, Nanos)> = BTreeMap::new();
    let mut ordered = trace.leaderships.clone();
    ordered.sort_by_key(|interval| (interval.start, interval.node));
    for interval in ordered {
        let (node, _) = *first
            .entry(interval.token)
            .or_insert((interval.node, interval.start));
        if node != interval.node {
            return Err(Violation::SharedToken {
                at: interval.start,
                token: interval.token,
                first: node,
                second: interval.node,
            });
        }
    }
    Ok(())
}

/// Never two acting leaders at once. Source: DESIGN.md §2 rule 1 (for the lease recipe, while
/// clocks stay within `max_drift`).
pub fn check_no_overlap(trace: &Trace) -> Result<(), Violation> {
    let mut ordered = trace.leaderships.clone();
    ordered.retain(|interval| interval.end > interval.start);
    ordered.sort_by_key(|interval| (interval.start, interval.node));
    let mut latest: Option<(Nanos, NodeId)> = None;
    for interval in ordered {
        if let Some((end, node)) = latest {
            if interval.start < end && node != interval.node {
                return Err(Violation::Overlap {
                    at: interval.start,
                    first: node,
                    second: interval.node,
                });
            }
        }
        if latest.is_none_or(|(end, _)| interval.end > end) {
            latest = Some((interval.end, interval.node));
        }
    }
    Ok(())
}

/// The fenced resource never accepts a stale write. Source: DESIGN.md §2 rule 2.
pub fn check_no_fenced_stale_write(trace: &Trace) -> Result<(), Violation> {
    match trace
        .writes
        .iter()
        .find(|write| write.stale && write.accepted_fenced)
    {
        Some(write) => Err(Violation::FencedStaleWrite {
            at: write.arrived,
            node: write.node,
            token: write.token,
        }),
        None => Ok(()),
    }
}

/// Whether, during the partition window that cut off `cut`, a node on each side acted as
/// leader at the same instant. Source: the issue's claim that bully and ring "elect one
/// leader per side of a partition".
pub fn both_sides_led(trace: &Trace, start: Nanos, end: Nanos, cut: u32) -> bool {
    let side = |node: NodeId| cut & (1 << node) != 0;
    let clipped = |inside: bool| -> Vec<(Nanos, Nanos)> {
        trace
            .leaderships
            .iter()
            .filter(|interval| side(interval.node) == inside)
            .map(|interval| (interval.start.max(start), interval.end.min(end)))
            .filter(|(from, to)| from < to)
            .collect()
    };
    let (a, b) = (clipped(true), clipped(false));
    a.iter()
        .any(|&(a0, a1)| b.iter().any(|&(b0, b1)| a0 < b1 && b0 < a1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{FaultWindow, LeadershipInterval, WriteRecord};

    fn interval(node: NodeId, token: u64, start: Nanos, end: Nanos) -> LeadershipInterval {
        LeadershipInterval {
            node,
            token,
            start,
            end,
        }
    }

    fn trace(leaderships: Vec<LeadershipInterval>) -> Trace {
        Trace {
            leaderships,
            ..Trace::new(3, 0, 100)
        }
    }

    #[test]
    fn split_brain_and_leaderless_time() {
        let t = trace(vec![
            interval(0, 1, 10, 50),
            interval(1, 1, 40, 60),
            interval(2, 2, 45, 55),
            interval(2, 3, 70, 80),
        ]);
        assert_eq!(
            split_brain(&t),
            SplitBrain {
                count: 1,
                total: 15
            }
        );
        // From 10: gaps 60..70 and 80..100.
        assert_eq!(leaderless(&t), 30);
        assert_eq!(
            check_one_leader_per_token(&t),
            Err(Violation::SharedToken {
                at: 40,
                token: 1,
                first: 0,
                second: 1
            })
        );
        assert_eq!(
            check_no_overlap(&t),
            Err(Violation::Overlap {
                at: 40,
                first: 0,
                second: 1
            })
        );
        assert!(both_sides_led(&t, 0, 100, 0b001));
        assert!(!both_sides_led(&t, 60, 100, 0b100));
        // Back-to-back intervals neither overlap nor leave a gap.
        let t = trace(vec![interval(0, 1, 10, 50), interval(1, 2, 50, 100)]);
        assert_eq!(split_brain(&t), SplitBrain::default());
        assert_eq!(leaderless(&t), 0);
        assert_eq!(check_no_overlap(&t), Ok(()));
        assert_eq!(check_one_leader_per_token(&t), Ok(()));
    }

    #[test]
    fn time_to_elect_counts_only_elections_before_the_next_fault() {
        let mut t = trace(vec![interval(0, 1, 5, 20), interval(1, 2, 32, 100)]);
        let window = |start| FaultWindow {
            kind: WindowKind::Crash,
            start,
            end: start + 5,
            nodes: 1,
            label: String::new(),
        };
        t.faults = vec![window(20), window(50), window(60)];
        // Boundaries 20, 25, 50, 55, 60, 65: only 25 → 32 has an election before the next.
        assert_eq!(time_to_elect(&t), vec![7]);
    }

    #[test]
    fn writes_are_counted_by_fate() {
        let mut t = trace(Vec::new());
        let write = |stale, accepted_fenced| WriteRecord {
            node: 0,
            token: 1,
            issued: 0,
            arrived: 1,
            stale,
            accepted_fenced,
        };
        t.writes = vec![write(false, true), write(true, false), write(true, true)];
        assert_eq!(
            writes(&t),
            Writes {
                total: 3,
                stale: 2,
                stale_accepted_fenced: 1,
                rejected_fenced: 1
            }
        );
        assert!(check_no_fenced_stale_write(&t).is_err());
    }
}
