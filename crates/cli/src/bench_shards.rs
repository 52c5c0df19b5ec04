//! `baton bench shards`: shard ownership at scale, members in this process (each on a
//! connection and a lease of its own, as separate hosts would be).
//!
//! For each member count: all members join at once, and the time until every shard is owned by
//! the member the assignment names; then one member joins and one leaves, with the time to
//! settle and the shards that moved; renewals per second per member; memory per owned shard.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use baton::shards::{ShardConfig, ShardEvent, ShardMember, ShardSet};
use baton::{ElectionConfig, Leadership};
use clap::Args;

#[derive(Debug, Args)]
pub struct ShardsBenchArgs {
    /// Backend URL.
    #[arg(long, env = "BATON_BACKEND")]
    backend: String,
    /// Comma-separated member counts.
    #[arg(long, value_delimiter = ',', default_value = "3,10")]
    members: Vec<usize>,
    /// Shards in the group.
    #[arg(long, default_value_t = 1000)]
    shards: u32,
    /// Lease TTL.
    #[arg(long, default_value = "2s", value_parser = crate::run::duration)]
    ttl: Duration,
    /// How long to count renewals.
    #[arg(long, default_value = "5s", value_parser = crate::run::duration)]
    window: Duration,
}

/// Who owns what, across the members of the run (shard → member id).
type Owners = Arc<Mutex<BTreeMap<String, String>>>;

struct Running {
    id: String,
    backend: baton::Backend,
    task: tokio::task::JoinHandle<()>,
    leave: tokio::sync::oneshot::Sender<()>,
}

/// A member that holds every shard it acquires until told to give it up (no work: the bench
/// measures the coordination).
async fn start(
    url: &str,
    group: &str,
    id: String,
    shards: u32,
    config: &ShardConfig,
    owners: Owners,
) -> anyhow::Result<Running> {
    let backend = crate::connect(url).await?;
    let mut member = ShardMember::join(
        &backend,
        group,
        &id,
        ShardSet::Count(shards),
        config.clone(),
    )
    .await?;
    let (leave, mut leaving) = tokio::sync::oneshot::channel::<()>();
    let me = id.clone();
    let task = tokio::spawn(async move {
        let mut held: BTreeMap<String, Leadership> = BTreeMap::new();
        let mut asked = false;
        loop {
            let event = tokio::select! {
                event = member.next() => event,
                _ = &mut leaving, if !asked => {
                    asked = true;
                    member.leave();
                    continue;
                }
            };
            match event {
                Some(ShardEvent::Acquired {
                    shard, leadership, ..
                }) => {
                    owners.lock().unwrap().insert(shard.clone(), me.clone());
                    held.insert(shard, leadership);
                }
                Some(ShardEvent::Released { shard, .. }) => {
                    let mut owners = owners.lock().unwrap();
                    if owners.get(&shard) == Some(&me) {
                        owners.remove(&shard);
                    }
                    drop(owners);
                    held.remove(&shard);
                }
                None => break,
            }
        }
    });
    Ok(Running {
        id,
        backend,
        task,
        leave,
    })
}

/// Waits until the owners are exactly the assignment over `ids`; returns the time it took.
async fn settle(
    owners: &Owners,
    names: &[String],
    ids: &[String],
    since: Instant,
) -> anyhow::Result<Duration> {
    let expected: BTreeMap<String, String> = names
        .iter()
        .cloned()
        .zip(
            baton::shards::assign(names, ids)
                .into_iter()
                .map(|o| ids[o.unwrap_or(0)].clone()),
        )
        .collect();
    let limit = Instant::now() + Duration::from_secs(120);
    loop {
        if *owners.lock().unwrap() == expected {
            return Ok(since.elapsed());
        }
        if Instant::now() > limit {
            anyhow::bail!("the shards did not settle within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn moved(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> usize {
    a.iter().filter(|(s, o)| b.get(*s) != Some(o)).count()
}

pub async fn shards(args: ShardsBenchArgs) -> anyhow::Result<()> {
    let config = ShardConfig {
        election: ElectionConfig::default().with_ttl(args.ttl),
        ..ShardConfig::default()
    };
    let names = baton::shards::numbered(args.shards);
    for count in args.members {
        let group = format!("bench-shards-{}-{}", std::process::id(), count);
        let owners: Owners = Arc::default();
        let rss_before = crate::bench::rss_kib(std::process::id()).unwrap_or(0);
        let started = Instant::now();
        let mut members = Vec::new();
        for i in 0..count {
            members.push(
                start(
                    &args.backend,
                    &group,
                    format!("m{i}"),
                    args.shards,
                    &config,
                    owners.clone(),
                )
                .await?,
            );
        }
        let ids: Vec<String> = members.iter().map(|m| m.id.clone()).collect();
        let balanced = settle(&owners, &names, &ids, started).await?;
        let rss_after = crate::bench::rss_kib(std::process::id()).unwrap_or(0);
        let before: Vec<u64> = members.iter().map(|m| m.backend.stats().renewals).collect();
        tokio::time::sleep(args.window).await;
        let renewals: f64 = members
            .iter()
            .zip(&before)
            .map(|(m, b)| (m.backend.stats().renewals - b) as f64)
            .sum::<f64>()
            / count as f64
            / args.window.as_secs_f64();
        let settled = owners.lock().unwrap().clone();
        // One more member joins.
        let joined_at = Instant::now();
        members.push(
            start(
                &args.backend,
                &group,
                format!("m{count}"),
                args.shards,
                &config,
                owners.clone(),
            )
            .await?,
        );
        let mut ids_after: Vec<String> = members.iter().map(|m| m.id.clone()).collect();
        let join_time = settle(&owners, &names, &ids_after, joined_at).await?;
        let after_join = owners.lock().unwrap().clone();
        // The first member leaves.
        let leaver = members.remove(0);
        ids_after.remove(0);
        let left_at = Instant::now();
        let _ = leaver.leave.send(());
        let leave_time = settle(&owners, &names, &ids_after, left_at).await?;
        let after_leave = owners.lock().unwrap().clone();
        let _ = leaver.task.await;
        leaver.backend.close().await;
        crate::print_out(&format!(
            "members={count} shards={}: balanced after {:.0} ms; renewals/s per member {renewals:.2}; \
             memory {:.1} KiB per owned shard; join: {} moved ({:.1}%), settled in {:.0} ms; \
             leave: {} moved ({:.1}%), settled in {:.0} ms",
            args.shards,
            balanced.as_secs_f64() * 1000.0,
            rss_after.saturating_sub(rss_before) as f64 / f64::from(args.shards),
            moved(&settled, &after_join),
            100.0 * moved(&settled, &after_join) as f64 / f64::from(args.shards),
            join_time.as_secs_f64() * 1000.0,
            moved(&after_join, &after_leave),
            100.0 * moved(&after_join, &after_leave) as f64 / f64::from(args.shards),
            leave_time.as_secs_f64() * 1000.0,
        ))?;
        for member in members {
            member.backend.close().await;
            let _ = member.task.await;
        }
    }
    Ok(())
}
