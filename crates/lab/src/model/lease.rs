//! The lease-plus-fencing recipe: baton's own election core against a modelled coordination
//! service (think etcd).
//!
//! Each node runs the very [`LeaseCore`] and [`Candidate`] the library uses, on its *local*
//! (possibly drifting) clock: it holds a lease with a TTL, creates a key bound to that lease,
//! and queues behind the key with the next-lower revision; the lowest revision leads and that
//! revision is its fencing token. The [`CoordinationService`] is a single always-correct node
//! on the reference clock: a lease expires `ttl` after the service *receives* its last
//! renewal, and an expired lease deletes its keys, which wakes the next waiter.
//!
//! A node acts as leader while its lease is live by its own clock and its candidate leads.
//! Safety rule 1 makes the local deadline come before the service's expiry as long as the
//! node's clock is no slower than `max_drift_ppm` allows; beyond that bound two nodes can act
//! at once, and only fencing (rule 2) keeps the old one's writes out.
//!
//! Requests to the service travel over what would be a gRPC stream: ordered and not lost
//! except by partitions. The node retries a request left unanswered for `request_timeout`;
//! the service makes the retries idempotent (one key per lease, as etcd's election recipe
//! does by naming the key after the lease).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use baton_core::{
    Candidate, CandidateAction, CandidateState, ElectionConfig, Instant, LeaseAction, LeaseCore,
    LeaseState,
};

use super::{Leadership, NodeId, Output, Process};

/// Configuration of a lease-recipe node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseConfig {
    /// The library's election configuration (TTL, renew interval, drift bound, margin).
    pub election: ElectionConfig,
    /// How long to wait for the service to answer a grant or a campaign request before
    /// retrying it.
    pub request_timeout: Duration,
}

impl Default for LeaseConfig {
    fn default() -> LeaseConfig {
        LeaseConfig {
            election: ElectionConfig::default()
                .with_ttl(Duration::from_millis(1500))
                .with_safety_margin(Duration::from_millis(50))
                .with_max_drift_ppm(10_000)
                .with_requeue(true),
            request_timeout: Duration::from_millis(1000),
        }
    }
}

/// Messages between lease nodes and the coordination service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Message {
    /// Node → service: grant a lease (`nonce` matches the answer to the request).
    Grant {
        /// The node's request number.
        nonce: u64,
        /// The requested TTL.
        ttl: Duration,
    },
    /// Node → service: renew `lease`.
    KeepAlive {
        /// The lease.
        lease: u64,
    },
    /// Node → service: drop `lease` and its keys.
    Revoke {
        /// The lease.
        lease: u64,
    },
    /// Node → service: create this node's key bound to `lease` (idempotent per lease).
    CreateEntry {
        /// The lease.
        lease: u64,
    },
    /// Node → service: which live key has the highest revision below `own`?
    FindPredecessor {
        /// The asking node's revision.
        own: u64,
    },
    /// Node → service: tell me when the key with `revision` is deleted.
    Watch {
        /// The watched key.
        revision: u64,
    },
    /// Node → service: delete my key with `revision`.
    DeleteEntry {
        /// The key.
        revision: u64,
    },
    /// Service → node: lease granted.
    Granted {
        /// Echo of the request's nonce.
        nonce: u64,
        /// The lease id.
        lease: u64,
        /// The granted TTL.
        ttl: Duration,
    },
    /// Service → node: renewal result; a zero TTL means the lease is gone.
    Renewed {
        /// The lease.
        lease: u64,
        /// Its TTL, or zero.
        ttl: Duration,
    },
    /// Service → node: that lease does not exist (any more).
    LeaseGone {
        /// The lease.
        lease: u64,
    },
    /// Service → node: your key exists with `revision`.
    KeyCreated {
        /// The lease it is bound to.
        lease: u64,
        /// Its revision.
        revision: u64,
    },
    /// Service → node: the key ahead of `own`, if any.
    Predecessor {
        /// The asking node's revision.
        own: u64,
        /// The next-lower live revision.
        predecessor: Option<u64>,
    },
    /// Service → node: your key `own` no longer exists.
    KeyGone {
        /// The revision asked about.
        own: u64,
    },
    /// Service → node: the watch on `revision` is in place.
    WatchCreated {
        /// The watched key.
        revision: u64,
    },
    /// Service → node: the watched key `revision` was deleted.
    Deleted {
        /// The deleted key.
        revision: u64,
    },
    /// Service → node: your own key `revision` was deleted (its lease expired).
    OwnKeyDeleted {
        /// The deleted key.
        revision: u64,
    },
}

