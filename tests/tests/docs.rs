//! The README's configuration tables say what `--help` says: every flag of `handoff-relay` and
//! `handoff-consumer`, with its environment variable and its default, and nothing else.

use std::collections::BTreeMap;

use clap::CommandFactory;

/// One documented setting: flag -> (env, default).
type Table = BTreeMap<String, (String, String)>;

/// The rows of the table that follows `heading` in the README.
fn table_after(readme: &str, heading: &str) -> Table {
    let start = readme.find(heading).unwrap_or_else(|| panic!("README has no {heading:?}"));
    let mut rows = Table::new();
    for line in readme[start..].lines().skip(1).skip_while(|l| !l.starts_with('|')) {
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<String> = line.trim_matches('|').split('|').map(|c| c.trim().replace('`', "")).collect();
        if cells.len() < 3 || cells[0] == "flag" || cells[0].starts_with("---") {
            continue;
        }
        // `--nats-user` / `--nats-password` with `NATS_USER` / `NATS_PASSWORD`: one row, two settings.
        let flags: Vec<&str> = cells[0].split(" / ").collect();
        let envs: Vec<&str> = cells[1].split(" / ").collect();
        for (i, flag) in flags.iter().enumerate() {
            let env = envs.get(i).or(envs.first()).copied().unwrap_or_default();
            rows.insert(flag.trim().to_owned(), (env.trim().to_owned(), cells[2].clone()));
        }
    }
    rows
}

/// What clap says: flag -> (env, default), with `required` for a required setting without one.
fn help_of(command: clap::Command) -> Table {
    command
        .get_arguments()
        .filter_map(|arg| {
            let long = arg.get_long()?;
            if matches!(long, "help" | "version") {
                return None;
            }
            let env = arg.get_env().map(|e| e.to_string_lossy().into_owned()).unwrap_or_default();
            let defaults: Vec<String> =
                arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
            let default =
                if defaults.is_empty() && arg.is_required_set() { "required".into() } else { defaults.join(",") };
            Some((format!("--{long}"), (env, default)))
        })
        .collect()
}

/// A default written as `<...>` is computed from other settings: clap has none.
fn same_default(readme: &str, help: &str) -> bool {
    readme == help || (readme.starts_with('<') && help.is_empty())
}

fn compare(binary: &str, help: Table, documented: Table) {
    let mut problems = Vec::new();
    for (flag, (env, default)) in &help {
        match documented.get(flag) {
            None => problems.push(format!("{flag} ({env}) is in --help but not in the README")),
            Some((doc_env, doc_default)) => {
                if doc_env != env {
                    problems.push(format!("{flag}: README says env {doc_env}, --help says {env}"));
                }
                if !same_default(doc_default, default) {
                    problems.push(format!("{flag}: README says default {doc_default:?}, --help says {default:?}"));
                }
            }
        }
    }
    for flag in documented.keys().filter(|f| !help.contains_key(*f)) {
        problems.push(format!("{flag} is in the README but not in --help"));
    }
    assert!(problems.is_empty(), "{binary}: README and --help differ:\n{}", problems.join("\n"));
}

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md")).unwrap()
}

#[test]
fn the_readme_documents_every_relay_flag_as_help_does() {
    let readme = readme();
    let mut documented = table_after(&readme, "Shared by both binaries:");
    documented.extend(table_after(&readme, "`handoff-relay`:\n"));
    compare("handoff-relay", help_of(handoff_relay::config::RelayConfig::command()), documented);
}

#[test]
fn the_readme_documents_every_consumer_flag_as_help_does() {
    let readme = readme();
    let mut documented = table_after(&readme, "Shared by both binaries:");
    documented.extend(table_after(&readme, "`handoff-consumer`:\n"));
    compare("handoff-consumer", help_of(handoff_consumer::config::ConsumerConfig::command()), documented);
}

/// The binary's own `--help`, words joined by single spaces (clap wraps lines to the terminal).
fn help_text_of(binary: &str) -> String {
    let path = handoff_testkit::process::binary_path(binary).unwrap();
    let output = std::process::Command::new(&path).arg("--help").output().unwrap();
    assert!(output.status.success(), "{} --help: {:?}", path.display(), output);
    String::from_utf8(output.stdout).unwrap().split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn the_relay_binary_and_the_readme_name_the_claim_size_auto_times_apart() {
    let rule = format!("claims of fewer than {} rows", handoff_relay::auto_mode::AUTO_ATOMIC_MIN_ROWS);
    let help = help_text_of("handoff-relay");
    assert!(help.contains(&rule), "handoff-relay --help should say {rule:?} for --publish-mode:\n{help}");
    let readme = readme().split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(readme.contains(&rule), "the README's --publish-mode row should say {rule:?}");
}
