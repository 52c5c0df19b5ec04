//! Shard ownership: a group of members splits a set of shards, each shard owned by exactly
//! one member at a time, with a fencing token per shard.
//!
//! Each shard is an election of its own (`@shard:<group>:<shard>`), so a shard has every guarantee a
//! leadership has: its owner hears of a loss before any rival can take the shard, and its token
//! strictly increases. Membership is one more election (`@members:<group>`) in which every member
//! keeps a candidacy; its participants are the live members. Every member computes the same
//! assignment from them ([`baton_core::shards::assign`]: balanced rendezvous hashing) and
//! campaigns for the shards assigned to it, and only those: a shard has one candidate at a
//! time, apart from a handoff, where the newcomer queues behind the old owner and takes over
//! when the old owner resigns (after its work on the shard stopped) or its lease runs out.
//!
//! All the elections of a member share one lease (one per backend connection and
//! configuration), so renewal traffic grows with members, not shards; and every shard campaigns
//! in a task of its own, so a member's campaigns are pipelined rather than one at a time.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};

use crate::election::{invalid_if, validate_election_name, validate_name, Ended};
use crate::{Backend, CandidateOptions, Election, ElectionConfig, Error, Leadership, LossReason};
use crate::{Candidacy, Result};

pub use baton_core::shards::{assign, numbered};

/// How often a member reads the membership (the cost is one read per member per interval,
/// whatever the number of shards).
pub const DEFAULT_POLL: Duration = Duration::from_millis(250);
/// How long the membership must stay the same before a member acts on it: members starting
/// together settle on one assignment instead of campaigning for each intermediate one.
pub const DEFAULT_SETTLE: Duration = Duration::from_millis(500);
/// The longest a membership change waits for the membership to settle (at least; four times
/// the settle time if that is longer): members joining and leaving without pause must not keep
/// a crashed member's shards unowned.
const MAX_SETTLE_WAIT: Duration = Duration::from_secs(2);
/// The pause before a shard campaigns again after its campaign failed.
const RETRY_PAUSE: Duration = Duration::from_millis(200);

/// The shards of a group: `count` shards named `0` to `count - 1`, or named shards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardSet {
    /// Shards `0..count`.
    Count(u32),
    /// Shards with these names (each a valid election-name suffix, no repeats).
    Names(Vec<String>),
}

impl ShardSet {
    /// A short description: "8 shards", or the first names.
    fn describe(&self) -> String {
        match self {
            ShardSet::Count(count) => format!("{count} shards"),
            ShardSet::Names(names) if names.len() <= 4 => format!("shards {names:?}"),
            ShardSet::Names(names) => format!("{} named shards, {:?}…", names.len(), &names[..4]),
        }
    }

    /// The shards' names, in order.
    pub fn names(&self) -> Vec<String> {
        match self {
            ShardSet::Count(count) => baton_core::shards::numbered(*count),
            ShardSet::Names(names) => names.clone(),
        }
    }

    /// Checks the set: at least one shard, valid names, no repeats.
    fn validate(&self, group: &str) -> Result<()> {
        let names = self.names();
        if names.is_empty() {
            return Err(Error::InvalidName {
                what: "shard set",
                value: String::new(),
                reason: "must have at least one shard",
            });
        }
        let mut seen = std::collections::HashSet::new();
        for name in &names {
            validate_name("shard name", name)?;
            validate_election_name("shard election", &shard_election(group, name))?;
            if !seen.insert(name) {
                return Err(Error::InvalidName {
                    what: "shard name",
                    value: name.clone(),
                    reason: "is repeated",
                });
            }
        }
        Ok(())
    }
}

/// The election that decides the owner of `shard` in `group`. Names of this form (and of
/// [`members_election`]) are reserved: [`Election::new`] refuses them, so no plain candidate
/// can join a group's elections by accident.
pub fn shard_election(group: &str, shard: &str) -> String {
    format!("@shard:{group}:{shard}")
}

