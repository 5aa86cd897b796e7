//! `meshd-runtime`: what a meshd instance runs, as a library.
//!
//! - [`runtime`]: the [`runtime::Runtime`] over the stores ([`runtime::Deps`]): one
//!   task per subscription partition driving the sans-IO dispatcher
//!   (`meshd-dispatch`), pull/ack/nack/extend with leases, the write-ahead attempt
//!   rule, retries and dead-lettering, redrives, offsets, push workers
//!   ([`runtime::push`]), and in cluster mode the handover of the partitions this
//!   instance owns ([`runtime::handover`]) plus forwarding to the owners of the others
//!   ([`runtime::forwarding`]).
//! - [`background`]: the tracked background tasks a graceful stop cancels and waits for.
//! - [`cluster`]: partition ownership (the [`cluster::ownership::Controller`], the
//!   assignment rule) and the calls between instances ([`cluster::forward`]).
//! - [`membership`]: the instance's membership record and lease in Meta.
//! - [`requeue`]: tasks of expired sessions go back to `submitted`.
//! - [`compaction`]: etcd history compaction by revision retention.
//! - [`egress`]: the address rules push connects under.
//! - [`metrics`]: the counters and gauges all of these report (`/metrics`).
//!
//! The HTTP API, configuration and process wiring live in the `meshd` crate; this one
//! has no HTTP server and no global state, so its delivery rules are tested in process
//! over embedded Meta and Local stores in a temp dir (`tests/`).

pub mod background;
pub mod cluster;
pub mod compaction;
pub mod egress;
pub mod membership;
pub mod metrics;
pub mod requeue;
pub mod runtime;
