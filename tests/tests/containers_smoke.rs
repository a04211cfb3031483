//! Smoke test for the container harness: Postgres and NATS start, a fresh database answers,
//! and JetStream data survives a NATS restart on the same port.
//!
//! Needs Docker and the images from `scripts/build-images`; on an engine older than API 1.53,
//! run `. scripts/docker-env` first.

use std::time::Duration;

use anyhow::{Context, Result};
use async_nats::jetstream::{self, stream};
use handoff_tests::containers::{Nats, Postgres};
use sqlx::{Connection, PgConnection};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_and_nats_start_and_nats_keeps_data_across_restart() -> Result<()> {
    let (pg, nats) = tokio::try_join!(Postgres::start(), Nats::start())?;

    let url = pg.fresh_database("containers_smoke").await?;
    let mut conn = PgConnection::connect(&url).await.context("connecting to fresh db")?;
    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut conn).await?;
    assert_eq!(one, 1);
    let db: String = sqlx::query_scalar("SELECT current_database()").fetch_one(&mut conn).await?;
    assert!(url.ends_with(&format!("/{db}")), "{url} vs {db}");
    conn.close().await?;

    let url_before = nats.url();
    let client = async_nats::connect(&url_before).await?;
    let js = jetstream::new(client);
    js.create_stream(stream::Config { name: "SMOKE".into(), subjects: vec!["smoke.>".into()], ..Default::default() })
        .await?;
    js.publish("smoke.one", "hello".into()).await?.await?;
    assert_eq!(js.get_stream("SMOKE").await?.get_info().await?.state.messages, 1);

    nats.restart().await?;
    assert_eq!(nats.url(), url_before, "the host port must survive a restart");

    // The old client reconnects by itself; a fresh one proves the port is the same too.
    let js = jetstream::new(async_nats::connect(nats.url()).await?);
    let info = tokio::time::timeout(Duration::from_secs(30), async {
        js.get_stream("SMOKE").await?.get_info().await.map_err(anyhow::Error::from)
    })
    .await??;
    assert_eq!(info.state.messages, 1, "JetStream lost the message across the restart");
    Ok(())
}