/// The election whose participants are the members of `group`.
pub fn members_election(group: &str) -> String {
    format!("@members:{group}")
}

/// Whether `name` is a shard group's election (reserved).
pub(crate) fn is_shard_election(name: &str) -> bool {
    name.starts_with("@members:") || name.starts_with("@shard:")
}

/// Checks a group name: a valid election name without ':' (it separates group and shard).
fn validate_group(group: &str) -> Result<()> {
    validate_name("group name", group)?;
    let reason = if group.contains('/') {
        Some("must not contain '/'")
    } else if group.contains(':') {
        Some("must not contain ':'")
    } else {
        None
    };
    invalid_if("group name", group, reason)
}

/// Settings of a member.
#[derive(Debug, Clone)]
pub struct ShardConfig {
    /// The elections' settings (TTL, renewal cadence, drift margin); requeue is ignored: a
    /// member campaigns for a shard again whenever it is assigned one.
    pub election: ElectionConfig,
    /// See [`DEFAULT_SETTLE`].
    pub settle: Duration,
    /// See [`DEFAULT_POLL`].
    pub poll: Duration,
}

impl Default for ShardConfig {
    fn default() -> Self {
        ShardConfig {
            election: ElectionConfig::default(),
            settle: DEFAULT_SETTLE,
            poll: DEFAULT_POLL,
        }
    }
}

/// Why a member no longer owns a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseReason {
    /// The shard is assigned to another member now. The ownership holds until you drop (or
    /// resign) its [`Leadership`]: stop the shard's work, then drop it; the new owner starts
    /// only after that (or after the lease runs out).
    Rebalanced,
    /// [`ShardMember::leave`] was called: as for `Rebalanced`, drop the leadership once the
    /// shard's work has stopped.
    Leaving,
    /// The ownership is over already (lease expired, entry deleted, backend failed): stop the
    /// shard's work at once. The member campaigns for the shard again while it is assigned.
    Lost(LossReason),
}

impl std::fmt::Display for ReleaseReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReleaseReason::Rebalanced => f.write_str("rebalanced"),
            ReleaseReason::Leaving => f.write_str("leaving"),
            ReleaseReason::Lost(reason) => write!(f, "lost: {reason}"),
        }
    }
}

/// What a member hears.
#[derive(Debug)]
pub enum ShardEvent {
    /// This member owns `shard` now, with `token` (strictly greater than any earlier owner's
    /// token for this shard). Act on the shard only while `leadership` leads, fencing every
    /// action with the token; dropping it gives the shard up.
    Acquired {
        /// The shard's name (`"0"`, `"1"`, ... for a counted set).
        shard: String,
        /// The fencing token.
        token: u64,
        /// The shard's ownership: [`Leadership::lost`], guarded writes, resign.
        leadership: Leadership,
    },
    /// This member no longer owns `shard` (or must give it up): see [`ReleaseReason`].
    Released {
        /// The shard's name.
        shard: String,
        /// Why.
        reason: ReleaseReason,
    },
}

/// One member of a shard group: see the [module documentation](self).
///
/// Read its events with [`ShardMember::next`]. Dropping it ends the membership: shards whose
/// leadership you still hold stay yours until you drop them (or their lease runs out), and
/// nothing campaigns any more.
#[derive(Debug)]
pub struct ShardMember {
    events: mpsc::UnboundedReceiver<ShardEvent>,
    leave: watch::Sender<bool>,
    owned: Arc<Mutex<BTreeMap<String, u64>>>,
    ended: Arc<Mutex<Option<String>>>,
    group: String,
    id: String,
}

/// What the member's tasks share.
struct Shared {
    events: mpsc::UnboundedSender<ShardEvent>,
    owned: Arc<Mutex<BTreeMap<String, u64>>>,
    /// Why the member left the group on its own, if it did.
    ended: Arc<Mutex<Option<String>>>,
}

/// The membership value: the shard set the member serves (so `status` can list shards).
#[derive(Debug, Serialize, Deserialize)]
struct MemberValue {
    shards: ShardSet,
}