/// What a lease node asks its driver to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send `message` to the coordination service.
    Send(Message),
    /// The candidate leads with `token` (it acts while the lease is live).
    BecameLeader {
        /// The key's revision.
        token: u64,
    },
    /// The candidate stopped leading.
    SteppedDown,
}

/// One node campaigning with baton's [`LeaseCore`] and [`Candidate`].
///
/// Call order: [`LeaseNode::start`]; then `handle_message` / `handle_timeout` (when
/// [`LeaseNode::poll_timeout`] passes) on the node's local clock; drain
/// [`LeaseNode::poll_action`] after each call.
#[derive(Debug, Clone)]
pub struct LeaseNode {
    config: LeaseConfig,
    lease: LeaseCore,
    lease_id: Option<u64>,
    /// Nonce of the current grant request; answers to older ones are stale.
    grant_nonce: u64,
    grant_sent_at: Option<Instant>,
    /// Renewals sent on the current stream and not yet answered.
    unanswered: u64,
    /// Answers still to come for renewals of streams the lease core gave up
    /// ([`LeaseAction::Reopen`]): the service answers in order, so they are the next ones,
    /// and they must never reach the core (they would count from a later send).
    stale_answers: u64,
    candidate: Candidate,
    /// The candidate asked for a key while no lease was live; create it once granted.
    pending_create: bool,
    /// The campaign request awaiting an answer, and when it was (last) sent.
    outstanding: Option<(Message, Instant)>,
    actions: VecDeque<Action>,
}

impl LeaseNode {
    /// A node with `config` (its election part should be valid).
    pub fn new(config: LeaseConfig) -> LeaseNode {
        LeaseNode {
            lease: LeaseCore::new(config.election.clone()),
            config,
            lease_id: None,
            grant_nonce: 0,
            grant_sent_at: None,
            unanswered: 0,
            stale_answers: 0,
            candidate: Candidate::new(true),
            pending_create: false,
            outstanding: None,
            actions: VecDeque::new(),
        }
    }

    // Getters.

    /// The candidate's state.
    pub fn candidate_state(&self) -> CandidateState {
        self.candidate.state()
    }

    /// The lease's state.
    pub fn lease_state(&self) -> LeaseState {
        self.lease.state()
    }

    /// The lease's local deadline.
    pub fn deadline(&self) -> Option<Instant> {
        self.lease.deadline()
    }

    /// Token and local deadline while acting as leader at `now`.
    pub fn leadership(&self, now: Instant) -> Option<Leadership> {
        let token = self.candidate.token()?;
        self.lease.is_live(now).then_some(Leadership {
            token,
            until: self.lease.deadline(),
        })
    }

    // Commands.

    /// Requests the first lease; the campaign starts once it is granted.
    pub fn start(&mut self, now: Instant) {
        self.lease.start(now);
        self.pump(now);
    }

    // Inputs.

