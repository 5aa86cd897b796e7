//! A TCP proxy on loopback that a test can cut and restore, so one process loses its
//! connection to a backend (etcd) while others still reach it. `cut` closes every
//! proxied connection at once and refuses new ones (the peer sees a reset / EOF, like a
//! network partition that the kernel reports); `restore` lets connections through
//! again. `swallow_replies` is the ambiguous outcome: requests still reach the backend
//! (which applies them) but nothing it answers reaches the client, so the caller sees a
//! timeout for a write that happened; `restore` then drops those connections (their
//! byte streams lost data) and lets fresh ones through.

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
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(to).await else {
                        return;
                    };
                    let (mut client_rx, mut client_tx) = client.into_split();
                    let (mut server_rx, mut server_tx) = server.into_split();
                    let up = async {
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = client_rx.read(&mut buf).await?;
                            if n == 0 {
                                return Ok::<(), std::io::Error>(());
                            }
                            counted.fetch_add(n as u64, Ordering::Relaxed);
                            server_tx.write_all(&buf[..n]).await?;
                        }
                    };
                    let down = async {
                        let mut buf = vec![0u8; 16 * 1024];
                        loop {
                            let n = server_rx.read(&mut buf).await?;
                            if n == 0 {
                                return Ok::<(), std::io::Error>(());
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
            generation,
            sent,
            task,
        })
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
        if self.swallow.swap(false, Ordering::SeqCst) {
            self.generation.send_modify(|g| *g += 1);
        }
        self.open.store(true, Ordering::SeqCst);
    }
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
