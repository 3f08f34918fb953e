//! `flotilla example [NAME]`: the example plans of `config/examples/`, each on the config it
//! names, with one command.
//!
//! The index, `config/examples/examples.toml` (`--examples DIR` points elsewhere), names per
//! example its plan, its config, what it shows, optionally a file of scripted model replies
//! (`model`), whether its run waits for a person (`waits`) and whether the plan is refused on
//! purpose (`rejected`). Paths in it are relative to its directory.
//!
//! Without a name the examples are listed. With one, the example runs as
//! `flotilla --config CONFIG up --workers 2 --data-dir <temporary> --submit PLAN`, a child
//! process of this executable, and its exit status is the run's (0 succeeded, 1 failed or
//! rejected). Every `kind = "llm"` agent of the config is pointed at the model through the
//! ordinary override variables (`FLOTILLA_AGENTS__<NAME>__BASE_URL`, `__MODEL`,
//! `__API_KEY_ENV`): by default at a **scripted OpenAI-compatible test double**
//! ([`flotilla_testkit::openai::OpenAiServer`]) started in this process and loaded with the
//! example's replies — fixed answers, not a model —; with `--model-url` at a real one.
//!
//! A run that waits for a person says so with the command that answers it; with `--approve`
//! this command approves every approval of the run (as `example`) once it is asked, through
//! the embedded NATS server whose URL `up` leaves in `<data-dir>/nats-url`.
//!
//! A model file is a script of the test double's replies, read by
//! [`flotilla_testkit::openai::read_script`] (its format is described there), the loader the
//! tests of the same examples use.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use figment::Figment;
use figment::providers::{Format, Toml};
use flotilla_bus::Bus;
use flotilla_client::Client;
use flotilla_model::approval::{
    AnswerOutcome, ApprovalAnswerReply, ApprovalAnswerRequest, Decision,
};
use flotilla_testkit::openai::OpenAiServer;
use flotilla_worker::AgentDefinition;
use serde::{Deserialize, Serialize};

/// Where the index is, relative to the current directory, unless `--examples` says.
const DEFAULT_DIR: &str = "config/examples";
/// The index's file name inside that directory.
const INDEX: &str = "examples.toml";
/// Who `--approve` answers as.
const APPROVER: &str = "example";
/// How often `--approve` looks for approvals the run waits for.
const APPROVE_POLL: Duration = Duration::from_millis(200);

/// `flotilla example`.
#[derive(Debug, clap::Args)]
pub(crate) struct ExampleArgs {
    /// The example to run; without one, the examples are listed.
    name: Option<String>,
    /// The directory of the examples index, examples.toml.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_DIR)]
    examples: PathBuf,
    /// A real OpenAI-compatible server for the example's LLM agents (base URL with /v1,
    /// e.g. http://127.0.0.1:8080/v1) instead of the scripted test double.
    #[arg(long, value_name = "URL")]
    model_url: Option<String>,
    /// The model to ask at --model-url (default: the one each agent's config names).
    #[arg(long, value_name = "MODEL", requires = "model_url")]
    model: Option<String>,
    /// The environment variable holding --model-url's API key (read by the workers).
    #[arg(long, value_name = "VAR", requires = "model_url")]
    api_key_env: Option<String>,
    /// Approve what the run waits for (as `example`) once it is asked.
    #[arg(long)]
    approve: bool,
    /// With no NAME: the list as JSON.
    #[arg(long, conflicts_with = "name")]
    json: bool,
}

/// `examples.toml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Index {
    #[serde(rename = "example", default)]
    examples: Vec<Example>,
}

/// One example of the index.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct Example {
    /// What `flotilla example NAME` calls it.
    name: String,
    /// The plan (relative to the index's directory).
    plan: PathBuf,
    /// The config it runs on (relative to the index's directory).
    config: PathBuf,
    /// What it shows, in a line.
    shows: String,
    /// Scripted replies of the test double for its LLM agents (relative to the index's
    /// directory); none: the config has no LLM agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model: Option<PathBuf>,
    /// Its run waits for a person's approval.
    #[serde(default)]
    waits: bool,
    /// Its plan is refused on purpose: running it shows the problems and exits 1.
    #[serde(default)]
    rejected: bool,
}

