//! Talking to a service's operations endpoint from a test: a free address to give it, plain GETs,
//! and reading one series out of the Prometheus text.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::time::Duration;

use anyhow::{Context, Result};

/// A loopback address with a port that is free now, for a service's `HANDOFF_HTTP_ADDR`.
pub fn free_local_addr() -> Result<SocketAddr> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("binding 127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// `GET http://<addr><path>`: the status code and the body. A refused connection is an error.
pub async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
    let response = client.get(format!("http://{addr}{path}")).send().await?;
    let status = response.status().as_u16();
    Ok((status, response.text().await?))
}

/// The value of one series (`name` or `name{label="value",...}`, labels as the exposition
/// writes them) in Prometheus text, if present.
pub fn series(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Whether a metric family `name` is exposed (its `# TYPE` line).
pub fn has_metric(text: &str, name: &str) -> bool {
    text.lines().any(|line| line.strip_prefix("# TYPE ").is_some_and(|rest| rest.split(' ').next() == Some(name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_series_with_and_without_labels() {
        let text = "# TYPE a_total counter\na_total{x=\"1\"} 3\na_total{x=\"2\"} 4\nb 0.5\n";
        assert_eq!(series(text, "a_total{x=\"2\"}"), Some(4.0));
        assert_eq!(series(text, "b"), Some(0.5));
        assert_eq!(series(text, "a_total"), None);
        assert!(has_metric(text, "a_total") && !has_metric(text, "b"));
    }
}
