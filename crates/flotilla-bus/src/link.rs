//! What one NATS connection has seen: which server it is on, whether it connected again, and
//! what the server refused it.
//!
//! The server reports a permissions violation asynchronously (`-ERR 'Permissions Violation
//! for Publish to "…"'`, or `… for Subscription to "…"`): async-nats hands it to the
//! connection's event callback as a server error, and the refused request itself only times
//! out. A [`Link`] keeps the connection's recent refusals (the last [`KEPT_REFUSALS`]) and
//! announces each new one, so an operation on a refused subject is answered
//! `permission_denied` — at once, not after its timeout — naming the subject and the user
//! ([`Bus::refusable`](crate::Bus::refusable)).
//!
//! ```text
//!  connect ──► connected ──(link silent: 3 pings due, 2 unanswered)──► disconnected
//!                  ▲                                                        │
//!                  └──────── reconnected (another server first) ◄───────────┘
//! ```

use std::collections::VecDeque;
use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use async_nats::{Event, ServerAddr, ServerError};
use tokio::sync::broadcast;
use tracing::{debug, info, warn};

use crate::options::{NatsAuth, NatsOptions};

/// How many refusals a connection remembers (the newest).
pub const KEPT_REFUSALS: usize = 32;

/// The prefix of the reply subjects async-nats subscribes to for requests: a refused
/// subscription there leaves every request on the connection unanswered.
const INBOX_PREFIX: &str = "_INBOX.";

/// What the server refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusedOp {
    /// Publishing (a message, a request, a JetStream API call) to the subject.
    Publish,
    /// Subscribing to the subject.
    Subscribe,
    /// Publishing a reply to the subject.
    Reply,
}

impl RefusedOp {
    fn verb(self) -> &'static str {
        match self {
            Self::Publish => "publish to",
            Self::Subscribe => "subscribe to",
            Self::Reply => "publish a reply to",
        }
    }
}

/// A permissions violation the server reported on a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// What was refused.
    pub op: RefusedOp,
    /// The subject, as the server names it.
    pub subject: String,
    /// Who the connection authenticates as, as [`Link::user`] says it.
    pub user: String,
    /// When it was reported.
    pub at: Instant,
}

impl Refusal {
    /// Reads the server's error text (`Permissions Violation for Publish to "x.y"`); `None`
    /// for any other error.
    pub fn parse(text: &str, user: &str) -> Option<Self> {
        const HEAD: &str = "permissions violation for ";
        let lower = text.to_ascii_lowercase();
        let start = lower.find(HEAD)? + HEAD.len();
        let rest = &lower[start..];
        let op = if rest.starts_with("publish with reply") {
            RefusedOp::Reply
        } else if rest.starts_with("publish") {
            RefusedOp::Publish
        } else if rest.starts_with("subscription") {
            RefusedOp::Subscribe
        } else {
            return None;
        };
        // The subject is the first quoted string (`%q` in the server); the text keeps its
        // case in `text`, at the same byte offsets (ASCII lowering keeps lengths).
        let open = start + text[start..].find('"')? + 1;
        let close = open + text[open..].find('"')?;
        Some(Self {
            op,
            subject: text[open..close].to_owned(),
            user: user.to_owned(),
            at: Instant::now(),
        })
    }

    /// Whether this refusal explains an unanswered request whose subject `is_ours` accepts:
    /// the request itself was refused, or the subscription its reply would arrive on.
    pub fn concerns(&self, is_ours: impl Fn(&str) -> bool) -> bool {
        match self.op {
            RefusedOp::Publish => is_ours(&self.subject),
            RefusedOp::Subscribe => self.subject.starts_with(INBOX_PREFIX),
            RefusedOp::Reply => false,
        }
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NATS refused {} permission to {} \"{}\"",
            self.user,
            self.op.verb(),
            self.subject
        )
    }
}

impl std::error::Error for Refusal {}

