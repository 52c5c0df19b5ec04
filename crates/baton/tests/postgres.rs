//! The conformance suite against a real PostgreSQL (a private cluster `scripts/test` starts;
//! `BATON_TEST_PG` is its URL). Built with the `postgres` feature only.
#![cfg(feature = "postgres")]

#[macro_use]
mod conformance;

use std::time::Duration;

use tokio_postgres::NoTls;

/// The PostgreSQL under test. Missing is a loud failure, never a skip.
fn server() -> String {
    std::env::var("BATON_TEST_PG").expect(
        "BATON_TEST_PG is not set: run the tests with scripts/test, which starts a private \
         PostgreSQL",
    )
}

/// A raw connection, for what the suite does behind baton's back.
async fn raw(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

/// PgBouncer in transaction mode in front of the same PostgreSQL (`BATON_TEST_PGBOUNCER`).
fn pgbouncer() -> String {
    std::env::var("BATON_TEST_PGBOUNCER").expect(
        "BATON_TEST_PGBOUNCER is not set: run the tests with scripts/test, which starts \
         PgBouncer in front of its private PostgreSQL",
    )
}

/// baton at `url` (PostgreSQL itself, or a pooler in front of it) in `schema`; what the suite
/// does behind baton's back goes to PostgreSQL directly.
struct PostgresUnderTest {
    url: fn() -> String,
    schema: &'static str,
}

impl conformance::BackendUnderTest for PostgresUnderTest {
    type Rewindable = RewindablePostgres;

    fn url(&self) -> String {
        format!("{}?schema={}", (self.url)(), self.schema)
    }

    async fn delete_leader_entry(&self, election: &str) {
        let client = raw(&server()).await;
        let deleted = client
            .execute(
                &format!(
                    "DELETE FROM {s}.entries WHERE election = $1 AND position = \
                     (SELECT min(position) FROM {s}.entries WHERE election = $1)",
                    s = self.schema
                ),
                &[&election],
            )
            .await
            .unwrap();
        assert_eq!(deleted, 1, "no leader in {election}");
    }

    async fn delete_all_entries(&self, election: &str) -> u64 {
        let client = raw(&server()).await;
        // Positions are per election: every entry created after the deletion is above the
        // highest one deleted.
        let rows = client
            .query(
                &format!(
                    "DELETE FROM {}.entries WHERE election = $1 RETURNING position",
                    self.schema
                ),
                &[&election],
            )
            .await
            .unwrap();
        assert_eq!(rows.len(), 2, "the leader's entry and the waiter's");
        rows.iter()
            .map(|row| row.get::<_, i64>(0) as u64)
            .max()
            .unwrap()
    }

    async fn rewindable(&self) -> RewindablePostgres {
        // A schema of its own, with some history behind it.
        let schema = format!("rewind_{}_{}", self.schema, std::process::id());
        let url = format!("{}?schema={schema}", (self.url)());
        let backend = baton::Backend::connect(&url).await.unwrap();
        backend.close().await;
        // Positions are per election: elections of this schema start at epoch 100, so that
        // after the rewind (epochs back to zero) new tokens lie well below the first ones.
        raw(&server())
            .await
            .batch_execute(&format!(
                "ALTER TABLE {schema}.elections ALTER COLUMN epoch SET DEFAULT 100"
            ))
            .await
            .unwrap();
        RewindablePostgres { url, schema }
    }
}

/// Restoring an older backup: every election's epoch back to zero, every session gone.
struct RewindablePostgres {
    url: String,
    schema: String,
}

impl conformance::Rewindable for RewindablePostgres {
    fn url(&self) -> String {
        self.url.clone()
    }

    async fn rewind(&mut self) {
        let client = raw(&server()).await;
        client
            .batch_execute(&format!(
                "DELETE FROM {s}.sessions; UPDATE {s}.elections SET epoch = 0;",
                s = self.schema
            ))
            .await
            .unwrap();
    }
}

conformance_suite!(PostgresUnderTest {
    url: server,
    schema: "baton_test",
});

/// The same suite behind PgBouncer in transaction mode: every statement may run on a different
/// server connection, so notifications do not arrive and waiters poll instead.
mod through_pgbouncer {
    use super::*;

    conformance_suite!(PostgresUnderTest {
        url: pgbouncer,
        schema: "baton_test_pgbouncer",
    });
}

/// Fencing inside the caller's own transaction: `SELECT <schema>.fence(resource, token)`
/// records the token for the resource; a stale token raises an error, so nothing of that
/// transaction commits, while the newer leader's transaction does.
#[tokio::test]
async fn fencing_inside_the_callers_own_transaction() {
    let url = format!("{}?schema=baton_test", server());
    let backend = baton::Backend::connect(&url).await.unwrap();
    let election = baton::Election::new(
        &backend,
        &conformance::unique("own-txn"),
        conformance::config(),
    )
    .unwrap();
    let first = election.campaign("a").await.unwrap();
    let old_token = first.token() as i64;
    first.resign().await;
    let second = election.campaign("b").await.unwrap();
    let new_token = second.token() as i64;
    assert!(new_token > old_token);

    let mut client = raw(&server()).await;
    let table = format!("jobs_{}", std::process::id());
    client
        .batch_execute(&format!("CREATE TABLE {table} (who text)"))
        .await
        .unwrap();
    let fence = baton::postgres::fence_sql("baton_test");
    let resource = conformance::unique("resource");
    // The new leader's write commits (the library call).
    let transaction = client.transaction().await.unwrap();
    baton::postgres::fence(&transaction, "baton_test", &resource, new_token as u64)
        .await
        .unwrap();
    transaction
        .execute(&format!("INSERT INTO {table} VALUES ('b')"), &[])
        .await
        .unwrap();
    transaction.commit().await.unwrap();
    // The old leader's, later: the fence refuses it and nothing of the transaction commits.
    let transaction = client.transaction().await.unwrap();
    transaction
        .execute(&format!("INSERT INTO {table} VALUES ('a')"), &[])
        .await
        .unwrap();
    let refused = transaction.execute(&fence, &[&resource, &old_token]).await;
    let refused = refused.unwrap_err();
    let message = refused.to_string();
    assert!(
        message.contains("db error") || message.contains("stale"),
        "{message}"
    );
    assert_eq!(
        refused.code().map(|code| code.code()),
        Some(baton::postgres::STALE_TOKEN_SQLSTATE)
    );
    // PostgreSQL answers COMMIT of a failed transaction by rolling it back.
    let _ = transaction.commit().await;
    // The library call says so as a typed error, and nothing of that transaction commits
    // either.
    let transaction = client.transaction().await.unwrap();
    transaction
        .execute(&format!("INSERT INTO {table} VALUES ('a2')"), &[])
        .await
        .unwrap();
    match baton::postgres::fence(&transaction, "baton_test", &resource, old_token as u64).await {
        Err(baton::Error::StaleToken { token, .. }) => assert_eq!(token, old_token as u64),
        other => panic!("expected a stale token, got {other:?}"),
    }
    let _ = transaction.commit().await;
    let rows = client
        .query(&format!("SELECT who FROM {table}"), &[])
        .await
        .unwrap();
    let who: Vec<String> = rows.iter().map(|row| row.get(0)).collect();
    assert_eq!(who, vec!["b".to_string()]);
    client
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
    second.resign().await;
}

/// A file named by the environment `scripts/test` sets up.
fn test_file(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the tests with scripts/test, which makes the certificates")
    })
}

