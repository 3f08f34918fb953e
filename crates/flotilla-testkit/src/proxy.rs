//! A TCP proxy the test controls, for links that go silent rather than die.
//!
//! A killed server closes its sockets, and clients notice at once. A network partition does
//! not: packets are dropped, no socket is closed, and a client learns of it only by asking
//! and hearing nothing. [`TcpProxy`] forwards between a loopback port and a target (a
//! nats-server); [`blackhole`](TcpProxy::blackhole) stops forwarding in both directions
//! without closing either socket — what a client sees when packets to its server are
//! dropped — and [`heal`](TcpProxy::heal) resumes. Connections made while blackholed are
//! accepted and forwarded nothing until healed, as a handshake would hang on a cut link.
//!
//! ```no_run
//! # async fn t() -> Result<(), Box<dyn std::error::Error>> {
//! let server = flotilla_testkit::NatsServer::start().await?;
//! let proxy = flotilla_testkit::proxy::TcpProxy::start(&server.url()).await?;
//! // Connect through `proxy.url()`, then cut the link:
//! proxy.blackhole();
//! # Ok(()) }
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Whether bytes flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Open,
    Blackholed,
    /// The proxy was dropped: every connection ends.
    Closed,
}

/// A loopback TCP proxy to one target; stops (closing every connection) on drop.
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    target: SocketAddr,
    flow: watch::Sender<Flow>,
    live: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
}

/// Reads `host:port` out of a URL such as `nats://127.0.0.1:4222`.
fn socket_addr(url: &str) -> std::io::Result<SocketAddr> {
    let hostport = url.rsplit("://").next().unwrap_or(url);
    let hostport = hostport.rsplit('@').next().unwrap_or(hostport);
    hostport
        .trim_end_matches('/')
        .parse()
        .map_err(|e| std::io::Error::other(format!("{url} is not a loopback address: {e}")))
}

impl TcpProxy {
    /// Starts a proxy on a free loopback port forwarding to `target` (`nats://host:port`
    /// or `host:port`, an IP address).
    pub async fn start(target: &str) -> std::io::Result<Self> {
        let target = socket_addr(target)?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (flow, _) = watch::channel(Flow::Open);
        let live = Arc::new(AtomicUsize::new(0));
        let accepted = Arc::new(AtomicUsize::new(0));
        tokio::spawn(accept(
            listener,
            target,
            flow.subscribe(),
            Arc::clone(&live),
            Arc::clone(&accepted),
        ));
        Ok(Self {
            addr,
            target,
            flow,
            live,
            accepted,
        })
    }

    /// The URL to give clients (`nats://127.0.0.1:<port>`).
    pub fn url(&self) -> String {
        format!("nats://{}", self.addr)
    }

    /// The proxy's own address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where it forwards to.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// Stops forwarding bytes, both ways, on every connection (and on those accepted from
    /// now on), closing nothing.
    pub fn blackhole(&self) {
        self.flow.send_replace(Flow::Blackholed);
    }

    /// Forwards again; what was read before the blackhole and held is delivered now, as TCP
    /// retransmits after a partition heals.
    pub fn heal(&self) {
        self.flow.send_replace(Flow::Open);
    }

    /// Connections open through the proxy now (a client's socket that the proxy has not yet
    /// seen closed counts: while blackholed, closes are not read).
    pub fn connections(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }

    /// Connections accepted since the start.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Acquire)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.flow.send_replace(Flow::Closed);
    }
}

/// Waits until bytes may flow; `false` once the proxy is gone.
async fn open(flow: &mut watch::Receiver<Flow>) -> bool {
    match flow.wait_for(|f| *f != Flow::Blackholed).await {
        Ok(f) => *f == Flow::Open,
        Err(_) => false,
    }
}

async fn accept(
    listener: TcpListener,
    target: SocketAddr,
    mut flow: watch::Receiver<Flow>,
    live: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
) {
    loop {
        let client = tokio::select! {
            c = listener.accept() => c,
            _ = flow.wait_for(|f| *f == Flow::Closed) => return,
        };
        let Ok((client, _)) = client else {
            continue;
        };
        accepted.fetch_add(1, Ordering::AcqRel);
        live.fetch_add(1, Ordering::AcqRel);
        let flow = flow.clone();
        let live = Arc::clone(&live);
        tokio::spawn(async move {
            connection(client, target, flow).await;
            live.fetch_sub(1, Ordering::AcqRel);
        });
    }
}

/// One client connection: the upstream is dialled once bytes may flow, then both directions
/// are pumped until either side closes or the proxy goes.
async fn connection(client: TcpStream, target: SocketAddr, mut flow: watch::Receiver<Flow>) {
    if !open(&mut flow).await {
        return;
    }
    let Ok(upstream) = TcpStream::connect(target).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    // Either direction ending (a close, an error, the proxy dropped) ends the connection:
    // dropping the halves closes both sockets.
    tokio::select! {
        _ = pump(client_read, upstream_write, flow.clone()) => {}
        _ = pump(upstream_read, client_write, flow) => {}
    }
}

/// Copies `from` to `to` while the flow is open. Bytes read just before a blackhole are
/// held, not written, until it heals.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut flow: watch::Receiver<Flow>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if !open(&mut flow).await {
            return;
        }
        let n = tokio::select! {
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            // Blackholed (or gone) while waiting to read: stop reading.
            _ = flow.wait_for(|f| *f != Flow::Open) => continue,
        };
        if !open(&mut flow).await {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_read_from_urls() {
        let want: SocketAddr = "127.0.0.1:4222".parse().expect("an address");
        for url in [
            "nats://127.0.0.1:4222",
            "127.0.0.1:4222",
            "nats://u:p@127.0.0.1:4222",
        ] {
            assert_eq!(socket_addr(url).expect(url), want);
        }
        assert!(socket_addr("nats://localhost:4222").is_err());
    }
}
