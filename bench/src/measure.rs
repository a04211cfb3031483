//! One measured window: items moved, wall time, and CPU seconds per kind of process in between.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::report::{ProcessUsage, Stats};
use crate::world::{Service, World, own_cpu_seconds};

/// What one run of one measurement found.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    pub items: u64,
    pub elapsed: Duration,
    /// CPU seconds in the window, by role.
    pub cpu_s: BTreeMap<&'static str, f64>,
    /// Processes per role.
    pub count: BTreeMap<&'static str, usize>,
    /// Largest peak RSS of one process of the role, MiB.
    pub peak_rss_mib: BTreeMap<&'static str, f64>,
}

impl Sample {
    /// Items per second.
    pub fn rate(&self) -> f64 {
        self.items as f64 / self.elapsed.as_secs_f64()
    }
}

/// CPU counters at the start of a window.
#[derive(Debug)]
pub struct Meter {
    start: Instant,
    base: Vec<(&'static str, f64)>,
}

fn readings(world: &World, services: &[Service]) -> Vec<(&'static str, f64)> {
    let (pg, nats) = world.servers_cpu();
    let mut out = Vec::new();
    out.extend(own_cpu_seconds().map(|s| ("bench", s)));
    out.extend(pg.map(|s| ("postgres", s)));
    out.extend(nats.map(|s| ("nats", s)));
    out.extend(services.iter().filter_map(|s| s.cpu_seconds().map(|c| (s.role, c))));
    out
}

impl Meter {
    /// Reads every counter now: the window starts.
    pub fn start(world: &World, services: &[Service]) -> Self {
        Self { base: readings(world, services), start: Instant::now() }
    }

    /// Closes the window after `items` were moved.
    pub fn finish(self, world: &World, services: &[Service], items: u64) -> Sample {
        let elapsed = self.start.elapsed();
        let mut sample = Sample { items, elapsed, ..Sample::default() };
        let sum = |readings: &[(&'static str, f64)]| {
            let mut by_role: BTreeMap<&'static str, f64> = BTreeMap::new();
            for (role, s) in readings {
                *by_role.entry(role).or_default() += s;
            }
            by_role
        };
        let before = sum(&self.base);
        for (role, now) in sum(&readings(world, services)) {
            if let Some(then) = before.get(role) {
                sample.cpu_s.insert(role, now - then);
            }
        }
        for service in services {
            *sample.count.entry(service.role).or_default() += 1;
            if let Some(mib) = service.peak_rss_mib() {
                let peak = sample.peak_rss_mib.entry(service.role).or_default();
                *peak = peak.max(mib);
            }
        }
        sample
    }
}

/// Per-role usage over the runs of one measurement.
pub fn usage(samples: &[Sample]) -> Vec<ProcessUsage> {
    let mut roles: Vec<&'static str> = samples.iter().flat_map(|s| s.cpu_s.keys().copied()).collect();
    roles.sort_unstable();
    roles.dedup();
    roles
        .into_iter()
        .map(|role| {
            let cpu: Vec<f64> = samples.iter().map(|s| s.cpu_s.get(role).copied().unwrap_or(0.0)).collect();
            let per_item: Vec<f64> = samples
                .iter()
                .map(|s| s.cpu_s.get(role).copied().unwrap_or(0.0) * 1e6 / s.items.max(1) as f64)
                .collect();
            let peak = samples.iter().filter_map(|s| s.peak_rss_mib.get(role).copied()).reduce(f64::max);
            ProcessUsage {
                role: role.to_owned(),
                count: samples.iter().map(|s| s.count.get(role).copied().unwrap_or(1)).max().unwrap_or(1),
                cpu_s: Stats::of(cpu),
                cpu_us_per_item: Stats::of(per_item),
                peak_rss_mib: peak,
            }
        })
        .collect()
}

/// Rates of the runs.
pub fn rates(samples: &[Sample]) -> Stats {
    Stats::of(samples.iter().map(Sample::rate).collect())
}
