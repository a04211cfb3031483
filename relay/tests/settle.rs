//! Settling a range on real Postgres and NATS: a fully published range is recorded once in its
//! `published_range` row and writes no outbox row; a failed row gets its own state next to the
//! range; a relay that lost its range's lease marks its rows one by one and the range's new owner
//! records the range, counted once; a large range's arrays are stored without compression.

use std::time::Duration;

use handoff_relay::outbox::{self, Lease, PublishedRow, RangeClaim};
use handoff_tests::{SEED_TITLE, TestEnv};

/// Each outbox row's physical version (`xmin`, `ctid`): unchanged means nobody wrote the row.
async fn row_versions(env: &TestEnv) -> Vec<(i64, String)> {
    sqlx::query_as("SELECT id, xmin::text || '/' || ctid::text FROM handoff.outbox ORDER BY id")
        .fetch_all(&env.producer_db)
        .await
        .unwrap()
}

async fn ranges(env: &TestEnv) -> Vec<i32> {
    sqlx::query_scalar("SELECT cardinality(outbox_ids) FROM handoff.published_range ORDER BY last_outbox_id")
        .fetch_all(&env.producer_db)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_published_range_is_recorded_once_and_writes_no_outbox_row() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    handoff_tests::approve_range(&env.producer_db, 1, 50).await.unwrap();
    let before = row_versions(&env).await;

    let batch = relay.publish_batch().await.unwrap();
    assert_eq!((batch.claimed, batch.published), (50, 50), "{batch:?}");
    assert_eq!(row_versions(&env).await, before, "no outbox row was written by the settle");
    assert_eq!(ranges(&env).await, [50]);
    assert_eq!(env.published_sequences_match_the_stream().await.unwrap(), 50);
    assert_eq!(env.stream_messages().await.unwrap(), 50);
    let counts = env.outbox().await.unwrap();
    assert_eq!((counts.published, counts.pending, counts.blocked), (50, 0, 0));
    let (attempts, duplicates): (Vec<i32>, i64) = sqlx::query_as(
        "SELECT array_agg(DISTINCT attempts), count(*) FILTER (WHERE duplicate) FROM handoff.outbox_delivery",
    )
    .fetch_one(&env.producer_db)
    .await
    .unwrap();
    assert_eq!((attempts, duplicates), (vec![1], 0));
}

#[tokio::test]
async fn a_failed_row_gets_its_own_state_and_the_rest_of_the_range_is_recorded_once() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    for case in ["case-1", "case-2", "case-3", "case-4", "case-5"] {
        env.approve(case, SEED_TITLE).await.unwrap();
    }
    let tampered = "harbor:create-followup:v1:case-3";
    env.tamper_with_payload(tampered, serde_json::json!({ "case_id": "case-3", "title": "edited" })).await.unwrap();
    let before = row_versions(&env).await;

    let batch = relay.publish_batch().await.unwrap();
    assert_eq!((batch.published, batch.blocked), (4, 1), "{batch:?}");
    let after = row_versions(&env).await;
    let written: Vec<i64> = before.iter().zip(&after).filter(|(b, a)| b != a).map(|(b, _)| b.0).collect();
    let tampered_id: i64 = sqlx::query_scalar("SELECT id FROM handoff.outbox WHERE operation_key = $1")
        .bind(tampered)
        .fetch_one(&env.producer_db)
        .await
        .unwrap();
    assert_eq!(written, [tampered_id], "only the failed row was written");
    assert_eq!(ranges(&env).await, [4]);
    let state: String = sqlx::query_scalar("SELECT state FROM handoff.outbox_delivery WHERE operation_key = $1")
        .bind(tampered)
        .fetch_one(&env.producer_db)
        .await
        .unwrap();
    assert_eq!(state, "blocked");
    assert_eq!(env.published_sequences_match_the_stream().await.unwrap(), 4);
    assert_eq!(env.stream_messages().await.unwrap(), 4);
}