impl ShardMember {
    /// Joins `group` as `id`, serving `shards`. Fails if `id` is already a live member of the
    /// group, or if the names are invalid. Every member of a group must serve the same shard
    /// set.
    pub async fn join(
        backend: &Backend,
        group: &str,
        id: &str,
        shards: ShardSet,
        config: ShardConfig,
    ) -> Result<ShardMember> {
        validate_group(group)?;
        validate_name("candidate id", id)?;
        shards.validate(group)?;
        let election_config = config.election.clone().with_requeue(false);
        let members = Election::for_shards(
            backend,
            &members_election(group),
            election_config.clone().with_requeue(true),
        )?;
        for member in members.participants().await? {
            if member.id == id {
                return Err(Error::DuplicateId {
                    election: members_election(group),
                    id: id.to_string(),
                    entry: String::new(),
                });
            }
            // Every member must serve the same shards: with different sets some shards would
            // have no owner, or two members would disagree on who owns what.
            if let Some(theirs) = other_set(&member, &shards) {
                return Err(Error::InvalidName {
                    what: "shard set",
                    value: format!(
                        "{} (member {:?} serves {})",
                        shards.describe(),
                        member.id,
                        theirs.describe()
                    ),
                    reason: "differs from the shard set the group's live members serve",
                });
            }
        }
        let value = serde_json::to_string(&MemberValue {
            shards: shards.clone(),
        })
        .expect("a shard set serializes");
        let value = CandidateOptions::default().with_value(value);
        let candidacy = members.candidacy_with(id, value.clone())?;
        let (events_tx, events) = mpsc::unbounded_channel();
        let (leave, leaving) = watch::channel(false);
        let owned = Arc::new(Mutex::new(BTreeMap::new()));
        let ended = Arc::new(Mutex::new(None));
        let shared = Arc::new(Shared {
            events: events_tx,
            owned: owned.clone(),
            ended: ended.clone(),
        });
        let member = Member {
            backend: backend.clone(),
            group: group.to_string(),
            id: id.to_string(),
            names: shards.names(),
            set: shards.clone(),
            config: ShardConfig {
                election: election_config,
                ..config
            },
            members,
            value,
            shared,
        };
        tokio::spawn(member.run(candidacy, leaving));
        Ok(ShardMember {
            events,
            leave,
            owned,
            ended,
            group: group.to_string(),
            id: id.to_string(),
        })
    }

    /// The next event; `None` once the member has left (after [`ShardMember::leave`], when every
    /// shard is released) or ended. Cancel-safe.
    pub async fn next(&mut self) -> Option<ShardEvent> {
        self.events.recv().await
    }