    /// A message from the service.
    pub fn handle_message(&mut self, now: Instant, message: Message) {
        match message {
            Message::Granted { nonce, lease, ttl } => self.on_granted(now, nonce, lease, ttl),
            Message::Renewed { lease, ttl } if self.lease_id == Some(lease) => {
                if self.stale_answers > 0 {
                    self.stale_answers -= 1;
                } else {
                    self.unanswered = self.unanswered.saturating_sub(1);
                    self.lease.handle_renewed(now, ttl);
                }
            }
            Message::LeaseGone { lease } if self.lease_id == Some(lease) => {
                self.outstanding = None;
                self.lease.handle_lease_gone(now);
            }
            Message::KeyCreated { lease, revision } => self.on_key_created(lease, revision),
            Message::Predecessor { own, predecessor } if self.own_position() == Some(own) => {
                if matches!(self.candidate.state(), CandidateState::Positioning { .. }) {
                    self.outstanding = None;
                    self.candidate.handle_predecessor(predecessor);
                }
            }
            Message::KeyGone { own: revision } | Message::OwnKeyDeleted { revision }
                if self.own_position() == Some(revision) =>
            {
                self.outstanding = None;
                self.candidate.handle_entry_deleted();
            }
            Message::WatchCreated { revision } => self.clear_outstanding_watch(revision),
            Message::Deleted { revision } => {
                self.clear_outstanding_watch(revision);
                self.candidate.handle_predecessor_deleted(revision);
            }
            _ => {}
        }
        self.pump(now);
    }

    /// Time passed (on this node's clock).
    pub fn handle_timeout(&mut self, now: Instant) {
        self.lease.handle_timeout(now);
        let timeout = self.config.request_timeout;
        if self.lease.state() == LeaseState::Granting
            && self.grant_sent_at.is_some_and(|at| now >= at + timeout)
        {
            self.lease.handle_grant_failed(now);
        }
        self.pump(now);
        if let Some((message, sent_at)) = self.outstanding {
            if now >= sent_at + timeout {
                self.outstanding = Some((message, now));
                self.actions.push_back(Action::Send(message));
            }
        }
    }

    // Outputs.

    /// The next action.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When to call [`LeaseNode::handle_timeout`].
    pub fn poll_timeout(&self) -> Option<Instant> {
        let timeout = self.config.request_timeout;
        let grant = (self.lease.state() == LeaseState::Granting)
            .then(|| self.grant_sent_at.map(|at| at + timeout))
            .flatten();
        let request = self.outstanding.map(|(_, at)| at + timeout);
        [self.lease.poll_timeout(), grant, request]
            .into_iter()
            .flatten()
            .min()
    }

    // Handlers.

    fn on_granted(&mut self, now: Instant, nonce: u64, lease: u64, ttl: Duration) {
        if nonce != self.grant_nonce || self.lease.state() != LeaseState::Granting {
            // An answer to a grant we gave up on: release it.
            self.actions
                .push_back(Action::Send(Message::Revoke { lease }));
            return;
        }
        self.lease_id = Some(lease);
        self.grant_sent_at = None;
        // Answers for an earlier lease carry its id and are dropped by it.
        (self.unanswered, self.stale_answers) = (0, 0);
        self.lease.handle_granted(now, ttl);
        self.candidate.campaign();
    }

    fn on_key_created(&mut self, lease: u64, revision: u64) {
        if self.lease_id != Some(lease) {
            // Created under a lease we no longer hold: remove it rather than queue on it.
            self.actions
                .push_back(Action::Send(Message::DeleteEntry { revision }));
            return;
        }
        if self.candidate.state() == CandidateState::Creating {
            self.outstanding = None;
            self.candidate.handle_entry_created(revision);
        }
    }

    fn clear_outstanding_watch(&mut self, revision: u64) {
        if matches!(self.outstanding, Some((Message::Watch { revision: r }, _)) if r == revision) {
            self.outstanding = None;
        }
    }

    /// Drains both cores until neither has anything left to say.
    fn pump(&mut self, now: Instant) {
        loop {
            let mut progressed = false;
            while let Some(action) = self.lease.poll_action() {
                progressed = true;
                self.on_lease_action(now, action);
            }
            while let Some(action) = self.candidate.poll_action() {
                progressed = true;
                self.on_candidate_action(now, action);
            }
            if matches!(
                self.lease.state(),
                LeaseState::Expired | LeaseState::Revoked
            ) {
                // Campaign on: a fresh lease for the requeued candidate.
                progressed = true;
                self.lease = LeaseCore::new(self.config.election.clone());
                self.lease.start(now);
            }
            if self.pending_create && self.lease.is_live(now) {
                self.pending_create = false;
                let lease = self.lease_id.expect("a live lease has an id");
                self.request(now, Message::CreateEntry { lease });
            }
            if !progressed {
                return;
            }
        }
    }

