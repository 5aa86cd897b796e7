//! What clap parses the client commands into: one struct or enum per command, with
//! the flags every command takes ([`Conn`]).

use clap::{Args, Subcommand, ValueEnum};

pub const DEFAULT_SERVER: &str = "http://127.0.0.1:7070";

/// Flags every client command takes (anywhere after the command name).
#[derive(Args, Clone, Debug)]
pub struct Conn {
    /// The meshd to talk to: http://host:port or https://host:port.
    #[arg(long, global = true, env = "MESHD_SERVER", default_value = DEFAULT_SERVER, value_name = "URL")]
    pub(crate) server: String,
    /// Print the server's JSON answer instead of a table.
    #[arg(long, global = true)]
    pub(crate) json: bool,
    /// Bearer token, when meshd runs with --client-token-file/--admin-token-file.
    /// Visible to other users in `ps` when given as a flag: prefer MESHD_TOKEN or
    /// --token-file.
    #[arg(long, global = true, env = "MESHD_TOKEN", hide_env_values = true)]
    pub(crate) token: Option<String>,
    /// A file whose first non-empty line is the bearer token (instead of --token).
    #[arg(
        long,
        global = true,
        env = "MESHD_TOKEN_FILE",
        value_name = "PATH",
        conflicts_with = "token"
    )]
    pub(crate) token_file: Option<std::path::PathBuf>,
    /// For https:// servers: the PEM CA that signed meshd's certificate (default:
    /// the system's CA bundle).
    #[arg(long, global = true, env = "MESHD_CA_FILE", value_name = "PEM")]
    pub(crate) ca_file: Option<std::path::PathBuf>,
}

/// The client commands, flattened next to `serve` in `main.rs`.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Create, list, show and delete topics.
    Topic(TopicArgs),
    /// Publish CloudEvents to a topic: from arguments, or one JSON event per stdin line.
    Publish(PublishArgs),
    /// Create, list and delete subscriptions.
    Sub(SubArgs),
    /// Pull deliveries from a subscription (and optionally ack them).
    Pull(PullArgs),
    /// Stream a subscription's deliveries as they come (Server-Sent Events), one line
    /// each, until interrupted (or --count deliveries).
    Tail(TailArgs),
    /// Inspect, redrive and delete dead letters.
    Dlq(DlqArgs),
    /// Submit, inspect and cancel tasks.
    Task(TaskArgs),
    /// List live sessions.
    Session(SessionArgs),
}

#[derive(Args, Debug)]
pub struct TopicArgs {
    #[command(flatten)]
    pub(crate) conn: Conn,
    #[command(subcommand)]
    pub(crate) cmd: TopicCmd,
}

#[derive(Subcommand, Debug)]
pub(crate) enum TopicCmd {
    /// Create a topic (succeeds when it exists with the same partition count).
    Create {
        name: String,
        /// Number of partitions, 1-1024.
        #[arg(long, short = 'p')]
        partitions: u32,
    },
    /// List topics.
    List,
    /// Show a topic with the end offset of each partition.
    Get { name: String },
    /// Delete a topic (refused while a subscription references it).
    Delete { name: String },
}

#[derive(Args, Debug)]
pub struct PublishArgs {
    #[command(flatten)]
    pub(crate) conn: Conn,
    /// The topic to publish to.
    pub(crate) topic: String,
    /// CloudEvents as JSON objects, one per argument. Without any (and without
    /// --type), events are read from stdin, one JSON object per line (blank lines
    /// skipped).
    pub(crate) events: Vec<String>,
    /// Build one event instead: its `type` (`--data`, `--source`, `--id` fill the rest).
    #[arg(long = "type", value_name = "TYPE", conflicts_with = "events")]
    pub(crate) event_type: Option<String>,
    /// With --type: the event's `data`, as JSON (`'{"n":1}'`, `'"text"'`, `42`).
    #[arg(long, value_name = "JSON", requires = "event_type")]
    pub(crate) data: Option<String>,
    /// With --type: the event's `source` (default `meshd-cli`).
    #[arg(long, requires = "event_type")]
    pub(crate) source: Option<String>,
    /// With --type: the event's `id` (default: generated, 32 hex characters); the same
    /// id again within the topic's dedup window is answered as a duplicate.
    #[arg(long, requires = "event_type")]
    pub(crate) id: Option<String>,
    /// Events per request, 1-1000 (each request is one atomic, durable append).
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub(crate) batch_size: u32,
}