/// The state of one connection, shared by its event callback, its server selection and the
/// [`Bus`](crate::Bus) that asks about refusals.
#[derive(Debug)]
pub struct Link {
    user: String,
    /// The server connected to last (host and port only: a URL may carry credentials).
    server: Mutex<Option<String>>,
    /// The pool entry dialled last, as async-nats names it: the next one is chosen against
    /// it, and it is the server once the connection is made.
    dialled: Mutex<Option<ServerAddr>>,
    /// Set once the first connection is made: from then on the client reconnects.
    started: AtomicBool,
    connects: AtomicU64,
    reconnected: AtomicBool,
    disconnected_at: Mutex<Option<Instant>>,
    refusals: Mutex<VecDeque<Refusal>>,
    refused: broadcast::Sender<Refusal>,
}

/// How the user of `opts` is named in messages (`user "worker-default"`). Secrets never.
fn describe_user(opts: &NatsOptions) -> String {
    match &opts.auth {
        NatsAuth::None => "this unauthenticated connection".to_owned(),
        NatsAuth::Token { .. } => "the token user".to_owned(),
        NatsAuth::UserPassword { user, .. } => format!("user \"{user}\""),
        NatsAuth::Nkey { .. } => "the NKey user".to_owned(),
        NatsAuth::CredsFile { path } => format!("the user of {}", path.display()),
    }
}

/// `host:port` of a server address, without the credentials a URL may carry.
pub(crate) fn show(addr: &ServerAddr) -> String {
    format!("{}:{}", addr.host(), addr.port())
}