    fn on_lease_action(&mut self, now: Instant, action: LeaseAction) {
        match action {
            LeaseAction::Grant { ttl } => {
                self.grant_nonce += 1;
                self.grant_sent_at = Some(now);
                self.actions.push_back(Action::Send(Message::Grant {
                    nonce: self.grant_nonce,
                    ttl,
                }));
            }
            LeaseAction::Reopen => {
                self.stale_answers += std::mem::take(&mut self.unanswered);
            }
            LeaseAction::Renew => {
                self.unanswered += 1;
                let lease = self.lease_id.expect("an active lease has an id");
                self.actions
                    .push_back(Action::Send(Message::KeepAlive { lease }));
            }
            LeaseAction::Expired => {
                self.candidate.handle_lease_expired();
            }
            LeaseAction::Revoke => {
                if let Some(lease) = self.lease_id {
                    self.actions
                        .push_back(Action::Send(Message::Revoke { lease }));
                }
            }
        }
    }

    fn on_candidate_action(&mut self, now: Instant, action: CandidateAction) {
        match action {
            CandidateAction::CreateEntry => match self.lease_id {
                Some(lease) if self.lease.is_live(now) => {
                    self.request(now, Message::CreateEntry { lease })
                }
                _ => self.pending_create = true,
            },
            CandidateAction::FindPredecessor { own_position } => {
                self.request(now, Message::FindPredecessor { own: own_position })
            }
            CandidateAction::WatchPredecessor { position: revision } => {
                self.request(now, Message::Watch { revision })
            }
            CandidateAction::Elected { token } => {
                self.actions.push_back(Action::BecameLeader { token })
            }
            CandidateAction::Lost { was_leading, .. } => {
                self.outstanding = None;
                if was_leading {
                    self.actions.push_back(Action::SteppedDown);
                }
            }
            CandidateAction::DeleteEntry { position: revision } => self
                .actions
                .push_back(Action::Send(Message::DeleteEntry { revision })),
        }
    }

    fn request(&mut self, now: Instant, message: Message) {
        self.outstanding = Some((message, now));
        self.actions.push_back(Action::Send(message));
    }

    fn own_position(&self) -> Option<u64> {
        match self.candidate.state() {
            CandidateState::Positioning { own_position }
            | CandidateState::Queued { own_position, .. } => Some(own_position),
            CandidateState::Leading { token } => Some(token),
            _ => None,
        }
    }
}

/// A lease held at the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ServerLease {
    owner: NodeId,
    ttl: Duration,
    expires_at: Instant,
}

/// A key in the election's prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    owner: NodeId,
    lease: u64,
}

/// What the service asks its driver to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceAction {
    /// Send `message` to node `to`.
    Send {
        /// Destination.
        to: NodeId,
        /// The message.
        message: Message,
    },
}

/// The modelled coordination service: leases with server-side expiry and keys whose
/// revisions order the queue. Always correct; runs on the reference clock.
///
/// Call order: `handle_message` / `handle_timeout` (when
/// [`CoordinationService::poll_timeout`] passes); drain [`CoordinationService::poll_action`].
#[derive(Debug, Clone, Default)]
pub struct CoordinationService {
    next_lease: u64,
    revision: u64,
    leases: BTreeMap<u64, ServerLease>,
    keys: BTreeMap<u64, Key>,
    watches: Vec<(u64, NodeId)>,
    actions: VecDeque<ServiceAction>,
}

impl CoordinationService {
    /// An empty service.
    pub fn new() -> CoordinationService {
        CoordinationService::default()
    }

