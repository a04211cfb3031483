//! The broker a test runs against: one NATS server, or a three-node cluster whose streams have
//! three replicas.

use anyhow::Result;

use crate::{Nats, cluster::NatsCluster};

/// One NATS server or a [`NatsCluster`]; tests that only need an address work on either.
#[derive(Debug)]
pub enum Broker {
    Single(Box<Nats>),
    Cluster(NatsCluster),
}

impl Broker {
    /// Every server's client address, comma-separated (as `NATS_URL` takes them).
    pub fn url(&self) -> String {
        match self {
            Self::Single(nats) => nats.url(),
            Self::Cluster(cluster) => cluster.urls(),
        }
    }

    /// Every server's client address, for `async_nats::connect` (which takes a list, not a
    /// comma-separated string).
    pub fn addrs(&self) -> Vec<String> {
        match self {
            Self::Single(nats) => vec![nats.url()],
            Self::Cluster(cluster) => cluster.nodes().iter().map(|n| n.nats.url()).collect(),
        }
    }

    /// Every server: the one, or the cluster's three nodes in name order.
    pub fn servers(&self) -> Vec<&Nats> {
        match self {
            Self::Single(nats) => vec![nats],
            Self::Cluster(cluster) => cluster.nodes().iter().map(|n| &n.nats).collect(),
        }
    }

    /// Stream replicas a test's stream gets here: 1 on one server, 3 on the cluster.
    pub fn replicas(&self) -> usize {
        match self {
            Self::Single(_) => 1,
            Self::Cluster(_) => crate::cluster::CLUSTER_NODES,
        }
    }

    /// The cluster, for tests that kill or restart its nodes.
    pub fn cluster(&self) -> Option<&NatsCluster> {
        match self {
            Self::Single(_) => None,
            Self::Cluster(cluster) => Some(cluster),
        }
    }

    /// Stops every server (clients see their connections drop).
    pub async fn stop(&self) -> Result<()> {
        match self {
            Self::Single(nats) => nats.stop().await,
            Self::Cluster(cluster) => {
                for node in cluster.nodes() {
                    node.nats.stop().await?;
                }
                Ok(())
            }
        }
    }

    /// Starts every server again after [`Broker::stop`], on the same ports.
    pub async fn start_again(&self) -> Result<()> {
        match self {
            Self::Single(nats) => nats.start_again().await,
            Self::Cluster(cluster) => {
                let [a, b, c] = cluster.nodes() else { unreachable!("a cluster has three nodes") };
                tokio::try_join!(a.nats.start_again(), b.nats.start_again(), c.nats.start_again())?;
                cluster.wait_until_jetstream_ready().await
            }
        }
    }

    /// Stops and starts every server.
    pub async fn restart(&self) -> Result<()> {
        self.stop().await?;
        self.start_again().await
    }
}