/// `flotilla example [NAME]`. `config` and `nats_url` are the global flags, which this
/// command does not take: an example runs on its own config and an embedded server.
pub(crate) async fn example(
    args: ExampleArgs,
    config: Option<&Path>,
    nats_url: Option<&str>,
) -> anyhow::Result<ExitCode> {
    if config.is_some() || nats_url.is_some() {
        anyhow::bail!(
            "flotilla example runs each example on the config its index names and an embedded NATS server: drop --config and --nats-url"
        );
    }
    let dir = args.examples.clone();
    let examples = read_index(&dir)?;
    let Some(name) = args.name.clone() else {
        list(&dir, &examples, args.json)?;
        return Ok(ExitCode::SUCCESS);
    };
    let Some(example) = examples.iter().find(|e| e.name == name) else {
        let known: Vec<&str> = examples.iter().map(|e| e.name.as_str()).collect();
        anyhow::bail!(
            "unknown example {name:?}; the examples are: {}",
            known.join(", ")
        );
    };
    run(&dir, example, &args).await
}

/// Reads and checks the index in `dir`.
fn read_index(dir: &Path) -> anyhow::Result<Vec<Example>> {
    let path = dir.join(INDEX);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => anyhow::bail!(
            "no examples index at {}: run this in the Flotilla repository's root, or pass --examples DIR",
            path.display()
        ),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let index: Index = Figment::from(Toml::string(&text))
        .extract()
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let mut seen = BTreeSet::new();
    for e in &index.examples {
        if e.name.is_empty() || !seen.insert(e.name.as_str()) {
            anyhow::bail!(
                "{}: example names must be unique and not empty ({:?})",
                path.display(),
                e.name
            );
        }
    }
    if index.examples.is_empty() {
        anyhow::bail!("{} names no example ([[example]] tables)", path.display());
    }
    Ok(index.examples)
}

/// A path of the index, as seen from the current directory (`..` resolved in the text).
fn resolve(dir: &Path, path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in dir.join(path).components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir
                if matches!(out.components().next_back(), Some(Component::Normal(_))) =>
            {
                out.pop();
            }
            c => out.push(c),
        }
    }
    out
}

