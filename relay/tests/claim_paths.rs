//! The relay's claim paths and retention on real Postgres and NATS: rows held back by an older open
//! transaction, the rescue that hands them to the per-row path, retention, rows left pending by
//! a relay from before the range claim, and two relays claiming at once.

use std::time::Duration;

use handoff_relay::outbox::{self, RangeClaim};
use handoff_relay::{Relay, RelaySettings};
use handoff_tests::{SEED_TITLE, TestEnv};
use sqlx::postgres::PgPoolOptions;

/// An unrelated write transaction that stays open: it has a transaction id, so it holds back the
/// horizon below which the relay claims in commit order.
async fn open_write_transaction(env: &TestEnv) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut tx = env.producer_db.begin().await.unwrap();
    sqlx::query("SELECT pg_current_xact_id()").execute(&mut *tx).await.unwrap();
    tx
}

#[tokio::test]
async fn a_row_committed_behind_an_open_transaction_waits_for_it_then_is_published_once() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    let open = open_write_transaction(&env).await;
    env.approve("case-104", SEED_TITLE).await.unwrap();

    let batch = relay.publish_batch().await.unwrap();
    assert_eq!(batch.claimed, 0, "{batch:?}");
    assert!(batch.held_back_by.is_some(), "{batch:?}");
    assert_eq!(env.stream_messages().await.unwrap(), 0);

    open.commit().await.unwrap();
    let batch = relay.publish_batch().await.unwrap();
    assert_eq!((batch.published, batch.held_back_by), (1, None), "{batch:?}");
    assert_eq!(relay.publish_batch().await.unwrap().claimed, 0);
    assert_eq!(env.stream_messages().await.unwrap(), 1);
    let (state, attempts): (String, i32) = sqlx::query_as("SELECT state, attempts FROM handoff.outbox_delivery")
        .fetch_one(&env.producer_db)
        .await
        .unwrap();
    assert_eq!((state.as_str(), attempts), ("published", 1));
}

#[tokio::test]
async fn a_row_held_back_too_long_is_rescued_to_the_per_row_path_and_not_sent_again_later() {
    let env = TestEnv::start().await.unwrap();
    let settings = RelaySettings { held_back: Duration::ZERO, ..env.relay_settings() };
    let relay = env.relay(settings).await.unwrap();
    let open = open_write_transaction(&env).await;
    env.approve("case-104", SEED_TITLE).await.unwrap();
    assert!(relay.publish_batch().await.unwrap().held_back_by.is_some());

    assert_eq!(relay.rescue_held_back_rows().await.unwrap(), 1);
    let batch = relay.publish_batch().await.unwrap();
    assert_eq!((batch.claimed, batch.published), (1, 1), "{batch:?}");
    assert_eq!(batch.held_back_by, None, "a rescued row no longer counts as held back");

    // When the old transaction ends, the range that covers the row finds it published already.
    open.commit().await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().claimed, 0);
    let ranges: i64 =
        sqlx::query_scalar("SELECT count(*) FROM handoff.relay_batch").fetch_one(&env.producer_db).await.unwrap();
    assert_eq!(ranges, 0, "the empty range was released");
    assert_eq!(env.stream_messages().await.unwrap(), 1);
    assert_eq!(env.outbox().await.unwrap().published, 1);
}

