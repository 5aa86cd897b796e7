//! A real nats-server per test, and logs connected to it.

#![allow(dead_code)]

use meshd_log_nats::{NatsConfig, NatsLog};
use meshd_test_support::nats::NatsProcess;
use std::time::Duration;

/// The request deadline the tests use: short, so a paused server is noticed fast.
pub const TIMEOUT: Duration = Duration::from_secs(2);

pub async fn server() -> NatsProcess {
    NatsProcess::start().await.expect("nats-server starts")
}

pub fn config(nats: &NatsProcess) -> NatsConfig {
    let mut c = NatsConfig::parse(&nats.url()).expect("config");
    c.request_timeout = TIMEOUT;
    c.connect_timeout = TIMEOUT;
    c.ping_interval = Duration::from_secs(1);
    c
}

/// A new client (as another process would have).
pub async fn connect(nats: &NatsProcess) -> NatsLog {
    NatsLog::connect(config(nats)).await.expect("connect")
}