fn list(dir: &Path, examples: &[Example], json: bool) -> anyhow::Result<()> {
    if json {
        let list: Vec<serde_json::Value> = examples
            .iter()
            .map(|e| {
                serde_json::json!({
                    "name": e.name,
                    "plan": resolve(dir, &e.plan),
                    "config": resolve(dir, &e.config),
                    "shows": e.shows,
                    "model": e.model.as_ref().map(|m| resolve(dir, m)),
                    "waits": e.waits,
                    "rejected": e.rejected,
                })
            })
            .collect();
        outln!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    let width = examples
        .iter()
        .map(|e| e.name.len())
        .max()
        .unwrap_or(0)
        .max(4);
    let config_width = examples
        .iter()
        .map(|e| resolve(dir, &e.config).display().to_string().len())
        .max()
        .unwrap_or(0)
        .max(6);
    outln!(
        "{:<width$}  {:<config_width$}  {:<8}  SHOWS",
        "NAME",
        "CONFIG",
        "MODEL"
    );
    for e in examples {
        let model = if e.model.is_some() { "scripted" } else { "-" };
        let mut shows = e.shows.clone();
        if e.waits {
            shows.push_str(" [waits for a person]");
        }
        if e.rejected {
            shows.push_str(" [refused on purpose]");
        }
        outln!(
            "{:<width$}  {:<config_width$}  {model:<8}  {shows}",
            e.name,
            resolve(dir, &e.config).display().to_string()
        );
    }
    outln!();
    outln!("Run one: flotilla example NAME [--approve] [--model-url URL --model MODEL]");
    outln!(
        "MODEL scripted: its LLM agents talk to a scripted OpenAI-compatible test double (fixed replies, not a model) unless --model-url names a real one."
    );
    Ok(())
}

/// The model the example's LLM agents talk to.
enum Model {
    /// None: the config has no LLM agents.
    None,
    /// The scripted test double, with the file its replies came from.
    Scripted(OpenAiServer, PathBuf, usize),
    /// A real one.
    Real,
}

async fn run(dir: &Path, example: &Example, args: &ExampleArgs) -> anyhow::Result<ExitCode> {
    let plan = resolve(dir, &example.plan);
    let config_path = resolve(dir, &example.config);
    for (what, path) in [("plan", &plan), ("config", &config_path)] {
        if !path.is_file() {
            anyhow::bail!(
                "example {} names {what} {}, which is not a file",
                example.name,
                path.display()
            );
        }
    }
    let config = crate::config::load(Some(&config_path), None)?;
    let llm_agents: Vec<String> = config
        .agents
        .iter()
        .filter(|(_, a)| matches!(a.definition, AgentDefinition::Llm(_)))
        .map(|(name, _)| name.clone())
        .collect();

    let model = match (&args.model_url, &example.model) {
        _ if llm_agents.is_empty() => {
            if args.model_url.is_some() {
                errln!(
                    "note: {} has no LLM agents; --model-url is not used",
                    config_path.display()
                );
            }
            Model::None
        }
        (Some(_), _) => Model::Real,
        (None, Some(file)) => {
            let file = resolve(dir, file);
            let replies = flotilla_testkit::openai::read_script(&file)?;
            let n = replies.len();
            let server = OpenAiServer::start()
                .await
                .context("starting the scripted model")?;
            server.push_all(replies);
            Model::Scripted(server, file, n)
        }
        (None, None) => anyhow::bail!(
            "example {} has LLM agents ({}) but no scripted replies (model = … in {}): pass --model-url URL",
            example.name,
            llm_agents.join(", "),
            dir.join(INDEX).display()
        ),
    };
    let base_url = match (&model, &args.model_url) {
        (Model::Scripted(server, ..), _) => Some(server.base_url()),
        (Model::Real, Some(url)) => Some(url.clone()),
        _ => None,
    };
    let mut env: Vec<(String, String)> = Vec::new();
    if let Some(url) = &base_url {
        for name in &llm_agents {
            let var = agent_var(name).ok_or_else(|| {
                anyhow::anyhow!(
                    "LLM agent {name} of {} cannot be pointed at a model: FLOTILLA_AGENTS__… variables read `_` as `-`, so rename it without `_`",
                    config_path.display()
                )
            })?;
            env.push((format!("{var}__BASE_URL"), url.clone()));
            if let Some(m) = &args.model {
                env.push((format!("{var}__MODEL"), m.clone()));
            }
            if let Some(k) = &args.api_key_env {
                env.push((format!("{var}__API_KEY_ENV"), k.clone()));
            }
        }
    }

    let data_dir = TempDir::new(&example.name)?;
    errln!("Example {}: {}", example.name, example.shows);
    errln!("  plan    {}", plan.display());
    errln!("  config  {}", config_path.display());
    match &model {
        Model::None => {}
        Model::Scripted(_, file, n) => errln!(
            "  model   a scripted OpenAI-compatible test double, not a model: {n} fixed replies from {} for {} (a real one: --model-url URL --model MODEL)",
            file.display(),
            llm_agents.join(", ")
        ),
        Model::Real => errln!(
            "  model   {} at {} for {}",
            args.model.as_deref().unwrap_or("each agent's own model"),
            args.model_url.as_deref().unwrap_or_default(),
            llm_agents.join(", ")
        ),
    }
    if example.rejected {
        errln!("  This plan is refused on purpose: the run shows its problems and exits 1.");
    }
    errln!(
        "  runs    flotilla --config {} up --workers 2 --data-dir {} --submit {}{}",
        config_path.display(),
        data_dir.path().display(),
        plan.display(),
        if env.is_empty() {
            String::new()
        } else {
            " (with FLOTILLA_AGENTS__<NAME>__BASE_URL set for each LLM agent)".to_owned()
        }
    );
    if example.waits {
        if args.approve {
            errln!(
                "  The run waits for a person; --approve approves as {APPROVER:?} once it asks."
            );
        } else {
            errln!(
                "  The run waits for a person: the command that answers it is printed when it asks (or rerun with --approve)."
            );
        }
    }
    errln!();

    let exe = std::env::current_exe().context("finding the flotilla executable")?;
    let mut command = tokio::process::Command::new(exe);
    command
        .arg("--config")
        .arg(&config_path)
        .args(["up", "--workers", "2", "--data-dir"])
        .arg(data_dir.path())
        .arg("--submit")
        .arg(&plan)
        .env_remove("FLOTILLA_CONFIG")
        .envs(env)
        .kill_on_drop(true);
    if std::env::var_os("FLOTILLA_LOG").is_none() {
        // The run's progress and result, not every service's start and stop.
        command.env("FLOTILLA_LOG", "warn");
    }
    let mut child = command.spawn().context("starting flotilla up")?;
    let approving = async {
        if args.approve || example.waits {
            answer_approvals(data_dir.path(), &config, args.approve).await
        } else {
            std::future::pending().await
        }
    };
    let status = tokio::select! {
        s = child.wait() => s.context("waiting for flotilla up")?,
        e = approving => {
            // Approving stopped for good: the run would wait for nobody.
            let _ = child.kill().await;
            return Err(e.context("approving the example's approvals"));
        }
        _ = tokio::signal::ctrl_c() => {
            // The child got the signal too (same process group); let it stop.
            let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
            return Ok(ExitCode::from(130));
        }
    };
    if let Model::Scripted(server, file, n) = &model {
        let requests = server.requests();
        let unanswered = requests.iter().filter(|r| r.reply_index.is_none()).count();
        errln!(
            "The LLM agents' model was the scripted test double: {} of {n} replies of {} used.",
            n - server.remaining(),
            file.display()
        );
        if unanswered > 0 {
            errln!(
                "warning: {unanswered} model call(s) found no scripted reply left (answered with an error): the run asked more than {} scripts",
                file.display()
            );
        }
    }
    Ok(match status.code() {
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(2)),
        None => ExitCode::from(2),
    })
}

