//! A TCP proxy on loopback that a test can cut and restore, so one process loses its
//! connection to a backend (etcd) while others still reach it. `cut` closes every
//! proxied connection at once and refuses new ones (the peer sees a reset / EOF, like a
//! network partition that the kernel reports); `restore` lets connections through
//! again. `swallow_replies` is the ambiguous outcome: requests still reach the backend
//! (which applies them) but nothing it answers reaches the client, so the caller sees a
//! timeout for a write that happened; `restore` then drops those connections (their
//! byte streams lost data) and lets fresh ones through.
//!
//! `hold` is a blackhole, the partition a network really makes: nothing is closed or
//! refused, bytes in the held direction (requests, replies or both: an asymmetric or a
//! symmetric partition) just stop moving, so the peers see silence and only their own
//! timeouts and keep-alives tell them; new connections are accepted and held too.
//! `restore` lets the held bytes through, in order and complete, as TCP delivers what
//! it retransmits once a partition heals before the connection gives up.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct TcpProxy {
    addr: SocketAddr,
    /// Where new connections go (`set_upstream` changes it for the next ones).
    upstream: Arc<std::sync::Mutex<SocketAddr>>,
    open: Arc<AtomicBool>,
    /// While set, bytes from the upstream are read and dropped.
    swallow: Arc<AtomicBool>,
    /// Which directions are held (`Hold` as bits), see [`TcpProxy::hold`].
    held: watch::Sender<u8>,
    /// Bumped by `cut`: every live connection ends.
    generation: watch::Sender<u64>,
    /// Bytes clients sent through the proxy (what a process sent its backend).
    sent: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    /// Listens on `127.0.0.1:0` and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let open = Arc::new(AtomicBool::new(true));
        let swallow = Arc::new(AtomicBool::new(false));
        let upstream = Arc::new(std::sync::Mutex::new(upstream));
        let target = upstream.clone();
        let (generation, _) = watch::channel(0u64);
        let gen_tx = generation.clone();
        let is_open = open.clone();
        let swallowing = swallow.clone();
        let sent = Arc::new(AtomicU64::new(0));
        let counted = sent.clone();
        let (held, _) = watch::channel(0u8);
        let holds = held.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if !is_open.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let mut cut = gen_tx.subscribe();
                cut.borrow_and_update();
                let swallowing = swallowing.clone();
                let counted = counted.clone();
                let to = *target.lock().unwrap_or_else(|e| e.into_inner());
                let (mut up_hold, mut down_hold) = (holds.subscribe(), holds.subscribe());
                tokio::spawn(async move {
                    // A connection opened during a hold of requests waits in silence
                    // (its SYN got nowhere) until the hold ends.
                    if !wait_unheld(&mut up_hold, Hold::Requests).await {
                        return;
                    }
                    let Ok(server) = TcpStream::connect(to).await else {
                        return;
                    };
                    let (mut client_rx, mut client_tx) = client.into_split();
                    let (mut server_rx, mut server_tx) = server.into_split();
                    let up = async {
                        // While requests are held they are still read (and counted:
                        // `bytes_sent` shows what a held process tried to send) and
                        // wait here, in order, until the hold ends.
                        let mut buf = vec![0u8; 16 * 1024];
                        let mut waiting: Vec<u8> = Vec::new();
                        let mut open = true;
                        loop {
                            let held = *up_hold.borrow_and_update() & Hold::Requests as u8 != 0;
                            if !held && !waiting.is_empty() {
                                server_tx.write_all(&waiting).await?;
                                waiting.clear();
                            }
                            if !open {
                                if waiting.is_empty() {
                                    return Ok::<(), std::io::Error>(());
                                }
                                if up_hold.changed().await.is_err() {
                                    return Ok(());
                                }
                                continue;
                            }
                            tokio::select! {
                                r = client_rx.read(&mut buf) => {
                                    let n = r?;
                                    if n == 0 {
                                        open = false;
                                        continue;
                                    }
                                    counted.fetch_add(n as u64, Ordering::Relaxed);
                                    if held {
                                        waiting.extend_from_slice(&buf[..n]);
                                    } else {
                                        server_tx.write_all(&buf[..n]).await?;
                                    }
                                }
                                c = up_hold.changed() => {
                                    if c.is_err() {
                                        return Ok(());
                                    }
                                }
                            }
                        }
                    };
                    let down = async {
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = server_rx.read(&mut buf).await?;
                            if n == 0 {
                                return Ok::<(), std::io::Error>(());
                            }
                            if !wait_unheld(&mut down_hold, Hold::Replies).await {
                                return Ok(());
                            }
                            if !swallowing.load(Ordering::SeqCst) {
                                client_tx.write_all(&buf[..n]).await?;
                            }
                        }
                    };
                    tokio::select! {
                        _ = up => {}
                        _ = down => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Ok(Self {
            addr,
            upstream,
            open,
            swallow,
            held,
            generation,
            sent,
            task,
        })
    }

    /// A blackhole in `direction`: bytes that way stop moving (requests wait in the
    /// proxy, still counted by [`bytes_sent`](Self::bytes_sent); replies in the
    /// sockets' buffers, then back-pressure the sender), connections stay open
    /// and new ones are accepted; nothing is closed or refused. `Hold::Both` is a
    /// symmetric partition, `Requests` or `Replies` an asymmetric one.
    /// [`restore`](Self::restore) lets everything held through, in order.
    pub fn hold(&self, direction: Hold) {
        self.held.send_modify(|h| *h |= direction as u8);
    }

    /// Bytes clients have sent through the proxy so far.
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    /// The address clients connect to (`host:port`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends the connections accepted from now on to `upstream` (for a process that
    /// must be told the proxy's address before its own is known).
    pub fn set_upstream(&self, upstream: SocketAddr) {
        *self.upstream.lock().unwrap_or_else(|e| e.into_inner()) = upstream;
    }

    /// Closes every proxied connection and refuses new ones.
    pub fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Requests still reach the upstream, its answers are dropped: every call made
    /// now times out on the caller's side whether or not it was applied.
    pub fn swallow_replies(&self) {
        self.swallow.store(true, Ordering::SeqCst);
    }

    /// Lets connections through again. After `swallow_replies` the connections that
    /// lost answers are closed first (their streams are out of step), as a network
    /// that comes back after dropping packets resets them.
    pub fn restore(&self) {
        self.held.send_modify(|h| *h = 0);
        if self.swallow.swap(false, Ordering::SeqCst) {
            self.generation.send_modify(|g| *g += 1);
        }
        self.open.store(true, Ordering::SeqCst);
    }
}