#[tokio::test]
async fn retention_deletes_outbox_rows_published_longer_ago_and_keeps_approvals_and_the_rest() {
    let env = TestEnv::start().await.unwrap();
    let settings =
        RelaySettings { retention: Some(Duration::from_secs(3600)), held_back: Duration::ZERO, ..env.relay_settings() };
    let relay = env.relay(settings).await.unwrap();
    let key = |case: &str| format!("harbor:create-followup:v1:{case}");
    // Range A: case-1 and case-2, recorded once as a published range.
    for case in ["case-1", "case-2"] {
        env.approve(case, SEED_TITLE).await.unwrap();
    }
    assert_eq!(relay.publish_batch().await.unwrap().published, 2);
    // Range B: case-3.
    env.approve("case-3", SEED_TITLE).await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().published, 1);
    // case-5 goes out on the per-row path (held back, rescued) and is marked on its own row.
    let open = open_write_transaction(&env).await;
    env.approve("case-5", SEED_TITLE).await.unwrap();
    assert!(relay.publish_batch().await.unwrap().held_back_by.is_some());
    assert_eq!(relay.rescue_held_back_rows().await.unwrap(), 1);
    assert_eq!(relay.publish_batch().await.unwrap().published, 1);
    open.commit().await.unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().claimed, 0);
    let ranges =
        || sqlx::query_scalar::<_, i64>("SELECT count(*) FROM handoff.published_range").fetch_one(&env.producer_db);
    assert_eq!(ranges().await.unwrap(), 2, "ranges A and B; case-5 has its own row");
    // case-2 is re-queued (as after a broker loss): its own row speaks for it again.
    let requeued =
        handoff_relay::reconcile::requeue(&env.producer_db, &[key("case-2")], Duration::ZERO, "test", "lost")
            .await
            .unwrap();
    assert_eq!(requeued.len(), 1);
    env.approve("case-4", SEED_TITLE).await.unwrap();
    // Range A and case-5 were published two hours ago.
    sqlx::query(
        "UPDATE handoff.published_range SET published_at = now() - interval '2 hours'
          WHERE (SELECT id FROM handoff.outbox WHERE operation_key = $1) = ANY(outbox_ids)",
    )
    .bind(key("case-1"))
    .execute(&env.producer_db)
    .await
    .unwrap();
    sqlx::query("UPDATE handoff.outbox SET published_at = now() - interval '2 hours' WHERE operation_key = $1")
        .bind(key("case-5"))
        .execute(&env.producer_db)
        .await
        .unwrap();

    assert_eq!(relay.apply_retention().await.unwrap(), 2, "case-1 with its range, and case-5");
    assert_eq!(ranges().await.unwrap(), 1, "range B is young");
    let states: Vec<(String, String)> =
        sqlx::query_as("SELECT operation_key, state FROM handoff.outbox_delivery ORDER BY operation_key")
            .fetch_all(&env.producer_db)
            .await
            .unwrap();
    let expected = [("case-2", "pending"), ("case-3", "published"), ("case-4", "pending")];
    assert_eq!(states, expected.map(|(c, s)| (key(c), s.to_owned())), "the re-queued row outlived its range");
    assert_eq!(env.approvals().await.unwrap(), 5, "approvals are the business record and stay");
    assert_eq!(relay.apply_retention().await.unwrap(), 0, "nothing else is old enough");
    // Re-approving a retained-away action still adds nothing, and a changed one is still a conflict.
    assert_eq!(env.approve("case-1", SEED_TITLE).await.unwrap(), handoff_relay::Recorded::AlreadyRecorded);
    assert!(matches!(env.approve("case-1", "changed").await, Err(handoff_relay::RecordError::Conflict(_))));
    assert_eq!(env.outbox().await.unwrap().pending, 2);
    // The new row is unaffected and still goes out. The re-queued one waits on the per-row path:
    // the broker still holds its message (nothing was really lost) and says so.
    let mut published = 0;
    for _ in 0..3 {
        published += relay.publish_batch().await.unwrap().published;
    }
    assert_eq!(published, 1);
    let outbox = env.outbox().await.unwrap();
    assert_eq!((outbox.published, outbox.pending), (2, 1));
}

#[tokio::test]
async fn rows_left_pending_by_a_relay_from_before_the_upgrade_are_published_on_the_per_row_path() {
    let env = TestEnv::start().await.unwrap();
    let url = env.postgres.fresh_database("upgrade").await.unwrap();
    let pool = PgPoolOptions::new().max_connections(4).connect(&url).await.unwrap();
    handoff_relay::SCHEMA.migrator().run_to(20261129000001, &pool).await.unwrap();
    sqlx::query(
        "SELECT handoff.record_approved_action('harbor:create-followup:v1:case-' || i,
                jsonb_build_object('case_id', 'case-' || i), 'user-17')
           FROM generate_series(1, 3) AS i",
    )
    .execute(&pool)
    .await
    .unwrap();
    // One row was published by the old relay, one is leased by it right now.
    sqlx::query("UPDATE handoff.outbox SET state = 'published', stream_sequence = 1 WHERE id = 1")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "UPDATE handoff.outbox SET lease_owner = 'old', next_attempt_at = now() + interval '1 hour' WHERE id = 2",
    )
    .execute(&pool)
    .await
    .unwrap();

    let client = async_nats::connect(env.nats.url()).await.unwrap();
    // This relay is the upgrade: it migrates the old schema itself, as the owner.
    let settings = RelaySettings { migrate: handoff_shared::migrate::MigrateMode::Auto, ..env.relay_settings() };
    let relay = Relay::build(pool.clone(), client, env.stream_settings(), settings).await.unwrap();
    let retrying: Vec<i64> = sqlx::query_scalar("SELECT id FROM handoff.outbox_delivery WHERE retrying ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(retrying, [2, 3]);

    // Row 3 is due; row 2 waits for the old relay's lease.
    let batch = relay.publish_batch().await.unwrap();
    assert_eq!((batch.claimed, batch.published), (1, 1), "{batch:?}");
    assert_eq!(relay.publish_batch().await.unwrap().claimed, 0);
    // A row recorded after the upgrade goes by range.
    sqlx::query("SELECT handoff.record_approved_action('harbor:create-followup:v1:case-4', '{\"case_id\": \"case-4\"}', 'user-17')")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(relay.publish_batch().await.unwrap().published, 1);
    let states: Vec<(i64, String, bool)> =
        sqlx::query_as("SELECT id, state, retrying FROM handoff.outbox_delivery ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        states,
        [
            (1, "published".to_owned(), false),
            (2, "pending".to_owned(), true),
            (3, "published".to_owned(), false),
            (4, "published".to_owned(), false)
        ]
    );
    assert_eq!(env.stream_messages().await.unwrap(), 2);
}

