//! The statements of a batch's happy path run on the workers' own connections, which plan each
//! statement once (`force_generic_plan`, sequential scans off): their plans must reach the outbox
//! through an index whatever its size. A generic plan is made without the parameters' values, so
//! it is checked where it is most tempted to scan: on an empty outbox, then after 5,000 rows and
//! ANALYZE.

use handoff_relay::{Relay, outbox};
use handoff_shared::config::DatabaseArgs;
use handoff_tests::TestEnv;

#[tokio::test]
async fn the_workers_statements_planned_once_reach_the_outbox_by_index_at_any_size() {
    let env = TestEnv::start().await.unwrap();
    // The relay's pool as its binary opens it (planning per execution), which the workers' pool
    // derives its own settings from: theirs must win.
    let pool = DatabaseArgs::plain(env.relay_url()).connect("handoff-relay").await.unwrap();
    let client = async_nats::connect(env.nats.addrs()).await.unwrap();
    let relay = Relay::build(pool, client, env.stream_settings(), env.relay_settings()).await.unwrap();
    let mut conn = relay.worker_pool().acquire().await.unwrap();
    let settings: (String, String, String) =
        sqlx::query_as("SELECT current_setting('plan_cache_mode'), current_setting('enable_seqscan'), current_setting('synchronous_commit')")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
    assert_eq!(settings, ("force_generic_plan".into(), "off".into(), "off".into()));

    for rows in [0, 5_000] {
        if rows > 0 {
            handoff_tests::approve_range(&env.producer_db, 1, rows).await.unwrap();
            sqlx::raw_sql("ANALYZE handoff.outbox; ANALYZE handoff.approved_action")
                .execute(&env.producer_db)
                .await
                .unwrap();
        }
        for (name, sql) in outbox::worker_statements() {
            let plan = handoff_tests::prepared_plan(&mut conn, sql).await.unwrap();
            let shown = plan.join("\n");
            for table in ["outbox", "approved_action", "published_range"] {
                assert!(
                    !plan.iter().any(|line| line.contains(&format!("Seq Scan on {table}"))),
                    "{name} at {rows} rows scans {table}:\n{shown}"
                );
            }
            if name == "claim_new_range" {
                // The range is an index range scan in commit order that stops after a batch (a
                // bitmap scan would read every row after the cursor and sort them).
                let start = plan.iter().position(|l| l == "CTE next").expect("the range's CTE");
                let end =
                    plan[start + 1..].iter().position(|l| l.starts_with("CTE ")).map_or(plan.len(), |i| start + 1 + i);
                assert!(
                    plan[start..end].iter().any(|l| l.contains("Index Scan using outbox_commit_order on outbox")),
                    "{name} at {rows} rows does not scan the commit order:\n{shown}"
                );
                assert!(
                    plan.iter().any(|l| l.contains("Index Scan using approved_action_pkey on approved_action")),
                    "{name} at {rows} rows reaches the approvals without their key:\n{shown}"
                );
            }
        }
    }
}
