//! A fault hook for JetStream's API: a client built with [`FaultyApi::jetstream`] sends its API
//! requests under another prefix, where this forwards them to the real `$JS.API` and passes the
//! answers back, except for the requests it is told to leave unanswered ([`Fault`]), as a cluster
//! electing a leader does. The client then sees exactly what it sees then: its request times out.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;

/// The prefix the forwarded requests arrive under.
const PREFIX: &str = "$FAULT.API";

/// How a request the rule picks goes unanswered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Never reaches the server: nothing happens there.
    NotDelivered,
    /// Reaches the server, which acts on it, and the answer is lost on the way back.
    AnswerLost,
}

/// Forwards JetStream API requests; see the module's documentation.
#[derive(Debug)]
pub struct FaultyApi {
    /// Every request's API subject (`CONSUMER.CREATE.<stream>.<name>...`), answered or not.
    seen: Arc<Mutex<Vec<String>>>,
    forwarder: tokio::task::JoinHandle<()>,
}

impl FaultyApi {
    /// Forwards every request and its answer, except that the first `unanswered` requests whose
    /// API subject starts with `subject` (`CONSUMER.CREATE.`, `STREAM.INFO.`, ...) go unanswered
    /// as `fault` says.
    pub async fn start(nats_url: &str, subject: &'static str, fault: Fault, unanswered: usize) -> Result<Self> {
        let client = async_nats::connect(nats_url).await.context("connecting the faulty API")?;
        let mut requests = client.subscribe(format!("{PREFIX}.>")).await?;
        // The subscription must be known to the server before a client asks through it.
        client.flush().await?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let forwarder = tokio::spawn({
            let client = client.clone();
            let seen = seen.clone();
            async move {
                let mut left_unanswered = 0;
                while let Some(request) = requests.next().await {
                    let Some(reply) = request.reply.clone() else { continue };
                    let api = request.subject.as_str()[PREFIX.len() + 1..].to_owned();
                    seen.lock().unwrap().push(api.clone());
                    let mut answer_lost = false;
                    if api.starts_with(subject) && left_unanswered < unanswered {
                        left_unanswered += 1;
                        match fault {
                            Fault::NotDelivered => continue,
                            Fault::AnswerLost => answer_lost = true,
                        }
                    }
                    let client = client.clone();
                    tokio::spawn(async move {
                        // An API request JetStream does not answer stays unanswered here too.
                        if let Ok(answer) = client.request(format!("$JS.API.{api}"), request.payload).await
                            && !answer_lost
                        {
                            let _ = client.publish(reply, answer.payload).await;
                        }
                    });
                }
            }
        });
        Ok(Self { seen, forwarder })
    }

    /// A JetStream context whose API requests go through this, giving up on each after `timeout`.
    pub fn jetstream(&self, client: async_nats::Client, timeout: Duration) -> async_nats::jetstream::Context {
        let mut js = async_nats::jetstream::with_prefix(client, PREFIX);
        js.set_timeout(timeout);
        js
    }

    /// How many requests whose API subject starts with `subject` arrived, answered or not.
    pub fn requests(&self, subject: &str) -> usize {
        self.seen.lock().unwrap().iter().filter(|api| api.starts_with(subject)).count()
    }
}

impl Drop for FaultyApi {
    fn drop(&mut self) {
        self.forwarder.abort();
    }
}
