//! The deterministic simulator: one seeded generator, a virtual clock that jumps from event to
//! event, a lossy network with partitions, crashes, pauses and drifting clocks.
//!
//! The simulator drives any [`Algorithm`] through the common [`Process`] face. Besides
//! delivering messages and timers it plays the workload: every node that acts as leader
//! issues a write to a shared resource every `write_interval`, carrying its token. Each write
//! reaches two copies of the resource, one guarded by baton's [`Fence`] and one unguarded, so
//! one run shows what fencing buys.
//!
//! It records every node's acting-as-leader intervals, every write, every fault window, and it
//! checks safety *after every step* (see [`Violation`]): the first violations are kept with
//! their time, the rest are counted.
//!
//! Time is kept in nanoseconds of "real" (reference) time. Each node sees its own clock,
//! which may run faster or slower; the coordination service (infrastructure) runs on the
//! reference clock.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt;
use std::time::Duration;

use baton_core::{Fence, Instant};

use crate::model::{Algorithm, Leadership, NodeId, Output, Process, MAX_NODES};
use crate::rng::Rng;
use crate::scenario::{Fault, Scenario, Side, Target};

/// Nanoseconds of simulated reference time.
pub type Nanos = u64;

/// Events allowed in the queue at once; message deliveries beyond it are dropped and counted
/// (a model flooding the network is a bug this makes visible instead of exhausting memory).
const MAX_QUEUED_EVENTS: usize = 1 << 20;
/// Messages held for a paused process; more are dropped, as a full socket buffer would.
const MAX_HELD_MESSAGES: usize = 4096;
/// Violations kept with their details; further ones are only counted.
const MAX_KEPT_VIOLATIONS: usize = 16;

/// The network's behaviour.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkConfig {
    /// Each directed link's base latency is drawn once per run between this ...
    pub min_link_latency: Duration,
    /// ... and this.
    pub max_link_latency: Duration,
    /// Chance (parts per million) that a message is slow ...
    pub tail_ppm: u32,
    /// ... by up to this much more.
    pub tail_latency: Duration,
    /// Chance (ppm) that a peer-to-peer message is lost.
    pub loss_ppm: u32,
    /// Chance (ppm) that a peer-to-peer message is delivered twice.
    pub duplicate_ppm: u32,
}

impl Default for NetworkConfig {
    fn default() -> NetworkConfig {
        NetworkConfig {
            min_link_latency: Duration::from_millis(1),
            max_link_latency: Duration::from_millis(5),
            tail_ppm: 10_000,
            tail_latency: Duration::from_millis(50),
            loss_ppm: 1_000,
            duplicate_ppm: 1_000,
        }
    }
}

/// One simulation's parameters (the scenario comes separately).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// Number of nodes (3 to 32).
    pub nodes: usize,
    /// The seed; everything random follows from it.
    pub seed: u64,
    /// The network.
    pub network: NetworkConfig,
    /// How often a leader writes to the fenced resource.
    pub write_interval: Duration,
    /// Each node's clock rate is drawn once in ±this many ppm (ordinary quartz drift).
    pub clock_drift_ppm: u32,
}

impl Default for SimConfig {
    fn default() -> SimConfig {
        SimConfig {
            nodes: 5,
            seed: 42,
            network: NetworkConfig::default(),
            write_interval: Duration::from_millis(100),
            clock_drift_ppm: 100,
        }
    }
}

/// A span during which one node acted as leader with one token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeadershipInterval {
    /// The node.
    pub node: NodeId,
    /// Its token.
    pub token: u64,
    /// When it started acting.
    pub start: Nanos,
    /// When it stopped (or the run ended).
    pub end: Nanos,
}

/// One write to the resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteRecord {
    /// The writer.
    pub node: NodeId,
    /// The token it carried.
    pub token: u64,
    /// When the writer issued it (it checked it was leader then).
    pub issued: Nanos,
    /// When it reached the resource.
    pub arrived: Nanos,
    /// Stale: the resource had already received a write from a different leadership with a
    /// token at least as high. The unfenced copy accepts it anyway.
    pub stale: bool,
    /// Whether the fenced copy accepted it.
    pub accepted_fenced: bool,
}

/// What a fault window shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowKind {
    /// The nodes are crashed.
    Crash,
    /// The nodes are frozen.
    Pause,
    /// The nodes are cut off from the rest.
    Partition,
    /// The nodes' outbound links fail.
    OneWay,
    /// The nodes' clocks run at a wrong rate.
    Clock,
}

