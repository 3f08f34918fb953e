//! One HTTP/1.1 request on a fresh connection (`Connection: close`): how tests speak to
//! Flotilla's HTTP listeners (the console) the way a browser's requests arrive, headers
//! exactly as given, without an HTTP client crate.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long the whole answer may take.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// Sends `method path` to `addr` with `headers` (a `Host: addr` unless they name one; a
/// POST's body as JSON with its length) and reads the answer to its end: the status and the
/// body (as sent: a streamed answer's chunks are not decoded).
pub async fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> std::io::Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    let body = body.unwrap_or_default();
    if method == "POST" {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await?;
    let mut out = String::new();
    tokio::time::timeout(ANSWER_WITHIN, s.read_to_string(&mut out))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no whole answer"))??;
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .unwrap_or_default();
    Ok((status, body.to_owned()))
}