    /// The shards this member owns now, with their tokens (acquired, not yet released).
    pub fn owned(&self) -> BTreeMap<String, u64> {
        self.owned.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The group's name.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// This member's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Why this member left the group on its own, once [`ShardMember::next`] has returned
    /// `None`: `None` after [`ShardMember::leave`] or a closed backend. Today the one reason is
    /// a member that joined first serving another shard set (two members that joined at the
    /// same moment can both pass the check at join).
    pub fn error(&self) -> Option<String> {
        self.ended.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Starts leaving the group: campaigns stop, every owned shard gets a
    /// [`ReleaseReason::Leaving`] event (drop its leadership once its work stopped), and
    /// [`ShardMember::next`] returns `None` once all are released and the membership is gone.
    pub fn leave(&self) {
        self.leave.send_replace(true);
    }

    /// The ids of the live members of `group`, sorted.
    pub async fn members(backend: &Backend, group: &str) -> Result<Vec<String>> {
        validate_group(group)?;
        let members =
            Election::for_shards(backend, &members_election(group), ElectionConfig::default())?;
        let mut ids: Vec<String> = members
            .participants()
            .await?
            .into_iter()
            .map(|m| m.id)
            .collect();
        ids.sort();
        ids.dedup();
        Ok(ids)
    }

    /// Who owns each shard of `group` now. The shard set is the one the live members serve; if
    /// no member is live, `shards` must say what it is.
    pub async fn status(
        backend: &Backend,
        group: &str,
        shards: Option<ShardSet>,
    ) -> Result<GroupStatus> {
        validate_group(group)?;
        let members =
            Election::for_shards(backend, &members_election(group), ElectionConfig::default())?;
        let set = match shards {
            Some(set) => set,
            None => members
                .participants()
                .await?
                .into_iter()
                .find_map(|m| {
                    serde_json::from_str::<MemberValue>(m.value.as_deref()?)
                        .ok()
                        .map(|v| v.shards)
                })
                .ok_or_else(|| Error::InvalidName {
                    what: "group",
                    value: group.to_string(),
                    reason: "has no live member to tell its shards; give the shard count",
                })?,
        };
        set.validate(group)?;
        let numbered = matches!(set, ShardSet::Count(_));
        let names = set.names();
        // Concurrently, a bounded number at a time.
        let mut owners = Vec::with_capacity(names.len());
        for chunk in names.chunks(64) {
            let mut reads = Vec::new();
            for name in chunk {
                let election = Election::for_shards(
                    backend,
                    &shard_election(group, name),
                    ElectionConfig::default(),
                )?;
                reads.push(tokio::spawn(async move { election.leader().await }));
            }
            for read in reads {
                let leader = read
                    .await
                    .map_err(|e| Error::protocol("shards", "status", &e.to_string()))??;
                owners.push(leader);
            }
        }
        let shards = names
            .into_iter()
            .zip(owners)
            .map(|(name, leader)| ShardStatus {
                shard: match name.parse::<u32>() {
                    Ok(index) if numbered => serde_json::Value::from(index),
                    _ => serde_json::Value::from(name),
                },
                owner: leader.map(|l| Owner {
                    id: l.id,
                    token: l.token,
                }),
            })
            .collect();
        Ok(GroupStatus {
            group: group.to_string(),
            shards,
        })
    }
}

/// Who owns each shard of a group (`baton shards status`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GroupStatus {
    /// The group's name.
    pub group: String,
    /// Every shard, in order.
    pub shards: Vec<ShardStatus>,
}

/// One shard's owner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShardStatus {
    /// The shard: its number for a counted set, else its name.
    pub shard: serde_json::Value,
    /// Its owner, or `None`.
    pub owner: Option<Owner>,
}

/// A shard's owner.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Owner {
    /// The member's id.
    pub id: String,
    /// Its fencing token for the shard.
    pub token: u64,
}

/// The member's own task: reads the membership, computes the assignment, tells each shard's
/// task whether it is assigned.
struct Member {
    backend: Backend,
    group: String,
    id: String,
    names: Vec<String>,
    /// The shard set this member serves (its membership value).
    set: ShardSet,
    config: ShardConfig,
    members: Election,
    /// The membership candidacy's options (its value: the shard set).
    value: CandidateOptions,
    shared: Arc<Shared>,
}

