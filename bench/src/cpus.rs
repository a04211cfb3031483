//! Where the remote section's processes run (`--crm-cpus`).
//!
//! The CRM simulator stands in for a remote CRM, which never shares a CPU with the replica calling
//! it. On one machine it does unless told otherwise, and then a row measures how two workloads
//! share the cores rather than whether the replica keeps its calls in flight: at 64 calls the
//! simulator and its database take most of the machine (tasks-api at 64 in flight: 0.74x with both
//! on two shared cores in session 18; the same dispatcher 0.99x with the simulator on a CPU of its
//! own in session 19, docs/benchmarks.md). With `split`, the simulator and its Postgres server run
//! on the upper half of the CPUs this process may use, and everything on the caller's side (this
//! process, whose loop is the ceilings' caller, the consumers, their Postgres server and NATS) on
//! the lower half, for the ceilings and the drains alike; afterwards every container gets all of
//! them back.

use anyhow::{Context, Result, bail};
use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
use nix::unistd::Pid;

use crate::world::World;

/// Where the simulator runs in the remote section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CrmCpus {
    /// The simulator and its database on CPUs of their own (half the machine's), the replica's
    /// side on the others.
    Split,
    /// Everything on every CPU (the simulator competes with what it serves).
    Shared,
}

/// The two halves of the CPUs this process may run on.
#[derive(Debug, Clone)]
pub struct CpuSplit {
    caller: Vec<usize>,
    crm: Vec<usize>,
    all: Vec<usize>,
}

impl CpuSplit {
    /// Halves the CPUs this process may run on (the lower half for the caller's side); `None` with
    /// fewer than two.
    pub fn of_this_process() -> Result<Option<Self>> {
        let allowed = sched_getaffinity(Pid::from_raw(0)).context("reading this process's CPU affinity")?;
        let all: Vec<usize> = (0..CpuSet::count()).filter(|&cpu| allowed.is_set(cpu).unwrap_or(false)).collect();
        if all.len() < 2 {
            return Ok(None);
        }
        let (caller, crm) = all.split_at(all.len() / 2);
        Ok(Some(Self { caller: caller.to_vec(), crm: crm.to_vec(), all: all.clone() }))
    }

    /// How rows name the arrangement, e.g. `CRM on CPU 1, caller on 0`.
    pub fn describe(&self) -> String {
        format!("CRM on CPU {}, caller on {}", list(&self.crm), list(&self.caller))
    }

    /// What a row's label adds for `split`: `, CRM on CPU 1, caller on 0`, or nothing when shared.
    pub fn label_suffix(split: Option<&Self>) -> String {
        split.map(|split| format!(", {}", split.describe())).unwrap_or_default()
    }

    /// Puts the caller's side on its half: every thread of this process (the consumers it spawns
    /// from now on inherit it), the consumer's Postgres server and every NATS server; and the
    /// simulator's Postgres server (the producer's) on the other half.
    pub async fn apply(&self, world: &World) -> Result<()> {
        let Some(consumer_pg) = &world.postgres.consumer else {
            bail!("the simulator's Postgres server is the consumer's too (--shared-postgres): nothing to split");
        };
        pin_this_process(&self.caller)?;
        handoff_tests::containers::set_container_cpus(world.postgres.producer.container(), &list(&self.crm)).await?;
        handoff_tests::containers::set_container_cpus(consumer_pg.container(), &list(&self.caller)).await?;
        for nats in world.nats.servers() {
            handoff_tests::containers::set_container_cpus(nats.container(), &list(&self.caller)).await?;
        }
        Ok(())
    }

    /// Gives this process and every container all the CPUs again.
    pub async fn restore(&self, world: &World) -> Result<()> {
        pin_this_process(&self.all)?;
        let all = list(&self.all);
        let servers = std::iter::once(&world.postgres.producer).chain(world.postgres.consumer.as_ref());
        for pg in servers {
            handoff_tests::containers::set_container_cpus(pg.container(), &all).await?;
        }
        for nats in world.nats.servers() {
            handoff_tests::containers::set_container_cpus(nats.container(), &all).await?;
        }
        Ok(())
    }

    /// Runs `spawn` with the calling thread on the simulator's half, so the process it starts
    /// (and every thread of that process) runs there; the thread gets its CPUs back afterwards.
    pub fn on_crm_cpus<T>(&self, spawn: impl FnOnce() -> Result<T>) -> Result<T> {
        let this_thread = Pid::from_raw(0);
        let before = sched_getaffinity(this_thread).context("reading this thread's CPU affinity")?;
        sched_setaffinity(this_thread, &cpu_set(&self.crm)?).context("moving this thread to the CRM's CPUs")?;
        let spawned = spawn();
        sched_setaffinity(this_thread, &before).context("moving this thread back")?;
        spawned
    }
}

/// Every thread of this process on `cpus`. Threads started later inherit the CPUs of the thread
/// that starts them, so they stay there too.
fn pin_this_process(cpus: &[usize]) -> Result<()> {
    let set = cpu_set(cpus)?;
    for task in std::fs::read_dir("/proc/self/task").context("listing this process's threads")? {
        let tid: i32 = task?.file_name().to_string_lossy().parse().context("a thread id in /proc/self/task")?;
        match sched_setaffinity(Pid::from_raw(tid), &set) {
            Ok(()) => {}
            // A thread that ended since the listing.
            Err(nix::errno::Errno::ESRCH) => {}
            Err(e) => return Err(e).with_context(|| format!("moving thread {tid} to CPUs {}", list(cpus))),
        }
    }
    Ok(())
}

fn cpu_set(cpus: &[usize]) -> Result<CpuSet> {
    let mut set = CpuSet::new();
    for &cpu in cpus {
        set.set(cpu).with_context(|| format!("CPU {cpu}"))?;
    }
    Ok(set)
}

/// Docker's `--cpuset-cpus` form: `0,1,3`.
fn list(cpus: &[usize]) -> String {
    cpus.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_the_allowed_cpus_with_the_caller_below() {
        assert_eq!(list(&[0, 2, 3]), "0,2,3");
        let Some(split) = CpuSplit::of_this_process().unwrap() else { return };
        assert!(!split.caller.is_empty() && !split.crm.is_empty());
        assert!(split.caller.iter().max() < split.crm.iter().min());
        assert_eq!(split.caller.len() + split.crm.len(), split.all.len());
    }
}