    // Getters.

    /// The leader key's revision (the lowest live key), if any.
    pub fn leader_revision(&self) -> Option<u64> {
        self.keys.keys().next().copied()
    }

    /// The number of live leases.
    pub fn lease_count(&self) -> usize {
        self.leases.len()
    }

    // Inputs.

    /// A request from node `from`.
    pub fn handle_message(&mut self, now: Instant, from: NodeId, message: Message) {
        self.expire(now);
        match message {
            Message::Grant { nonce, ttl } => {
                self.next_lease += 1;
                let lease = self.next_lease;
                let expires_at = now + ttl;
                self.leases.insert(
                    lease,
                    ServerLease {
                        owner: from,
                        ttl,
                        expires_at,
                    },
                );
                self.send(from, Message::Granted { nonce, lease, ttl });
            }
            Message::KeepAlive { lease } => {
                let ttl = match self.leases.get_mut(&lease) {
                    Some(held) => {
                        held.expires_at = now + held.ttl;
                        held.ttl
                    }
                    None => Duration::ZERO,
                };
                self.send(from, Message::Renewed { lease, ttl });
            }
            Message::Revoke { lease }
                if self.leases.get(&lease).is_some_and(|l| l.owner == from) =>
            {
                self.drop_lease(lease);
            }
            Message::CreateEntry { lease } => self.create_key(from, lease),
            Message::FindPredecessor { own } => {
                let answer = if self.keys.contains_key(&own) {
                    let predecessor = self.keys.range(..own).next_back().map(|(&rev, _)| rev);
                    Message::Predecessor { own, predecessor }
                } else {
                    Message::KeyGone { own }
                };
                self.send(from, answer);
            }
            Message::Watch { revision } => {
                if self.keys.contains_key(&revision) {
                    if !self.watches.contains(&(revision, from)) {
                        self.watches.push((revision, from));
                    }
                    self.send(from, Message::WatchCreated { revision });
                } else {
                    self.send(from, Message::Deleted { revision });
                }
            }
            Message::DeleteEntry { revision }
                if self
                    .keys
                    .get(&revision)
                    .is_some_and(|key| key.owner == from) =>
            {
                self.delete_key(revision, true);
            }
            _ => {}
        }
    }

    /// Time passed: expire leases whose TTL ran out since their last renewal was received.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.expire(now);
    }

    // Outputs.

    /// The next action.
    pub fn poll_action(&mut self) -> Option<ServiceAction> {
        self.actions.pop_front()
    }

    /// The next lease expiry.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.leases.values().map(|lease| lease.expires_at).min()
    }

    fn create_key(&mut self, from: NodeId, lease: u64) {
        if self.leases.get(&lease).is_none_or(|l| l.owner != from) {
            self.send(from, Message::LeaseGone { lease });
            return;
        }
        let existing = self
            .keys
            .iter()
            .find(|(_, key)| key.lease == lease)
            .map(|(&revision, _)| revision);
        let revision = existing.unwrap_or_else(|| {
            self.revision += 1;
            self.keys.insert(self.revision, Key { owner: from, lease });
            self.revision
        });
        self.send(from, Message::KeyCreated { lease, revision });
    }

    fn expire(&mut self, now: Instant) {
        let expired: Vec<u64> = self
            .leases
            .iter()
            .filter(|(_, lease)| lease.expires_at <= now)
            .map(|(&id, _)| id)
            .collect();
        for lease in expired {
            self.drop_lease(lease);
        }
    }

    fn drop_lease(&mut self, lease: u64) {
        self.leases.remove(&lease);
        let keys: Vec<u64> = self
            .keys
            .iter()
            .filter(|(_, key)| key.lease == lease)
            .map(|(&revision, _)| revision)
            .collect();
        for revision in keys {
            self.delete_key(revision, false);
        }
    }

    fn delete_key(&mut self, revision: u64, by_owner: bool) {
        let Some(key) = self.keys.remove(&revision) else {
            return;
        };
        let mut fired = Vec::new();
        self.watches.retain(|&(watched, watcher)| {
            let hit = watched == revision;
            if hit {
                fired.push(watcher);
            }
            !hit
        });
        for watcher in fired {
            self.send(watcher, Message::Deleted { revision });
        }
        if !by_owner {
            self.send(key.owner, Message::OwnKeyDeleted { revision });
        }
    }

    fn send(&mut self, to: NodeId, message: Message) {
        self.actions.push_back(ServiceAction::Send { to, message });
    }
}