impl Member {
    async fn run(self, mut candidacy: Candidacy, mut leaving: watch::Receiver<bool>) {
        let mut assigned = Vec::with_capacity(self.names.len());
        let mut tasks = Vec::with_capacity(self.names.len());
        for name in &self.names {
            let (tx, rx) = watch::channel(Assigned::No);
            assigned.push(tx);
            let election = match Election::for_shards(
                &self.backend,
                &shard_election(&self.group, name),
                self.config.election.clone(),
            ) {
                Ok(election) => election,
                // Validated at join.
                Err(_) => continue,
            };
            tasks.push(tokio::spawn(shard_task(
                election,
                self.id.clone(),
                name.clone(),
                rx,
                self.shared.clone(),
            )));
        }
        // The membership's own leadership (whoever queued first leads it; it means nothing
        // here), kept so that it is not resigned and campaigned for again.
        let mut _membership: Option<Leadership> = None;
        let mut seen: Option<Vec<String>> = None;
        let mut since = tokio::time::Instant::now();
        // Since when the membership read differs from the one applied: a membership that
        // keeps changing (members flapping) is applied anyway after `max_wait`.
        let mut pending_since: Option<tokio::time::Instant> = None;
        let max_wait = (self.config.settle * 4).max(MAX_SETTLE_WAIT);
        let mut applied: Option<Vec<String>> = None;
        let mut ticks = tokio::time::interval(self.config.poll);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                next = candidacy.next() => {
                    match next {
                        Ok(leadership) => _membership = Some(leadership),
                        // Our place in the membership was lost (the lease expired while the
                        // backend could not be reached, or we were paused): join again.
                        Err(error @ (Error::CampaignLost(_) | Error::Backend { retryable: true, .. } | Error::Unreachable { .. } | Error::Timeout { .. })) => {
                            tracing::warn!("shard group {}: membership lost ({error}); joining again", self.group);
                            tokio::time::sleep(RETRY_PAUSE).await;
                            match self.members.candidacy_with(&self.id, self.value.clone()) {
                                Ok(again) => candidacy = again,
                                Err(_) => break,
                            }
                        }
                        // The membership ended for good (the backend was closed, or its history
                        // went backwards): so does the member.
                        Err(Error::Closed) => break,
                        Err(error) => {
                            tracing::warn!("shard group {}: membership ended ({error})", self.group);
                            break;
                        }
                    }
                    continue;
                }
                _ = async { let _ = leaving.wait_for(|l| *l).await; } => break,
            }
            let participants = match self.members.participants().await {
                Ok(participants) => participants,
                // The backend was closed: every lease is revoked, nothing campaigns again.
                Err(Error::Closed) => break,
                // Unreachable: the shards' leaderships end on their own at their deadlines.
                Err(_) => continue,
            };
            // Members that joined at the same moment with different shard sets both passed the
            // check at join: the one that joined later (behind in the membership's queue order)
            // leaves, so the group serves one set.
            if let Some(conflict) = self.conflict(&participants) {
                tracing::warn!("shard group {}: {conflict}", self.group);
                *self.shared.ended.lock().unwrap_or_else(|e| e.into_inner()) = Some(conflict);
                break;
            }
            let mut view: Vec<String> = participants.into_iter().map(|m| m.id).collect();
            view.sort();
            view.dedup();
            if seen.as_ref() != Some(&view) {
                seen = Some(view);
                since = tokio::time::Instant::now();
            }
            if applied == seen {
                pending_since = None;
                continue;
            }
            let pending = *pending_since.get_or_insert(since);
            if since.elapsed() < self.config.settle && pending.elapsed() < max_wait {
                continue;
            }
            pending_since = None;
            let view = seen.clone().unwrap_or_default();
            let me = view.iter().position(|m| *m == self.id);
            let owners = baton_core::shards::assign(&self.names, &view);
            for (tx, owner) in assigned.iter().zip(&owners) {
                let want = if me.is_some() && *owner == me {
                    Assigned::Yes
                } else {
                    Assigned::No
                };
                tx.send_if_modified(|a| std::mem::replace(a, want) != want);
            }
            applied = seen.clone();
        }
        for tx in &assigned {
            tx.send_replace(Assigned::Leaving);
        }
        for task in tasks {
            let _ = task.await;
        }
        candidacy.resign().await;
        drop(_membership);
        // Dropping `self.shared` (the last sender) ends the event stream.
    }
}

impl Member {
    /// A member ahead of us in the membership serving another shard set, described.
    fn conflict(&self, participants: &[crate::LeaderInfo]) -> Option<String> {
        let mine = participants.iter().position(|m| m.id == self.id)?;
        participants[..mine].iter().find_map(|member| {
            let theirs = other_set(member, &self.set)?;
            Some(format!(
                "this member serves {} but member {:?}, which joined first, serves {}: \
                 every member of a group must serve the same shards; this member left",
                self.set.describe(),
                member.id,
                theirs.describe()
            ))
        })
    }
}

