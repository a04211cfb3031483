//! The example to copy into your own suite: an approved action becomes exactly one CRM task, also
//! when the application records it twice, with the services in process, as the real binaries, and
//! behind the CRM simulator.

use std::time::Duration;

use handoff_testkit::{Services, Stack};

const KEY: &str = "harbor:create-followup:v1:case-104";

fn payload() -> serde_json::Value {
    serde_json::json!({"case_id": "case-104", "title": "Call about the approved repair plan"})
}

#[tokio::test]
async fn an_approved_follow_up_becomes_one_crm_task() -> anyhow::Result<()> {
    let stack = Stack::start().await?;
    stack.record(KEY, payload(), "user-17").await?;
    // The application retries its own transaction: same key, same payload, nothing new.
    stack.record(KEY, payload(), "user-17").await?;
    let task = stack.wait_for_task(KEY, Duration::from_secs(60)).await?;
    assert_eq!(task.operation_key, KEY);
    assert_eq!(stack.task_count().await?, 1);
    assert_eq!(stack.stream_messages().await?, 1);
    stack.stop().await
}

#[tokio::test]
async fn the_real_binaries_behind_the_crm_simulator_make_one_remote_task_per_key() -> anyhow::Result<()> {
    let stack = Stack::builder().services(Services::Processes).with_crm_sim().start().await?;
    for case in 1..=20 {
        let key = format!("harbor:create-followup:v1:case-{case}");
        stack.record(&key, serde_json::json!({"case_id": format!("case-{case}"), "title": "Call"}), "user-17").await?;
    }
    for case in 1..=20 {
        stack.wait_for_task(&format!("harbor:create-followup:v1:case-{case}"), Duration::from_secs(90)).await?;
    }
    assert_eq!(stack.task_count().await?, 20, "the simulator's effects: one per key");
    stack.stop().await
}
