//! The real `handoff-relay` and `handoff-consumer` binaries as child processes, for tests that
//! crash them for real (SIGKILL) or stop them as an orchestrator would (SIGTERM).
//!
//! A binary is looked up in `HANDOFF_BIN_DIR` if set, then next to the test executable
//! (`target/<profile>/`, where `cargo build --bins` puts a workspace's binaries), then on `PATH`
//! (after `cargo install handoff-relay handoff-consumer`).

use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};

/// A running service binary. Killed on drop.
#[derive(Debug)]
pub struct ServiceProcess {
    name: &'static str,
    child: Child,
    /// Its stderr lines, when spawned with [`ServiceProcess::spawn_capturing`].
    log: Option<std::sync::Arc<std::sync::Mutex<Vec<String>>>>,
}

/// Where the binary `name` is: `HANDOFF_BIN_DIR`, next to the test executable, or on `PATH`.
pub fn binary_path(name: &str) -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("HANDOFF_BIN_DIR") {
        let candidate = PathBuf::from(dir).join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
        bail!("{name} is not in HANDOFF_BIN_DIR ({})", candidate.display());
    }
    let exe = std::env::current_exe()?;
    // target/<profile>/deps/<test-binary> or target/<profile>/<binary>
    for dir in exe.ancestors().skip(1).take(2) {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    bail!(
        "{name} is not built next to {} nor on PATH; run `cargo build --bins` in handoff's workspace, \
         `cargo install {name}`, or set HANDOFF_BIN_DIR",
        exe.display()
    )
}

impl ServiceProcess {
    /// Starts `name` with exactly these environment variables added (stdout/stderr inherited so
    /// the test output shows its logs).
    pub fn spawn(name: &'static str, env: &[(&str, String)]) -> Result<Self> {
        Self::spawn_program(name, &binary_path(name)?, &[], env)
    }

    /// Starts another program (`path` with `args`) the same way: environment added, stdin closed,
    /// logs inherited, killed on drop. For measuring a tool next to the services, as the benchmark
    /// does with a WAL-reading relay.
    pub fn spawn_program(
        name: &'static str,
        path: &std::path::Path,
        args: &[&str],
        env: &[(&str, String)],
    ) -> Result<Self> {
        let mut command = Command::new(path);
        command.args(args).envs(env.iter().map(|(k, v)| (*k, v.as_str()))).stdin(Stdio::null()).kill_on_drop(true);
        let child = command.spawn().with_context(|| format!("spawning {}", path.display()))?;
        Ok(Self { name, child, log: None })
    }

    /// Like [`ServiceProcess::spawn`], keeping every stderr line (also echoed to the test's stderr)
    /// for [`ServiceProcess::log_lines`]: for tests about what the service logs.
    pub fn spawn_capturing(name: &'static str, env: &[(&str, String)]) -> Result<Self> {
        use tokio::io::AsyncBufReadExt;
        let path = binary_path(name)?;
        let mut command = Command::new(&path);
        command
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command.spawn().with_context(|| format!("spawning {}", path.display()))?;
        let stderr = child.stderr.take().context("stderr is piped")?;
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let lines = log.clone();
        tokio::spawn(async move {
            let mut reader = tokio::io::BufReader::new(stderr).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                eprintln!("{name}: {line}");
                lines.lock().unwrap_or_else(|e| e.into_inner()).push(line);
            }
        });
        Ok(Self { name, child, log: Some(log) })
    }

    /// The stderr lines so far (empty unless spawned with [`ServiceProcess::spawn_capturing`]).
    pub fn log_lines(&self) -> Vec<String> {
        self.log.as_ref().map(|log| log.lock().unwrap_or_else(|e| e.into_inner()).clone()).unwrap_or_default()
    }

    /// The OS process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// SIGKILL: the process dies wherever it is, as in a crash or an OOM kill.
    pub async fn kill(&mut self) -> Result<()> {
        self.child.kill().await.with_context(|| format!("killing {}", self.name))
    }

    /// SIGTERM, then waits for the process to exit by itself (as Kubernetes stops a pod).
    pub async fn terminate(&mut self) -> Result<ExitStatus> {
        let pid = self.pid().context("process already exited")?;
        let status = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status()?;
        if !status.success() {
            bail!("kill -TERM {pid} failed");
        }
        Ok(self.child.wait().await?)
    }

    /// Whether the process has exited, without waiting.
    pub fn has_exited(&mut self) -> Result<bool> {
        Ok(self.child.try_wait()?.is_some())
    }
}

/// What a command-line binary printed and how it exited.
#[derive(Debug)]
pub struct CommandOutput {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

impl CommandOutput {
    /// Fails with both outputs when the exit code is not `code`.
    pub fn expect_code(self, code: i32) -> Result<Self> {
        if self.code != Some(code) {
            bail!("exit code {:?}, expected {code}\nstdout:\n{}\nstderr:\n{}", self.code, self.stdout, self.stderr);
        }
        Ok(self)
    }
}

/// Runs the workspace binary `name` with `args` and exactly these environment variables added,
/// to completion (bounded by `timeout`).
pub async fn run_binary(
    name: &str,
    env: &[(&str, String)],
    args: &[&str],
    timeout: std::time::Duration,
) -> Result<CommandOutput> {
    let path = binary_path(name)?;
    let mut command = Command::new(&path);
    command.args(args).envs(env.iter().map(|(k, v)| (*k, v.as_str()))).stdin(Stdio::null()).kill_on_drop(true);
    let output = tokio::time::timeout(timeout, command.output())
        .await
        .with_context(|| format!("{name} {args:?} did not finish within {timeout:?}"))?
        .with_context(|| format!("running {}", path.display()))?;
    Ok(CommandOutput {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    })
}