/// TLS when asked for: `sslmode=require` encrypts every connection baton opens (the server's
/// `pg_stat_ssl` says so); `verify-full` with the server's CA connects by address and by name.
/// A certificate from another CA, and a server offering no TLS under `require`, are refused
/// with one line and are not retryable (not an outage to wait out).
#[tokio::test]
async fn tls_when_asked_for() {
    let ca = test_file("BATON_TEST_PG_CA");
    let other_ca = test_file("BATON_TEST_PG_OTHER_CA");
    let by_name = server().replace("127.0.0.1", "localhost");
    let cases = [
        (server(), "sslmode=require".to_string(), "baton-tls-require"),
        (
            server(),
            format!("sslmode=verify-full&sslrootcert={ca}"),
            "baton-tls-full-ip",
        ),
        (
            by_name.clone(),
            format!("sslmode=verify-full&sslrootcert={ca}"),
            "baton-tls-full-name",
        ),
        (
            server(),
            format!("sslmode=verify-ca&sslrootcert={ca}"),
            "baton-tls-ca",
        ),
    ];
    let observer = raw(&server()).await;
    for (base, tls, app) in cases {
        let url = format!("{base}?schema=baton_test&{tls}&application_name={app}");
        let backend = baton::Backend::connect(&url)
            .await
            .unwrap_or_else(|error| panic!("{tls}: {error}"));
        let election =
            baton::Election::new(&backend, &conformance::unique("tls"), conformance::config())
                .unwrap();
        let leadership = election.campaign("a").await.unwrap();
        let row = observer
            .query_one(
                "SELECT count(*), bool_and(s.ssl) FROM pg_stat_ssl s JOIN pg_stat_activity a \
                 USING (pid) WHERE a.application_name = $1",
                &[&app],
            )
            .await
            .unwrap();
        let (connections, all_tls): (i64, Option<bool>) = (row.get(0), row.get(1));
        // Statements and notifications at least (renewals connect beside the grant).
        assert!(connections >= 2, "{tls}: {connections} connections");
        assert_eq!(all_tls, Some(true), "{tls}: a connection without TLS");
        leadership.resign().await;
        backend.close().await;
    }
    let refused = [
        (
            server(),
            format!("sslmode=verify-full&sslrootcert={other_ca}"),
        ),
        (
            server(),
            format!("sslmode=verify-ca&sslrootcert={other_ca}"),
        ),
        // PgBouncer here offers no TLS.
        (pgbouncer(), "sslmode=require".to_string()),
    ];
    for (base, tls) in refused {
        let url = format!("{base}?schema=baton_test&{tls}");
        let error = baton::Backend::connect(&url)
            .await
            .err()
            .unwrap_or_else(|| panic!("{tls} connected"));
        let message = error.to_string();
        assert!(!error.is_retryable(), "{tls}: retryable: {message}");
        assert!(message.contains("TLS"), "{tls}: {message}");
        assert!(
            !message.contains('\n') && !message.contains("baton:baton"),
            "{message}"
        );
    }
}