/// The direction(s) [`TcpProxy::hold`] stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Hold {
    /// Client to upstream.
    Requests = 1,
    /// Upstream to client.
    Replies = 2,
    Both = 3,
}

/// Waits while `direction` is held; `false` when the proxy is gone.
async fn wait_unheld(held: &mut watch::Receiver<u8>, direction: Hold) -> bool {
    held.wait_for(|h| h & direction as u8 == 0).await.is_ok()
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.cut();
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn echo_server() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn roundtrip(s: &mut TcpStream) -> bool {
        if s.write_all(b"ping").await.is_err() {
            return false;
        }
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await.is_ok() && &buf == b"ping"
    }

    #[tokio::test]
    async fn a_cut_ends_live_connections_and_refuses_new_ones_until_restored() {
        let proxy = TcpProxy::start(echo_server().await).await.unwrap();
        let mut live = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(roundtrip(&mut live).await, "traffic passes");
        proxy.cut();
        assert!(!roundtrip(&mut live).await, "the live connection is closed");
        let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(!roundtrip(&mut fresh).await, "new connections are refused");
        proxy.restore();
        let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(roundtrip(&mut again).await, "traffic passes again");
    }

    #[tokio::test]
    async fn a_hold_keeps_connections_open_and_silent_then_delivers_everything_held() {
        let (upstream, mut received) = recording_server().await;
        let proxy = TcpProxy::start(upstream).await.unwrap();
        let mut live = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(roundtrip(&mut live).await, "traffic passes");
        assert_eq!(received.recv().await.unwrap(), b"ping");
        let quiet = std::time::Duration::from_millis(300);

        // Both ways: nothing arrives, nothing is closed, new connections hang.
        proxy.hold(Hold::Both);
        live.write_all(b"held").await.unwrap();
        let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
        fresh.write_all(b"fresh").await.unwrap();
        assert!(
            tokio::time::timeout(quiet, received.recv()).await.is_err(),
            "nothing reaches the upstream during a hold"
        );
        let mut buf = [0u8; 4];
        assert!(
            tokio::time::timeout(quiet, live.read(&mut buf))
                .await
                .is_err(),
            "no answer and no close during a hold"
        );
        proxy.restore();
        live.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"held", "what was held arrives once restored");
        let mut got = Vec::new();
        while got.len() < 9 {
            got.extend(received.recv().await.unwrap());
        }
        got.sort_unstable();
        let mut want = b"heldfresh".to_vec();
        want.sort_unstable();
        assert_eq!(got, want, "both connections' held requests arrive");

        // Replies only (asymmetric): requests are applied, answers wait.
        proxy.hold(Hold::Replies);
        live.write_all(b"asym").await.unwrap();
        assert_eq!(received.recv().await.unwrap(), b"asym", "requests pass");
        assert!(
            tokio::time::timeout(quiet, live.read(&mut buf))
                .await
                .is_err(),
            "the answer is held"
        );
        proxy.restore();
        live.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"asym");

        // Requests only: nothing reaches the upstream until restored.
        proxy.hold(Hold::Requests);
        let before = proxy.bytes_sent();
        live.write_all(b"late").await.unwrap();
        assert!(tokio::time::timeout(quiet, received.recv()).await.is_err());
        assert_eq!(
            proxy.bytes_sent() - before,
            4,
            "held requests are counted as sent"
        );
        proxy.restore();
        assert_eq!(received.recv().await.unwrap(), b"late");
        live.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"late");
    }

    /// An upstream that records what it received.
    async fn recording_server() -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 {
                            return;
                        }
                        let _ = tx.send(buf[..n].to_vec());
                        if s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, rx)
    }

    #[tokio::test]
    async fn swallowing_replies_delivers_requests_but_no_answer_until_restored() {
        let (upstream, mut received) = recording_server().await;
        let proxy = TcpProxy::start(upstream).await.unwrap();
        let mut live = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(roundtrip(&mut live).await, "traffic passes");
        assert_eq!(received.recv().await.unwrap(), b"ping");

        proxy.swallow_replies();
        live.write_all(b"applied").await.unwrap();
        assert_eq!(
            received.recv().await.unwrap(),
            b"applied",
            "the request reached the upstream"
        );
        let mut buf = [0u8; 7];
        let answer =
            tokio::time::timeout(std::time::Duration::from_millis(300), live.read(&mut buf)).await;
        assert!(answer.is_err(), "no answer reaches the caller: {answer:?}");

        proxy.restore();
        let mut after = [0u8; 7];
        let old = live.read(&mut after).await;
        assert!(
            matches!(old, Ok(0) | Err(_)),
            "the connection that lost answers is closed: {old:?}"
        );
        let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(roundtrip(&mut fresh).await, "fresh connections work");
    }
}
