//! Claim cost as the backlog grows: the relay's own claim statements (the constants in
//! `handoff_relay::outbox`, not copies), timed and explained at each backlog size.
//!
//! A claim is timed whole, as the relay runs it (one statement: move the cursor, record the range,
//! return its rows with their payloads; on a connection with the relay workers' settings, so with
//! the generic plan they make once), inside a transaction that is rolled back, so every
//! repetition claims the same rows. Statistics are left to autovacuum, as in production: a backlog that arrives
//! faster than ANALYZE must not change the plan (platform notes).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Result;
use handoff_relay::outbox::{
    CLAIM_NEW_RANGE, CLAIM_RETRY_ROWS, DELETE_EXPIRED, DELETE_EXPIRED_RANGES, ROWS_IN_RANGE, SETTLE_RANGE,
};
use handoff_shared::config::Plans;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool, Row};

use crate::report::{PlanSample, Stats};
use crate::workload;
use crate::world::World;

/// Claims timed per backlog size.
const REPETITIONS: usize = 15;
/// Backlog rows recorded per transaction while growing the table.
const FILL_CHUNK: i64 = 100_000;

/// Grows one outbox through `backlogs` (ascending) and measures a claim of `batch` rows at each.
pub async fn claim_cost(world: &World, backlogs: &[i64], batch: i64) -> Result<Vec<PlanSample>> {
    let db = world.database("bench_plans", 2).await?;
    handoff_relay::SCHEMA.migrate(&db.pool).await?;
    // The relay's session settings, so plans are the ones it gets: its workers' connections plan
    // the range claim and the settle once (generic plans), the others plan every execution.
    let connect = |plans: Plans| -> Result<_> {
        let options = db.url.parse::<PgConnectOptions>()?.options([("synchronous_commit", "off")]);
        Ok(PgPoolOptions::new().max_connections(1).connect_with(options.options(plans.settings())))
    };
    let pool = connect(Plans::PerExecution)?.await?;
    let worker = connect(Plans::OncePerConnection)?.await?;
    let mut recorded = 0;
    let mut samples = Vec::new();
    for &backlog in backlogs {
        while recorded < backlog {
            let n = FILL_CHUNK.min(backlog - recorded);
            workload::record_actions(&pool, "plan", recorded + 1, n).await?;
            recorded += n;
        }
        // Alternating, so both meet the same machine.
        let (mut millis, mut planned_each_time) = (Vec::new(), Vec::new());
        for _ in 0..REPETITIONS {
            for (on, out) in [(&worker, &mut millis), (&pool, &mut planned_each_time)] {
                let mut tx = on.begin().await?;
                let started = Instant::now();
                let rows = claim(&mut tx, batch).await?;
                out.push(started.elapsed().as_secs_f64() * 1e3);
                tx.rollback().await?;
                anyhow::ensure!(rows.len() as i64 == batch.min(backlog), "claimed {} rows", rows.len());
            }
        }
        let plans = explain_all(&pool, &worker, batch).await?;
        let full_scans = full_scans(&plans, batch);
        samples.push(PlanSample {
            backlog,
            claim_ms: Stats::of(millis),
            claim_ms_planned_each_time: Stats::of(planned_each_time),
            batch,
            full_scans,
            plans,
        });
    }
    pool.close().await;
    worker.close().await;
    world.drop_database(db).await?;
    Ok(samples)
}

