//! Metrics through the `metrics` facade, against a real etcd (started by `scripts/test`), read
//! back from a recorder local to the test's thread (the test's runtime runs every task on it).

// Only its helpers (`unique`, `within`) are used here.
#[allow(dead_code)]
mod conformance;
mod etcd_support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use baton::metrics::{
    BACKEND_ERRORS, DEADLINE_REMAINING, IS_LEADER, LEADERSHIP_TRANSITIONS, LOSSES, RENEWAL_LATENCY,
};
use baton::{Backend, Election, ElectionConfig, Error, LossReason};
use conformance::{unique, within};
use etcd_support::{delete_leader_key, etcd, url};
use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

/// How many candidates' keys `election` has.
async fn candidates(election: &str) -> i64 {
    let mut client = etcd_client::Client::connect([etcd()], None).await.unwrap();
    let prefix = format!("/baton-test/{election}/@candidates/");
    let options = etcd_client::GetOptions::new()
        .with_prefix()
        .with_count_only();
    client.get(prefix, Some(options)).await.unwrap().count()
}

/// A recorder that keeps every value, read back by name and labels. (metrics-util's debugging
/// recorder resets counters and gauges on every snapshot, which an up-down gauge cannot bear.)
#[derive(Debug, Default)]
struct Recorded {
    counters: Mutex<HashMap<Key, Arc<AtomicU64>>>,
    gauges: Mutex<HashMap<Key, Arc<AtomicU64>>>,
    histograms: Mutex<HashMap<Key, Arc<Samples>>>,
}

#[derive(Debug, Default)]
struct Samples(Mutex<Vec<f64>>);

impl HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().push(value);
    }
}

impl Recorder for Recorded {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut counters = self.counters.lock().unwrap();
        Counter::from_arc(counters.entry(key.clone()).or_default().clone())
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        let mut gauges = self.gauges.lock().unwrap();
        Gauge::from_arc(gauges.entry(key.clone()).or_default().clone())
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let mut histograms = self.histograms.lock().unwrap();
        Histogram::from_arc(histograms.entry(key.clone()).or_default().clone())
    }
}

/// Whether `key` is `name` with exactly `labels`.
fn matches(key: &Key, name: &str, labels: &[(&str, &str)]) -> bool {
    let mut have: Vec<(&str, &str)> = key.labels().map(|l| (l.key(), l.value())).collect();
    let mut want = labels.to_vec();
    have.sort();
    want.sort();
    key.name() == name && have == want
}