/// A lease-recipe endpoint: a campaigning node or the coordination service.
#[derive(Debug, Clone)]
pub enum LeaseProcess {
    /// A node running baton's election core, and the service's endpoint.
    Node {
        /// The node.
        node: Box<LeaseNode>,
        /// Where the coordination service is.
        service: NodeId,
    },
    /// The coordination service.
    Service(CoordinationService),
}

/// The lease recipe as a simulator [`super::Algorithm`]: nodes `0..n` plus the service at
/// endpoint `n`.
#[derive(Debug, Clone, Default)]
pub struct Lease {
    /// Configuration shared by every node.
    pub config: LeaseConfig,
}

impl super::Algorithm for Lease {
    type Process = LeaseProcess;

    fn node(&self, _id: NodeId, nodes: usize, _stable: Option<&()>) -> LeaseProcess {
        LeaseProcess::Node {
            node: Box::new(LeaseNode::new(self.config.clone())),
            service: nodes,
        }
    }

    fn infrastructure(&self, _nodes: usize) -> Vec<LeaseProcess> {
        vec![LeaseProcess::Service(CoordinationService::new())]
    }
}

impl Process for LeaseProcess {
    type Message = Message;
    type Stable = ();

    fn start(&mut self, now: Instant, _entropy: u64) {
        if let LeaseProcess::Node { node, .. } = self {
            node.start(now);
        }
    }

    fn handle_message(&mut self, now: Instant, _entropy: u64, from: NodeId, message: Message) {
        match self {
            LeaseProcess::Node { node, .. } => node.handle_message(now, message),
            LeaseProcess::Service(service) => service.handle_message(now, from, message),
        }
    }

    fn handle_timeout(&mut self, now: Instant, _entropy: u64) {
        match self {
            LeaseProcess::Node { node, .. } => node.handle_timeout(now),
            LeaseProcess::Service(service) => service.handle_timeout(now),
        }
    }

    fn poll_output(&mut self) -> Option<Output<Message, ()>> {
        match self {
            LeaseProcess::Node { node, service } => loop {
                match node.poll_action()? {
                    Action::Send(message) => {
                        return Some(Output::Send {
                            to: *service,
                            message,
                        })
                    }
                    Action::BecameLeader { .. } | Action::SteppedDown => {}
                }
            },
            LeaseProcess::Service(service) => {
                let ServiceAction::Send { to, message } = service.poll_action()?;
                Some(Output::Send { to, message })
            }
        }
    }

    fn poll_timeout(&self) -> Option<Instant> {
        match self {
            LeaseProcess::Node { node, .. } => node.poll_timeout(),
            LeaseProcess::Service(service) => service.poll_timeout(),
        }
    }

    fn leadership(&self, now: Instant) -> Option<Leadership> {
        match self {
            LeaseProcess::Node { node, .. } => node.leadership(now),
            LeaseProcess::Service(_) => None,
        }
    }