#[tokio::test]
async fn a_relay_that_lost_its_range_marks_rows_one_by_one_and_the_new_owner_records_the_range_once() {
    let env = TestEnv::start().await.unwrap();
    let pool = &env.producer_db;
    handoff_tests::approve_range(pool, 1, 3).await.unwrap();
    let lease = Duration::from_secs(30);
    let RangeClaim::Claimed(first) = outbox::claim_new_range(pool, "relay-a", 10, lease, false).await.unwrap() else {
        panic!("nothing claimed")
    };
    assert_eq!(first.rows.len(), 3);
    // relay-a stalls past its lease and relay-b takes the range over.
    sqlx::query("UPDATE handoff.relay_batch SET lease_until = now() - interval '1 second'")
        .execute(pool)
        .await
        .unwrap();
    let second = outbox::claim_expired_range(pool, "relay-b", lease).await.unwrap().expect("the expired range");
    assert_eq!(second.lease, first.lease);
    assert_eq!(second.rows.len(), 3);

    // Both publish the same three messages (the broker's dedup gives the re-publish the same
    // sequences); relay-a settles first, without the lease.
    let published: Vec<PublishedRow> = first
        .rows
        .iter()
        .zip(1_u64..)
        .map(|(row, sequence)| PublishedRow {
            id: row.id,
            operation_key: row.operation_key.clone(),
            attempts: 1,
            sequence,
            duplicate: false,
            computed_hash: None,
        })
        .collect();
    let settled = outbox::settle(pool, "relay-a", &env.stream, first.lease, &published, &[]).await.unwrap();
    assert_eq!(settled.published, 3);
    assert!(ranges(&env).await.is_empty(), "relay-a holds no range to record");
    let own: i64 = sqlx::query_scalar("SELECT count(*) FROM handoff.outbox WHERE state = 'published'")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(own, 3, "marked one by one: published is the truth whoever holds the lease");

    let Lease::Range { .. } = second.lease else { panic!("a range") };
    let duplicates: Vec<PublishedRow> =
        published.iter().map(|r| PublishedRow { duplicate: true, ..r.clone() }).collect();
    outbox::settle(pool, "relay-b", &env.stream, second.lease, &duplicates, &[]).await.unwrap();
    assert_eq!(ranges(&env).await, [3]);
    let counts = outbox::count_by_state(pool).await.unwrap();
    assert_eq!((counts.published, counts.pending), (3, 0), "each row counted once");
    let rows: Vec<(i64, bool)> =
        sqlx::query_as("SELECT stream_sequence, duplicate FROM handoff.outbox_delivery ORDER BY id")
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(rows, [(1, false), (2, false), (3, false)], "a row's own state speaks first");
    let batches: i64 = sqlx::query_scalar("SELECT count(*) FROM handoff.relay_batch").fetch_one(pool).await.unwrap();
    assert_eq!(batches, 0, "the range was released");
}

#[tokio::test]
async fn a_large_range_is_stored_out_of_line_without_compression_and_stays_answerable() {
    let env = TestEnv::start().await.unwrap();
    let relay = env.relay(env.relay_settings()).await.unwrap();
    // 400 ids and 400 sequences: 3.2 KB each, over the 2 KB at which Postgres moves a value out of
    // line (and, by default, compresses it first: the largest item of its CPU in the relay's drain).
    handoff_tests::approve_range(&env.producer_db, 1, 400).await.unwrap();
    let batch = relay.publish_batch().await.unwrap();
    assert_eq!((batch.claimed, batch.published), (400, 400), "{batch:?}");
    assert_eq!(ranges(&env).await, [400]);
    let (ids, sequences, stored): (Option<String>, Option<String>, i32) = sqlx::query_as(
        "SELECT pg_column_compression(outbox_ids), pg_column_compression(stream_sequences),
                pg_column_size(outbox_ids) FROM handoff.published_range",
    )
    .fetch_one(&env.producer_db)
    .await
    .unwrap();
    assert_eq!((ids, sequences), (None, None), "neither array compressed");
    assert!(stored >= 400 * 8, "the ids are stored whole: {stored} bytes");
    assert_eq!(env.published_sequences_match_the_stream().await.unwrap(), 400);
    let counts = env.outbox().await.unwrap();
    assert_eq!((counts.published, counts.pending), (400, 0));
}