/// The new rows in commit order: each one's transaction id (as text) and id.
async fn commit_order(pool: &sqlx::PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT transaction_id::text, id FROM handoff.outbox ORDER BY transaction_id, id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Records `rows` actions, then has another relay's claim move the cursor to the third of them and
/// hold the cursor's row lock (an open transaction) while `relay-b` claims up to 10 rows: once that
/// claim waits for the lock (`pg_locks`), the other commits. Returns the rows in commit order and
/// what `relay-b` claimed.
async fn claim_while_another_relay_moves_the_cursor(
    pool: &sqlx::PgPool,
    rows: i64,
) -> (Vec<(String, i64)>, RangeClaim) {
    handoff_tests::approve_range(pool, 1, rows).await.unwrap();
    let order = commit_order(pool).await;
    let mut other = pool.begin().await.unwrap();
    sqlx::query("UPDATE handoff.relay_cursor SET transaction_id = $1::text::xid8, outbox_id = $2")
        .bind(&order[2].0)
        .bind(order[2].1)
        .execute(&mut *other)
        .await
        .unwrap();
    let claim = tokio::spawn({
        let pool = pool.clone();
        async move { outbox::claim_new_range(&pool, "relay-b", 10, Duration::from_secs(30), false).await }
    });
    handoff_tests::eventually("the claim to wait for the cursor's row lock", Duration::from_secs(10), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks JOIN pg_stat_activity USING (pid)
              WHERE NOT granted AND datname = current_database()",
        )
        .fetch_one(pool)
        .await?;
        Ok((waiting > 0).then_some(()))
    })
    .await
    .unwrap();
    other.commit().await.unwrap();
    (order, claim.await.unwrap().unwrap())
}

#[tokio::test]
async fn a_claim_that_waits_for_another_relay_to_move_the_cursor_claims_the_rows_after_it() {
    let env = TestEnv::start().await.unwrap();
    let pool = &env.producer_db;
    let (order, claim) = claim_while_another_relay_moves_the_cursor(pool, 6).await;

    let RangeClaim::Claimed(claim) = claim else { panic!("the claim lost its work to the relay it waited for") };
    let claimed: Vec<i64> = claim.rows.iter().map(|row| row.id).collect();
    let after: Vec<i64> = order[3..].iter().map(|(_, id)| *id).collect();
    assert_eq!(claimed, after, "the rows after the other relay's range, none of its own");
    let cursor: i64 = sqlx::query_scalar("SELECT outbox_id FROM handoff.relay_cursor").fetch_one(pool).await.unwrap();
    assert_eq!(cursor, order[5].1);
}

#[tokio::test]
async fn a_claim_that_finds_no_row_after_the_moved_cursor_in_its_snapshot_claims_nothing_and_says_so() {
    let env = TestEnv::start().await.unwrap();
    let pool = &env.producer_db;
    let (_, claim) = claim_while_another_relay_moves_the_cursor(pool, 3).await;

    assert!(matches!(claim, RangeClaim::Contended), "told to claim again at once: {claim:?}");
    let ranges: i64 = sqlx::query_scalar("SELECT count(*) FROM handoff.relay_batch").fetch_one(pool).await.unwrap();
    assert_eq!(ranges, 0, "a contended claim writes no range");
    let again = outbox::claim_new_range(pool, "relay-b", 10, Duration::from_secs(30), false).await.unwrap();
    let RangeClaim::Claimed(again) = again else { panic!("claimed again: {again:?}") };
    assert!(again.rows.is_empty(), "the other relay's rows are not claimed twice");
}

#[tokio::test]
async fn a_claim_with_nothing_to_claim_does_not_lock_the_cursor() {
    let env = TestEnv::start().await.unwrap();
    let pool = &env.producer_db;
    handoff_tests::approve_range(pool, 1, 3).await.unwrap();
    let lease = Duration::from_secs(30);
    let RangeClaim::Claimed(claim) = outbox::claim_new_range(pool, "relay-a", 10, lease, false).await.unwrap() else {
        panic!("nothing claimed")
    };
    assert_eq!(claim.rows.len(), 3);
    // A row lock writes the locker's transaction id into the row's xmax.
    let locker = || sqlx::query_scalar::<_, String>("SELECT xmax::text FROM handoff.relay_cursor").fetch_one(pool);
    let after_claim = locker().await.unwrap();

    let RangeClaim::Claimed(idle) = outbox::claim_new_range(pool, "relay-a", 10, lease, false).await.unwrap() else {
        panic!("an idle claim is not contended")
    };
    assert!(idle.rows.is_empty());
    assert_eq!(
        locker().await.unwrap(),
        after_claim,
        "an idle claim neither locks the cursor nor takes a transaction id"
    );
}
