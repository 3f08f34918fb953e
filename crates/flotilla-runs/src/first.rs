//! A run's first message, as read: the client's own durable submission on
//! `<prefix>.submit.<run>` or the coordinator's first run-log entry (`submitted` or
//! `rejected`), and what can still be read of a submission that does not decode.

use async_nats::HeaderMap;
use bytes::Bytes;
use flotilla_bus::wire;
use flotilla_model::ids::RunId;
use flotilla_model::runlog::RunLogEntry;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::task::TraceContext;

/// The first message of a run's history.
#[derive(Debug, Clone)]
pub struct First {
    /// Its stream sequence.
    pub seq: u64,
    /// Its server time, Unix ms.
    pub ts_ms: i64,
    /// What it is.
    pub content: FirstMessage,
}

/// What a run's first message is.
#[derive(Debug, Clone)]
pub enum FirstMessage {
    /// A durable submission on `<prefix>.submit.<run>`, with the trace it came with.
    Submission {
        /// The submission.
        request: Box<SubmitRequest>,
        /// Its trace context.
        trace: TraceContext,
    },
    /// A run-log entry (`submitted` or `rejected`).
    Entry(RunLogEntry),
    /// A client's own submission that cannot be decoded: the run is rejected with these
    /// problems.
    Unreadable(UnreadableSubmission),
}

/// A client's submission on `<prefix>.submit.<run>` that does not decode, with what can
/// still be read of it.
#[derive(Debug, Clone, PartialEq)]
pub struct UnreadableSubmission {
    /// Its codec.
    pub codec: flotilla_model::codec::Codec,
    /// Its bytes, for the full list of its problems
    /// ([`flotilla_model::lenient::submission_problems`], which needs the deployment's validation
    /// context).
    pub payload: Bytes,
    /// Where its submitter waits for the answer (a publishable subject), if it says.
    pub reply_to: Option<String>,
}

impl UnreadableSubmission {
    /// Reads what can be read of an undecodable submission.
    pub fn of(headers: Option<&HeaderMap>, payload: &Bytes) -> Self {
        let loose = loose_fields(headers, payload, None);
        Self {
            codec: wire::codec_of(headers),
            payload: payload.clone(),
            reply_to: loose
                .reply_to
                .filter(|s| flotilla_model::token::check_subject(s).is_ok()),
        }
    }
}

/// The fields of an undecodable submission that still help: which run it meant, which key,
/// where to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loose {
    /// The run it names (`run_id`), if readable.
    pub run_id: Option<RunId>,
    /// Its idempotency key, or else the message id it was published with.
    pub key: Option<String>,
    /// Where its submitter waits for the answer, unchecked.
    pub reply_to: Option<String>,
}

/// Reads what can be read from a submission that does not decode: the top-level fields that
/// say which run it meant and where to answer (everything else is skipped, at any depth).
pub fn loose_fields(headers: Option<&HeaderMap>, payload: &[u8], msg_id: Option<String>) -> Loose {
    let mut fields =
        wire::codec_of(headers).skim_strings(payload, &["run_id", "idempotency_key", "reply_to"]);
    let run_id = fields.remove("run_id").and_then(|r| r.parse().ok());
    Loose {
        key: fields
            .remove("idempotency_key")
            .or(if run_id.is_none() { msg_id } else { None }),
        run_id,
        reply_to: fields.remove("reply_to"),
    }
}

/// The trace context a submission carries in its headers, if any.
pub fn header_trace(headers: Option<&HeaderMap>) -> Option<TraceContext> {
    let tp = wire::header(headers, wire::TRACEPARENT).filter(|tp| tp.split('-').count() == 4)?;
    Some(TraceContext {
        traceparent: tp.to_owned(),
        tracestate: wire::header(headers, "tracestate").map(str::to_owned),
    })
}

/// The submission's trace context, or a new trace rooted at the run (its trace id is the run
/// id: without an exporter there is no span to point at, and processes further down that do
/// export still group the run's spans under its id).
pub fn trace_from(headers: Option<&HeaderMap>, run: RunId) -> TraceContext {
    if let Some(trace) = header_trace(headers) {
        return trace;
    }
    let trace_id = run.as_uuid().simple().to_string();
    TraceContext {
        traceparent: format!("00-{trace_id}-{}-01", &trace_id[..16]),
        tracestate: None,
    }
}
