//! The operator CLI (`meshd topic|publish|sub|pull|dlq|...`) as an operator runs it: a
//! real `meshd serve` in the background and the same binary as a client subprocess.
//! Assertions read `--json` output with serde_json (the table output gets one sanity
//! check), the exit code (1 an error answer, 2 bad usage, 3 unreachable) and stderr.

mod common;

use anyhow::ensure;
use common::{bin, committed, start};
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::process::{Output, Stdio};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// What one CLI run left behind.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not JSON ({e}): {:?}; stderr: {}",
                self.stdout, self.stderr
            )
        })
    }

    #[track_caller]
    fn ok(self) -> Self {
        assert_eq!(
            self.code,
            Some(0),
            "stdout: {}\nstderr: {}",
            self.stdout,
            self.stderr
        );
        self
    }
}

/// Runs `meshd args...` against `server` (`host:port`, passed as `--server`, or in
/// `MESHD_SERVER` when `via_env`), feeding `stdin`; bounded by a deadline.
async fn cli_with(server: &str, via_env: bool, args: &[&str], stdin: Option<&str>) -> Run {
    let mut cmd = tokio::process::Command::new(bin());
    cmd.args(args)
        .env_remove("MESHD_SERVER")
        .env_remove("MESHD_TOKEN")
        .env("RUST_LOG", "off")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let url = format!("http://{server}");
    if via_env {
        cmd.env("MESHD_SERVER", &url);
    } else {
        cmd.args(["--server", &url]);
    }
    let mut child = cmd.spawn().expect("spawn the CLI");
    if let Some(text) = stdin {
        let mut pipe = child.stdin.take().expect("stdin pipe");
        pipe.write_all(text.as_bytes()).await.expect("write stdin");
        drop(pipe);
    }
    let out: Output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("meshd {args:?} did not finish within 60 s"))
        .expect("wait for the CLI");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn cli(server: &str, args: &[&str]) -> Run {
    cli_with(server, false, args, None).await
}