/// The `FLOTILLA_AGENTS__<NAME>` prefix of an agent's override variables, or `None` for a
/// name such a variable cannot spell (`_` there stands for `-`).
fn agent_var(name: &str) -> Option<String> {
    (!name.contains('_') && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')).then(
        || {
            format!(
                "FLOTILLA_AGENTS__{}",
                name.to_ascii_uppercase().replace('-', "_")
            )
        },
    )
}

/// Until the run ends, every approval the run waits for: approved as [`APPROVER`] with
/// `approve`, else the command that answers it from another terminal is printed (with the
/// embedded server's URL, which such a command needs). Returns only when approving cannot go
/// on.
async fn answer_approvals(
    data_dir: &Path,
    config: &crate::config::Config,
    approve: bool,
) -> anyhow::Error {
    // `up` writes its embedded server's URL once the server listens.
    let url = loop {
        if let Some(url) = crate::config::running_up_url(data_dir) {
            break url;
        }
        tokio::time::sleep(APPROVE_POLL).await;
    };
    let mut nats = config.nats.clone();
    nats.urls = vec![url.clone()];
    let bus = match Bus::connect(&nats, "flotilla-example").await {
        Ok(b) => b,
        Err(e) => return anyhow::anyhow!("connecting to {url}: {e}"),
    };
    let client = Client::new(bus);
    tokio::select! {
        e = answer_pending(&client, if approve { Answer::Approve } else { Answer::Show(url) }) => e,
        () = root_run_end(&client) => {
            // The run ended and `up` stops its server next: leave first, so that the server
            // going away does not read as a lost connection.
            let _ = tokio::time::timeout(Duration::from_secs(2), client.bus().client().drain()).await;
            std::future::pending().await
        }
    }
}

