//! What a benchmark run found: rows of figures (min / median / max over repeated runs), each tied
//! to the ceiling it is compared with, printed as a table and written as JSON.
//!
//! Absolute numbers drift on a shared machine, so the headline of every row is its ratio to a
//! ceiling measured in the same run. A row is generic (a section, a label, parameters, a value,
//! optional latency percentiles and per-process usage), so new measurements, such as the remote
//! CRM's throughput per in-flight limit, are new rows rather than a new format.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;
use serde_json::Value;

/// min / median / max over repeated runs, and every run's value.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    pub min: f64,
    pub median: f64,
    pub max: f64,
    pub runs: Vec<f64>,
}

impl Stats {
    /// Summarises `values` (at least one).
    pub fn of(values: Vec<f64>) -> Self {
        let mut sorted = values.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n == 0 {
            f64::NAN
        } else if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Self {
            min: sorted.first().copied().unwrap_or(f64::NAN),
            median,
            max: sorted.last().copied().unwrap_or(f64::NAN),
            runs: values,
        }
    }
}

/// The `q` quantile (0..=1) of `samples`, nearest rank.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Latency percentiles in milliseconds, each over repeated runs.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    pub p50: Stats,
    pub p95: Stats,
    pub p99: Stats,
    /// Samples per run.
    pub samples: Vec<usize>,
}

/// One run's percentiles.
#[derive(Debug, Clone, Copy)]
pub struct Percentiles {
    pub p50: f64,
    pub p95: f64,
    pub p99: f64,
    pub samples: usize,
}

impl Percentiles {
    pub fn of(mut millis: Vec<f64>) -> Self {
        millis.sort_by(f64::total_cmp);
        Self {
            p50: quantile(&millis, 0.50),
            p95: quantile(&millis, 0.95),
            p99: quantile(&millis, 0.99),
            samples: millis.len(),
        }
    }
}

impl Latency {
    pub fn of(runs: &[Percentiles]) -> Self {
        Self {
            p50: Stats::of(runs.iter().map(|r| r.p50).collect()),
            p95: Stats::of(runs.iter().map(|r| r.p95).collect()),
            p99: Stats::of(runs.iter().map(|r| r.p99).collect()),
            samples: runs.iter().map(|r| r.samples).collect(),
        }
    }
}

/// CPU and memory of one kind of process over the measured window of each run.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessUsage {
    /// `relay`, `consumer`, `postgres`, `nats` or `bench` (the benchmark itself: bare loops,
    /// producer).
    pub role: String,
    /// Processes of this role in each run.
    pub count: usize,
    /// CPU seconds (user + system) of all processes of the role during the window.
    pub cpu_s: Stats,
    /// CPU microseconds per item (row, message, action) moved in the window.
    pub cpu_us_per_item: Stats,
    /// Largest peak resident set of one process of the role over all runs (VmHWM; for containers
    /// the cgroup's peak, which includes the page cache it touched). None when unreadable.
    pub peak_rss_mib: Option<f64>,
}

/// A target from the issue, checked against this run.
#[derive(Debug, Clone, Serialize)]
pub struct Target {
    /// e.g. "ratio >= 1.0", "p99 <= 5x round trip", "peak RSS <= 50 MiB".
    pub rule: String,
    pub met: bool,
}

/// One measured figure.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Stable identifier, e.g. `default/relay/relays=2`.
    pub id: String,
    /// Broker setting: `default` (sync_interval 2 min) or `durable` (sync_interval always).
    pub profile: String,
    /// `ceiling`, `relay`, `consumer`, `e2e`, `latency`.
    pub section: String,
    pub label: String,
    pub unit: String,
    /// What varies between rows of a section: workers, relays, replicas, offered load, and for the
    /// remote CRM rows `crm_latency_ms` and `in_flight`.
    pub params: BTreeMap<String, Value>,
    /// Throughput rows: the rate. Latency rows: the p99 in milliseconds.
    pub value: Stats,
    pub latency: Option<Latency>,
    /// The row this one is compared with (or, for the remote CRM rows, the ideal rate), and
    /// value median / ceiling median.
    pub ceiling: Option<String>,
    pub ratio: Option<f64>,
    pub targets: Vec<Target>,
    pub processes: Vec<ProcessUsage>,
    /// Correctness counters of the run (duplicates, tasks, HOT updates, ...), by name.
    pub checks: BTreeMap<String, Value>,
    pub note: Option<String>,
}