/// EXPLAIN (ANALYZE, BUFFERS) of each relay statement, each in a transaction that is rolled back:
/// the workers' statements on `worker` as the generic plans its connections make, the others on
/// `pool`, planned with their parameters.
async fn explain_all(pool: &PgPool, worker: &PgPool, batch: i64) -> Result<BTreeMap<String, String>> {
    let mut plans = BTreeMap::new();
    let mut tx = worker.begin().await?;
    plans.insert(
        "claim_new_range".into(),
        explain_generic(&mut tx, CLAIM_NEW_RANGE, &format!("{batch}, 'bench', 30.0, true")).await?,
    );
    tx.rollback().await?;

    // The range claimed (and rolled back) here is the one the statements below work on.
    let mut tx = worker.begin().await?;
    let claimed = claim(&mut tx, batch).await?;
    let batch_id: Option<i64> = claimed.first().map(|r| r.get("batch_id"));
    let ids: Vec<i64> = claimed.iter().map(|r| r.get("id")).collect();
    let ids = format!("'{{{}}}'::bigint[]", ids.iter().map(i64::to_string).collect::<Vec<_>>().join(","));
    let range = batch_id.map_or("NULL".into(), |id| id.to_string());
    plans.insert(
        "settle".into(),
        explain_generic(
            &mut tx,
            SETTLE_RANGE.as_str(),
            &format!("'BENCH', {ids}, {ids}, '{{}}'::bigint[], 'bench', {range}"),
        )
        .await?,
    );
    // Re-claiming an expired range runs on the relay's other connections.
    sqlx::raw_sql("SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL enable_seqscan = on")
        .execute(&mut *tx)
        .await?;
    plans.insert("rows_in_range".into(), explain(&mut tx, ROWS_IN_RANGE, |q| q.bind(batch_id)).await?);
    tx.rollback().await?;

    let mut tx = pool.begin().await?;
    plans.insert(
        "claim_retry_rows".into(),
        explain(&mut tx, CLAIM_RETRY_ROWS, |q| q.bind(batch).bind("bench").bind(30.0)).await?,
    );
    plans.insert(
        "retention_step".into(),
        explain(&mut tx, DELETE_EXPIRED, |q| q.bind("0").bind(0_i64).bind(5_000_i64).bind(3600.0)).await?,
    );
    plans.insert(
        "retention_ranges_step".into(),
        explain(&mut tx, DELETE_EXPIRED_RANGES, |q| q.bind(5_000_i64).bind(3600.0)).await?,
    );
    tx.rollback().await?;
    Ok(plans)
}

/// One range claim as the relay runs it; the claimed rows (each line carries the range id).
async fn claim(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, batch: i64) -> Result<Vec<sqlx::postgres::PgRow>> {
    let lines =
        sqlx::query(CLAIM_NEW_RANGE).bind(batch).bind("bench").bind(30.0).bind(true).fetch_all(&mut **tx).await?;
    Ok(lines.into_iter().filter(|l| l.get::<Option<i64>, _>("id").is_some()).collect())
}

type Query<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

async fn explain<'q>(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    sql: &'static str,
    bind: impl FnOnce(Query<'q>) -> Query<'q>,
) -> Result<String> {
    let text = format!("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {sql}");
    let rows = bind(sqlx::query(AssertSqlSafe(text))).fetch_all(&mut **tx).await?;
    Ok(rows.iter().map(|r| elide_arrays(&r.get::<String, _>(0))).collect::<Vec<_>>().join("\n"))
}

/// EXPLAIN (ANALYZE, BUFFERS) of `sql` prepared and executed with `args` (SQL literals): the plan
/// the connection's plan cache chooses, which on the workers' connections is the generic one.
async fn explain_generic(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, sql: &str, args: &str) -> Result<String> {
    // The statements are the relay's own constants and the arguments numbers and fixed words.
    sqlx::raw_sql(AssertSqlSafe(format!("PREPARE bench_plan AS {sql}"))).execute(&mut **tx).await?;
    let text = format!("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) EXECUTE bench_plan({args})");
    let rows = sqlx::raw_sql(AssertSqlSafe(text)).fetch_all(&mut **tx).await?;
    sqlx::raw_sql("DEALLOCATE bench_plan").execute(&mut **tx).await?;
    Ok(rows.iter().map(|r| elide_arrays(&r.get::<String, _>(0))).collect::<Vec<_>>().join("\n"))
}

