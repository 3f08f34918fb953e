//! Contract-net negotiation end to end, over a real nats-server.
//!
//! The responders here are deterministic scripts standing in for analyst agents: each offers
//! a fixed confidence where a model would judge its own fitness for the request. What is
//! tested is the protocol — requests, offers, the choice, the award — not the judgement.

mod common;

use std::time::Duration;

use common::{server, task};
use flotilla_context::Clients;
use flotilla_model::ids::RunId;
use flotilla_model::mailbox::{MailboxKind, MailboxMessage};
use serde_json::json;

/// A scripted responder: waits for a request, offers `confidence`, then waits for the award.
fn respond(
    c: Clients,
    confidence: Option<f64>,
    award_wait: Duration,
) -> tokio::task::JoinHandle<anyhow::Result<(MailboxMessage, Option<MailboxMessage>)>> {
    tokio::spawn(async move {
        let mailbox = c.mailbox();
        let request = mailbox
            .next_request(Duration::from_secs(20))
            .await?
            .ok_or_else(|| anyhow::anyhow!("no request arrived"))?;
        if let Some(confidence) = confidence {
            mailbox
                .offer(&request, confidence, json!({"plan": "use the Q3 ledger"}))
                .await?;
        }
        let award = mailbox.await_award(&request, award_wait).await?;
        Ok((request, award))
    })
}

#[tokio::test]
async fn the_most_confident_analyst_gets_the_work() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let a = respond(
        task(&bus, run, "analyst_a")?,
        Some(0.6),
        Duration::from_secs(2),
    );
    let b = respond(
        task(&bus, run, "analyst_b")?,
        Some(0.9),
        Duration::from_secs(20),
    );
    let lead = task(&bus, run, "lead")?;
    // Unrelated mail in the lead's box stays there: negotiation only peeks.
    task(&bus, run, "other")?
        .mailbox()
        .send("lead", MailboxKind::Info, json!("fyi"), None)
        .await?;
    let award = lead
        .mailbox()
        .negotiate(
            &["analyst_b".into(), "analyst_a".into()],
            json!({"task": "analyse the Q3 margin"}),
            json!({"work": "margin analysis", "quarter": "Q3"}),
            Duration::from_secs(20),
        )
        .await?
        .expect("both offered");
    assert_eq!(award.winner, "analyst_b");
    assert_eq!(award.confidence, 0.9);
    let offers: Vec<(&str, f64)> = award
        .offers
        .iter()
        .map(|o| (o.from.as_str(), o.confidence))
        .collect();
    assert_eq!(offers, vec![("analyst_a", 0.6), ("analyst_b", 0.9)]);
    let (request_b, award_b) = b.await??;
    assert_eq!(request_b.payload["task"], "analyse the Q3 margin");
    assert_eq!(
        request_b.correlation_id.as_deref(),
        Some(award.correlation_id.as_str())
    );
    let delegation = award_b.expect("the winner is awarded");
    assert_eq!(delegation.kind, MailboxKind::Delegation);
    assert_eq!(delegation.payload["work"], "margin analysis");
    assert_eq!(delegation.seq, award.delegation.seq);
    let (_, award_a) = a.await??;
    assert!(award_a.is_none(), "the other analyst is not awarded");
    // The lead's mailbox still holds everything, the unrelated message included.
    let page = lead.mailbox().receive(None, Duration::ZERO).await?;
    let kinds: Vec<MailboxKind> = page.messages.iter().map(|m| m.kind).collect();
    assert_eq!(
        kinds,
        vec![MailboxKind::Info, MailboxKind::Offer, MailboxKind::Offer]
    );
    // The winner's mailbox: request, accept, delegation.
    let winner = task(&bus, run, "analyst_b")?;
    let kinds: Vec<MailboxKind> = winner
        .mailbox()
        .receive(None, Duration::ZERO)
        .await?
        .messages
        .iter()
        .map(|m| m.kind)
        .collect();
    assert_eq!(
        kinds,
        vec![
            MailboxKind::Request,
            MailboxKind::Accept,
            MailboxKind::Delegation
        ]
    );
    Ok(())
}

#[tokio::test]
async fn ties_go_to_the_lowest_candidate_id_and_silence_ends_at_the_deadline() -> anyhow::Result<()>
{
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let lead = task(&bus, run, "lead")?;
    let z = respond(task(&bus, run, "zed")?, Some(0.8), Duration::from_secs(2));
    let m = respond(task(&bus, run, "mia")?, Some(0.8), Duration::from_secs(20));
    let award = lead
        .mailbox()
        .negotiate(
            &["zed".into(), "mia".into()],
            json!("q"),
            json!("w"),
            Duration::from_secs(20),
        )
        .await?
        .expect("offers");
    assert_eq!(award.winner, "mia", "equal confidence: the lowest id wins");
    assert!(m.await??.1.is_some());
    assert!(z.await??.1.is_none());

    // One candidate never offers: the negotiation ends at its deadline with the other.
    let quiet = respond(task(&bus, run, "quiet")?, None, Duration::from_secs(1));
    let eager = respond(
        task(&bus, run, "eager")?,
        Some(0.3),
        Duration::from_secs(20),
    );
    let started = std::time::Instant::now();
    let award = lead
        .mailbox()
        .negotiate(
            &["quiet".into(), "eager".into()],
            json!("q2"),
            json!("w2"),
            Duration::from_millis(1500),
        )
        .await?
        .expect("one offer");
    assert!(started.elapsed() >= Duration::from_millis(1500));
    assert_eq!((award.winner.as_str(), award.offers.len()), ("eager", 1));
    assert!(eager.await??.1.is_some());
    assert!(quiet.await??.1.is_none());

    // Nobody answers: no award.
    let none = lead
        .mailbox()
        .negotiate(
            &["absent".into()],
            json!("q3"),
            json!("w3"),
            Duration::from_millis(300),
        )
        .await?;
    assert!(none.is_none());
    // Bad candidates are refused before anything is sent.
    let err = lead
        .mailbox()
        .negotiate(&["lead".into()], json!(1), json!(1), Duration::ZERO)
        .await
        .expect_err("itself");
    assert_eq!(err.code(), "invalid_address");
    let err = lead
        .mailbox()
        .negotiate(&[], json!(1), json!(1), Duration::ZERO)
        .await
        .expect_err("nobody");
    assert_eq!(err.code(), "invalid_address");
    Ok(())
}
