//! `docker-api-shim`: lets a Docker client that is pinned to a newer Engine API talk to an
//! older engine.
//!
//! # Why it exists
//!
//! testcontainers 0.28 talks to Docker through bollard 0.21, whose client version is 1.53 and
//! which never negotiates down. A client that puts `/v1.53/` in its request paths gets "client
//! version 1.53 is too new" from an engine whose maximum API is lower (Debian 12's `docker.io`
//! 20.10 speaks 1.41, and so do other LTS distributions). This shim listens on a unix socket,
//! forwards each connection to the real engine socket and rewrites the version prefix of the
//! request path (` /v1.53/` becomes ` /v1.41/`), so pointing `DOCKER_HOST` at the shim is all a
//! test run needs. `scripts/docker-env` builds, starts and exports it when the engine is older.
//!
//! Measured with bollard 0.21.1 (the version in `Cargo.lock`): its URI builder joins the
//! absolute endpoint path onto `.../v1.53`, which drops the prefix, so it actually sends
//! unversioned paths (`POST /containers/create`) and a 1.41 engine serves them at 1.41 without
//! the shim. The shim is then a transparent proxy; it guards against a bollard release that fixes
//! the join, and serves any other client that pins a newer version.
//!
//! # How
//!
//! Every accepted connection gets its own upstream connection. Bytes from the server to the
//! client are copied unchanged; bytes from the client to the server go through a streaming
//! rewriter ([`Rewriter`]) that replaces ` /vMAJOR.MINOR/` by the target version when the
//! client's version is newer than the target. The rewriter holds back at most a few bytes that
//! could be the start of a split pattern, so it works across read boundaries and never buffers a
//! body. Both directions run concurrently and each end's EOF is forwarded as a half-close, so
//! hijacked streams (attach, exec) and chunked or streamed bodies (logs, events) pass through.
//!
//! # Limits
//!
//! - The rewrite is byte-level and only lightly HTTP-aware: it stops for good after a request
//!   head carrying `Upgrade:` (Docker's hijacked attach/exec streams, so stdin passes untouched),
//!   but a request *body* containing ` /v1.53/` would be rewritten too. Docker request bodies are
//!   JSON or tar archives where that is vanishingly unlikely; this is a test-machine tool.
//! - Only the version in the path is changed. A request that relies on API features newer than
//!   the engine still fails (or the engine ignores unknown fields), exactly as it would for an
//!   old client; what testcontainers uses for create/start/stop/inspect/logs/exec works on 1.41.
//! - Up to a dozen client bytes that could begin a pattern (` /v1.5`) are held until the next
//!   read or EOF; harmless for HTTP, noticeable only on an interactive attach stream.
//! - Unix sockets only (no TCP, no TLS).

use std::{
    io::{self, IsTerminal},
    path::{Path, PathBuf},
    sync::Arc,
};

use anyhow::{Context, Result, bail};
use clap::Parser;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::{UnixListener, UnixStream},
};
use tracing::{debug, info, warn};