/// A fault as it happened, for the checker and the charts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultWindow {
    /// What.
    pub kind: WindowKind,
    /// From.
    pub start: Nanos,
    /// Until.
    pub end: Nanos,
    /// Which nodes (bit mask).
    pub nodes: u32,
    /// A short label.
    pub label: String,
}

/// A safety property broken at some instant, found by the checks run after every step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Violation {
    /// Two nodes acted as leader at once (`second` started while `first` still acted).
    /// Source: DESIGN.md §2 rule 1, "stop before anyone else can start".
    Overlap {
        /// When.
        at: Nanos,
        /// The node already acting.
        first: NodeId,
        /// The node that started.
        second: NodeId,
    },
    /// Two different nodes led with the same token. For Raft this is two leaders in one term.
    /// Source: Raft §5.2, Election Safety.
    SharedToken {
        /// When the second leadership started.
        at: Nanos,
        /// The token.
        token: u64,
        /// The earlier holder.
        first: NodeId,
        /// The later holder.
        second: NodeId,
    },
    /// The fenced resource accepted a stale write. Source: DESIGN.md §2 rule 2; Kleppmann,
    /// "How to do distributed locking" (2016).
    FencedStaleWrite {
        /// When it arrived.
        at: Nanos,
        /// The writer.
        node: NodeId,
        /// Its token.
        token: u64,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Violation::Overlap { at, first, second } => write!(
                f,
                "at {} ms node {second} started acting as leader while node {first} still did",
                at / 1_000_000
            ),
            Violation::SharedToken {
                at,
                token,
                first,
                second,
            } => write!(
                f,
                "at {} ms node {second} led with token {token}, which node {first} had led with",
                at / 1_000_000
            ),
            Violation::FencedStaleWrite { at, node, token } => write!(
                f,
                "at {} ms the fenced resource accepted a stale write from node {node} with token {token}",
                at / 1_000_000
            ),
        }
    }
}

/// Everything one run recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// Number of nodes.
    pub nodes: usize,
    /// The seed.
    pub seed: u64,
    /// Run length.
    pub duration: Nanos,
    /// Acting-as-leader intervals, in the order they ended.
    pub leaderships: Vec<LeadershipInterval>,
    /// Writes that reached the resource before the end, in issue order.
    pub writes: Vec<WriteRecord>,
    /// Faults as they happened.
    pub faults: Vec<FaultWindow>,
    /// The first violations found by the per-step checks.
    pub violations: Vec<Violation>,
    /// How many overlaps, shared tokens and fenced stale writes were found in all.
    pub violation_counts: [u64; 3],
    /// Messages sent (including lost ones).
    pub messages: u64,
    /// Of which election traffic (not heartbeats or lease renewals).
    pub election_messages: u64,
    /// Events processed.
    pub events: u64,
    /// Deliveries dropped because the event queue was full (should be zero).
    pub overflow: u64,
    /// A hash of every processed event and the recorded outcome: equal seeds give equal
    /// hashes.
    pub hash: u64,
}

impl Trace {
    /// The trace of a run that has recorded nothing yet.
    pub(crate) fn new(nodes: usize, seed: u64, duration: Nanos) -> Trace {
        Trace {
            nodes,
            seed,
            duration,
            leaderships: Vec::new(),
            writes: Vec::new(),
            faults: Vec::new(),
            violations: Vec::new(),
            violation_counts: [0; 3],
            messages: 0,
            election_messages: 0,
            events: 0,
            overflow: 0,
            hash: 0,
        }
    }
}