    fn is_election_traffic(message: &Message) -> bool {
        !matches!(message, Message::KeepAlive { .. } | Message::Renewed { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_millis(ms)
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn drain(node: &mut LeaseNode) -> Vec<Action> {
        std::iter::from_fn(|| node.poll_action()).collect()
    }

    fn drain_service(service: &mut CoordinationService) -> Vec<ServiceAction> {
        std::iter::from_fn(|| service.poll_action()).collect()
    }

    fn to(node: NodeId, message: Message) -> ServiceAction {
        ServiceAction::Send { to: node, message }
    }

    /// Walks a node to leadership with lease 1 and revision `revision`, granted at 0 ms.
    fn leading(revision: u64) -> LeaseNode {
        let mut node = LeaseNode::new(LeaseConfig::default());
        node.start(at(0));
        assert_eq!(
            drain(&mut node),
            vec![Action::Send(Message::Grant {
                nonce: 1,
                ttl: ms(1500)
            })]
        );
        node.handle_message(
            at(2),
            Message::Granted {
                nonce: 1,
                lease: 1,
                ttl: ms(1500),
            },
        );
        assert_eq!(
            drain(&mut node),
            vec![Action::Send(Message::CreateEntry { lease: 1 })]
        );
        node.handle_message(at(4), Message::KeyCreated { lease: 1, revision });
        assert_eq!(
            drain(&mut node),
            vec![Action::Send(Message::FindPredecessor { own: revision })]
        );
        node.handle_message(
            at(6),
            Message::Predecessor {
                own: revision,
                predecessor: None,
            },
        );
        assert_eq!(
            drain(&mut node),
            vec![Action::BecameLeader { token: revision }]
        );
        node
    }

    #[test]
    fn node_leads_with_its_revision_until_the_local_deadline() {
        let node = leading(7);
        // 1500 ms less 1% (15 ms) less the 50 ms margin, from the grant's send time (0).
        assert_eq!(node.deadline(), Some(at(1435)));
        assert_eq!(
            node.leadership(at(1434)),
            Some(Leadership {
                token: 7,
                until: Some(at(1435))
            })
        );
        assert_eq!(node.leadership(at(1435)), None);
        // Renew a third of the TTL after the grant arrived.
        assert_eq!(node.poll_timeout(), Some(at(502)));
    }

    #[test]
    fn silent_service_expiry_loses_leadership_and_campaigns_on_a_fresh_lease() {
        let mut node = leading(7);
        for now in [502, 1002] {
            node.handle_timeout(at(now));
            assert_eq!(
                drain(&mut node),
                vec![Action::Send(Message::KeepAlive { lease: 1 })]
            );
        }
        node.handle_timeout(at(1435));
        assert_eq!(
            drain(&mut node),
            vec![
                Action::SteppedDown,
                Action::Send(Message::DeleteEntry { revision: 7 }),
                Action::Send(Message::Grant {
                    nonce: 2,
                    ttl: ms(1500)
                }),
            ]
        );
        assert_eq!(node.candidate_state(), CandidateState::Creating);
        // The key is created only once the new lease is granted.
        node.handle_message(
            at(1440),
            Message::Granted {
                nonce: 2,
                lease: 5,
                ttl: ms(1500),
            },
        );
        assert_eq!(
            drain(&mut node),
            vec![Action::Send(Message::CreateEntry { lease: 5 })]
        );
        // A late answer for the old lease creates nothing we keep.
        node.handle_message(
            at(1441),
            Message::KeyCreated {
                lease: 1,
                revision: 9,
            },
        );
        assert_eq!(
            drain(&mut node),
            vec![Action::Send(Message::DeleteEntry { revision: 9 })]
        );
    }

    #[test]
    fn waiter_watches_its_predecessor_and_retries_unanswered_requests() {
        let mut node = LeaseNode::new(LeaseConfig::default());
        node.start(at(0));
        node.handle_message(
            at(1),
            Message::Granted {
                nonce: 1,
                lease: 2,
                ttl: ms(1500),
            },
        );
        node.handle_message(
            at(2),
            Message::KeyCreated {
                lease: 2,
                revision: 9,
            },
        );
        node.handle_message(
            at(3),
            Message::Predecessor {
                own: 9,
                predecessor: Some(4),
            },
        );
        let actions = drain(&mut node);
        assert_eq!(
            actions.last(),
            Some(&Action::Send(Message::Watch { revision: 4 }))
        );
        // No WatchCreated: the watch is sent again after the request timeout.
        node.handle_timeout(at(501));
        assert_eq!(
            drain(&mut node),
            vec![Action::Send(Message::KeepAlive { lease: 2 })]
        );
        node.handle_timeout(at(1003));
        assert_eq!(
            drain(&mut node),
            vec![
                Action::Send(Message::KeepAlive { lease: 2 }),
                Action::Send(Message::Watch { revision: 4 })
            ]
        );
        node.handle_message(at(1004), Message::Deleted { revision: 4 });
        assert_eq!(
            drain(&mut node),
            vec![Action::Send(Message::FindPredecessor { own: 9 })]
        );
    }

    #[test]
    fn service_expires_leases_from_receive_time_and_wakes_the_next_waiter() {
        let mut service = CoordinationService::new();
        let ttl = ms(1500);
        service.handle_message(at(10), 0, Message::Grant { nonce: 1, ttl });
        service.handle_message(at(10), 1, Message::Grant { nonce: 1, ttl });
        service.handle_message(at(11), 0, Message::CreateEntry { lease: 1 });
        service.handle_message(at(12), 1, Message::CreateEntry { lease: 2 });
        // Idempotent: a retried create returns the same key.
        service.handle_message(at(13), 1, Message::CreateEntry { lease: 2 });
        service.handle_message(at(14), 1, Message::FindPredecessor { own: 2 });
        service.handle_message(at(15), 1, Message::Watch { revision: 1 });
        assert_eq!(
            drain_service(&mut service),
            vec![
                to(
                    0,
                    Message::Granted {
                        nonce: 1,
                        lease: 1,
                        ttl
                    }
                ),
                to(
                    1,
                    Message::Granted {
                        nonce: 1,
                        lease: 2,
                        ttl
                    }
                ),
                to(
                    0,
                    Message::KeyCreated {
                        lease: 1,
                        revision: 1
                    }
                ),
                to(
                    1,
                    Message::KeyCreated {
                        lease: 2,
                        revision: 2
                    }
                ),
                to(
                    1,
                    Message::KeyCreated {
                        lease: 2,
                        revision: 2
                    }
                ),
                to(
                    1,
                    Message::Predecessor {
                        own: 2,
                        predecessor: Some(1)
                    }
                ),
                to(1, Message::WatchCreated { revision: 1 }),
            ]
        );
        assert_eq!(service.leader_revision(), Some(1));
        service.handle_message(at(800), 1, Message::KeepAlive { lease: 2 });
        assert_eq!(
            drain_service(&mut service),
            vec![to(1, Message::Renewed { lease: 2, ttl })]
        );
        assert_eq!(service.poll_timeout(), Some(at(1510)));
        service.handle_timeout(at(1510));
        assert_eq!(
            drain_service(&mut service),
            vec![
                to(1, Message::Deleted { revision: 1 }),
                to(0, Message::OwnKeyDeleted { revision: 1 }),
            ]
        );
        assert_eq!(service.leader_revision(), Some(2));
        // The expired lease answers renewals with a zero TTL and refuses keys.
        service.handle_message(at(1600), 0, Message::KeepAlive { lease: 1 });
        service.handle_message(at(1601), 0, Message::CreateEntry { lease: 1 });
        assert_eq!(
            drain_service(&mut service),
            vec![
                to(
                    0,
                    Message::Renewed {
                        lease: 1,
                        ttl: Duration::ZERO
                    }
                ),
                to(0, Message::LeaseGone { lease: 1 }),
            ]
        );
    }

    #[test]
    fn own_key_deleted_at_the_service_is_a_loss() {
        let mut node = leading(3);
        node.handle_message(at(100), Message::OwnKeyDeleted { revision: 3 });
        assert_eq!(
            drain(&mut node),
            vec![
                Action::SteppedDown,
                Action::Send(Message::CreateEntry { lease: 1 })
            ]
        );
        assert_eq!(node.leadership(at(101)), None);
    }
}