impl Recorded {
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        let counters = self.counters.lock().unwrap();
        counters
            .iter()
            .find(|(key, _)| matches(key, name, labels))
            .map_or(0, |(_, value)| value.load(Ordering::SeqCst))
    }

    fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let gauges = self.gauges.lock().unwrap();
        gauges
            .iter()
            .find(|(key, _)| matches(key, name, labels))
            .map(|(_, value)| f64::from_bits(value.load(Ordering::SeqCst)))
    }

    fn histogram(&self, name: &str) -> Vec<f64> {
        let histograms = self.histograms.lock().unwrap();
        histograms
            .iter()
            .filter(|(key, _)| key.name() == name)
            .flat_map(|(_, samples)| samples.0.lock().unwrap().clone())
            .collect()
    }

    /// Waits until the gauge reads `value`.
    async fn gauge_becomes(&self, name: &str, labels: &[(&str, &str)], value: f64) {
        let limit = Duration::from_secs(3);
        let start = std::time::Instant::now();
        while self.gauge(name, labels) != Some(value) {
            assert!(
                start.elapsed() < limit,
                "{name} {labels:?} is {:?}, not {value}",
                self.gauge(name, labels)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

#[tokio::test]
async fn leadership_renewals_losses_and_backend_errors_are_recorded() {
    let recorded = Recorded::default();
    let _local = metrics::set_default_local_recorder(&recorded);

    let backend = Backend::connect(&url()).await.unwrap();
    let name = unique("metrics");
    let renew_interval = Duration::from_millis(200);
    let config = ElectionConfig::default()
        .with_ttl(Duration::from_secs(2))
        .with_renew_interval(renew_interval);
    let election = Election::new(&backend, &name, config).unwrap();
    let this = [("election", name.as_str())];

    // First term: elected, renewed, then its key is deleted behind its back.
    let first = within("campaign", Duration::from_secs(5), election.campaign("a"))
        .await
        .unwrap();
    assert_eq!(recorded.gauge(IS_LEADER, &this), Some(1.0));
    assert_eq!(recorded.counter(LEADERSHIP_TRANSITIONS, &this), 1);
    // Renewals every 200 ms, each one timed from its send to its answer.
    within("three renewals", Duration::from_secs(5), async {
        while recorded.histogram(RENEWAL_LATENCY).len() < 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    for latency in recorded.histogram(RENEWAL_LATENCY) {
        assert!(latency > 0.0 && latency < 1.0, "latency {latency}");
    }
    // The time left as of the last renewal: the local lease (1.88 s) less at most a round trip.
    let remaining = recorded.gauge(DEADLINE_REMAINING, &this).unwrap();
    assert!(remaining > 1.0 && remaining <= 1.88, "{remaining}");
    let health = first.lease_health();
    assert!(health.is_live());
    assert_eq!(health.renew_interval(), renew_interval);
    assert!(
        health.since_last_renewal() < Duration::from_secs(1),
        "{:?}",
        health.since_last_renewal()
    );

    // A request etcd refuses (a value above its 1.5 MiB request limit) is a backend error.
    let oversized = "x".repeat(1_600_000);
    let error = first
        .guarded_put("/metrics-key", &oversized)
        .await
        .unwrap_err();
    assert!(matches!(error, Error::Backend { .. }), "{error:?}");
    assert_eq!(
        recorded.counter(BACKEND_ERRORS, &[("operation", "fenced transaction")]),
        1
    );

    delete_leader_key(&name).await;
    let reason = within("loss", Duration::from_secs(5), first.lost()).await;
    assert_eq!(reason, LossReason::EntryDeleted);
    recorded.gauge_becomes(IS_LEADER, &this, 0.0).await;
    recorded.gauge_becomes(DEADLINE_REMAINING, &this, 0.0).await;
    let entry_deleted = [("election", name.as_str()), ("reason", "entry_deleted")];
    assert_eq!(recorded.counter(LOSSES, &entry_deleted), 1);
    drop(first);

    // A handoff between two candidacies of this process: whichever driver runs first, the
    // gauge ends at 1, and resigning is not a loss.
    let second = within("second", Duration::from_secs(5), election.campaign("b"))
        .await
        .unwrap();
    let waiter = tokio::spawn({
        let election = election.clone();
        async move { election.campaign("c").await }
    });
    // The waiter queues (its key exists) before the second term resigns.
    within("waiter queued", Duration::from_secs(5), async {
        while candidates(&name).await < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(!waiter.is_finished());
    second.resign().await;
    let third = within("third", Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap();
    recorded.gauge_becomes(IS_LEADER, &this, 1.0).await;
    assert_eq!(recorded.counter(LEADERSHIP_TRANSITIONS, &this), 3);
    let total_losses: u64 = ["lease_expired", "entry_deleted", "backend_failed"]
        .iter()
        .map(|reason| recorded.counter(LOSSES, &[("election", &name), ("reason", reason)]))
        .sum();
    assert_eq!(total_losses, 1, "only the deleted key was a loss");

    // The last term ends with its lease: closing the backend revokes it.
    let health = third.lease_health();
    backend.close().await;
    let reason = within("loss", Duration::from_secs(5), third.lost()).await;
    assert_eq!(reason, LossReason::LeaseExpired);
    assert!(!health.is_live());
    recorded.gauge_becomes(IS_LEADER, &this, 0.0).await;
    recorded.gauge_becomes(DEADLINE_REMAINING, &this, 0.0).await;
    let lease_expired = [("election", name.as_str()), ("reason", "lease_expired")];
    assert_eq!(recorded.counter(LOSSES, &lease_expired), 1);
}