#[derive(Args, Debug)]
pub struct SubArgs {
    #[command(flatten)]
    pub(crate) conn: Conn,
    #[command(subcommand)]
    pub(crate) cmd: SubCmd,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum Start {
    Earliest,
    Latest,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum OrderingArg {
    None,
    Key,
}

#[derive(Args, Debug)]
pub(crate) struct SubCreate {
    pub(crate) name: String,
    /// The topic to subscribe to (must exist).
    #[arg(long)]
    pub(crate) topic: String,
    /// Deliveries before an event is dead-lettered, 1-1000 (server default 5).
    #[arg(long)]
    pub(crate) max_attempts: Option<u32>,
    /// Lease of one delivery, 100-600000 ms (server default 30000).
    #[arg(long)]
    pub(crate) ack_timeout_ms: Option<u64>,
    /// Where a new subscription starts in each partition (server default latest).
    #[arg(long, value_enum)]
    pub(crate) start: Option<Start>,
    /// "key": one event per partitionkey at a time, in order (server default none).
    #[arg(long, value_enum)]
    pub(crate) ordering: Option<OrderingArg>,
    /// Deliver only events of this CloudEvents type.
    #[arg(long)]
    pub(crate) filter_type: Option<String>,
    /// Deliver only events from this CloudEvents source.
    #[arg(long)]
    pub(crate) filter_source: Option<String>,
    /// CloudEvents Subscriptions API filters, a JSON array that must all match, e.g.
    /// '[{"prefix":{"type":"com.shop."}},{"not":{"exact":{"region":"us"}}}]'.
    #[arg(long, value_name = "JSON")]
    pub(crate) filters: Option<String>,
    /// First retry delay in ms.
    #[arg(long)]
    pub(crate) backoff_initial_ms: Option<u64>,
    /// Longest retry delay in ms.
    #[arg(long)]
    pub(crate) backoff_max_ms: Option<u64>,
    /// Push deliveries to this URL instead of waiting for pulls.
    #[arg(long)]
    pub(crate) push_url: Option<String>,
    /// Sign pushes with this Standard Webhooks secret (whsec_...); give it twice while
    /// rotating; "***" keeps a stored one (with --upsert).
    #[arg(long = "push-secret", value_name = "SECRET")]
    pub(crate) push_secrets: Vec<String>,
    /// A static header sent with every push, NAME=VALUE (repeatable).
    #[arg(long = "push-header", value_name = "NAME=VALUE")]
    pub(crate) push_headers: Vec<String>,
    /// Push requests in flight at once, 1-256 (server default 16).
    #[arg(long)]
    pub(crate) push_max_concurrency: Option<u32>,
    /// Push requests started per second, 0.1-100000 (server default unlimited).
    #[arg(long)]
    pub(crate) push_rate_per_s: Option<f64>,
    /// Update the subscription if it exists, instead of failing.
    #[arg(long)]
    pub(crate) upsert: bool,
}

#[derive(Subcommand, Debug)]
pub(crate) enum SubCmd {
    /// Create a subscription (fails if it exists, unless --upsert).
    Create(Box<SubCreate>),
    /// List subscriptions.
    List,
    /// Show one subscription with its committed offsets.
    Get { name: String },
    /// Delete a subscription with its offsets and in-flight deliveries.
    Delete { name: String },
    /// Per partition: committed and end offsets, backlog, in flight, waiting retries,
    /// parked, dead-lettering, and the delivery counters.
    Stats { name: String },
}

#[derive(Args, Debug)]
pub struct PullArgs {
    #[command(flatten)]
    pub(crate) conn: Conn,
    /// The subscription to pull from.
    pub(crate) subscription: String,
    /// Most deliveries to take, 1-1000 (server default 10).
    #[arg(long)]
    pub(crate) max: Option<u64>,
    /// Long-poll up to this long for the first delivery, 0-30000 ms.
    #[arg(long)]
    pub(crate) wait_ms: Option<u64>,
    /// Ack every delivery right after it is received (exit 1 if any ack is not recorded).
    #[arg(long)]
    pub(crate) ack: bool,
}

#[derive(Args, Debug)]
pub struct TailArgs {
    #[command(flatten)]
    pub(crate) conn: Conn,
    /// The subscription to stream.
    pub(crate) subscription: String,
    /// Ack every delivery once it is printed (unacked ones come back after the
    /// subscription's ack timeout, to this stream or another consumer).
    #[arg(long)]
    pub(crate) ack: bool,
    /// Deliveries leased to this stream and not yet acked, 1-10000 (server default 100).
    #[arg(long)]
    pub(crate) max_in_flight: Option<u32>,
    /// Stop after this many deliveries.
    #[arg(long)]
    pub(crate) count: Option<u64>,
}

#[derive(Args, Debug)]
pub struct DlqArgs {
    #[command(flatten)]
    pub(crate) conn: Conn,
    #[command(subcommand)]
    pub(crate) cmd: DlqCmd,
}

#[derive(Subcommand, Debug)]
pub(crate) enum DlqCmd {
    /// List dead-letter entries.
    List {
        /// Only entries of this subscription.
        #[arg(long)]
        subscription: Option<String>,
        /// Entries per page, 1-1000.
        #[arg(long)]
        limit: Option<u32>,
        /// Continue from this cursor (printed after a partial page).
        #[arg(long)]
        cursor: Option<String>,
        /// Follow cursors to the last page.
        #[arg(long)]
        all: bool,
    },
    /// Show one entry with its event.
    Show { id: String },
    /// Deliver entries again to their subscription ("-" reads ids from stdin).
    Redrive {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Delete entries ("-" reads ids from stdin).
    Delete {
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

#[derive(Args, Debug)]
pub struct TaskArgs {
    #[command(flatten)]
    pub(crate) conn: Conn,
    #[command(subcommand)]
    pub(crate) cmd: TaskCmd,
}

#[derive(Subcommand, Debug)]
pub(crate) enum TaskCmd {
    /// Submit a task for an agent (repeating the same --id and body is safe).
    Submit {
        /// The agent (client id) that should work on it.
        #[arg(long)]
        agent: String,
        /// A client-chosen id, making the submit safe to retry.
        #[arg(long)]
        id: Option<String>,
        /// The task input as JSON.
        #[arg(long)]
        input: Option<String>,
    },
    /// Show one task with its history.
    Get { id: String },
    /// List tasks.
    List {
        #[arg(long)]
        agent: Option<String>,
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        limit: Option<u32>,
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Cancel a task that is not terminal.
    Cancel { id: String },
}

#[derive(Args, Debug)]
pub struct SessionArgs {
    #[command(flatten)]
    pub(crate) conn: Conn,
    #[command(subcommand)]
    pub(crate) cmd: SessionCmd,
}

#[derive(Subcommand, Debug)]
pub(crate) enum SessionCmd {
    /// List live sessions.
    List,
}
