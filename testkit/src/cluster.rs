//! A three-node NATS JetStream cluster for integration tests: three containers from
//! `HANDOFF_NATS_IMAGE` on a Docker network of their own, routed to each other by container name,
//! each published on its own port on 127.0.0.1. Streams created on it can have 3 replicas; any
//! node can be killed, stopped and started again (it keeps its store and its host port).
//!
//! The nodes run with `/etc/nats/durable.conf` (`sync_interval: always`, the production setting;
//! only the image `scripts/build-images` builds has that file) or with the default
//! `sync_interval` ([`NatsCluster::start_with_default_sync`]). Clients connect with
//! [`NatsCluster::urls`], every node's address, so they reconnect to a live node when theirs dies.
//! The servers do not advertise their cluster addresses to clients (`--no_advertise`): the
//! containers' own addresses are not the ones a client on the host should use.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::containers::{DEFAULT_NATS_IMAGE, NATS_DATA, Nats, Placement, Storage, image_from_env};

/// Nodes in a [`NatsCluster`].
pub const CLUSTER_NODES: usize = 3;
const ROUTE_PORT: u16 = 6222;
/// How long the cluster may take to elect its JetStream meta leader after the nodes start.
const JETSTREAM_READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Three routed NATS servers with JetStream; see the [module docs](self).
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<ClusterNode>,
}

/// One server of a [`NatsCluster`].
#[derive(Debug)]
pub struct ClusterNode {
    /// The server's name (`server_name`), as stream info names a leader and replicas.
    pub name: String,
    pub nats: Nats,
}

impl NatsCluster {
    /// Starts three nodes with `sync_interval: always` and waits until JetStream answers.
    pub async fn start() -> Result<Self> {
        Self::start_durable_on(Storage::Layer).await
    }

    /// Starts three durable nodes (as [`NatsCluster::start`]) with their stores where `storage`
    /// says: the benchmark puts them on volumes, to measure the host's fsync.
    pub async fn start_durable_on(storage: Storage) -> Result<Self> {
        Self::start_with(&["-c", "/etc/nats/durable.conf"], storage).await
    }

    /// Starts three nodes with JetStream's default `sync_interval` (2 minutes).
    pub async fn start_with_default_sync() -> Result<Self> {
        Self::start_with(&["-js", "--store_dir", NATS_DATA], Storage::Layer).await
    }

    async fn start_with(base: &[&str], storage: Storage) -> Result<Self> {
        let id = format!(
            "{:08x}",
            std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), std::process::id()) as u32
        );
        let network = format!("handoff-nats-{id}");
        let names: Vec<String> = (1..=CLUSTER_NODES).map(|n| format!("n{n}")).collect();
        let containers: Vec<String> = names.iter().map(|n| format!("handoff-nats-{id}-{n}")).collect();
        let routes = containers.iter().map(|c| format!("nats://{c}:{ROUTE_PORT}")).collect::<Vec<_>>().join(",");
        let image = image_from_env("HANDOFF_NATS_IMAGE", DEFAULT_NATS_IMAGE);
        let cluster = format!("handoff-{id}");
        let listen = format!("nats://0.0.0.0:{ROUTE_PORT}");
        let start = |n: usize| {
            let (name, container) = (names[n].clone(), containers[n].clone());
            let mut args: Vec<String> = base.iter().map(|a| a.to_string()).collect();
            args.extend(
                [
                    "--server_name",
                    &name,
                    "--cluster_name",
                    &cluster,
                    "--cluster",
                    &listen,
                    "--routes",
                    &routes,
                    "--no_advertise",
                ]
                .map(str::to_owned),
            );
            let placement = Placement { network: network.clone(), container };
            let image = image.clone();
            async move {
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                let nats = Nats::start_on_network(image, &args, storage, &placement)
                    .await
                    .with_context(|| format!("starting cluster node {name}"))?;
                anyhow::Ok(ClusterNode { name, nats })
            }
        };
        // Together: a node's routes retry until the others listen.
        let (a, b, c) = tokio::try_join!(start(0), start(1), start(2))?;
        let nodes = vec![a, b, c];
        let cluster = Self { nodes };
        cluster.wait_until_jetstream_ready().await?;
        tracing::info!(urls = %cluster.urls(), "NATS cluster ready");
        Ok(cluster)
    }

    /// Every node's client address, comma-separated (as `NATS_URL` takes them).
    pub fn urls(&self) -> String {
        self.nodes.iter().map(|n| n.nats.url()).collect::<Vec<_>>().join(",")
    }

    /// The nodes, in name order (`n1`, `n2`, `n3`).
    pub fn nodes(&self) -> &[ClusterNode] {
        &self.nodes
    }

    /// Every node's client address becomes its container's own ([`Nats::connect_directly`]),
    /// if the host reaches all three there; returns whether it does.
    pub async fn connect_directly(&mut self) -> anyhow::Result<bool> {
        for node in &mut self.nodes {
            if !node.nats.connect_directly().await? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The node named `name` (a stream's leader, say).
    pub fn node(&self, name: &str) -> Result<&ClusterNode> {
        self.nodes.iter().find(|n| n.name == name).with_context(|| format!("no cluster node named {name}"))
    }

    /// The current leader of `stream` (every node's view is asked until one knows it).
    pub async fn stream_leader(&self, js: &async_nats::jetstream::Context, stream: &str) -> Result<&ClusterNode> {
        let mut handle = js.get_stream(stream).await.with_context(|| format!("looking up stream {stream}"))?;
        let info = handle.info().await.with_context(|| format!("reading stream {stream}'s info"))?;
        let leader = info
            .cluster
            .as_ref()
            .and_then(|c| c.leader.clone())
            .with_context(|| format!("stream {stream} has no leader right now"))?;
        self.node(&leader)
    }

    /// Waits until the cluster has a JetStream meta leader, i.e. account info answers through
    /// every node.
    pub async fn wait_until_jetstream_ready(&self) -> Result<()> {
        let deadline = Instant::now() + JETSTREAM_READY_TIMEOUT;
        for node in &self.nodes {
            let client = async_nats::connect(node.nats.url())
                .await
                .with_context(|| format!("connecting to cluster node {}", node.name))?;
            let js = async_nats::jetstream::new(client);
            loop {
                match js.query_account().await {
                    Ok(_) => break,
                    Err(error) if Instant::now() < deadline => {
                        tracing::debug!(node = %node.name, "JetStream not ready yet: {error}");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(error) => bail!(
                        "JetStream on cluster node {} did not answer within {JETSTREAM_READY_TIMEOUT:?}: {error}",
                        node.name
                    ),
                }
            }
        }
        Ok(())
    }
}