/// Locks `m`, taking the data of a poisoned lock as it is (nothing here leaves it half
/// written).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Link {
    /// The state of a new connection made with `opts`.
    pub fn new(opts: &NatsOptions) -> Self {
        Self {
            user: describe_user(opts),
            server: Mutex::new(None),
            dialled: Mutex::new(None),
            started: AtomicBool::new(false),
            connects: AtomicU64::new(0),
            reconnected: AtomicBool::new(false),
            disconnected_at: Mutex::new(None),
            refusals: Mutex::new(VecDeque::with_capacity(KEPT_REFUSALS)),
            refused: broadcast::channel(KEPT_REFUSALS).0,
        }
    }

    /// Who the connection authenticates as (`user "worker-default"`), for messages.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// The server the connection is on, or was on last (`host:port`).
    pub fn server(&self) -> Option<String> {
        lock(&self.server).clone()
    }

    /// Whether the client connected again since the last call: what it caches of the
    /// server's info is then out of date.
    pub(crate) fn take_reconnected(&self) -> bool {
        self.reconnected.swap(false, Ordering::AcqRel)
    }

    /// The first connection was made to `addr` (a URL of the pool).
    pub(crate) fn started_on(&self, addr: Option<ServerAddr>) {
        if let Some(addr) = &addr {
            *lock(&self.server) = Some(show(addr));
        }
        *lock(&self.dialled) = addr;
        self.started.store(true, Ordering::Release);
    }

    /// The server to try next, after a connection was lost or an attempt failed: the one
    /// with the fewest failed attempts, and of those not the one just dialled — a server
    /// whose link went silent has no failed attempt yet, and dialling it again would wait
    /// out `connect-timeout` first. Ties are broken at random, so clients spread over the
    /// cluster. `None` before the first connection: async-nats then tries every URL in turn.
    pub(crate) fn next_server(&self, pool: &[async_nats::Server]) -> Option<ServerAddr> {
        if !self.started.load(Ordering::Acquire) {
            return None;
        }
        let mut dialled = lock(&self.dialled);
        let rank = |s: &async_nats::Server| {
            (
                s.failed_attempts,
                dialled.as_ref().is_some_and(|d| *d == s.addr),
            )
        };
        let best = pool.iter().map(rank).min()?;
        let candidates: Vec<&async_nats::Server> =
            pool.iter().filter(|s| rank(s) == best).collect();
        let pick = (uuid::Uuid::new_v4().as_u128() % candidates.len() as u128) as usize;
        let chosen = candidates.get(pick)?.addr.clone();
        *dialled = Some(chosen.clone());
        Some(chosen)
    }

    /// Follows one connection event: logs losing and regaining the server (with its
    /// address) and records refusals.
    pub(crate) fn on_event(&self, event: Event) {
        match event {
            Event::Connected => {
                // The first connection is logged by `connect`, which knows its server.
                if self.connects.fetch_add(1, Ordering::AcqRel) > 0 {
                    if let Some(addr) = lock(&self.dialled).as_ref() {
                        *lock(&self.server) = Some(show(addr));
                    }
                    self.reconnected.store(true, Ordering::Release);
                    let down = lock(&self.disconnected_at).take().map(|t| t.elapsed());
                    info!(
                        server = self.server().as_deref().unwrap_or("?"),
                        disconnected_for = ?down,
                        "Reconnected to NATS"
                    );
                }
            }
            Event::Disconnected => {
                *lock(&self.disconnected_at) = Some(Instant::now());
                warn!(
                    server = self.server().as_deref().unwrap_or("?"),
                    "Lost the connection to NATS (closed, or silent for three pings); reconnecting, another server first"
                );
            }
            Event::ServerError(ServerError::Other(text)) => match Refusal::parse(&text, &self.user)
            {
                Some(refusal) => self.record(refusal),
                None => warn!(error = %text, "NATS server reported an error"),
            },
            Event::ServerError(ServerError::AuthorizationViolation) => {
                warn!(user = %self.user, "NATS server reported an authorization violation");
            }
            Event::LameDuckMode => {
                info!(
                    server = self.server().as_deref().unwrap_or("?"),
                    "NATS server is shutting down (lame duck mode); the client will move to another"
                );
            }
            other => debug!(event = %other, "NATS connection event"),
        }
    }

    /// Keeps `refusal` (the newest [`KEPT_REFUSALS`]) and announces it. Logged at info: the
    /// operation it refused reports it as its error (`permission_denied`), so a command's one
    /// error line is not preceded by a warning saying the same.
    pub(crate) fn record(&self, refusal: Refusal) {
        info!(
            user = %self.user,
            subject = %refusal.subject,
            op = refusal.op.verb(),
            "NATS refused an operation: permissions violation"
        );
        {
            let mut kept = lock(&self.refusals);
            if kept.len() == KEPT_REFUSALS {
                kept.pop_front();
            }
            kept.push_back(refusal.clone());
        }
        // Nobody waiting is fine: the refusal is kept.
        let _ = self.refused.send(refusal);
    }

    /// The newest refusal reported at or after `since` that `is_ours` accepts (see
    /// [`Refusal::concerns`]).
    pub fn refused_since(&self, since: Instant, is_ours: impl Fn(&str) -> bool) -> Option<Refusal> {
        lock(&self.refusals)
            .iter()
            .rev()
            .take_while(|r| r.at >= since)
            .find(|r| r.concerns(&is_ours))
            .cloned()
    }

    /// Refusals as they are reported from now on.
    pub(crate) fn watch(&self) -> broadcast::Receiver<Refusal> {
        self.refused.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_servers_violation_texts_are_read() {
        let r = Refusal::parse(
            "Permissions Violation for Publish to \"flotilla.api.approval.answer\"",
            "user \"w\"",
        )
        .expect("a publish refusal");
        assert_eq!(r.op, RefusedOp::Publish);
        assert_eq!(r.subject, "flotilla.api.approval.answer");
        assert_eq!(
            r.to_string(),
            "NATS refused user \"w\" permission to publish to \"flotilla.api.approval.answer\""
        );
        let s = Refusal::parse(
            "Permissions Violation for Subscription to \"_INBOX.Ab9.*\" using queue \"q\"",
            "u",
        )
        .expect("a subscription refusal");
        assert_eq!(
            (s.op, s.subject.as_str()),
            (RefusedOp::Subscribe, "_INBOX.Ab9.*")
        );
        let reply = Refusal::parse(
            "Permissions Violation for Publish with Reply of \"r.1\"",
            "u",
        )
        .expect("a reply refusal");
        assert_eq!(reply.op, RefusedOp::Reply);
        assert!(Refusal::parse("Maximum Payload Violation", "u").is_none());
        assert!(Refusal::parse("Permissions Violation for Publish", "u").is_none());
    }

    #[test]
    fn a_refusal_concerns_its_subject_or_the_reply_inbox() {
        let publish =
            Refusal::parse("Permissions Violation for Publish to \"a.b\"", "u").expect("parsed");
        assert!(publish.concerns(|s| s == "a.b"));
        assert!(!publish.concerns(|s| s == "a.c"));
        let inbox = Refusal::parse(
            "Permissions Violation for Subscription to \"_INBOX.x.*\"",
            "u",
        )
        .expect("parsed");
        assert!(inbox.concerns(|_| false), "no reply can arrive");
        let other = Refusal::parse("Permissions Violation for Subscription to \"a.>\"", "u")
            .expect("parsed");
        assert!(!other.concerns(|_| true));
    }

    #[test]
    fn refusals_are_kept_newest_first_and_bounded() {
        let link = Link::new(&NatsOptions::default());
        let since = Instant::now();
        for i in 0..KEPT_REFUSALS + 5 {
            let text = format!("Permissions Violation for Publish to \"s.{i}\"");
            link.record(Refusal::parse(&text, link.user()).expect("parsed"));
        }
        assert_eq!(lock(&link.refusals).len(), KEPT_REFUSALS);
        assert!(
            link.refused_since(since, |s| s == "s.0").is_none(),
            "dropped"
        );
        let last = format!("s.{}", KEPT_REFUSALS + 4);
        assert!(link.refused_since(since, |s| s == last).is_some());
        assert!(
            link.refused_since(Instant::now(), |s| s == last).is_none(),
            "only refusals since the operation started count"
        );
    }

    #[test]
    fn the_next_server_is_not_the_one_just_lost() {
        let link = Link::new(&NatsOptions::default());
        let addr =
            |p: u16| -> ServerAddr { format!("nats://127.0.0.1:{p}").parse().expect("an address") };
        let pool: Vec<async_nats::Server> = Vec::new();
        assert!(link.next_server(&pool).is_none(), "empty pool");
        link.started_on(Some(addr(1)));
        assert_eq!(link.server().as_deref(), Some("127.0.0.1:1"));
        // Choosing the next server does not change the one the connection was on (a
        // disconnect is logged with the server lost) until the new one connects.
        link.on_event(Event::Connected);
        let next = link.next_server(&[pool_entry(addr(2))]);
        assert_eq!(next, Some(addr(2)));
        assert_eq!(link.server().as_deref(), Some("127.0.0.1:1"));
        link.on_event(Event::Disconnected);
        link.on_event(Event::Connected);
        assert_eq!(link.server().as_deref(), Some("127.0.0.1:2"));
        assert!(link.take_reconnected());
        // The pool as async-nats keeps it after a silent link: nothing failed yet, the lost
        // server included.
        let mut pool: Vec<async_nats::Server> = [1, 2, 3].map(|p| pool_entry(addr(p))).to_vec();
        for _ in 0..20 {
            link.started_on(Some(addr(1)));
            let next = link.next_server(&pool).expect("a server");
            assert_ne!(next, addr(1), "the silent server is not dialled first");
        }
        // Once the others failed, it is tried again.
        link.started_on(Some(addr(1)));
        pool[1].failed_attempts = 1;
        pool[2].failed_attempts = 2;
        assert_eq!(link.next_server(&pool), Some(addr(1)));
        // It failed too: the fewest failures first, of those not the one just dialled.
        pool[0].failed_attempts = 1;
        assert_eq!(link.next_server(&pool), Some(addr(2)));
    }

    /// A pool entry as the client lists it (async-nats builds them; its fields are public).
    fn pool_entry(addr: ServerAddr) -> async_nats::Server {
        async_nats::Server {
            addr,
            failed_attempts: 0,
            did_connect: true,
            is_discovered: false,
            last_error: None,
        }
    }
}