impl Row {
    pub fn new(profile: &str, section: &str, id: &str, label: impl Into<String>, unit: &str, value: Stats) -> Self {
        Self {
            id: format!("{profile}/{section}/{id}"),
            profile: profile.to_owned(),
            section: section.to_owned(),
            label: label.into(),
            unit: unit.to_owned(),
            params: BTreeMap::new(),
            value,
            latency: None,
            ceiling: None,
            ratio: None,
            targets: Vec::new(),
            processes: Vec::new(),
            checks: BTreeMap::new(),
            note: None,
        }
    }

    pub fn param(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.params.insert(key.to_owned(), value.into());
        self
    }

    pub fn check(&mut self, key: &str, value: impl Into<Value>) {
        self.checks.insert(key.to_owned(), value.into());
    }

    /// Ties this row to `ceiling` and records the ratio of medians.
    pub fn against(mut self, ceiling: &Row) -> Self {
        self.ratio = Some(self.value.median / ceiling.value.median);
        self.ceiling = Some(ceiling.id.clone());
        self
    }

    pub fn target(&mut self, rule: impl Into<String>, met: bool) {
        self.targets.push(Target { rule: rule.into(), met });
    }
}

/// A query plan captured at one backlog size.
#[derive(Debug, Clone, Serialize)]
pub struct PlanSample {
    pub backlog: i64,
    /// Milliseconds for one whole claim (lock, claim, read the rows) of `batch` rows, rolled back,
    /// as the relay's workers run it (the generic plan their connections make once).
    pub claim_ms: Stats,
    /// The same claim planned at every execution (`force_custom_plan`, as before session 21).
    pub claim_ms_planned_each_time: Stats,
    pub batch: i64,
    /// Outbox scans that were not index scans, and sorts, found in the plans (want none).
    pub full_scans: Vec<String>,
    /// EXPLAIN (ANALYZE, BUFFERS) of each relay statement, by name.
    pub plans: BTreeMap<String, String>,
}

/// Sizes over a long run with retention on.
#[derive(Debug, Clone, Serialize)]
pub struct SoakSample {
    pub elapsed_s: f64,
    pub tasks: i64,
    pub outbox_rows: i64,
    /// Heap + indexes + TOAST, MiB.
    pub outbox_mib: f64,
    pub approved_action_mib: f64,
    pub outbox_dead_rows: i64,
    /// Longest-running transaction of any relay or consumer session at the sample, seconds.
    pub longest_xact_s: f64,
}

/// The soak's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct Soak {
    pub actions: i64,
    pub offered_per_s: f64,
    pub retention_s: u64,
    pub samples: Vec<SoakSample>,
    pub checks: BTreeMap<String, Value>,
}

/// A whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub started_at: String,
    pub machine: BTreeMap<String, Value>,
    pub settings: BTreeMap<String, Value>,
    pub rows: Vec<Row>,
    pub plans: Vec<PlanSample>,
    pub soak: Option<Soak>,
    /// Measurements designed in but not taken, with the reason.
    pub not_measured: Vec<BTreeMap<String, Value>>,
    pub elapsed_s: f64,
}

fn human(value: f64) -> String {
    if !value.is_finite() {
        "-".into()
    } else if value >= 100.0 {
        format!("{:.0}", value)
    } else if value >= 10.0 {
        format!("{:.1}", value)
    } else {
        format!("{:.2}", value)
    }
}