/// The statements PostgreSQL ran for baton in `schema`, renewals aside (pg_stat_statements).
async fn statements_in(client: &tokio_postgres::Client, schema: &str) -> i64 {
    client
        .query_one(
            "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
             WHERE query LIKE '%' || $1 || '.%' AND query NOT LIKE '%SET expires_at%'",
            &[&schema],
        )
        .await
        .unwrap()
        .get(0)
}

/// Waits (up to 60 s) until PostgreSQL runs no statement in `schema` for 500 ms.
async fn quiet(client: &tokio_postgres::Client, schema: &str) {
    let start = std::time::Instant::now();
    let mut last = statements_in(client, schema).await;
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let now = statements_in(client, schema).await;
        if now == last {
            return;
        }
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "statements in {schema} never stopped"
        );
        last = now;
    }
}

/// One release with 50 and with 1,000 waiters (on 20 connections) costs the same few
/// statements, counted by the server (pg_stat_statements), and wakes one waiter: the
/// notification goes to the one waiter watching the released entry, nobody else reads.
#[tokio::test]
async fn one_release_costs_the_same_few_statements_at_50_and_1000_waiters() {
    let schema = "baton_herd";
    let url = format!("{}?schema={schema}", server());
    // A long TTL: no session comes due (and no watcher looks) while we count.
    let config = baton::ElectionConfig::default().with_ttl(std::time::Duration::from_secs(60));
    let counter = raw(&server()).await;
    let mut costs = Vec::new();
    for waiters in [50, 1000] {
        let name = conformance::unique("herd-statements");
        let leader_backend = baton::Backend::connect(&url).await.unwrap();
        let leader = baton::Election::new(&leader_backend, &name, config.clone())
            .unwrap()
            .campaign("leader")
            .await
            .unwrap();
        let mut backends = Vec::new();
        for _ in 0..20 {
            backends.push(baton::Backend::connect(&url).await.unwrap());
        }
        let mut candidacies = Vec::new();
        for i in 0..waiters {
            let election = baton::Election::new(&backends[i % 20], &name, config.clone()).unwrap();
            candidacies.push(election.candidacy(&format!("w{i}")).unwrap());
        }
        let observer = baton::Election::new(&leader_backend, &name, config.clone()).unwrap();
        while observer.participants().await.unwrap().len() < waiters + 1 {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        // Queued is not yet watching: wait until the campaigns' last statements (finding
        // predecessors, first looks) have run, so that only the release is counted.
        quiet(&counter, schema).await;
        let next: usize = observer.participants().await.unwrap()[1]
            .id
            .trim_start_matches('w')
            .parse()
            .unwrap();
        let woken_before: u64 = backends.iter().map(|b| b.stats().wakeups).sum();
        let before = statements_in(&counter, schema).await;
        leader.resign().await;
        let first =
            tokio::time::timeout(std::time::Duration::from_secs(5), candidacies[next].next())
                .await
                .expect("the next waiter leads")
                .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let cost = statements_in(&counter, schema).await - before;
        let woken: u64 = backends.iter().map(|b| b.stats().wakeups).sum::<u64>() - woken_before;
        assert_eq!(woken, 1, "{waiters} waiters: one release, one waiter woken");
        eprintln!("{waiters} waiters: {cost} statements for one release");
        costs.push(cost);
        first.resign().await;
        for candidacy in candidacies {
            candidacy.resign().await;
        }
        for backend in backends {
            backend.close().await;
        }
        leader_backend.close().await;
    }
    assert!(
        costs.iter().all(|&cost| (1..=8).contains(&cost)),
        "statements per release: {costs:?}"
    );
    assert!(costs[1] <= costs[0] + 2, "grows with waiters: {costs:?}");
}

/// Behind PgBouncer (waiters poll) handoffs that follow each other at once are each noticed
/// within the polling cadence, not only the first: a waiter looks at the entry ahead of it
/// more often the closer that entry is to leading, so it has caught up with its place by the
/// time the line reaches it. (It looked every 5 s until its entry became next in line, and
/// each leader after the first that resigned within 5 s of winning waited up to 5 s for its
/// successor.)
#[tokio::test]
async fn quick_handoffs_behind_pgbouncer_are_each_noticed_soon() {
    let url = format!("{}?schema=baton_test_pgbouncer", pgbouncer());
    let name = conformance::unique("quick-handoffs");
    let config = conformance::config().with_ttl(Duration::from_secs(30));
    let mut backends = Vec::new();
    let mut candidacies = Vec::new();
    for id in ["a", "b", "c", "d", "e"] {
        let backend = baton::Backend::connect(&url).await.unwrap();
        let election = baton::Election::new(&backend, &name, config.clone()).unwrap();
        candidacies.push(election.candidacy(id).unwrap());
        backends.push(backend);
        // Queued in this order.
        let queued = baton::Election::new(&backends[0], &name, config.clone()).unwrap();
        conformance::within("queued", Duration::from_secs(10), async {
            while queued.participants().await.unwrap().len() < candidacies.len() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    }
    let mut term = conformance::within("a leads", Duration::from_secs(5), candidacies[0].next())
        .await
        .unwrap();
    // Every waiter watches the entry ahead of it.
    conformance::settled(&backends[1..], 4).await;
    for (next, candidacy) in candidacies.iter_mut().enumerate().skip(1) {
        let resigned = std::time::Instant::now();
        term.resign().await;
        term = conformance::within(
            "the next waiter leads",
            Duration::from_secs(10),
            candidacy.next(),
        )
        .await
        .unwrap();
        let took = resigned.elapsed();
        // The cadence behind the leader is 250 ms, 500 ms, 750 ms...; 5 s was the old one.
        assert!(
            took < Duration::from_millis(2_500),
            "handoff {next} took {took:?}"
        );
    }
    term.resign().await;
    for candidacy in candidacies {
        candidacy.resign().await;
    }
}

/// A restored backup hands a session id out again: the holder of the old session with that id
/// must not have its renewals keep the new one alive (each session has a random key its
/// renewals prove). Its lease ends at its local deadline.
#[tokio::test]
async fn a_reused_session_id_does_not_keep_the_old_holder_leading() {
    let schema = format!("restored_{}", std::process::id());
    let url = format!("{}?schema={schema}", server());
    let backend = baton::Backend::connect(&url).await.unwrap();
    let election = baton::Election::new(
        &backend,
        &conformance::unique("restored"),
        conformance::config(),
    )
    .unwrap();
    let leadership = election.campaign("a").await.unwrap();
    let client = raw(&server()).await;
    // As a restore would leave it: the tables emptied behind baton's back (no notification),
    // and the same session id now someone else's, live for a minute.
    client
        .batch_execute(&format!(
            "BEGIN; \
             CREATE TEMP TABLE old AS SELECT id FROM {schema}.sessions; \
             ALTER TABLE {schema}.entries DISABLE TRIGGER entry_changed; \
             DELETE FROM {schema}.sessions; \
             ALTER TABLE {schema}.entries ENABLE TRIGGER entry_changed; \
             INSERT INTO {schema}.sessions (id, ttl, expires_at) \
             SELECT id, '60s', clock_timestamp() + interval '60s' FROM old; \
             COMMIT;"
        ))
        .await
        .unwrap();
    let started = std::time::Instant::now();
    tokio::time::timeout(std::time::Duration::from_secs(4), leadership.lost())
        .await
        .expect("the old holder still leads on a session id that is no longer its own");
    assert!(started.elapsed() <= std::time::Duration::from_millis(2_100));
    backend.close().await;
}

/// Schemas: a role without CREATE on the database uses a schema made for it; a reserved word
/// as the schema's name is one clear line, not a syntax error from deep inside.
#[tokio::test]
async fn schemas_made_for_a_role_and_reserved_words() {
    let limited = server().replace("baton:baton@", "baton_limited:limited@");
    let backend = baton::Backend::connect(&format!("{limited}?schema=limited"))
        .await
        .unwrap_or_else(|error| panic!("a schema made for the role: {error}"));
    let election = baton::Election::new(
        &backend,
        &conformance::unique("limited"),
        conformance::config(),
    )
    .unwrap();
    election.campaign("a").await.unwrap().resign().await;
    backend.close().await;
    for word in ["select", "user", "order"] {
        let error = baton::Backend::connect(&format!("{}?schema={word}", server()))
            .await
            .err()
            .unwrap_or_else(|| panic!("schema={word} accepted"));
        let message = error.to_string();
        assert!(
            message.contains("reserves") && !error.is_retryable(),
            "{message}"
        );
    }
}

/// A read-only role (USAGE on the schema, SELECT on its tables) sees the leader and observes
/// it: connecting writes nothing it may not, and observing removes expired sessions only when
/// it may (the README says so).
#[tokio::test]
async fn a_read_only_role_reads_and_observes() {
    let url = format!("{}?schema=baton_test", server());
    let backend = baton::Backend::connect(&url).await.unwrap();
    raw(&server())
        .await
        .batch_execute(
            "GRANT USAGE ON SCHEMA baton_test TO baton_readonly; \
             GRANT SELECT ON ALL TABLES IN SCHEMA baton_test TO baton_readonly",
        )
        .await
        .unwrap();
    let name = conformance::unique("readonly");
    let leadership = baton::Election::new(&backend, &name, conformance::config())
        .unwrap()
        .campaign("a")
        .await
        .unwrap();
    let readonly = server().replace("baton:baton@", "baton_readonly:readonly@");
    let reader = baton::Backend::connect(&format!("{readonly}?schema=baton_test"))
        .await
        .unwrap_or_else(|error| panic!("a read-only role connects: {error}"));
    let election = baton::Election::new(&reader, &name, conformance::config()).unwrap();
    let leader = election.leader().await.unwrap().expect("a leader");
    assert_eq!(leader.id, "a");
    let mut observer = election.observe().await.unwrap();
    let seen = tokio::time::timeout(std::time::Duration::from_secs(3), observer.next())
        .await
        .expect("observed within 3s");
    match seen {
        Some(baton::Observed::Leader(Some(info))) => assert_eq!(info.id, "a"),
        other => panic!("a read-only observer saw {other:?}"),
    }
    leadership.resign().await;
    reader.close().await;
    backend.close().await;
}

/// Every commit of baton's waits for its record to be flushed, whatever the session's
/// `synchronous_commit` says (off here for the whole session; through PgBouncer another
/// client's `SET` can leave a server connection so, and a reload changes open sessions). A
/// deferred trigger on each of baton's tables records the setting in force at each commit
/// that wrote a row there: it reads `off` for a plain write on such a session, and `on` for
/// every write baton makes (grant, renewal, campaign, fenced write, resign, revoke) and for a
/// caller's own transaction that fences.
#[tokio::test]
async fn commits_wait_for_the_flush_whatever_the_session_says() {
    let schema = format!("durable_{}", std::process::id());
    let url = format!("{}?schema={schema}", server());
    baton::Backend::connect(&url).await.unwrap().close().await;
    let admin = raw(&server()).await;
    let mut sql = format!(
        "CREATE TABLE {schema}.commit_log (app text, tbl text, op text, setting text); \
         CREATE FUNCTION {schema}.zz_log_commit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
         INSERT INTO {schema}.commit_log VALUES (current_setting('application_name'), \
         TG_TABLE_NAME, TG_OP, current_setting('synchronous_commit')); RETURN NULL; END $$;"
    );
    // Named to fire last: deferred triggers of one event fire in name order, and the setting
    // in force at commit is the one after baton's own (`fence_durable`).
    for table in ["sessions", "elections", "entries", "data", "fences"] {
        sql.push_str(&format!(
            "CREATE CONSTRAINT TRIGGER zz_log_commit AFTER INSERT OR UPDATE OR DELETE \
             ON {schema}.{table} DEFERRABLE INITIALLY DEFERRED FOR EACH ROW \
             EXECUTE FUNCTION {schema}.zz_log_commit();"
        ));
    }
    admin.batch_execute(&sql).await.unwrap();
    let off = "options=-c%20synchronous_commit%3Doff";
    // A plain write on such a session commits without waiting: the log can tell.
    let control = raw(&format!("{}?application_name=control&{off}", server())).await;
    control
        .execute(
            &format!("INSERT INTO {schema}.data VALUES ('control', 'x')"),
            &[],
        )
        .await
        .unwrap();
    // baton on sessions that all have it off.
    let backend = baton::Backend::connect(&format!("{url}&application_name=durable-baton&{off}"))
        .await
        .unwrap_or_else(|error| panic!("synchronous_commit = off is no reason to refuse: {error}"));
    let election = baton::Election::new(
        &backend,
        &conformance::unique("durable"),
        conformance::config(),
    )
    .unwrap();
    let first = election.campaign("a").await.unwrap();
    first.guarded_put("/k", "v").await.unwrap();
    let mut waiter = election.candidacy("b").unwrap();
    // Waits (at most 5 s) until baton has committed a change `op` of `sessions`.
    let logged = |op: &'static str| {
        let sql = format!(
            "SELECT count(*) FROM {schema}.commit_log WHERE app = 'durable-baton' \
             AND tbl = 'sessions' AND op = '{op}'"
        );
        let admin = &admin;
        async move {
            let until = std::time::Instant::now() + Duration::from_secs(5);
            while admin.query_one(&sql, &[]).await.unwrap().get::<_, i64>(0) == 0 {
                assert!(std::time::Instant::now() < until, "no {op} within 5s");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    logged("UPDATE").await;
    // A caller's own transaction that fences, on a session with it off: plain, then turning
    // it off again after the fence, then through a function whose `SET` clause puts the
    // session's setting back when it returns.
    let mut caller = raw(&format!("{}?application_name=fence-caller&{off}", server())).await;
    let transaction = caller.transaction().await.unwrap();
    baton::postgres::fence(&transaction, &schema, "resource", first.token())
        .await
        .unwrap();
    transaction.commit().await.unwrap();
    let transaction = caller.transaction().await.unwrap();
    baton::postgres::fence(&transaction, &schema, "set-local", first.token())
        .await
        .unwrap();
    transaction
        .batch_execute(
            "SET LOCAL synchronous_commit = off; SET LOCAL application_name = 'set-local'",
        )
        .await
        .unwrap();
    transaction.commit().await.unwrap();
    caller
        .batch_execute(&format!(
            "CREATE FUNCTION {schema}.wrapped(r text, t bigint) RETURNS void LANGUAGE plpgsql \
             SET synchronous_commit = on AS $$ BEGIN PERFORM {schema}.fence(r, t); END $$; \
             BEGIN; SET LOCAL application_name = 'wrapped'; \
             SELECT {schema}.wrapped('wrapped', {}); COMMIT;",
            first.token()
        ))
        .await
        .unwrap();
    first.resign().await;
    let second = waiter.next().await.unwrap();
    second.resign().await;
    drop(waiter);
    backend.close().await;
    // The sessions are revoked, maybe after close returns.
    logged("DELETE").await;
    let rows = admin
        .query(
            &format!(
                "SELECT app, tbl, op, setting, count(*) FROM {schema}.commit_log \
                 GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3, 4"
            ),
            &[],
        )
        .await
        .unwrap();
    let log: Vec<String> = rows
        .iter()
        .map(|row| {
            let field = |i| row.get::<_, String>(i);
            format!("{} {} {} {}", field(0), field(1), field(2), field(3))
        })
        .collect();
    assert!(
        log.contains(&"control data INSERT off".to_string()),
        "{log:?}"
    );
    for caller in ["fence-caller", "set-local", "wrapped"] {
        let line = format!("{caller} fences INSERT on");
        assert!(log.contains(&line), "no {line:?} in {log:?}");
    }
    for written in [
        "sessions INSERT",
        "sessions UPDATE",
        "sessions DELETE",
        "elections INSERT",
        "elections UPDATE",
        "entries INSERT",
        "entries DELETE",
        "data INSERT",
    ] {
        let line = format!("durable-baton {written} on");
        assert!(log.contains(&line), "no {line:?} in {log:?}");
    }
    let ours = log.iter().filter(|line| !line.starts_with("control"));
    assert!(ours.clone().all(|line| line.ends_with(" on")), "{log:?}");
}

/// A schema an earlier release made has no `fence_durable` trigger on `fences`: connecting as
/// the table's owner adds it, and changes nothing else (a `fence()` its admin made a security
/// definer stays one); a role that may not add it (a read-only one) still connects. One found
/// disabled is enabled again; with the schema lock busy, connecting does not wait for it and
/// leaves the trigger to a later connect.
#[tokio::test]
async fn an_earlier_releases_fences_get_their_trigger_from_the_owner() {
    let schema = format!("old_fences_{}", std::process::id());
    let url = format!("{}?schema={schema}", server());
    baton::Backend::connect(&url).await.unwrap().close().await;
    let admin = raw(&server()).await;
    admin
        .batch_execute(&format!(
            "DROP TRIGGER fence_durable ON {schema}.fences; \
             ALTER FUNCTION {schema}.fence(text, bigint) SECURITY DEFINER; \
             GRANT USAGE ON SCHEMA {schema} TO baton_readonly; \
             GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO baton_readonly"
        ))
        .await
        .unwrap();
    let look = format!(
        "SELECT EXISTS (SELECT 1 FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = '{schema}' \
         AND c.relname = 'fences' AND t.tgname = 'fence_durable' AND t.tgenabled = 'A'), \
         (SELECT f.prosecdef FROM pg_proc f JOIN pg_namespace n ON n.oid = f.pronamespace \
         WHERE n.nspname = '{schema}' AND f.proname = 'fence')"
    );
    let state = || async {
        let row = admin.query_one(&look, &[]).await.unwrap();
        (row.get::<_, bool>(0), row.get::<_, bool>(1))
    };
    let readonly = server().replace("baton:baton@", "baton_readonly:readonly@");
    let reader = baton::Backend::connect(&format!("{readonly}?schema={schema}"))
        .await
        .unwrap_or_else(|error| panic!("a role that may not add the trigger connects: {error}"));
    reader.close().await;
    assert_eq!(state().await, (false, true));
    baton::Backend::connect(&url).await.unwrap().close().await;
    assert_eq!(state().await, (true, true));
    admin
        .batch_execute(&format!(
            "ALTER TABLE {schema}.fences DISABLE TRIGGER fence_durable"
        ))
        .await
        .unwrap();
    assert_eq!(state().await, (false, true));
    baton::Backend::connect(&url).await.unwrap().close().await;
    assert_eq!(state().await, (true, true));
    // Another process adds it (holds this schema's upgrade lock), then a transaction that
    // fences holds the table: connecting waits for neither, and leaves the trigger to a later
    // connect.
    admin
        .batch_execute(&format!("DROP TRIGGER fence_durable ON {schema}.fences"))
        .await
        .unwrap();
    let mut holder = raw(&server()).await;
    for hold in [
        format!("SELECT pg_advisory_xact_lock(hashtext('baton schema'), hashtext('{schema}'))"),
        format!("SELECT {schema}.fence('held', 1)"),
    ] {
        let holding = holder.transaction().await.unwrap();
        holding.execute(&hold, &[]).await.unwrap();
        let started = std::time::Instant::now();
        baton::Backend::connect(&url).await.unwrap().close().await;
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "connect waited {:?} behind {hold}",
            started.elapsed()
        );
        assert_eq!(state().await, (false, true), "{hold}");
        holding.commit().await.unwrap();
    }
    baton::Backend::connect(&url).await.unwrap().close().await;
    assert_eq!(state().await, (true, true));
    // And it still fences.
    let client = raw(&server()).await;
    baton::postgres::fence(&client, &schema, "r", 5)
        .await
        .unwrap();
    match baton::postgres::fence(&client, &schema, "r", 4).await {
        Err(baton::Error::StaleToken { token: 4, .. }) => {}
        other => panic!("expected a stale token, got {other:?}"),
    }
}

/// Connections of `application_name` `app` open at PostgreSQL.
async fn connections_of(observer: &tokio_postgres::Client, app: &str) -> i64 {
    observer
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
            &[&app],
        )
        .await
        .unwrap()
        .get(0)
}

/// A backend whose connections are named `app` (a unique name), a raw connection to count
/// them, and an election of the backend's named `app` too.
async fn named_backend(
    prefix: &str,
) -> (
    String,
    tokio_postgres::Client,
    baton::Backend,
    baton::Election,
) {
    let app = conformance::unique(prefix);
    let url = format!("{}?schema=baton_test&application_name={app}", server());
    let observer = raw(&server()).await;
    let backend = baton::Backend::connect(&url).await.unwrap();
    let election = baton::Election::new(&backend, &app, conformance::config()).unwrap();
    (app, observer, backend, election)
}

/// A process with one election (`baton run`) keeps three connections: one for statements, one
/// for renewals, one for notifications. Statements that keep waiting for the statement
/// connection (many elections campaigning at once) open one more, and no more than that.
#[tokio::test]
async fn the_statement_pool_grows_only_under_contention() {
    let (app, observer, backend, election) = named_backend("pool").await;
    let name = app.clone();
    let leadership = election.campaign("leader").await.unwrap();
    let mut waiter = election.candidacy("waiter").unwrap();
    let waiting = tokio::time::timeout(Duration::from_millis(300), waiter.next()).await;
    assert!(waiting.is_err(), "the waiter led beside the leader");
    assert_eq!(connections_of(&observer, &app).await, 3);
    // A handoff on those three: nothing opened on its path.
    leadership.resign().await;
    let next = waiter.next().await.unwrap();
    assert!(next.is_leading());
    assert_eq!(connections_of(&observer, &app).await, 3);
    // 200 elections campaigning at once keep the statement connection busy: a second opens.
    let many: Vec<_> = (0..200)
        .map(|i| baton::Election::new(&backend, &format!("{name}-{i}"), conformance::config()))
        .collect::<Result<_, _>>()
        .unwrap();
    let campaigns: Vec<_> = many
        .into_iter()
        .map(|election| tokio::spawn(async move { election.campaign("bulk").await }))
        .collect();
    let mut leaderships = Vec::new();
    for campaign in campaigns {
        let leadership = campaign.await.unwrap().unwrap();
        assert!(leadership.is_leading());
        leaderships.push(leadership);
    }
    assert_eq!(connections_of(&observer, &app).await, 4);
    drop(leaderships);
    drop(next);
    backend.close().await;
}

/// A statement connection that breaks while idle (`pg_terminate_backend`, a server restart) is
/// replaced within about a second, not by the next statement, which may be the resign of a
/// handoff.
#[tokio::test]
async fn a_broken_idle_statement_connection_is_replaced_before_it_is_needed() {
    let (app, observer, backend, election) = named_backend("mend").await;
    let leadership = election.campaign("leader").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(connections_of(&observer, &app).await, 3);
    // Neither the LISTEN connection nor the renewals' one (its last statement renews, or it
    // has run none yet but the durability check every connection starts with).
    let statements: i32 = observer
        .query_one(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 \
             AND query <> '' AND query NOT LIKE 'LISTEN%' \
             AND query NOT LIKE 'UPDATE%sessions SET expires_at%' \
             AND query NOT LIKE 'SELECT current_setting%'",
            &[&app],
        )
        .await
        .unwrap()
        .get(0);
    observer
        .execute("SELECT pg_terminate_backend($1)", &[&statements])
        .await
        .unwrap();
    // The leader runs no statement meanwhile: only the pool's own mending reconnects.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while connections_of(&observer, &app).await < 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "the broken statement connection was not replaced"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(leadership.is_leading());
    leadership.resign().await;
    backend.close().await;
}