/// Unix-socket proxy to the Docker engine that rewrites the API version in request paths.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Unix socket to listen on (a stale file there is replaced).
    #[arg(long)]
    listen: PathBuf,
    /// The engine's unix socket.
    #[arg(long, default_value = "/var/run/docker.sock")]
    upstream: PathBuf,
    /// API version to send upstream, e.g. 1.41 [default: the engine's, from `GET /version`].
    #[arg(long)]
    api_version: Option<String>,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(io::stderr)
        .with_ansi(io::stderr().is_terminal())
        .init();
    let args = Args::parse();

    let target = match args.api_version {
        Some(v) => v,
        None => engine_api_version(&args.upstream).await?,
    };
    let rewriter = Rewriter::new(&target)?;

    if args.listen.exists() {
        std::fs::remove_file(&args.listen).with_context(|| format!("removing stale {}", args.listen.display()))?;
    }
    let listener =
        UnixListener::bind(&args.listen).with_context(|| format!("listening on {}", args.listen.display()))?;
    info!(
        listen = %args.listen.display(),
        upstream = %args.upstream.display(),
        api_version = %target,
        "docker-api-shim ready"
    );

    let upstream = Arc::new(args.upstream);
    let serve = async {
        loop {
            let (client, _) = listener.accept().await?;
            let upstream = Arc::clone(&upstream);
            let rewriter = rewriter.clone();
            tokio::spawn(async move {
                if let Err(err) = proxy(client, &upstream, rewriter).await {
                    debug!("connection ended with error: {err:#}");
                }
            });
        }
    };
    let result: io::Result<()> = tokio::select! {
        r = serve => r,
        _ = shutdown_signal() => Ok(()),
    };
    let _ = std::fs::remove_file(&args.listen);
    info!("docker-api-shim stopped");
    Ok(result?)
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => tokio::select! {
            _ = term.recv() => {},
            _ = tokio::signal::ctrl_c() => {},
        },
        Err(err) => {
            warn!("cannot watch SIGTERM: {err}");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Asks the engine for its maximum API version (`ApiVersion` in `GET /version`).
async fn engine_api_version(upstream: &Path) -> Result<String> {
    let mut conn =
        UnixStream::connect(upstream).await.with_context(|| format!("connecting to {}", upstream.display()))?;
    conn.write_all(b"GET /version HTTP/1.1\r\nHost: docker\r\nConnection: close\r\n\r\n").await?;
    let mut response = Vec::new();
    conn.read_to_end(&mut response).await?;
    let text = String::from_utf8_lossy(&response);
    let key = "\"ApiVersion\":\"";
    let Some(start) = text.find(key).map(|i| i + key.len()) else {
        bail!("no ApiVersion in the engine's /version answer: {text}");
    };
    let version: String = text[start..].chars().take_while(|&c| c != '"').collect();
    Ok(version)
}

/// Forwards one client connection to the engine, rewriting client-to-server bytes.
async fn proxy(client: UnixStream, upstream: &Path, rewriter: Rewriter) -> io::Result<()> {
    let server = UnixStream::connect(upstream).await?;
    let (client_rd, mut client_wr) = client.into_split();
    let (server_rd, mut server_wr) = server.into_split();
    let to_server = async {
        copy_rewriting(client_rd, &mut server_wr, rewriter).await?;
        server_wr.shutdown().await
    };
    let to_client = async {
        tokio::io::copy(&mut { server_rd }, &mut client_wr).await?;
        client_wr.shutdown().await
    };
    tokio::try_join!(to_server, to_client)?;
    Ok(())
}

async fn copy_rewriting(
    mut reader: impl AsyncRead + Unpin,
    writer: &mut (impl AsyncWrite + Unpin),
    mut rewriter: Rewriter,
) -> io::Result<()> {
    let mut buf = vec![0u8; 16 * 1024];
    let mut out = Vec::with_capacity(buf.len() + 16);
    loop {
        let n = reader.read(&mut buf).await?;
        if n == 0 {
            rewriter.finish(&mut out);
            writer.write_all(&out).await?;
            return writer.flush().await;
        }
        rewriter.push(&buf[..n], &mut out);
        writer.write_all(&out).await?;
        out.clear();
    }
}

/// Streaming replacement of ` /vMAJOR.MINOR/` by ` /vTARGET/` when MAJOR.MINOR > TARGET.
///
/// Feed it chunks with [`Rewriter::push`] and call [`Rewriter::finish`] at end of stream. Bytes
/// that might begin a pattern completed by the next chunk are held back (at most
/// [`MAX_DIGITS`] * 2 + 4 bytes); everything else is emitted at once. After a match, the rest of
/// that request's head is checked for an `Upgrade:` header: Docker hijacks such connections
/// (attach, exec start) for raw stdin, so from the end of that head on, bytes pass untouched.
#[derive(Debug, Clone)]
struct Rewriter {
    target: (u32, u32),
    replacement: Vec<u8>,
    mode: Mode,
    /// `Scan`: bytes that may begin a pattern. `Head`: the last (lowercased) bytes of the head
    /// seen so far, so that markers split across chunks are found.
    carry: Vec<u8>,
    upgrade: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Looking for the next version pattern.
    Scan,
    /// Inside a request head, after its version: looking for its end and an `Upgrade:` header.
    Head,
    /// The connection was upgraded: raw bytes, no more HTTP.
    Raw,
}

/// Longest version component accepted, which bounds how much the rewriter holds back.
const MAX_DIGITS: usize = 4;
const HEAD_END: &[u8] = b"\r\n\r\n";
const UPGRADE_HEADER: &[u8] = b"\r\nupgrade:";

enum Scan {
    /// The pattern ends here (exclusive) with this version.
    Match(usize, (u32, u32)),
    /// Not the pattern.
    NoMatch,
    /// The input ended inside what is so far a valid prefix of the pattern.
    Incomplete,
}

impl Rewriter {
    fn new(target: &str) -> Result<Self> {
        let parsed = match scan(format!(" /v{target}/").as_bytes()) {
            Scan::Match(_, v) => v,
            _ => bail!("API version must look like 1.41, got {target:?}"),
        };
        Ok(Self {
            target: parsed,
            replacement: format!(" /v{target}/").into_bytes(),
            mode: Mode::Scan,
            carry: Vec::new(),
            upgrade: false,
        })
    }

    fn push(&mut self, input: &[u8], out: &mut Vec<u8>) {
        let owned;
        let data: &[u8] = if self.mode == Mode::Scan && !self.carry.is_empty() {
            self.carry.extend_from_slice(input);
            owned = std::mem::take(&mut self.carry);
            &owned
        } else {
            input
        };
        let mut emitted = 0;
        let mut pos = 0;
        while pos < data.len() {
            match self.mode {
                Mode::Raw => break,
                Mode::Head => pos = self.scan_head(data, pos),
                Mode::Scan => {
                    let Some(off) = data[pos..].iter().position(|&b| b == b' ') else {
                        break;
                    };
                    let start = pos + off;
                    match scan(&data[start..]) {
                        Scan::Match(len, version) => {
                            if version > self.target {
                                out.extend_from_slice(&data[emitted..start]);
                                out.extend_from_slice(&self.replacement);
                                emitted = start + len;
                            }
                            pos = start + len;
                            self.mode = Mode::Head;
                            self.upgrade = false;
                        }
                        Scan::NoMatch => pos = start + 1,
                        Scan::Incomplete => {
                            out.extend_from_slice(&data[emitted..start]);
                            self.carry.extend_from_slice(&data[start..]);
                            return;
                        }
                    }
                }
            }
        }
        out.extend_from_slice(&data[emitted..]);
    }

    /// In `Head` mode: looks for the end of the head in `data[pos..]`; returns where to go on.
    fn scan_head(&mut self, data: &[u8], pos: usize) -> usize {
        let kept = self.carry.len();
        let mut window = std::mem::take(&mut self.carry);
        window.extend(data[pos..].iter().map(u8::to_ascii_lowercase));
        let end = find(&window, HEAD_END);
        let head = &window[..end.map_or(window.len(), |e| e + 2)];
        self.upgrade |= find(head, UPGRADE_HEADER).is_some();
        match end {
            // The carry never holds a whole HEAD_END, so `e + 4 > kept`.
            Some(e) => {
                self.mode = if self.upgrade { Mode::Raw } else { Mode::Scan };
                pos + e + HEAD_END.len() - kept
            }
            None => {
                let keep_from = window.len().saturating_sub(UPGRADE_HEADER.len() - 1);
                self.carry = window.split_off(keep_from);
                data.len()
            }
        }
    }

    fn finish(&mut self, out: &mut Vec<u8>) {
        if self.mode == Mode::Scan {
            out.append(&mut self.carry);
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Matches ` /v<digits>.<digits>/` at the start of `data`.
fn scan(data: &[u8]) -> Scan {
    const PREFIX: &[u8] = b" /v";
    let n = data.len().min(PREFIX.len());
    if data[..n] != PREFIX[..n] {
        return Scan::NoMatch;
    }
    if n < PREFIX.len() {
        return Scan::Incomplete;
    }
    let mut i = PREFIX.len();
    let mut parts = [0u32; 2];
    for (k, part) in parts.iter_mut().enumerate() {
        let digits_start = i;
        while let Some(&b) = data.get(i) {
            if !b.is_ascii_digit() {
                break;
            }
            if i - digits_start == MAX_DIGITS {
                return Scan::NoMatch;
            }
            *part = *part * 10 + u32::from(b - b'0');
            i += 1;
        }
        let Some(&sep) = data.get(i) else {
            return Scan::Incomplete;
        };
        let expected = if k == 0 { b'.' } else { b'/' };
        if i == digits_start || sep != expected {
            return Scan::NoMatch;
        }
        i += 1;
    }
    Scan::Match(i, (parts[0], parts[1]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `chunks` one by one and returns the whole output.
    fn run(target: &str, chunks: &[&[u8]]) -> String {
        let mut rw = Rewriter::new(target).unwrap();
        let mut out = Vec::new();
        for chunk in chunks {
            rw.push(chunk, &mut out);
        }
        rw.finish(&mut out);
        String::from_utf8(out).unwrap()
    }

    const REQUEST: &str = "GET /v1.53/containers/json HTTP/1.1\r\nHost: docker\r\n\r\n";
    const EXPECTED: &str = "GET /v1.41/containers/json HTTP/1.1\r\nHost: docker\r\n\r\n";

    #[test]
    fn rewrites_in_one_chunk() {
        assert_eq!(run("1.41", &[REQUEST.as_bytes()]), EXPECTED);
    }

    #[test]
    fn pattern_split_across_chunks_at_every_offset() {
        let bytes = REQUEST.as_bytes();
        for split in 0..=bytes.len() {
            let (a, b) = bytes.split_at(split);
            assert_eq!(run("1.41", &[a, b]), EXPECTED, "split at {split}");
        }
        let single_bytes: Vec<&[u8]> = bytes.chunks(1).collect();
        assert_eq!(run("1.41", &single_bytes), EXPECTED);
    }

    #[test]
    fn no_pattern_passes_unchanged() {
        let body = b"{\"Image\":\"x /v\",\"Cmd\":[\"a b\"]} /v1 /v1. /v1.2x /vv1.53/ end ";
        let expected = String::from_utf8(body.to_vec()).unwrap();
        assert_eq!(run("1.41", &[body]), expected);
        let single_bytes: Vec<&[u8]> = body.chunks(1).collect();
        assert_eq!(run("1.41", &single_bytes), expected);
    }

    #[test]
    fn pattern_at_end_of_stream() {
        assert_eq!(run("1.41", &[b"POST", b" /v1.53/"]), "POST /v1.41/");
        // An incomplete pattern at EOF is flushed as it is.
        assert_eq!(run("1.41", &[b"POST /v1.5"]), "POST /v1.5");
    }

    #[test]
    fn older_or_equal_versions_are_kept() {
        assert_eq!(run("1.41", &[b"GET /v1.24/x"]), "GET /v1.24/x");
        assert_eq!(run("1.41", &[b"GET /v1.41/x"]), "GET /v1.41/x");
        assert_eq!(run("1.41", &[b"GET /v2.0/x"]), "GET /v1.41/x");
    }

    #[test]
    fn pipelined_requests() {
        let two = format!("{REQUEST}{REQUEST}");
        let bytes = two.as_bytes();
        let (a, b) = bytes.split_at(REQUEST.len() + 6);
        assert_eq!(run("1.41", &[a, b]), format!("{EXPECTED}{EXPECTED}"));
    }

    #[test]
    fn upgraded_connection_passes_raw_bytes() {
        let request = "POST /v1.53/containers/x/attach?stream=1&stdin=1 HTTP/1.1\r\n\
                       Host: docker\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n";
        let stdin = "echo GET /v1.53/x\r\n\r\nPOST /v1.99/y\n";
        let input = format!("{request}{stdin}");
        let expected = format!("{}{stdin}", request.replace("/v1.53/", "/v1.41/"));
        assert_eq!(run("1.41", &[input.as_bytes()]), expected);
        let single_bytes: Vec<&[u8]> = input.as_bytes().chunks(1).collect();
        assert_eq!(run("1.41", &single_bytes), expected);
        for split in 0..=input.len() {
            let (a, b) = input.as_bytes().split_at(split);
            assert_eq!(run("1.41", &[a, b]), expected, "split at {split}");
        }
    }

    #[test]
    fn keep_alive_without_upgrade_keeps_rewriting() {
        let first = "POST /v1.53/x HTTP/1.1\r\nConnection: keep-alive\r\nX-Upgrade: no\r\n\r\n";
        let input = format!("{first}{REQUEST}");
        let expected = format!("{}{EXPECTED}", first.replace("/v1.53/", "/v1.41/"));
        let single_bytes: Vec<&[u8]> = input.as_bytes().chunks(1).collect();
        assert_eq!(run("1.41", &single_bytes), expected);
    }

    #[test]
    fn rejects_bad_target() {
        assert!(Rewriter::new("latest").is_err());
        assert!(Rewriter::new("1.41").is_ok());
    }
}
