//! `meshd-client`: the Rust client of meshd.
//!
//! - [`Client`]: one typed async method per operation of the public HTTP API
//!   (topics, publish, pull/ack/nack/extend, subscriptions, offsets, dead letters,
//!   sessions, tasks, cluster), and [`Client::stream`]: deliveries as Server-Sent
//!   Events ([`EventStream`]). For a caller that shows answers (the `meshd` CLI), a
//!   `*_answer` twin of each operation it shows returns the answer whole, its body
//!   exactly as meshd wrote it.
//! - [`Transport`]: the HTTP/1.1 transport under it (hyper; TLS with rustls), which
//!   every part of meshd that calls over HTTP uses: the CLI, push delivery, calls
//!   between cluster instances, the test harnesses and the load generator.
//!
//! Errors say whether the request may have been applied ([`Error::outcome_unknown`]):
//! a failure to connect is [`Error::Unreachable`] (nothing was sent); a connection
//! lost after sending, or a deadline passed, is [`Error::Lost`].
//!
//! ```no_run
//! use meshd_client::{Client, Pull};
//!
//! # async fn run() -> Result<(), meshd_client::Error> {
//! let meshd = Client::connect("http://127.0.0.1:7070")?;
//! meshd
//!     .put_subscription("billing", &serde_json::json!({ "topic": "orders" }))
//!     .await?;
//! let pull = Pull { max_events: Some(10), wait_ms: Some(1000), ..Pull::default() };
//! for d in meshd.pull("billing", &pull).await? {
//!     match &d.event {
//!         Ok(event) => println!("{} attempt {}: {event}", d.delivery_id, d.attempt),
//!         // One event this client cannot decode; the others are unaffected.
//!         Err(e) => eprintln!("{}: {e}", d.delivery_id),
//!     }
//!     meshd.ack("billing", &[d.delivery_id]).await?;
//! }
//! # Ok(()) }
//! ```

mod api;
mod delivery;
mod error;
pub mod paths;
mod stream;
mod target;
pub mod tls;
pub mod transport;

pub use api::{
    deliveries_of, Acked, Client, Extended, Nacked, Offset, Pull, Session, Stored, Topic,
    TopicSummary,
};
pub use delivery::{Delivery, UndecodableEvent};
pub use error::{shorten, Error, Problem};
pub use http::Method;
pub use stream::{EventStream, SseEvent, SseParser, StreamOptions, STREAM_IDLE};
pub use target::{query, segment, split_host_port, Target};
pub use transport::{Request, Response, Transport};