/// Replaces long array literals (the bound id lists) with their length, to keep plans readable.
fn elide_arrays(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(start) = rest.find("'{") {
        let Some(len) = rest[start..].find("}'") else { break };
        let literal = &rest[start + 2..start + len];
        out.push_str(&rest[..start]);
        if literal.len() > 40 {
            out.push_str(&format!("'{{…{} elements}}'", literal.split(',').count()));
        } else {
            out.push_str(&rest[start..start + len + 2]);
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    out
}

/// Sequential scans of the outbox, claims that read more outbox rows than one batch, and sorts of
/// more rows than one batch: what must not happen as the backlog grows.
fn full_scans(plans: &BTreeMap<String, String>, batch: i64) -> Vec<String> {
    let mut found = Vec::new();
    for (name, plan) in plans {
        for line in plan.lines() {
            let node = line.trim_start().trim_start_matches("->  ");
            let rows = line
                .split("rows=")
                .nth(2)
                .or_else(|| line.split("rows=").nth(1))
                .and_then(|r| r.split_whitespace().next())
                .and_then(|r| r.parse::<i64>().ok())
                .unwrap_or(0);
            let claims = name == "claim_new_range" || name == "rows_in_range";
            if node.starts_with("Seq Scan on outbox") || node.starts_with("Seq Scan on approved_action") {
                found.push(format!("{name}: {node}"));
            } else if claims && node.contains(" on outbox ") && rows > batch {
                // A claim reads one batch: a scan that returns more (a bitmap scan of everything
                // after the cursor, sorted and cut by the LIMIT above it) grows with the backlog.
                found.push(format!("{name}: {rows} outbox rows read for a batch of {batch}"));
            } else if node.starts_with("Sort") && rows > batch {
                found.push(format!("{name}: sort of {rows} rows"));
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_array_literals_are_elided() {
        let ids: Vec<String> = (1..=100).map(|i| i.to_string()).collect();
        let line = format!("Index Cond: (id = ANY ('{{{}}}'::bigint[]))", ids.join(","));
        assert_eq!(elide_arrays(&line), "Index Cond: (id = ANY ('{…100 elements}'::bigint[]))");
        assert_eq!(elide_arrays("x = ANY ('{}'::text[])"), "x = ANY ('{}'::text[])");
    }

    #[test]
    fn flags_table_scans_and_big_sorts_only() {
        let plan = "Limit (actual time=0.1..0.2 rows=1000 loops=1)\n  ->  Index Scan using outbox_commit_order on outbox o (actual time=0.1..0.2 rows=1000 loops=1)\n  ->  Sort (actual time=1..2 rows=50 loops=1)";
        let plans = BTreeMap::from([("a".to_owned(), plan.to_owned())]);
        assert!(full_scans(&plans, 1000).is_empty());
        let bad = "Sort (actual time=1..2 rows=100000 loops=1)\n  ->  Seq Scan on outbox o (actual time=0.1..9 rows=100000 loops=1)";
        let plans = BTreeMap::from([("b".to_owned(), bad.to_owned())]);
        assert_eq!(full_scans(&plans, 1000).len(), 2);
        // A claim that reads the whole backlog through a bitmap scan, then sorts and cuts it
        // (the Sort above it returns only a batch).
        let bitmap = "Limit (actual time=1..2 rows=1000 loops=1)\n  ->  Sort (actual time=1..2 rows=1000 loops=1)\n        ->  Bitmap Heap Scan on outbox o (actual time=0.1..9 rows=100000 loops=1)";
        let plans = BTreeMap::from([("claim_new_range".to_owned(), bitmap.to_owned())]);
        assert_eq!(full_scans(&plans, 1000), ["claim_new_range: 100000 outbox rows read for a batch of 1000"]);
        // Retention reads a chunk bigger than a batch on purpose.
        let plans = BTreeMap::from([("retention_step".to_owned(), bitmap.to_owned())]);
        assert!(full_scans(&plans, 1000).is_empty());
    }
}