/// Returns once the deployment's root run (the example's; `up` submits one) has ended.
async fn root_run_end(client: &Client) {
    loop {
        if let Ok(store) = flotilla_client::open_store(client.bus()).await
            && let Ok(records) = store.recent(50).await
            && let Some(root) = records.iter().find(|r| r.handle.parent_run_id.is_none())
            && client
                .wait(root.handle.run_id, Duration::from_secs(24 * 3600))
                .await
                .is_ok()
        {
            return;
        }
        tokio::time::sleep(APPROVE_POLL).await;
    }
}

/// What [`answer_pending`] does with an approval.
enum Answer {
    /// Approves it as [`APPROVER`].
    Approve,
    /// Prints the command that answers it on the NATS server at this URL.
    Show(String),
}

/// Answers every approval asked as `how` says; returns only when one cannot be answered.
async fn answer_pending(client: &Client, how: Answer) -> anyhow::Error {
    let mut answered = BTreeSet::new();
    loop {
        // Until the coordinator answers, and between approvals, the list may fail or be
        // empty: look again.
        if let Ok(pending) = client.pending_approvals(None).await {
            for record in pending {
                let q = &record.request;
                let key = (q.run_id, q.approval_id.clone());
                if answered.contains(&key) {
                    continue;
                }
                if let Answer::Show(url) = &how {
                    errln!(
                        "example: answer from another terminal: flotilla --nats-url {url} approvals approve {} {} --by NAME (or reject … --message WHY)",
                        q.run_id,
                        q.approval_id
                    );
                    answered.insert(key);
                    continue;
                }
                let request = ApprovalAnswerRequest {
                    protocol: flotilla_model::PROTOCOL_VERSION,
                    run_id: q.run_id,
                    approval_id: q.approval_id.clone(),
                    decision: Decision::Approve,
                    by: APPROVER.to_owned(),
                    comment: Some("approved by flotilla example --approve".to_owned()),
                    digest: Some(q.digest.clone()),
                    always: false,
                    incident: false,
                };
                match client
                    .request::<ApprovalAnswerRequest>(&request, Duration::from_secs(10))
                    .await
                {
                    Ok(reply) => {
                        let ApprovalAnswerReply {
                            outcome, record, ..
                        } = reply;
                        match outcome {
                            AnswerOutcome::Decided => errln!(
                                "example: approved {} of task {} (run {}) as {APPROVER:?}",
                                q.approval_id,
                                q.task_id,
                                q.run_id
                            ),
                            AnswerOutcome::AlreadyDecided => errln!(
                                "example: {} of task {} was decided already: {}",
                                q.approval_id,
                                q.task_id,
                                super::approvals::settled_line(&record)
                            ),
                        }
                        answered.insert(key);
                    }
                    Err(e) => return anyhow::anyhow!("approving {}: {e}", q.approval_id),
                }
            }
        }
        tokio::time::sleep(APPROVE_POLL).await;
    }
}

/// A directory of its own for the run's data, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> anyhow::Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        let path = std::env::temp_dir().join(format!(
            "flotilla-example-{name}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&path)
            .with_context(|| format!("creating the data directory {}", path.display()))?;
        Ok(Self(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_paths_resolve_from_the_current_directory() {
        let dir = Path::new("config/examples");
        assert_eq!(
            resolve(dir, Path::new("../flotilla.toml")),
            Path::new("config/flotilla.toml")
        );
        assert_eq!(
            resolve(dir, Path::new("./plans/x.json")),
            Path::new("config/examples/plans/x.json")
        );
        assert_eq!(
            resolve(Path::new("../a"), Path::new("../../b")),
            Path::new("../../b")
        );
    }

    #[test]
    fn agent_names_map_to_override_variables() {
        assert_eq!(
            agent_var("writer").as_deref(),
            Some("FLOTILLA_AGENTS__WRITER")
        );
        assert_eq!(
            agent_var("lead-writer").as_deref(),
            Some("FLOTILLA_AGENTS__LEAD_WRITER")
        );
        assert_eq!(agent_var("fetch_data"), None);
    }
}