fn event(id: &str, kind: &str) -> String {
    json!({"specversion": "1.0", "id": id, "source": "cli-test", "type": kind, "data": {"n": id}})
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_running_meshd_when_topics_and_subscriptions_are_created_then_the_lists_show_them()
{
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();

    let created = cli(
        a,
        &["topic", "create", "orders", "--partitions", "3", "--json"],
    )
    .await
    .ok()
    .json();
    assert_eq!(created, json!({"name": "orders", "partitions": 3}));
    // Idempotent with the same count (via MESHD_SERVER this time), refused with another.
    cli_with(a, true, &["topic", "create", "orders", "-p", "3"], None)
        .await
        .ok();
    let clash = cli(a, &["topic", "create", "orders", "-p", "4"]).await;
    assert_eq!(clash.code, Some(1), "{}", clash.stderr);
    assert!(clash.stderr.contains("4"), "{}", clash.stderr);
    cli(a, &["topic", "create", "audit", "-p", "1"]).await.ok();

    let topics = cli(a, &["topic", "list", "--json"]).await.ok().json();
    let mut names: Vec<(String, u64)> = topics["topics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["name"].as_str().unwrap().to_string(),
                t["partitions"].as_u64().unwrap(),
            )
        })
        .collect();
    names.sort();
    assert_eq!(names, vec![("audit".into(), 1), ("orders".into(), 3)]);

    // The table: a header, then one aligned row per topic.
    let table = cli(a, &["topic", "list"]).await.ok().stdout;
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 3, "{table}");
    assert!(lines[0].starts_with("NAME"), "{table}");
    let col = lines[0].find("PARTITIONS").expect("a PARTITIONS column");
    let orders = lines
        .iter()
        .find(|l| l.starts_with("orders"))
        .expect("an orders row");
    assert_eq!(orders[col..].trim(), "3", "{table}");

    let sub = cli(
        a,
        &[
            "sub",
            "create",
            "billing",
            "--topic",
            "orders",
            "--max-attempts",
            "3",
            "--ack-timeout-ms",
            "5000",
            "--start",
            "earliest",
            "--filter-type",
            "order.created",
            "--json",
        ],
    )
    .await
    .ok()
    .json();
    assert_eq!(sub["name"], "billing");
    assert_eq!(sub["topic"], "orders");
    assert_eq!(sub["max_attempts"], 3);
    assert_eq!(sub["ack_timeout_ms"], 5000);
    assert_eq!(sub["start"], "earliest");
    assert_eq!(sub["filter"]["type"], "order.created");
    // Create is create-only.
    let again = cli(a, &["sub", "create", "billing", "--topic", "orders"]).await;
    assert_eq!(again.code, Some(1), "{}", again.stderr);
    assert!(again.stderr.contains("already exists"), "{}", again.stderr);
    let missing_topic = cli(a, &["sub", "create", "x", "--topic", "nope"]).await;
    assert_eq!(missing_topic.code, Some(1));
    assert!(
        missing_topic.stderr.contains("field: topic"),
        "{}",
        missing_topic.stderr
    );

    // Filters and signed, bounded push from flags.
    let hooked = cli(
        a,
        &[
            "sub",
            "create",
            "hooked",
            "--topic",
            "orders",
            "--filters",
            r#"[{"prefix":{"type":"order."}}]"#,
            "--ordering",
            "key",
            "--push-url",
            "http://127.0.0.1:9/hook",
            "--push-secret",
            "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
            "--push-header",
            "authorization=Bearer x=y",
            "--push-max-concurrency",
            "4",
            "--push-rate-per-s",
            "2.5",
            "--json",
        ],
    )
    .await
    .ok()
    .json();
    assert_eq!(hooked["filters"], json!([{"prefix": {"type": "order."}}]));
    assert_eq!(hooked["ordering"], "key");
    assert_eq!(
        hooked["push"],
        json!({"url": "http://127.0.0.1:9/hook", "secrets": ["***"],
               "headers": {"authorization": "***"}, "max_concurrency": 4, "rate_per_s": 2.5})
    );
    let bad = cli(
        a,
        &["sub", "create", "x", "--topic", "orders", "--filters", "[{"],
    )
    .await;
    assert_eq!(bad.code, Some(2), "{}", bad.stderr);
    let bad = cli(
        a,
        &[
            "sub",
            "create",
            "x",
            "--topic",
            "orders",
            "--filters",
            r#"[{"bogus":{}}]"#,
        ],
    )
    .await;
    assert_eq!(bad.code, Some(1), "{}", bad.stderr);
    assert!(bad.stderr.contains("filters[0]"), "{}", bad.stderr);
    cli(a, &["sub", "delete", "hooked"]).await.ok();

    let subs = cli(a, &["sub", "list", "--json"]).await.ok().json();
    let list = subs["subscriptions"].as_array().unwrap();
    assert_eq!(list.len(), 1, "{subs}");
    assert_eq!(list[0]["name"], "billing");
    assert!(list[0]["revision"].as_u64().is_some(), "{subs}");

    cli(a, &["sub", "delete", "billing"]).await.ok();
    let subs = cli(a, &["sub", "list", "--json"]).await.ok().json();
    assert_eq!(subs["subscriptions"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_events_from_arguments_and_stdin_when_pulled_with_ack_then_all_arrive_and_the_committed_offset_advances(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    cli(a, &["topic", "create", "orders", "-p", "1"]).await.ok();
    cli(
        a,
        &[
            "sub", "create", "billing", "--topic", "orders", "--start", "earliest",
        ],
    )
    .await
    .ok();

    let (e1, e2) = (event("a1", "order.created"), event("a2", "order.created"));
    let placed = cli(a, &["publish", "orders", &e1, &e2, "--json"])
        .await
        .ok()
        .json();
    let ids: Vec<&str> = placed["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["a1", "a2"]);

    // Several lines on stdin, a blank one among them, in batches of two.
    let stdin = format!(
        "{}\n{}\n\n{}\n",
        event("s1", "order.created"),
        event("s2", "order.created"),
        event("s3", "order.created")
    );
    let placed = cli_with(
        a,
        false,
        &["publish", "orders", "--batch-size", "2", "--json"],
        Some(&stdin),
    )
    .await
    .ok()
    .json();
    let offsets: Vec<u64> = placed["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["offset"].as_u64().unwrap())
        .collect();
    assert_eq!(offsets, [2, 3, 4]);

    // Pull with --ack until all five are in (the dispatcher may hand them out in parts).
    // A plain deadline loop: each pull's deliveries are acked, so they must be kept.
    let mut got: Vec<Value> = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while got.len() < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "only {} of 5 events pulled within 20 s: {got:?}",
            got.len()
        );
        let run = cli(
            a,
            &[
                "pull",
                "billing",
                "--max",
                "100",
                "--wait-ms",
                "500",
                "--ack",
                "--json",
            ],
        )
        .await
        .ok();
        let deliveries = run.json()["deliveries"]
            .as_array()
            .cloned()
            .unwrap_or_else(|| panic!("no deliveries list: {}", run.stdout));
        if !deliveries.is_empty() {
            assert!(
                run.stderr.contains("acked"),
                "no ack report: {}",
                run.stderr
            );
        }
        got.extend(deliveries);
    }
    let mut pulled: Vec<(u64, String)> = got
        .iter()
        .map(|d| {
            (
                d["offset"].as_u64().unwrap(),
                d["event"]["id"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    pulled.sort();
    assert_eq!(
        pulled,
        vec![
            (0, "a1".into()),
            (1, "a2".into()),
            (2, "s1".into()),
            (3, "s2".into()),
            (4, "s3".into())
        ]
    );
    // Delivered exactly as published.
    let first = got.iter().find(|d| d["event"]["id"] == "a1").unwrap();
    assert_eq!(first["event"], serde_json::from_str::<Value>(&e1).unwrap());

    // Acked: nothing comes back, and the committed offset moves past all five.
    let again = cli(a, &["pull", "billing", "--max", "100", "--json"])
        .await
        .ok()
        .json();
    assert_eq!(again["deliveries"], json!([]));
    wait_until(
        Duration::from_secs(15),
        "committed offset 5",
        || async move {
            let c = committed(a, "billing", 0).await?;
            ensure!(c == 5, "committed is {c}");
            Ok(())
        },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_big_stdin_when_published_then_progress_is_reported_and_every_event_is_placed() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    cli(a, &["topic", "create", "bulk", "-p", "4"]).await.ok();
    let stdin: String = (0..2500)
        .map(|i| event(&format!("e{i}"), "bulk") + "\n")
        .collect();
    let run = cli_with(a, false, &["publish", "bulk", "--json"], Some(&stdin))
        .await
        .ok();
    assert!(
        run.stderr.contains("published 1000 events"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("published 2000 events"),
        "{}",
        run.stderr
    );
    assert_eq!(run.json()["events"].as_array().unwrap().len(), 2500);
    let topic = common::end_offsets(a, "bulk").await;
    assert_eq!(topic.iter().sum::<u64>(), 2500, "{topic:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_bad_input_when_published_then_the_exit_code_and_message_say_what_and_where() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    cli(a, &["topic", "create", "orders", "-p", "1"]).await.ok();

    // Not JSON in an argument: usage error, nothing sent.
    let run = cli(a, &["publish", "orders", &event("x", "t"), "{nope"]).await;
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    assert!(run.stderr.contains("argument 2"), "{}", run.stderr);

    // A bad stdin line: the lines before it are published, then exit 2 naming the line.
    let stdin = format!("{}\nnot json\n{}\n", event("ok1", "t"), event("ok2", "t"));
    let run = cli_with(a, false, &["publish", "orders"], Some(&stdin)).await;
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    assert!(run.stderr.contains("stdin line 2"), "{}", run.stderr);
    assert!(
        run.stderr.contains("1 event before it was published"),
        "{}",
        run.stderr
    );

    // Not a CloudEvent: the server's 400 names the field, the CLI names the line.
    let stdin = format!(
        "{}\n{}\n",
        event("ok3", "t"),
        json!({"specversion": "1.0", "id": "x", "type": "t"})
    );
    let run = cli_with(a, false, &["publish", "orders"], Some(&stdin)).await;
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert!(
        run.stderr.contains("field: events[1].source"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("stdin line 2"), "{}", run.stderr);
    assert_eq!(
        common::end_offsets(a, "orders").await,
        vec![1],
        "only ok1 was stored"
    );

    // Bad usage of the command line itself.
    let run = cli(a, &["topic", "create", "orders"]).await;
    assert_eq!(run.code, Some(2), "{}", run.stderr);
    let run = cli(
        a,
        &[
            "sub", "create", "s", "--topic", "orders", "--start", "middle",
        ],
    )
    .await;
    assert_eq!(run.code, Some(2), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_empty_store_when_dead_letters_are_listed_then_there_are_none() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let list = cli(a, &["dlq", "list", "--json"]).await.ok().json();
    assert_eq!(list["entries"], json!([]), "{list}");
    let all = cli(a, &["dlq", "list", "--all", "--json"])
        .await
        .ok()
        .json();
    assert_eq!(all, json!({"entries": []}));
    let table = cli(a, &["dlq", "list"]).await.ok();
    assert_eq!(table.stdout, "", "nothing on stdout for an empty list");
    assert!(
        table.stderr.contains("no dead-letter entries"),
        "{}",
        table.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_unknown_subscription_when_pulled_then_it_exits_1_with_the_detail_on_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let run = cli(m.addr(), &["pull", "nope", "--json"]).await;
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert_eq!(run.stdout, "");
    assert!(
        run.stderr.contains("subscription \"nope\" does not exist"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("404"), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_no_server_when_a_command_runs_then_it_exits_3() {
    // A port that was just free: nothing listens there.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    for args in [
        &["topic", "list"][..],
        &["pull", "s", "--ack"][..],
        &["dlq", "list", "--json"][..],
    ] {
        let run = cli(&addr, args).await;
        assert_eq!(run.code, Some(3), "{args:?}: {}", run.stderr);
        assert!(run.stderr.contains("cannot reach meshd"), "{}", run.stderr);
    }
    let run = cli_with(&addr, true, &["session", "list"], None).await;
    assert_eq!(run.code, Some(3), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_published_events_when_tailed_with_ack_then_each_is_printed_once_and_stats_show_them_acked(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    cli(a, &["topic", "create", "orders", "-p", "2"]).await.ok();
    cli(
        a,
        &[
            "sub", "create", "billing", "--topic", "orders", "--start", "earliest",
        ],
    )
    .await
    .ok();
    let events: Vec<String> = (0..4)
        .map(|i| event(&format!("t{i}"), "order.created"))
        .collect();
    let mut args = vec!["publish", "orders"];
    args.extend(events.iter().map(String::as_str));
    cli(a, &args).await.ok();

    let run = cli(a, &["tail", "billing", "--ack", "--json", "--count", "4"])
        .await
        .ok();
    let mut seen: Vec<String> = run
        .stdout
        .lines()
        .map(|l| {
            let d: Value = serde_json::from_str(l).unwrap();
            assert_eq!(d["attempt"], 1, "{d}");
            d["event"]["id"].as_str().unwrap().to_string()
        })
        .collect();
    seen.sort();
    assert_eq!(seen, ["t0", "t1", "t2", "t3"]);

    let stats = cli(a, &["sub", "stats", "billing", "--json"])
        .await
        .ok()
        .json();
    let parts = stats["partitions"].as_array().unwrap();
    assert_eq!(parts.len(), 2, "{stats}");
    let total = |k: &str| parts.iter().map(|p| p[k].as_u64().unwrap()).sum::<u64>();
    assert_eq!(
        (total("delivered_total"), total("acked_total")),
        (4, 4),
        "{stats}"
    );
    for p in parts {
        assert_eq!(p["committed"], p["end_offset"], "{stats}");
    }
    let table = cli(a, &["sub", "stats", "billing"]).await.ok();
    let head = table.stdout.lines().next().unwrap_or_default();
    for col in [
        "PARTITION",
        "COMMITTED",
        "END",
        "BACKLOG",
        "IN_FLIGHT",
        "ACKED",
    ] {
        assert!(head.contains(col), "{}", table.stdout);
    }
    assert_eq!(table.stdout.lines().count(), 3, "{}", table.stdout);
}

/// `meshd publish TOPIC --type T --data JSON [--source S] [--id I]` builds the
/// CloudEvent a newcomer would otherwise write out by hand (as `nats pub` takes a
/// subject and a payload): the id generated unless given, the source `meshd-cli`
/// unless given, `data` as JSON. Before, `--type` was an unknown argument.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_type_and_data_then_meshd_publish_builds_the_cloud_event() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    cli(a, &["topic", "create", "orders", "-p", "1"]).await.ok();
    let placed = cli(
        a,
        &[
            "publish",
            "orders",
            "--type",
            "order.created",
            "--data",
            r#"{"n":1}"#,
            "--json",
        ],
    )
    .await
    .ok()
    .json();
    let id = placed["events"][0]["id"].as_str().unwrap().to_string();
    assert!(
        id.len() == 32 && id.chars().all(|c| c.is_ascii_hexdigit()),
        "a generated id: {placed}"
    );
    let mut args = vec![
        "publish",
        "orders",
        "--type",
        "order.paid",
        "--source",
        "/shop",
    ];
    args.extend(["--id", "pay-1", "--data", r#""text""#, "--json"]);
    let first = cli(a, &args).await.ok().json();
    assert_eq!(first["events"][0]["id"], "pay-1", "{first}");
    // The same id again is a duplicate of the first (dedup by id and source).
    let again = cli(a, &args).await.ok().json();
    assert_eq!(again["events"][0]["duplicate"], true, "{again}");
    let stored: Vec<Value> = common::browse_all(a, "orders", 0)
        .await
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    assert_eq!(
        stored,
        vec![
            json!({"specversion": "1.0", "id": id, "source": "meshd-cli", "type": "order.created",
                   "datacontenttype": "application/json", "data": {"n": 1}}),
            json!({"specversion": "1.0", "id": "pay-1", "source": "/shop", "type": "order.paid",
                   "datacontenttype": "application/json", "data": "text"}),
        ]
    );
    // Bad input: usage errors (exit 2) naming what, nothing sent.
    for bad in [
        vec!["publish", "orders", "--type", "t", "--data", "not json"],
        vec!["publish", "orders", "--data", "1"],
        vec![
            "publish",
            "orders",
            "--type",
            "t",
            r#"{"specversion":"1.0"}"#,
        ],
    ] {
        let run = cli(a, &bad).await;
        assert_eq!(run.code, Some(2), "{bad:?}: {}", run.stderr);
        assert!(
            run.stderr.contains("--data") || run.stderr.contains("--type"),
            "{bad:?}: {}",
            run.stderr
        );
    }
    assert_eq!(common::browse_all(a, "orders", 0).await.len(), 2);
}

/// A stand-in meshd for what a real one will not do on cue: answers the connections it
/// gets with `answers` in order (status, JSON body), one request each, and hands back
/// each request's line and body.
async fn stand_in(answers: Vec<(u16, String)>) -> (String, tokio::task::JoinHandle<Vec<String>>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let mut requests = Vec::new();
        for (status, body) in answers {
            let (mut s, _) = l.accept().await.unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            // The head, then as many body bytes as it announces.
            let (line_end, body_at) = loop {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "the request ended early: {got:?}");
                got.extend_from_slice(&buf[..n]);
                let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
                    continue;
                };
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                if got.len() >= end + 4 + len {
                    break (head.find("\r\n").unwrap_or(end), end + 4);
                }
            };
            requests.push(format!(
                "{} {}",
                String::from_utf8_lossy(&got[..line_end]),
                String::from_utf8_lossy(&got[body_at..])
            ));
            let answer = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            s.write_all(answer.as_bytes()).await.unwrap();
        }
        requests
    });
    (addr, task)
}

/// `--json` prints the server's answer exactly as it came: keys in its order, its
/// spacing, its spelling of numbers, events byte for byte as published. A stand-in
/// answers in a way no re-serialised value would reproduce.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_answers_no_reserialising_would_keep_when_printed_with_json_then_each_comes_out_byte_for_byte(
) {
    let event = r#"{ "type":"t", "specversion":"1.0","id":"e1","source":"/s","data":1.50}"#;
    let cases: Vec<(Vec<&str>, &str, String)> = vec![
        (
            vec!["topic", "create", "orders", "-p", "3"],
            "PUT /v1/topics/orders HTTP/1.1 {\"partitions\":3}",
            r#"{"partitions":3, "name":"orders"}"#.into(),
        ),
        (
            vec!["topic", "list"],
            "GET /v1/topics HTTP/1.1 ",
            r#"{ "topics": [{"partitions":3,"name":"orders"}] }"#.into(),
        ),
        (
            vec!["topic", "get", "orders"],
            "GET /v1/topics/orders HTTP/1.1 ",
            r#"{"name":"orders","partitions":1,"end_offsets":[1.0e0]}"#.into(),
        ),
        (
            vec!["sub", "list"],
            "GET /v1/subscriptions HTTP/1.1 ",
            r#"{"subscriptions":[{"topic":"orders","name":"s"}]}"#.into(),
        ),
        (
            vec!["sub", "get", "s"],
            "GET /v1/subscriptions/s HTTP/1.1 ",
            r#"{"topic":"orders","name":"s"}"#.into(),
        ),
        (
            vec!["sub", "stats", "s"],
            "GET /v1/subscriptions/s/stats HTTP/1.1 ",
            r#"{"subscription":"s","partitions":[]}"#.into(),
        ),
        (
            vec!["pull", "s", "--max", "2"],
            "POST /v1/subscriptions/s/pull HTTP/1.1 {\"max_events\":2}",
            format!(
                r#"{{"deliveries":[{{"delivery_id":"d","partition":0,"offset":0,"attempt":1,"event":{event}}}]}}"#
            ),
        ),
        (
            vec!["dlq", "list", "--subscription", "s"],
            "GET /v1/deadletters?subscription=s HTTP/1.1 ",
            format!(r#"{{"next_cursor":null, "entries":[{{"id":"x","event":{event}}}]}}"#),
        ),
        (
            vec!["dlq", "show", "x"],
            "GET /v1/deadletters/x HTTP/1.1 ",
            format!(r#"{{"id":"x","event":{event}}}"#),
        ),
        (
            vec!["task", "submit", "--agent", "a", "--input", "[1]"],
            "POST /v1/tasks HTTP/1.1 {\"agent\":\"a\",\"input\":[1]}",
            r#"{"state":"submitted","id":"t","input":[1.0]}"#.into(),
        ),
        (
            vec!["task", "get", "t"],
            "GET /v1/tasks/t HTTP/1.1 ",
            r#"{"state":"submitted","id":"t"}"#.into(),
        ),
        (
            vec!["task", "list", "--agent", "a", "--limit", "1"],
            "GET /v1/tasks?agent=a&limit=1 HTTP/1.1 ",
            r#"{"tasks":[],"next_cursor":"c"}"#.into(),
        ),
        (
            vec!["task", "cancel", "t"],
            "POST /v1/tasks/t/cancel HTTP/1.1 ",
            r#"{"state":"canceled","id":"t"}"#.into(),
        ),
        (
            vec!["session", "list"],
            "GET /v1/sessions HTTP/1.1 ",
            r#"{"sessions":[ ]}"#.into(),
        ),
    ];
    for (mut args, request, answer) in cases {
        let status = if args[1] == "create" || args[1] == "submit" {
            201
        } else {
            200
        };
        let (addr, requests) = stand_in(vec![(status, answer.clone())]).await;
        args.push("--json");
        let run = cli(&addr, &args).await.ok();
        assert_eq!(run.stdout, format!("{answer}\n"), "{args:?}");
        assert_eq!(requests.await.unwrap(), [request], "{args:?}");
    }
}

/// A batch whose outcome is unknown (a 504: meshd could not tell whether it was
/// stored) is sent again as it was, and stderr says so; the answer to the resend is
/// what is printed. A stand-in answers 504 first, then 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_504_when_published_then_the_same_batch_is_sent_again_and_the_retry_is_noted() {
    let placed = json!({"events": [{"duplicate": true, "id": "r1", "offset": 7, "partition": 0}]});
    let (addr, requests) = stand_in(vec![
        (
            504,
            json!({"title": "Gateway Timeout", "status": 504, "detail": "the log did not answer in time"})
                .to_string(),
        ),
        (201, placed.to_string()),
    ])
    .await;
    // Keys out of order and spaced: sent as written.
    let event = r#"{ "type":"t", "specversion":"1.0","id":"r1","source":"cli-test"}"#;
    let run = cli(&addr, &["publish", "orders", event, "--json"])
        .await
        .ok();
    assert!(
        run.stderr.contains(
            "the batch of argument 1 answered 504: the log did not answer in time; sending it again (1 of 5)"
        ),
        "{}",
        run.stderr
    );
    assert_eq!(run.stdout, format!("{placed}\n"));
    let sent = format!("POST /v1/topics/orders/events HTTP/1.1 [{event}]");
    assert_eq!(requests.await.unwrap(), [sent.clone(), sent]);
}