impl Report {
    /// The table printed at the end of a run (also pasted into docs/benchmarks.md).
    pub fn table(&self) -> String {
        let mut out = String::new();
        let mut rows: Vec<[String; 9]> = vec![[
            "profile".into(),
            "measurement".into(),
            "min".into(),
            "median".into(),
            "max".into(),
            "unit".into(),
            "ratio".into(),
            "peak RSS MiB".into(),
            "CPU µs/item".into(),
        ]];
        for row in &self.rows {
            let (min, median, max, unit) = match &row.latency {
                Some(l) => (
                    format!("{}/{}/{}", human(l.p50.min), human(l.p95.min), human(l.p99.min)),
                    format!("{}/{}/{}", human(l.p50.median), human(l.p95.median), human(l.p99.median)),
                    format!("{}/{}/{}", human(l.p50.max), human(l.p95.max), human(l.p99.max)),
                    "ms p50/p95/p99".to_owned(),
                ),
                None => (human(row.value.min), human(row.value.median), human(row.value.max), row.unit.clone()),
            };
            let ratio = match (&row.ratio, row.targets.iter().all(|t| t.met)) {
                (Some(r), true) => format!("{r:.2}x"),
                (Some(r), false) => format!("{r:.2}x !"),
                (None, _) => String::new(),
            };
            let rss = row
                .processes
                .iter()
                .filter(|p| p.role == "relay" || p.role == "consumer")
                .filter_map(|p| p.peak_rss_mib.map(|m| format!("{} {:.0}", p.role, m)))
                .collect::<Vec<_>>()
                .join(", ");
            let cpu = row
                .processes
                .iter()
                .filter(|p| p.cpu_us_per_item.median.is_finite() && p.cpu_s.median > 0.0)
                .map(|p| format!("{} {:.0}", short_role(&p.role), p.cpu_us_per_item.median))
                .collect::<Vec<_>>()
                .join(" ");
            rows.push([row.profile.clone(), row.label.clone(), min, median, max, unit, ratio, rss, cpu]);
        }
        let widths: Vec<usize> = (0..9).map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0)).collect();
        for (i, row) in rows.iter().enumerate() {
            let line: Vec<String> = row
                .iter()
                .enumerate()
                .map(|(c, cell)| {
                    let pad = widths[c] - cell.chars().count();
                    if (2..=4).contains(&c) || c == 6 {
                        format!("{}{}", " ".repeat(pad), cell)
                    } else {
                        format!("{}{}", cell, " ".repeat(pad))
                    }
                })
                .collect();
            let _ = writeln!(out, "{}", line.join("  ").trim_end());
            if i == 0 {
                let _ = writeln!(out, "{}", widths.iter().map(|w| "-".repeat(*w)).collect::<Vec<_>>().join("  "));
            }
        }
        let missed: Vec<String> = self
            .rows
            .iter()
            .flat_map(|r| r.targets.iter().filter(|t| !t.met).map(move |t| format!("{}: {}", r.id, t.rule)))
            .collect();
        if !missed.is_empty() {
            let _ = writeln!(out, "\ntargets not met (! above):");
            for m in missed {
                let _ = writeln!(out, "  {m}");
            }
        }
        if !self.plans.is_empty() {
            let _ = writeln!(out, "\nclaim cost by backlog (one claim of a batch, rolled back):");
            for p in &self.plans {
                let _ = writeln!(
                    out,
                    "  backlog {:>9}: {} ms per claim of {} rows (min {} max {}; planned at each claim {}); full scans or sorts: {}",
                    p.backlog,
                    human(p.claim_ms.median),
                    p.batch,
                    human(p.claim_ms.min),
                    human(p.claim_ms.max),
                    human(p.claim_ms_planned_each_time.median),
                    if p.full_scans.is_empty() { "none".to_owned() } else { p.full_scans.join("; ") }
                );
            }
        }
        if let Some(soak) = &self.soak {
            let max = |f: fn(&SoakSample) -> f64| soak.samples.iter().map(f).fold(0.0, f64::max);
            let last = soak.samples.last();
            let _ = writeln!(
                out,
                "\nretention soak: {} actions at {:.0}/s, retention {} s, {} samples",
                soak.actions,
                soak.offered_per_s,
                soak.retention_s,
                soak.samples.len()
            );
            let _ = writeln!(
                out,
                "  outbox rows max {:.0}, last {}; outbox MiB max {:.1}, last {:.1}; approved_action MiB last {:.1}",
                max(|s| s.outbox_rows as f64),
                last.map_or(0, |s| s.outbox_rows),
                max(|s| s.outbox_mib),
                last.map_or(0.0, |s| s.outbox_mib),
                last.map_or(0.0, |s| s.approved_action_mib),
            );
            let _ = writeln!(
                out,
                "  outbox dead rows max {:.0}; longest relay/consumer transaction {:.3} s; checks {}",
                max(|s| s.outbox_dead_rows as f64),
                max(|s| s.longest_xact_s),
                serde_json::to_string(&soak.checks).unwrap_or_default()
            );
        }
        for item in &self.not_measured {
            let what = item.get("measurement").and_then(Value::as_str).unwrap_or("?");
            let why = item.get("reason").and_then(Value::as_str).unwrap_or("");
            let _ = writeln!(out, "not measured: {what} ({why})");
        }
        out
    }
}

fn short_role(role: &str) -> &str {
    match role {
        "postgres" => "pg",
        "crm-sim" => "sim",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_take_the_middle_of_odd_and_even_runs() {
        let s = Stats::of(vec![3.0, 1.0, 2.0]);
        assert_eq!((s.min, s.median, s.max), (1.0, 2.0, 3.0));
        assert_eq!(s.runs, vec![3.0, 1.0, 2.0]);
        assert_eq!(Stats::of(vec![4.0, 1.0]).median, 2.5);
    }

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let samples: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&samples, 0.5), 50.0);
        assert_eq!(quantile(&samples, 0.99), 99.0);
        assert_eq!(quantile(&samples, 1.0), 100.0);
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
    }
}