/// 64-bit FNV-1a, written out so that trace hashes never change with a dependency.
#[derive(Debug, Clone, Copy)]
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, value: u64) {
        for byte in value.to_le_bytes() {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// A node's clock: `local = anchor_local + (real − anchor_real) · (10⁶ + rate_ppm) / 10⁶`.
#[derive(Debug, Clone, Copy)]
struct Clock {
    anchor_real: Nanos,
    anchor_local: u64,
    rate_ppm: i64,
}

const PPM: i128 = 1_000_000;

impl Clock {
    fn new(rate_ppm: i64) -> Clock {
        Clock {
            anchor_real: 0,
            anchor_local: 0,
            rate_ppm,
        }
    }

    fn local(&self, real: Nanos) -> u64 {
        let elapsed = i128::from(real.saturating_sub(self.anchor_real));
        let local = elapsed * (PPM + i128::from(self.rate_ppm)) / PPM;
        self.anchor_local
            .saturating_add(u64::try_from(local).unwrap_or(u64::MAX))
    }

    /// The first real instant at which the local clock reads at least `local`.
    fn real(&self, local: u64) -> Nanos {
        let rate = PPM + i128::from(self.rate_ppm);
        if local <= self.anchor_local {
            let back = i128::from(self.anchor_local - local) * PPM / rate;
            return self
                .anchor_real
                .saturating_sub(u64::try_from(back).unwrap_or(u64::MAX));
        }
        let ahead = i128::from(local - self.anchor_local) * PPM;
        let real = (ahead + rate - 1) / rate;
        self.anchor_real
            .saturating_add(u64::try_from(real).unwrap_or(u64::MAX))
    }

    fn set_rate(&mut self, real: Nanos, rate_ppm: i64) {
        self.anchor_local = self.local(real);
        self.anchor_real = real;
        self.rate_ppm = rate_ppm;
    }
}

enum Event<M> {
    Deliver { from: usize, to: usize, message: M },
    Timer { endpoint: usize, generation: u64 },
    WriteTick { node: usize },
    WriteArrive { write: usize },
    Fault { index: usize },
    Block { partition: usize },
    Heal { partition: usize },
    Boot { node: usize },
    Resume { node: usize },
}

impl<M> Event<M> {
    fn tag(&self) -> (u64, u64) {
        match *self {
            Event::Deliver { from, to, .. } => (1, (from * 64 + to) as u64),
            Event::Timer { endpoint, .. } => (2, endpoint as u64),
            Event::WriteTick { node } => (3, node as u64),
            Event::WriteArrive { write } => (4, write as u64),
            Event::Fault { index } => (5, index as u64),
            Event::Block { partition } => (6, partition as u64),
            Event::Heal { partition } => (7, partition as u64),
            Event::Boot { node } => (8, node as u64),
            Event::Resume { node } => (9, node as u64),
        }
    }
}

struct Entry<M> {
    at: Nanos,
    seq: u64,
    event: Event<M>,
}

impl<M> PartialEq for Entry<M> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl<M> Eq for Entry<M> {}

impl<M> PartialOrd for Entry<M> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<M> Ord for Entry<M> {
    /// Reversed, so that the max-heap pops the earliest event (ties: first scheduled).
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

#[derive(Debug, Clone, Copy)]
struct Open {
    token: u64,
    start: Nanos,
    /// The real instant at which the node stops acting on its own (lease deadline).
    until: Option<Nanos>,
}

impl Open {
    fn acting_at(&self, now: Nanos) -> bool {
        self.until.is_none_or(|until| until > now)
    }
}

struct Slot<S, M> {
    infrastructure: bool,
    stable: Option<S>,
    clock: Clock,
    paused_until: Option<Nanos>,
    held: Vec<(usize, M)>,
    generation: u64,
    armed: Option<Nanos>,
    open: Option<Open>,
    clock_window: Option<usize>,
}

struct Partition {
    pairs: Vec<(usize, usize)>,
    active: bool,
}

enum Input<M> {
    Start,
    Message(usize, M),
    Timeout,
}

type Msg<A> = <<A as Algorithm>::Process as Process>::Message;
type Stable<A> = <<A as Algorithm>::Process as Process>::Stable;

/// Runs `scenario` against `algorithm` and returns what happened.
///
/// # Panics
/// If `config.nodes` is outside `3..=32` (the command line validates it first).
pub fn simulate<A: Algorithm>(algorithm: &A, scenario: &Scenario, config: &SimConfig) -> Trace {
    assert!(
        (3..=MAX_NODES).contains(&config.nodes),
        "3 to {MAX_NODES} nodes"
    );
    let mut sim = Sim::new(algorithm, scenario, config);
    sim.run();
    sim.finish()
}

struct Sim<'a, A: Algorithm> {
    algorithm: &'a A,
    config: &'a SimConfig,
    scenario: &'a Scenario,
    nodes: usize,
    endpoints: usize,
    duration: Nanos,
    now: Nanos,
    seq: u64,
    queue: BinaryHeap<Entry<Msg<A>>>,
    rng: Rng,
    processes: Vec<Option<A::Process>>,
    slots: Vec<Slot<Stable<A>, Msg<A>>>,
    base_latency: Vec<Nanos>,
    resource_latency: Vec<Nanos>,
    blocked: Vec<u16>,
    last_fifo: Vec<Nanos>,
    partitions: Vec<Partition>,
    resolved: Vec<Option<NodeId>>,
    armed_pause: Option<(NodeId, Nanos)>,
    fence: Fence,
    /// Highest token the resource has received and the nodes that wrote with it.
    received_max: Option<(u64, u32)>,
    token_holders: BTreeMap<u64, u32>,
    outbox: Vec<Output<Msg<A>, Stable<A>>>,
    hash: Fnv,
    trace: Trace,
}

fn nanos(duration: Duration) -> Nanos {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

impl<'a, A: Algorithm> Sim<'a, A> {
    fn new(algorithm: &'a A, scenario: &'a Scenario, config: &'a SimConfig) -> Sim<'a, A> {
        let nodes = config.nodes;
        let mut rng = Rng::new(config.seed);
        let infrastructure = algorithm.infrastructure(nodes);
        let endpoints = nodes + infrastructure.len();
        let network = &config.network;
        let (low, high) = (
            nanos(network.min_link_latency),
            nanos(network.max_link_latency),
        );
        let base_latency = (0..endpoints * endpoints)
            .map(|_| rng.between(low, high))
            .collect();
        let resource_latency = (0..nodes).map(|_| rng.between(low, high)).collect();
        let drift = i64::from(config.clock_drift_ppm);
        let slots = (0..endpoints)
            .map(|endpoint| {
                let infra = endpoint >= nodes;
                let rate = if infra {
                    0
                } else {
                    rng.between(0, 2 * drift as u64) as i64 - drift
                };
                Slot {
                    infrastructure: infra,
                    stable: None,
                    clock: Clock::new(rate),
                    paused_until: None,
                    held: Vec::new(),
                    generation: 0,
                    armed: None,
                    open: None,
                    clock_window: None,
                }
            })
            .collect();
        let mut processes: Vec<Option<A::Process>> = (0..nodes).map(|_| None).collect();
        processes.extend(infrastructure.into_iter().map(Some));
        Sim {
            algorithm,
            config,
            scenario,
            nodes,
            endpoints,
            duration: nanos(scenario.duration),
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            rng,
            processes,
            slots,
            base_latency,
            resource_latency,
            blocked: vec![0; endpoints * endpoints],
            last_fifo: vec![0; endpoints * endpoints],
            partitions: Vec::new(),
            resolved: vec![None; scenario.faults.len()],
            armed_pause: None,
            fence: Fence::new(),
            received_max: None,
            token_holders: BTreeMap::new(),
            outbox: Vec::new(),
            hash: Fnv::new(),
            trace: Trace::new(nodes, config.seed, nanos(scenario.duration)),
        }
    }

    fn run(&mut self) {
        for endpoint in self.nodes..self.endpoints {
            self.dispatch(endpoint, Input::Start, false);
        }
        let interval = nanos(self.config.write_interval).max(1);
        for node in 0..self.nodes {
            let boot = self.rng.below(50_000_000);
            self.push(boot, Event::Boot { node });
            let first_write = interval + self.rng.below(interval);
            self.push(first_write, Event::WriteTick { node });
        }
        for (index, (at, _)) in self.scenario.faults.iter().enumerate() {
            self.push(nanos(*at), Event::Fault { index });
        }
        while let Some(entry) = self.queue.peek() {
            if entry.at >= self.duration {
                break;
            }
            let entry = self.queue.pop().expect("peeked");
            self.now = entry.at;
            self.trace.events += 1;
            let (tag, detail) = entry.event.tag();
            self.hash.write(entry.at);
            self.hash.write(tag << 32 | detail);
            self.handle(entry.event);
        }
        self.now = self.duration;
    }

    fn finish(mut self) -> Trace {
        for node in 0..self.nodes {
            if let Some(open) = self.slots[node].open.take() {
                self.close(node, open);
            }
        }
        let duration = self.duration;
        self.trace.writes.retain(|write| write.arrived < duration);
        for window in &mut self.trace.faults {
            window.end = window.end.min(duration);
        }
        for interval in &self.trace.leaderships {
            for value in [
                interval.node as u64,
                interval.token,
                interval.start,
                interval.end,
            ] {
                self.hash.write(value);
            }
        }
        for write in &self.trace.writes {
            self.hash.write(write.token << 8 | write.node as u64);
            self.hash.write(write.arrived);
            self.hash
                .write(u64::from(write.stale) << 1 | u64::from(write.accepted_fenced));
        }
        self.hash.write(self.trace.messages);
        self.trace.hash = self.hash.0;
        self.trace
    }

    fn push(&mut self, at: Nanos, event: Event<Msg<A>>) {
        if self.queue.len() >= MAX_QUEUED_EVENTS && matches!(event, Event::Deliver { .. }) {
            self.trace.overflow += 1;
            return;
        }
        self.seq += 1;
        self.queue.push(Entry {
            at,
            seq: self.seq,
            event,
        });
    }

    fn handle(&mut self, event: Event<Msg<A>>) {
        match event {
            Event::Deliver { from, to, message } => self.deliver(from, to, message),
            Event::Timer {
                endpoint,
                generation,
            } => {
                let slot = &self.slots[endpoint];
                if slot.generation == generation && slot.paused_until.is_none() {
                    self.slots[endpoint].armed = None;
                    self.dispatch(endpoint, Input::Timeout, true);
                }
            }
            Event::WriteTick { node } => self.write_tick(node),
            Event::WriteArrive { write } => self.write_arrive(write),
            Event::Fault { index } => self.apply_fault(index),
            Event::Block { partition } => self.set_partition(partition, true),
            Event::Heal { partition } => self.set_partition(partition, false),
            Event::Boot { node } => self.boot(node),
            Event::Resume { node } => self.resume(node),
        }
    }

    // Processes.

    fn dispatch(&mut self, endpoint: usize, input: Input<Msg<A>>, fired: bool) {
        let local = Instant::from_nanos(self.slots[endpoint].clock.local(self.now));
        let entropy = self.rng.next_u64();
        let Some(process) = self.processes[endpoint].as_mut() else {
            return;
        };
        match input {
            Input::Start => process.start(local, entropy),
            Input::Message(from, message) => process.handle_message(local, entropy, from, message),
            Input::Timeout => process.handle_timeout(local, entropy),
        }
        while let Some(output) = process.poll_output() {
            self.outbox.push(output);
        }
        let timeout = process.poll_timeout();
        let leadership = process.leadership(local);
        let mut outbox = std::mem::take(&mut self.outbox);
        for output in outbox.drain(..) {
            match output {
                // Durable before spoken: the state is stored before anything after it leaves.
                Output::Persist(stable) => self.slots[endpoint].stable = Some(stable),
                Output::Send { to, message } => self.send(endpoint, to, message),
            }
        }
        self.outbox = outbox;
        self.arm(endpoint, timeout, fired);
        if endpoint < self.nodes {
            self.observe(endpoint, leadership);
        }
    }

    fn arm(&mut self, endpoint: usize, timeout: Option<Instant>, fired: bool) {
        let slot = &mut self.slots[endpoint];
        let Some(local) = timeout else {
            if slot.armed.take().is_some() {
                slot.generation += 1;
            }
            return;
        };
        let mut at = slot.clock.real(local.as_nanos()).max(self.now);
        if fired && at <= self.now {
            // A timer that fired and is due again at once would spin; a microsecond later
            // changes nothing the models can observe.
            at = self.now + 1_000;
        }
        if slot.armed == Some(at) {
            return;
        }
        slot.generation += 1;
        slot.armed = Some(at);
        let generation = slot.generation;
        self.push(
            at,
            Event::Timer {
                endpoint,
                generation,
            },
        );
    }

    fn boot(&mut self, node: usize) {
        let stable = self.slots[node].stable.as_ref();
        self.processes[node] = Some(self.algorithm.node(node, self.nodes, stable));
        self.dispatch(node, Input::Start, false);
    }

    fn crash(&mut self, node: usize) {
        self.processes[node] = None;
        let slot = &mut self.slots[node];
        slot.held.clear();
        slot.paused_until = None;
        slot.armed = None;
        slot.generation += 1;
        if let Some(open) = slot.open.take() {
            self.close(node, open);
        }
    }

    fn pause(&mut self, node: usize, duration: Nanos) {
        if self.processes[node].is_none() || self.slots[node].paused_until.is_some() {
            return;
        }
        let end = self.now + duration;
        self.slots[node].paused_until = Some(end);
        self.push(end, Event::Resume { node });
        self.window(WindowKind::Pause, end, 1 << node, format!("n{node} paused"));
    }

    fn resume(&mut self, node: usize) {
        let slot = &mut self.slots[node];
        if slot.paused_until.take().is_none() {
            return;
        }
        // Overdue timers first (the process checks its clock as it wakes), then the messages
        // that queued up while it was frozen, in arrival order.
        slot.armed = None;
        slot.generation += 1;
        let held = std::mem::take(&mut slot.held);
        self.dispatch(node, Input::Timeout, false);
        for (from, message) in held {
            self.push(
                self.now,
                Event::Deliver {
                    from,
                    to: node,
                    message,
                },
            );
        }
    }

    // Network.

    fn send(&mut self, from: usize, to: usize, message: Msg<A>) {
        self.trace.messages += 1;
        if <A::Process as Process>::is_election_traffic(&message) {
            self.trace.election_messages += 1;
        }
        if to >= self.endpoints || to == from {
            return;
        }
        let link = from * self.endpoints + to;
        if self.blocked[link] > 0 {
            return;
        }
        let reliable = self.slots[from].infrastructure || self.slots[to].infrastructure;
        let network = &self.config.network;
        let (loss, duplicate) = (network.loss_ppm, network.duplicate_ppm);
        if !reliable && self.rng.chance_ppm(loss) {
            return;
        }
        let mut at = self.now + self.latency(self.base_latency[link]);
        if reliable {
            // An ordered stream (gRPC over TCP): never overtakes an earlier message.
            at = at.max(self.last_fifo[link]);
            self.last_fifo[link] = at;
        }
        self.push(at, Event::Deliver { from, to, message });
        if !reliable && self.rng.chance_ppm(duplicate) {
            let again = self.now + self.latency(self.base_latency[link]);
            self.push(again, Event::Deliver { from, to, message });
        }
    }

    fn latency(&mut self, base: Nanos) -> Nanos {
        let mut latency = base + self.rng.below(base.max(1));
        if self.rng.chance_ppm(self.config.network.tail_ppm) {
            latency += self.rng.below(nanos(self.config.network.tail_latency));
        }
        latency
    }

    fn deliver(&mut self, from: usize, to: usize, message: Msg<A>) {
        if self.blocked[from * self.endpoints + to] > 0 || self.processes[to].is_none() {
            return;
        }
        let slot = &mut self.slots[to];
        if slot.paused_until.is_some() {
            if slot.held.len() < MAX_HELD_MESSAGES {
                slot.held.push((from, message));
            }
            return;
        }
        self.dispatch(to, Input::Message(from, message), false);
    }

    fn set_partition(&mut self, partition: usize, active: bool) {
        let state = &mut self.partitions[partition];
        if state.active == active {
            return;
        }
        state.active = active;
        for &(from, to) in &state.pairs {
            let link = &mut self.blocked[from * self.endpoints + to];
            if active {
                *link += 1;
            } else {
                *link -= 1;
            }
        }
    }

    // Leadership and the per-step checks.

    fn observe(&mut self, node: usize, leadership: Option<Leadership>) {
        let clock = self.slots[node].clock;
        let until = leadership
            .and_then(|l| l.until)
            .map(|until| clock.real(until.as_nanos()));
        match (self.slots[node].open, leadership) {
            (None, None) => {}
            (Some(open), Some(now)) if open.token == now.token && open.acting_at(self.now) => {
                self.slots[node].open = Some(Open { until, ..open });
            }
            (open, now) => {
                if let Some(open) = open {
                    self.slots[node].open = None;
                    self.close(node, open);
                }
                if let Some(now) = now {
                    self.start_leading(node, now.token, until);
                }
            }
        }
    }

    fn start_leading(&mut self, node: usize, token: u64, until: Option<Nanos>) {
        let now = self.now;
        for other in (0..self.nodes).filter(|&other| other != node) {
            if self.slots[other]
                .open
                .is_some_and(|open| open.acting_at(now))
            {
                self.violation(
                    0,
                    Violation::Overlap {
                        at: now,
                        first: other,
                        second: node,
                    },
                );
            }
        }
        let holders = self.token_holders.entry(token).or_insert(0);
        let others = *holders & !(1 << node);
        *holders |= 1 << node;
        if others != 0 {
            let first = others.trailing_zeros() as usize;
            self.violation(
                1,
                Violation::SharedToken {
                    at: now,
                    token,
                    first,
                    second: node,
                },
            );
        }
        self.slots[node].open = Some(Open {
            token,
            start: now,
            until,
        });
    }

    fn close(&mut self, node: usize, open: Open) {
        let end = open.until.map_or(self.now, |until| until.min(self.now));
        self.trace.leaderships.push(LeadershipInterval {
            node,
            token: open.token,
            start: open.start,
            end: end.max(open.start),
        });
    }

    fn violation(&mut self, kind: usize, violation: Violation) {
        self.trace.violation_counts[kind] += 1;
        if self.trace.violations.len() < MAX_KEPT_VIOLATIONS {
            self.trace.violations.push(violation);
        }
    }

    // The workload: fenced writes.

    fn write_tick(&mut self, node: usize) {
        let interval = nanos(self.config.write_interval).max(1);
        self.push(self.now + interval, Event::WriteTick { node });
        if self.processes[node].is_none() || self.slots[node].paused_until.is_some() {
            return;
        }
        let pause = match self.armed_pause {
            Some((target, duration)) if target == node => {
                self.armed_pause = None;
                Some(duration)
            }
            _ => None,
        };
        let local = Instant::from_nanos(self.slots[node].clock.local(self.now));
        let leadership = self.processes[node]
            .as_ref()
            .and_then(|process| process.leadership(local));
        if let Some(leadership) = leadership {
            // The write leaves the process only when it wakes up from a mid-write pause.
            let departs = self.now + pause.unwrap_or(0);
            let base = self.resource_latency[node];
            let arrives = departs + self.latency(base);
            self.trace.writes.push(WriteRecord {
                node,
                token: leadership.token,
                issued: self.now,
                arrived: arrives,
                stale: false,
                accepted_fenced: false,
            });
            let write = self.trace.writes.len() - 1;
            self.push(arrives, Event::WriteArrive { write });
        }
        if let Some(duration) = pause {
            self.pause(node, duration);
        }
    }

    fn write_arrive(&mut self, index: usize) {
        let write = self.trace.writes[index];
        let bit = 1u32 << write.node;
        let stale = match self.received_max {
            Some((max, writers)) => {
                write.token < max || (write.token == max && writers & !bit != 0)
            }
            None => false,
        };
        self.received_max = Some(match self.received_max {
            Some((max, writers)) if max == write.token => (max, writers | bit),
            Some((max, writers)) if max > write.token => (max, writers),
            _ => (write.token, bit),
        });
        let accepted = self.fence.admit(write.token).is_ok();
        let record = &mut self.trace.writes[index];
        record.stale = stale;
        record.accepted_fenced = accepted;
        if stale && accepted {
            self.violation(
                2,
                Violation::FencedStaleWrite {
                    at: self.now,
                    node: write.node,
                    token: write.token,
                },
            );
        }
    }

    // Faults.

    fn window(&mut self, kind: WindowKind, end: Nanos, nodes: u32, label: String) -> usize {
        self.trace.faults.push(FaultWindow {
            kind,
            start: self.now,
            end,
            nodes,
            label,
        });
        self.trace.faults.len() - 1
    }

    fn apply_fault(&mut self, index: usize) {
        let fault = self.scenario.faults[index].1;
        match fault {
            Fault::Crash {
                target,
                restart_after,
            } => {
                let node = self.resolve(target);
                self.resolved[index] = Some(node);
                if self.processes[node].is_none() {
                    return;
                }
                self.crash(node);
                let end = restart_after.map_or(self.duration, |after| self.now + nanos(after));
                if restart_after.is_some() {
                    self.push(end, Event::Boot { node });
                }
                self.window(
                    WindowKind::Crash,
                    end,
                    1 << node,
                    format!("n{node} crashed"),
                );
            }
            Fault::Partition { side, duration } => {
                let cut = self.resolve_side(side, index);
                let partition = self.new_partition(self.split(cut));
                self.set_partition(partition, true);
                let end = self.now + nanos(duration);
                self.push(end, Event::Heal { partition });
                self.window(
                    WindowKind::Partition,
                    end,
                    cut,
                    format!("{} cut off", names(cut)),
                );
            }
            Fault::Flap {
                side,
                on,
                off,
                cycles,
            } => {
                let cut = self.resolve_side(side, index);
                let partition = self.new_partition(self.split(cut));
                let (on, off) = (nanos(on), nanos(off));
                for cycle in 0..u64::from(cycles) {
                    let start = self.now + cycle * (on + off);
                    self.push(start, Event::Block { partition });
                    self.push(start + on, Event::Heal { partition });
                    self.trace.faults.push(FaultWindow {
                        kind: WindowKind::Partition,
                        start,
                        end: start + on,
                        nodes: cut,
                        label: format!("{} flapping", names(cut)),
                    });
                }
            }
            Fault::CutOutbound { target, duration } => {
                let node = self.resolve(target);
                self.resolved[index] = Some(node);
                let pairs = (0..self.endpoints)
                    .filter(|&to| to != node)
                    .map(|to| (node, to))
                    .collect();
                let partition = self.new_partition(pairs);
                self.set_partition(partition, true);
                let end = self.now + nanos(duration);
                self.push(end, Event::Heal { partition });
                self.window(
                    WindowKind::OneWay,
                    end,
                    1 << node,
                    format!("n{node} cannot send"),
                );
            }
            Fault::Pause {
                target,
                duration,
                mid_write,
            } => {
                let node = self.resolve(target);
                self.resolved[index] = Some(node);
                if mid_write {
                    self.armed_pause = Some((node, nanos(duration)));
                } else {
                    self.pause(node, nanos(duration));
                }
            }
            Fault::ClockRate { target, rate_ppm } => {
                let node = self.resolve(target);
                self.resolved[index] = Some(node);
                let now = self.now;
                self.slots[node].clock.set_rate(now, i64::from(rate_ppm));
                if let Some(open) = self.slots[node].clock_window.take() {
                    self.trace.faults[open].end = now;
                }
                if rate_ppm != 0 {
                    let label = format!("n{node} clock {:+}%", f64::from(rate_ppm) / 10_000.0);
                    let window = self.window(WindowKind::Clock, self.duration, 1 << node, label);
                    self.slots[node].clock_window = Some(window);
                }
                // The node's armed timer was converted at the old rate.
                let timeout = self.processes[node].as_ref().and_then(|p| p.poll_timeout());
                self.arm(node, timeout, false);
            }
        }
    }

    fn new_partition(&mut self, pairs: Vec<(usize, usize)>) -> usize {
        self.partitions.push(Partition {
            pairs,
            active: false,
        });
        self.partitions.len() - 1
    }

    /// Both directions between the `cut` nodes and everything else (infrastructure included).
    fn split(&self, cut: u32) -> Vec<(usize, usize)> {
        let inside = |endpoint: usize| endpoint < self.nodes && cut & (1 << endpoint) != 0;
        let mut pairs = Vec::new();
        for a in (0..self.endpoints).filter(|&a| inside(a)) {
            for b in (0..self.endpoints).filter(|&b| !inside(b)) {
                pairs.push((a, b));
                pairs.push((b, a));
            }
        }
        pairs
    }

    fn current_leader(&self) -> Option<NodeId> {
        (0..self.nodes)
            .filter_map(|node| {
                let open = self.slots[node].open?;
                open.acting_at(self.now).then_some((open.token, node))
            })
            .max()
            .map(|(_, node)| node)
    }

    fn resolve(&mut self, target: Target) -> NodeId {
        match target {
            Target::Leader => self.current_leader().unwrap_or_else(|| {
                (0..self.nodes)
                    .rev()
                    .find(|&node| self.processes[node].is_some())
                    .unwrap_or(self.nodes - 1)
            }),
            Target::Random => {
                let up: Vec<NodeId> = (0..self.nodes)
                    .filter(|&node| self.processes[node].is_some())
                    .collect();
                if up.is_empty() {
                    self.rng.below(self.nodes as u64) as usize
                } else {
                    up[self.rng.below(up.len() as u64) as usize]
                }
            }
            Target::Node(node) => node % self.nodes,
            Target::SameAs(index) => match self.resolved.get(index).copied().flatten() {
                Some(node) => node,
                None => self.resolve(Target::Leader),
            },
        }
    }

    fn resolve_side(&mut self, side: Side, index: usize) -> u32 {
        let minority = ((self.nodes - 1) / 2).max(1);
        match side {
            Side::Isolate(target) => {
                let node = self.resolve(target);
                self.resolved[index] = Some(node);
                1 << node
            }
            Side::LeaderMinority => {
                let leader = self.resolve(Target::Leader);
                self.resolved[index] = Some(leader);
                self.add_random(1 << leader, minority - 1, 0)
            }
            Side::FollowerMinority => {
                let leader = self.resolve(Target::Leader);
                let highest = (0..self.nodes).rev().find(|&n| n != leader).unwrap_or(0);
                self.resolved[index] = Some(highest);
                self.add_random(1 << highest, minority - 1, 1 << leader)
            }
            Side::RandomMinority => self.add_random(0, minority, 0),
        }
    }

    fn add_random(&mut self, mut set: u32, count: usize, exclude: u32) -> u32 {
        for _ in 0..count {
            let candidates: Vec<usize> = (0..self.nodes)
                .filter(|&n| (set | exclude) & (1 << n) == 0)
                .collect();
            if candidates.is_empty() {
                break;
            }
            set |= 1 << candidates[self.rng.below(candidates.len() as u64) as usize];
        }
        set
    }
}

/// "n1+n3" for a bit mask.
pub fn names(mask: u32) -> String {
    crate::model::members(mask)
        .map(|node| format!("n{node}"))
        .collect::<Vec<_>>()
        .join("+")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_round_trips_and_never_fires_early() {
        let mut clock = Clock::new(-250_000);
        assert_eq!(clock.local(1_000_000), 750_000);
        assert_eq!(clock.real(750_000), 1_000_000);
        for local in [1, 7, 999_999, 123_456_789] {
            assert!(clock.local(clock.real(local)) >= local);
            assert!(clock.local(clock.real(local) - 1) < local);
        }
        clock.set_rate(1_000_000, 0);
        assert_eq!(clock.local(2_000_000), 1_750_000);
        assert_eq!(clock.real(1_750_000), 2_000_000);
        // Instants before the anchor map back at the new rate.
        assert_eq!(clock.real(700_000), 950_000);
    }

    #[test]
    fn fnv_is_pinned() {
        let mut hash = Fnv::new();
        hash.write(0);
        assert_ne!(hash.0, Fnv::new().0);
        let mut again = Fnv::new();
        again.write(0);
        assert_eq!(hash.0, again.0);
    }
}
