//! A TCP proxy on loopback that a test can cut and restore, so one process loses its
//! connection to a backend (etcd) while others still reach it. `cut` closes every
//! proxied connection at once and refuses new ones (the peer sees a reset / EOF, like a
//! network partition that the kernel reports); `restore` lets connections through
//! again.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct TcpProxy {
    addr: SocketAddr,
    open: Arc<AtomicBool>,
    /// Bumped by `cut`: every live connection ends.
    generation: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    /// Listens on `127.0.0.1:0` and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let open = Arc::new(AtomicBool::new(true));
        let (generation, _) = watch::channel(0u64);
        let gen_tx = generation.clone();
        let is_open = open.clone();
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
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (mut client, mut server) = (client, server);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Ok(Self {
            addr,
            open,
            generation,
            task,
        })
    }

    /// The address clients connect to (`host:port`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every proxied connection and refuses new ones.
    pub fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    /// Lets connections through again.
    pub fn restore(&self) {
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
}