/// The shard set `member` serves (its membership value), if it is not `mine`.
fn other_set(member: &crate::LeaderInfo, mine: &ShardSet) -> Option<ShardSet> {
    let theirs = serde_json::from_str::<MemberValue>(member.value.as_deref()?).ok()?;
    (theirs.shards != *mine).then_some(theirs.shards)
}

/// What a shard's task is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Assigned {
    Yes,
    No,
    Leaving,
}

/// One shard: campaigns while assigned, reports the ownership and its end.
async fn shard_task(
    election: Election,
    id: String,
    name: String,
    mut assigned: watch::Receiver<Assigned>,
    shared: Arc<Shared>,
) {
    let send = |event: ShardEvent| shared.events.send(event).is_ok();
    loop {
        // Wait until assigned (or leaving).
        let Ok(now) = assigned.wait_for(|a| *a != Assigned::No).await.map(|a| *a) else {
            return;
        };
        if now == Assigned::Leaving {
            return;
        }
        let mut candidacy = match election.candidacy(&id) {
            Ok(candidacy) => candidacy,
            Err(_) => return,
        };
        let won = tokio::select! {
            won = candidacy.next() => won,
            _ = assigned.wait_for(|a| *a != Assigned::Yes) => {
                // No longer ours before we led: leave the queue.
                drop(candidacy);
                continue;
            }
        };
        let mut leadership = match won {
            Ok(leadership) => leadership,
            // Every new entry would get a low token too: the shard stays unowned by us.
            Err(error @ Error::TokenRegressed { .. }) => {
                tracing::warn!(shard = %name, "{error}");
                return;
            }
            Err(_) => {
                tokio::time::sleep(RETRY_PAUSE).await;
                continue;
            }
        };
        let token = leadership.token();
        let ending = leadership.ending();
        // The holder letting go: only then has its work on the shard stopped, whatever ended
        // the term. Nothing campaigns for the shard again before that.
        let dropped = leadership.drop_signal();
        shared
            .owned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), token);
        if !send(ShardEvent::Acquired {
            shard: name.clone(),
            token,
            leadership,
        }) {
            // Nobody listens: the leadership was dropped with the event, which resigns.
            return;
        }
        tokio::pin!(ending);
        let ended = tokio::select! {
            ended = &mut ending => Some(ended),
            _ = assigned.wait_for(|a| *a != Assigned::Yes) => None,
        };
        let handed_back = ended.is_none();
        let ended = match ended {
            // The owner gave it up itself: campaign again (below) if it is still ours.
            Some(Ended::Resigned) => Ended::Resigned,
            Some(Ended::Lost(reason)) => {
                send(ShardEvent::Released {
                    shard: name.clone(),
                    reason: ReleaseReason::Lost(reason),
                });
                Ended::Lost(reason)
            }
            None => {
                let reason = if *assigned.borrow() == Assigned::Leaving {
                    ReleaseReason::Leaving
                } else {
                    ReleaseReason::Rebalanced
                };
                send(ShardEvent::Released {
                    shard: name.clone(),
                    reason,
                });
                // Held until the owner drops it.
                ending.await
            }
        };
        // Whatever ended the term, its work may still be stopping: nothing campaigns for the
        // shard again before the holder has let go.
        let _ = dropped.await;
        forget(&shared, &name, token);
        match ended {
            // Every new entry would get a low token too: the shard stays unowned by us (see
            // `LossReason::TokenRegressed`).
            Ended::Lost(LossReason::TokenRegressed) => return,
            Ended::Lost(_) if !handed_back => tokio::time::sleep(RETRY_PAUSE).await,
            Ended::Lost(_) | Ended::Resigned => {}
        }
    }
}

/// The ownership of `name` with `token` is over.
fn forget(shared: &Shared, name: &str, token: u64) {
    let mut owned = shared.owned.lock().unwrap_or_else(|e| e.into_inner());
    if owned.get(name) == Some(&token) {
        owned.remove(name);
    }
}
