//! End-to-end suites on real Postgres and NATS. Each test starts its own servers (see
//! `handoff_tests::TestEnv`) and proves its claim by counting rows in the outbox, messages in the
//! stream and tasks in the CRM store.

mod adapters;
mod admin;
mod atomic;
mod cluster;
mod consumer;
mod install;
mod nats_permissions;
mod operability;
mod processes;
mod producer;
mod relay;
mod remote;
mod scale;
mod signing;
mod startup;
