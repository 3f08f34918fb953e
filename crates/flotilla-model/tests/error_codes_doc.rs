//! `docs/protocol.md` and [`ErrorCode`] cannot drift: the table "API error codes" lists every
//! code of the enum and no other, each with the enum's status first; and every `<status>
//! <code>` the protocol's prose names (the NATS Agent Protocol's frames aside, whose codes are
//! their own) is a code of the table, with one of its statuses.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use flotilla_model::ErrorCode;

const HEADING: &str = "## API error codes";

fn protocol() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/protocol.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The table under [`HEADING`]: code → its statuses, in the order written.
fn documented(doc: &str) -> BTreeMap<String, Vec<u16>> {
    let start = doc
        .lines()
        .position(|l| l.trim_end() == HEADING)
        .unwrap_or_else(|| panic!("docs/protocol.md has no heading {HEADING:?}"));
    let mut rows = BTreeMap::new();
    let mut in_table = false;
    for line in doc.lines().skip(start + 1) {
        if line.starts_with("## ") {
            break;
        }
        if !line.starts_with('|') {
            if in_table {
                break;
            }
            continue;
        }
        in_table = true;
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        assert!(cells.len() >= 4, "a row of three cells: {line}");
        let (status, code) = (cells[1], cells[2]);
        if status == "Status" || status.starts_with("---") {
            continue;
        }
        let code = code
            .strip_prefix('`')
            .and_then(|c| c.strip_suffix('`'))
            .unwrap_or_else(|| panic!("the code cell is one `code`: {line}"));
        let statuses: Vec<u16> = status
            .split(',')
            .map(|s| {
                s.trim()
                    .parse()
                    .unwrap_or_else(|e| panic!("status {s:?} of {code}: {e}"))
            })
            .collect();
        assert!(
            rows.insert(code.to_owned(), statuses).is_none(),
            "{code} is listed twice"
        );
    }
    assert!(!rows.is_empty(), "no table under {HEADING:?}");
    rows
}

#[test]
fn the_table_lists_every_code_and_only_those() {
    let rows = documented(&protocol());
    let listed: BTreeSet<&str> = rows.keys().map(String::as_str).collect();
    let defined: BTreeSet<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    let undocumented: Vec<_> = defined.difference(&listed).collect();
    let unknown: Vec<_> = listed.difference(&defined).collect();
    assert!(
        undocumented.is_empty(),
        "codes of ErrorCode missing from docs/protocol.md ({HEADING}): {undocumented:?}"
    );
    assert!(
        unknown.is_empty(),
        "codes in docs/protocol.md ({HEADING}) that ErrorCode does not have: {unknown:?}"
    );
    for &code in ErrorCode::ALL {
        assert_eq!(
            rows[code.as_str()].first(),
            Some(&code.status()),
            "the first status documented for {code} is not ErrorCode::status"
        );
    }
}

#[test]
fn every_status_and_code_the_prose_names_is_in_the_table() {
    let doc = protocol();
    let rows = documented(&doc);
    // The agents of the NATS Agent Protocol answer error frames with codes of their own.
    let agents = doc
        .find("\n## The NATS Agent Protocol\n")
        .expect("the NATS Agent Protocol section");
    let after = doc[agents + 1..]
        .find("\n## ")
        .map_or(doc.len(), |i| agents + 1 + i);
    let prose = format!("{}{}", &doc[..agents], &doc[after..]).replace('\n', " ");
    let mut checked = 0;
    // `400 invalid_limit` or 400 `invalid_limit`.
    for (i, _) in prose.match_indices(|c: char| c.is_ascii_digit()) {
        let rest = &prose[i..];
        let before = prose[..i].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric()) {
            continue;
        }
        let Some((status, tail)) = rest.split_at_checked(3) else {
            continue;
        };
        let Ok(status) = status.parse::<u16>() else {
            continue;
        };
        if !(400..600).contains(&status) {
            continue;
        }
        let code_part = if before == Some('`') {
            tail.strip_prefix(' ')
        } else {
            tail.strip_prefix(" `")
        };
        let Some(code_part) = code_part else {
            continue;
        };
        let code: String = code_part
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
            .collect();
        if code.is_empty() || !code_part[code.len()..].starts_with('`') {
            continue;
        }
        checked += 1;
        let statuses = rows.get(&code).unwrap_or_else(|| {
            panic!("docs/protocol.md names `{status} {code}`, not in {HEADING}")
        });
        assert!(
            statuses.contains(&status),
            "docs/protocol.md names `{status} {code}`, but {HEADING} gives it {statuses:?}"
        );
    }
    assert!(
        checked > 50,
        "only {checked} mentions found: is the scan broken?"
    );
}
